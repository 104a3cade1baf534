"""A request's outputs wait for a slow reader merged into one, not queued one per step;
merge_streams stops pulling from its streams while its consumer does not read."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.engine.output_collector import RequestOutputCollector, merge_deltas
from pagedllm.entrypoints.openai.serving_common import merge_streams
from pagedllm.errors import EngineDeadError
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind


def _output(step: int, finished: bool = False, indices=(0, 1), cumulative: bool = False,
            ) -> RequestOutput:
    """Step `step` of a 2-sample request: sample i gains token 10 * step + i."""
    completions = []
    for i in indices:
        steps = range(step + 1) if cumulative else [step]
        completions.append(CompletionOutput(
            index=i, text="".join(f"<{s}.{i}>" for s in steps),
            token_ids=[10 * s + i for s in steps], cumulative_logprob=-float(step),
            logprobs=[{10 * s + i: Logprob(-0.5, 1)} for s in steps],
            finish_reason="length" if finished else None))
    return RequestOutput("r", "p", [1, 2], completions, finished,
                         prompt_logprobs=[None, {2: Logprob(-1.0)}] if step == 0 else None,
                         metrics={"step": step})


def test_a_cumulative_collector_keeps_only_the_newest_output():
    async def main():
        collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        for step in range(100):
            collector.put(_output(step, finished=step == 99, cumulative=True))
        out = await collector.get()
        assert out.finished and out.metrics == {"step": 99}
        assert out.outputs[0].token_ids == [10 * s for s in range(100)]
        # Nothing else waits: the next get waits for the next put.
        waiter = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        collector.put(_output(100, cumulative=True))
        assert (await waiter).metrics == {"step": 100}
    asyncio.run(main())


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stream_interval_wakes_the_reader_every_k_tokens(kind):
    """stream_interval 3: the first token at once, then every 3 tokens, the end at once;
    what the reader gets adds up to every step's tokens."""
    cumulative = kind == RequestOutputKind.CUMULATIVE

    async def main():
        collector = RequestOutputCollector(kind, stream_interval=3)
        woken_at, tokens = [], []

        async def reader():
            while True:
                out = await collector.get()
                woken_at.append(out.metrics["step"])
                ids = out.outputs[0].token_ids
                tokens.extend(ids[len(tokens):] if cumulative else ids)
                if out.finished:
                    return

        task = asyncio.ensure_future(reader())
        for step in range(9):
            collector.put(_output(step, finished=step == 8, cumulative=cumulative))
            await asyncio.sleep(0)  # the reader runs if it was woken
            await asyncio.sleep(0)
        await task
        assert woken_at == [0, 3, 6, 8]
        assert tokens == [10 * s for s in range(9)]
    asyncio.run(main())


def test_deltas_taken_late_merge_into_what_each_step_said():
    async def main():
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        steps = [_output(s, finished=s == 6) for s in range(7)]
        # Sample 1 has nothing new at step 3 (a delta leaves an unchanged sample out).
        steps[3].outputs = steps[3].outputs[:1]
        for out in steps[:5]:
            collector.put(out)
        first = await collector.get()
        for out in steps[5:]:
            collector.put(out)
        second = await collector.get()
        for merged, parts in ((first, steps[:5]), (second, steps[5:])):
            assert merged.finished == parts[-1].finished
            for i in (0, 1):
                mine = [c for p in parts for c in p.outputs if c.index == i]
                got = next(c for c in merged.outputs if c.index == i)
                assert got.text == "".join(c.text for c in mine)
                assert got.token_ids == [t for c in mine for t in c.token_ids]
                assert got.logprobs == [d for c in mine for d in c.logprobs]
                assert got.cumulative_logprob == mine[-1].cumulative_logprob
        assert first.prompt_logprobs == steps[0].prompt_logprobs
        assert second.prompt_logprobs is None
        assert second.outputs[0].finish_reason == "length"
    asyncio.run(main())


def test_an_error_replaces_what_waits_and_stays():
    async def main():
        collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        collector.put(_output(0, cumulative=True))
        collector.put(EngineDeadError("gone"))
        collector.put(_output(1, cumulative=True))
        for _ in range(2):
            with pytest.raises(EngineDeadError, match="gone"):
                await collector.get()
    asyncio.run(main())


def test_merge_deltas_of_one_output_is_that_output():
    out = _output(3)
    merged = merge_deltas([out])
    assert [c.token_ids for c in merged.outputs] == [c.token_ids for c in out.outputs]


def test_merge_streams_stops_pulling_while_its_consumer_does_not_read():
    """Two streams of 1,000 outputs each: while the consumer waits after its first
    output, the pumps take at most a few more (the rest stay with the streams, where the
    engine's collector merges them)."""
    pulled = [0, 0]

    async def stream(i: int):
        for step in range(1000):
            pulled[i] += 1
            yield _output(step, finished=step == 999)

    async def main():
        merged = merge_streams([stream(0), stream(1)])
        await merged.__anext__()
        await asyncio.sleep(0.05)
        assert sum(pulled) <= 6, pulled
        count = 1 + sum([1 async for _ in merged])
        assert count == 2000 and pulled == [1000, 1000]
    asyncio.run(main())
