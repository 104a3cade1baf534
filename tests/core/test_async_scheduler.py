"""Async scheduling in the scheduler (`SchedulerConfig.async_scheduling`), driven by hand.

The engine schedules step N + 1 before step N's output is back. A request that samples
in step N gets a placeholder (`Request.num_output_placeholders`) and continues in N + 1
with one token that the runner takes from N's sampled ids on the device;
`update_from_output` of N removes the placeholder when the real token is applied. These
tests fabricate the runner's `ModelRunnerOutput`s step by step, and compare whole runs
against a synchronous scheduler fed by the same fake runner (a deterministic "model"
whose next token depends only on the request and the position).

Pools are tiny (block_size 4) so budgets, blocks and preemptions are exact.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

BLOCK_SIZE = 4


# ---------------------------------------------------------------------------- builders


def make_sched(async_scheduling: bool = True, num_blocks: int = 20,
               max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
               max_model_len: int = 64, enable_prefix_caching: bool = True,
               preemption_mode: str = "recompute", num_swap_blocks: int = 0) -> Scheduler:
    """A scheduler over `num_blocks` blocks of BLOCK_SIZE tokens (block 0 is the null
    block), chunked prefill on."""
    sched_config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len, enable_chunked_prefill=True,
                                   preemption_mode=preemption_mode,
                                   async_scheduling=async_scheduling)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
                               enable_prefix_caching=enable_prefix_caching)
    return Scheduler(sched_config, cache_config, num_blocks, num_swap_blocks=num_swap_blocks)


def make_req(req_id: str, prompt: int | list[int], max_tokens: int | None = 16,
             eos_token_id: int | None = None, start: int = 0, **sampling_kw) -> Request:
    """A greedy request; `prompt` is its token ids, or a length (ids start.. then)."""
    ids = list(range(start, start + prompt)) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling_kw)
    return Request(req_id, ids, params, eos_token_id=eos_token_id)


def runner_output(so: SchedulerOutput, **tokens: list[int]) -> ModelRunnerOutput:
    """The runner's answer to step `so`: `tokens[req_id]` sampled for the named requests,
    [] (a partial prefill) for the other scheduled ones."""
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids,
                             sampled_token_ids=[list(tokens.get(r, [])) for r in req_ids])


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.get_num_free_blocks()


# ---------------------------------------------------------------- a fake model runner


def model_token(req_id: str, position: int) -> int:
    """The fake model: the token at `position` of request `req_id` (a pure function, so
    recomputation, swapping or scheduling order can never change it)."""
    return 100 + (sum(map(ord, req_id)) * 31 + position * 17) % 61


class FakeRunner:
    """Mimics the model runner's own bookkeeping, independently of the scheduler.

    The runner knows each request's tokens: what it was sent (prompt and outputs), plus
    every token it sampled itself (so a placeholder is known to it as soon as the step
    that samples it has run). A step computes positions [num_computed_tokens,
    num_computed_tokens + num_scheduled); it samples when that reaches the end of what
    the runner knows, and must never compute a position it does not know.
    """

    def __init__(self, token: Callable[[str, int], int] = model_token) -> None:
        self.token = token
        self.known: dict[str, int] = {}
        self.num_steps = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.known.pop(req_id, None)
        starts = {}
        for new in so.scheduled_new_reqs:
            self.known[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            starts[new.req_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            assert cached.req_id in self.known, f"{cached.req_id} unknown to the runner"
            starts[cached.req_id] = cached.num_computed_tokens
        req_ids, sampled = [], []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            end = starts[req_id] + num_tokens
            known = self.known[req_id]
            assert end <= known, (f"{req_id}: positions up to {end} computed, but only "
                                  f"{known} tokens exist (a placeholder without a sample)")
            req_ids.append(req_id)
            if end == known:
                sampled.append([self.token(req_id, known)])
                self.known[req_id] = known + 1
            else:
                sampled.append([])  # a prefill chunk short of the end
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def run_sync(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> None:
    """schedule -> execute -> update, until every request is finished."""
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    raise AssertionError("the synchronous run did not finish")


def _samplers(ro: ModelRunnerOutput) -> set[str]:
    return {r for r, t in zip(ro.req_ids, ro.sampled_token_ids) if t}


def run_async(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000,
              scheduled: list[SchedulerOutput] | None = None) -> int:
    """The async engine loop: schedule and run step N + 1 while N's output is not yet
    applied (unless `can_overlap()` says no: then apply N first), then apply N.

    After every `schedule()` it checks the placeholder accounting against the fake
    runner: each live request holds one placeholder per step not yet applied in which
    the runner sampled for it. Returns how many steps were scheduled with another one in
    flight (the overlap actually achieved).
    """
    pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    num_overlapped = 0
    for _ in range(max_steps):
        if pending is None and not sched.has_unfinished_requests():
            return num_overlapped
        step = None
        if sched.has_unfinished_requests() and (pending is None or sched.can_overlap()):
            so = sched.schedule()
            ro = runner.execute(so)
            step = (so, ro)
            if scheduled is not None:
                scheduled.append(so)
            if pending is not None and not so.is_empty:
                num_overlapped += 1
            in_flight = [s for s in (pending, step) if s is not None]
            for req_id, request in sched.requests.items():
                expected = sum(req_id in _samplers(r) for _, r in in_flight)
                assert request.num_output_placeholders == expected, (req_id, expected)
                assert (request.num_computed_tokens
                        <= request.num_tokens + request.num_output_placeholders), request
        if pending is not None:
            sched.update_from_output(*pending)
            # Only the step just scheduled is unapplied now.
            for req_id, request in sched.requests.items():
                expected = int(step is not None and req_id in _samplers(step[1]))
                assert request.num_output_placeholders == expected, (req_id, expected)
        pending = step
    raise AssertionError("the async run did not finish")


# ------------------------------------------------------------------ hand-driven steps


def test_decode_is_scheduled_again_before_its_token_is_back():
    """A request that samples in step 1 continues in step 2 (scheduled before step 1's
    output is applied) with one token: its placeholder. num_output_placeholders goes
    0 -> 1 (step 1 samples) -> 2 (step 2 samples too) and back down by one per applied
    output; the runner is sent no token ids (it has the sample on the device)."""
    sched = make_sched()
    a = make_req("a", 5, max_tokens=10)
    assert a.num_output_placeholders == 0
    sched.add_request(a)

    s1 = sched.schedule()
    assert s1.num_scheduled_tokens == {"a": 5}
    assert a.num_computed_tokens == 5 and a.num_output_placeholders == 1

    s2 = sched.schedule()  # step 1 still in flight
    assert s2.num_scheduled_tokens == {"a": 1}
    assert [(c.req_id, c.num_computed_tokens, c.new_token_ids)
            for c in s2.scheduled_cached_reqs] == [("a", 5, [])]
    assert not s2.scheduled_new_reqs
    assert a.num_computed_tokens == 6 and a.num_output_placeholders == 2
    assert a.output_token_ids == []

    assert sched.update_from_output(s1, runner_output(s1, a=[100])) == [a]
    assert a.output_token_ids == [100] and a.num_output_placeholders == 1

    s3 = sched.schedule()  # step 2 in flight
    assert s3.num_scheduled_tokens == {"a": 1}
    assert s3.scheduled_cached_reqs[0].num_computed_tokens == 6
    assert a.num_output_placeholders == 2

    assert sched.update_from_output(s2, runner_output(s2, a=[101])) == [a]
    assert a.output_token_ids == [100, 101] and a.num_output_placeholders == 1
    assert sched.update_from_output(s3, runner_output(s3, a=[102])) == [a]
    assert a.output_token_ids == [100, 101, 102] and a.num_output_placeholders == 0
    # Every token but the newest has its K/V computed: nothing ran ahead.
    assert a.num_computed_tokens == a.num_tokens - 1 == 7
    assert a.status == RequestStatus.RUNNING


def test_max_tokens_2_is_not_scheduled_a_third_time():
    """max_tokens=2: the prefill and one decode are scheduled back to back; once two
    tokens are pending (one applied + one placeholder) the request is not scheduled
    again, and the second token finishes it by length with no wasted computation."""
    sched = make_sched()
    a = make_req("a", 4, max_tokens=2)
    sched.add_request(a)
    s1 = sched.schedule()
    s2 = sched.schedule()
    assert s1.num_scheduled_tokens == {"a": 4} and s2.num_scheduled_tokens == {"a": 1}
    assert a.num_output_placeholders == 2

    sched.update_from_output(s1, runner_output(s1, a=[100]))
    assert a.num_output_tokens + a.num_output_placeholders == 2
    s3 = sched.schedule()  # step 2 in flight: 2 tokens pending, max_tokens reached
    assert "a" not in s3.num_scheduled_tokens and s3.is_empty
    assert a.num_computed_tokens == 5

    assert sched.update_from_output(s2, runner_output(s2, a=[101])) == [a]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [100, 101] and a.num_output_placeholders == 0
    assert free_blocks(sched) == 19 and not sched.has_unfinished_requests()
    assert sched.update_from_output(s3, runner_output(s3)) == []
    assert "a" in sched.schedule().finished_req_ids


def test_max_tokens_1_gets_no_decode_step():
    """max_tokens=1: the prefill's token is all it may have, so the step scheduled while
    the prefill is in flight leaves it out."""
    sched = make_sched()
    a = make_req("a", 6, max_tokens=1)
    sched.add_request(a)
    s1 = sched.schedule()
    s2 = sched.schedule()
    assert s1.num_scheduled_tokens == {"a": 6} and s2.is_empty
    assert a.num_output_placeholders == 1
    sched.update_from_output(s1, runner_output(s1, a=[100]))
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [100]
    assert free_blocks(sched) == 19


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_length_finish_computes_no_extra_token(max_tokens):
    """A request that ends by max_tokens never has a token computed past its end: over
    the whole async run it is scheduled exactly prompt + max_tokens - 1 tokens, in
    1 + (max_tokens - 1) steps, and its outputs are the model's."""
    sched = make_sched()
    a = make_req("a", 5, max_tokens=max_tokens)
    sched.add_request(a)
    steps: list[SchedulerOutput] = []
    run_async(sched, FakeRunner(), scheduled=steps)
    assert sum(s.num_scheduled_tokens.get("a", 0) for s in steps) == 5 + max_tokens - 1
    assert sum("a" in s.num_scheduled_tokens for s in steps) == max_tokens
    assert a.output_token_ids == [model_token("a", 5 + i) for i in range(max_tokens)]
    assert a.status == RequestStatus.FINISHED_LENGTH


def test_longest_sequence_caps_pending_tokens():
    """Without max_tokens the longest sequence (max_model_len) ends the request: it is
    not scheduled again once its known tokens plus placeholders reach it, so no position
    at or beyond max_model_len is ever computed."""
    sched = make_sched(max_model_len=8, max_num_batched_tokens=8)
    a = make_req("a", 5, max_tokens=None)
    sched.add_request(a)
    steps: list[SchedulerOutput] = []
    run_async(sched, FakeRunner(), scheduled=steps)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_tokens == 8
    assert a.output_token_ids == [model_token("a", p) for p in (5, 6, 7)]
    # Positions 0..6 computed (the last token needs no K/V), never position 7 or 8.
    assert sum(s.num_scheduled_tokens.get("a", 0) for s in steps) == 7


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids"])
def test_request_stopped_at_step_n_ignores_its_step_n_plus_1_token(stop):
    """a samples its EOS (or a stop token id) in step 1, but step 2, scheduled before
    step 1's output was applied, computed one more token for it. Applying step 1
    finishes a and frees its blocks at once; step 2's token for a is then ignored (not
    appended, a is not reported again, nothing freed twice) while b carries on."""
    sched = make_sched()
    if stop == "eos":
        a = make_req("a", 4, max_tokens=10, eos_token_id=7)
    else:
        a = make_req("a", 4, max_tokens=10, stop_token_ids=[7])
    b = make_req("b", 6, max_tokens=3, start=50)
    sched.add_request(a)
    sched.add_request(b)
    s1 = sched.schedule()
    s2 = sched.schedule()
    assert s1.num_scheduled_tokens == {"a": 4, "b": 6}
    assert s2.num_scheduled_tokens == {"a": 1, "b": 1}
    blocks_of_b = len(sched.kv_cache_manager.get_blocks("b"))

    updated = sched.update_from_output(s1, runner_output(s1, a=[7], b=[60]))
    assert {r.req_id for r in updated} == {"a", "b"}
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [7]
    assert a.stop_reason == (None if stop == "eos" else 7)
    assert sched.get_request("a") is None
    assert free_blocks(sched) == 19 - blocks_of_b  # a's blocks are back

    s3 = sched.schedule()  # step 2 in flight
    assert s3.num_scheduled_tokens == {"b": 1}
    assert "a" in s3.finished_req_ids

    updated = sched.update_from_output(s2, runner_output(s2, a=[99], b=[61]))
    assert updated == [b]
    assert a.output_token_ids == [7] and a.status == RequestStatus.FINISHED_STOPPED
    assert free_blocks(sched) == 19 - blocks_of_b

    assert sched.update_from_output(s3, runner_output(s3, b=[62])) == [b]
    assert b.output_token_ids == [60, 61, 62] and b.status == RequestStatus.FINISHED_LENGTH
    assert b.num_output_placeholders == 0
    assert free_blocks(sched) == 19 and not sched.has_unfinished_requests()


def test_chunked_prefill_in_flight_gets_its_next_chunk():
    """A prompt prefilled in 4-token chunks: the next chunk is scheduled while the
    previous one is in flight. Chunks that do not reach the end of the prompt sample
    nothing, so they add no placeholder; the chunk that completes the prompt adds one,
    and the first decode follows it at once."""
    sched = make_sched(max_num_batched_tokens=4)
    a = make_req("a", 10, max_tokens=3)
    sched.add_request(a)

    s1 = sched.schedule()
    assert s1.num_scheduled_tokens == {"a": 4} and a.num_output_placeholders == 0
    s2 = sched.schedule()  # chunk 1 in flight
    assert s2.num_scheduled_tokens == {"a": 4} and a.num_output_placeholders == 0
    assert s2.scheduled_cached_reqs[0].num_computed_tokens == 4
    assert sched.update_from_output(s1, runner_output(s1)) == []

    s3 = sched.schedule()  # chunk 2 in flight
    assert s3.num_scheduled_tokens == {"a": 2} and a.num_output_placeholders == 1
    assert sched.update_from_output(s2, runner_output(s2)) == []
    assert a.num_output_placeholders == 1

    s4 = sched.schedule()  # the last chunk in flight: decode its placeholder
    assert s4.num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    assert s4.scheduled_cached_reqs[0].num_computed_tokens == 10
    sched.update_from_output(s3, runner_output(s3, a=[100]))
    assert a.output_token_ids == [100] and a.num_output_placeholders == 1

    s5 = sched.schedule()
    assert s5.num_scheduled_tokens == {"a": 1}
    sched.update_from_output(s4, runner_output(s4, a=[101]))
    assert sched.schedule().is_empty  # 3 tokens pending = max_tokens
    sched.update_from_output(s5, runner_output(s5, a=[102]))
    assert a.output_token_ids == [100, 101, 102]
    assert a.status == RequestStatus.FINISHED_LENGTH and free_blocks(sched) == 19


def test_sync_scheduling_never_schedules_a_request_in_flight():
    """async_scheduling=False (the default) keeps the old rule: a request in a step whose
    output is not back is not scheduled again (decode or next prefill chunk), and no
    placeholder is ever counted."""
    assert SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                           max_model_len=64).async_scheduling is False
    sched = make_sched(async_scheduling=False)
    a = make_req("a", 5, max_tokens=3)
    sched.add_request(a)
    s1 = sched.schedule()
    assert s1.num_scheduled_tokens == {"a": 5} and a.num_output_placeholders == 0
    assert sched.schedule().is_empty  # a in flight
    sched.update_from_output(s1, runner_output(s1, a=[100]))
    s2 = sched.schedule()
    assert s2.num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 0
    assert sched.schedule().is_empty
    sched.update_from_output(s2, runner_output(s2, a=[101]))
    assert a.output_token_ids == [100, 101] and a.num_computed_tokens == 6

    chunked = make_sched(async_scheduling=False, max_num_batched_tokens=4)
    c = make_req("c", 10, max_tokens=2)
    chunked.add_request(c)
    s1 = chunked.schedule()
    assert s1.num_scheduled_tokens == {"c": 4}
    assert chunked.schedule().is_empty  # the next chunk waits for the first
    chunked.update_from_output(s1, runner_output(s1))
    assert chunked.schedule().num_scheduled_tokens == {"c": 4}
    assert c.num_output_placeholders == 0


def test_abort_while_in_two_steps():
    """A request aborted while scheduled in two unapplied steps is freed at once; both
    steps' tokens for it are ignored and its id reaches the runner in the next step."""
    sched = make_sched()
    a = make_req("a", 5, max_tokens=10)
    sched.add_request(a)
    s1 = sched.schedule()
    s2 = sched.schedule()
    assert s2.num_scheduled_tokens == {"a": 1}
    assert sched.finish_requests("a", RequestStatus.FINISHED_ABORTED) == [a]
    assert free_blocks(sched) == 19 and not sched.has_unfinished_requests()
    assert sched.update_from_output(s1, runner_output(s1, a=[100])) == []
    assert sched.update_from_output(s2, runner_output(s2, a=[101])) == []
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert free_blocks(sched) == 19
    s3 = sched.schedule()
    assert s3.is_empty and "a" in s3.finished_req_ids


def test_pooling_request_gets_no_placeholder():
    """An embedding request samples nothing: its one step adds no placeholder and it is
    not scheduled again while that step is in flight; its pooled output finishes it."""
    sched = make_sched()
    e = Request("e", list(range(6)), SamplingParams(max_tokens=1), eos_token_id=None,
                max_tokens=1, pooling_params=PoolingParams(pooling_type="last"))
    sched.add_request(e)
    s1 = sched.schedule()
    assert s1.num_scheduled_tokens == {"e": 6} and e.num_output_placeholders == 0
    s2 = sched.schedule()
    assert "e" not in s2.num_scheduled_tokens
    out = ModelRunnerOutput(req_ids=["e"], sampled_token_ids=[[]],
                            pooler_output={"e": [1.0, 0.0]})
    assert sched.update_from_output(s1, out) == [e]
    assert e.status == RequestStatus.FINISHED_STOPPED and e.num_output_placeholders == 0
    assert free_blocks(sched) == 19


def test_requests_in_flight_are_never_preempted():
    """Both requests fill the pool with their prefills; the step scheduled while those
    are in flight needs a new block for each, but neither may be preempted (their K/V
    is being written): nobody is preempted and the step goes without them. Once step 1
    is applied, preemption proceeds as usual and the outputs are the model's."""
    sched = make_sched(num_blocks=5, enable_prefix_caching=False)  # 4 usable blocks
    a = make_req("a", 8, max_tokens=4)
    b = make_req("b", 8, max_tokens=4, start=20)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner()
    s1 = sched.schedule()
    r1 = runner.execute(s1)
    assert s1.num_scheduled_tokens == {"a": 8, "b": 8} and free_blocks(sched) == 0
    s2 = sched.schedule()
    assert s2.preempted_req_ids == set()
    assert a.status == b.status == RequestStatus.RUNNING
    r2 = runner.execute(s2)
    sched.update_from_output(s1, r1)
    sched.update_from_output(s2, r2)
    run_async(sched, runner)
    assert a.output_token_ids == [model_token("a", p) for p in range(8, 12)]
    assert b.output_token_ids == [model_token("b", p) for p in range(8, 12)]
    assert sched.num_preemptions > 0 and free_blocks(sched) == 4


# ------------------------------------------------------------------------ can_overlap


@pytest.mark.parametrize("sampling_kw", [
    dict(repetition_penalty=1.2),
    dict(presence_penalty=0.5),
    dict(frequency_penalty=0.5),
    dict(min_tokens=2),
    dict(bad_words=["foo"]),
    dict(structured_outputs=StructuredOutputsParams(regex="[ab]+")),
], ids=["repetition", "presence", "frequency", "min_tokens", "bad_words", "structured"])
def test_can_overlap_is_false_while_a_request_needs_host_tokens(sampling_kw):
    """can_overlap() is False from the moment a request whose sampling reads its previous
    token on the host (penalties, min_tokens, bad words, a grammar) is added until it is
    finished (by length or abort); plain requests never block overlap."""
    sched = make_sched()
    assert sched.can_overlap()
    sched.add_request(make_req("plain", 5, max_tokens=4))
    assert sched.can_overlap()
    special = make_req("special", 5, max_tokens=2, start=40, **sampling_kw)
    sched.add_request(special)
    assert not sched.can_overlap()  # waiting counts: it is live
    # What the engine does meanwhile: apply each step before scheduling the next.
    s1 = sched.schedule()
    assert "special" in s1.num_scheduled_tokens and not sched.can_overlap()
    sched.update_from_output(s1, runner_output(s1, plain=[100], special=[101]))
    assert not sched.can_overlap()
    s2 = sched.schedule()
    assert s2.num_scheduled_tokens == {"plain": 1, "special": 1}
    sched.update_from_output(s2, runner_output(s2, plain=[102], special=[103]))
    assert special.status == RequestStatus.FINISHED_LENGTH
    assert special.output_token_ids == [101, 103]
    assert sched.can_overlap()

    aborted = make_req("aborted", 5, max_tokens=8, start=80, **sampling_kw)
    sched.add_request(aborted)
    assert not sched.can_overlap()
    sched.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    assert sched.can_overlap()


# ------------------------------------------------- whole runs: async == sync, same model


def _workload() -> list[Request]:
    """Mixed requests: different lengths and max_tokens, shared prefixes (prefix-cache
    hits), one stopped by EOS and one by a stop token id at a position the fake model
    reaches mid-way, one capped by the longest sequence."""
    shared = list(range(200, 212))  # three full blocks
    reqs = [
        make_req("r0", 5, max_tokens=7),
        make_req("r1", 13, max_tokens=3, start=30),
        make_req("r2", shared + [1, 2, 3], max_tokens=6),
        make_req("r3", shared + [4], max_tokens=9),
        make_req("r4", 9, max_tokens=12, start=60,
                 eos_token_id=model_token("r4", 9 + 4)),     # stops at its 5th token
        make_req("r5", 3, max_tokens=10, start=90,
                 stop_token_ids=[model_token("r5", 3 + 2)]),  # stops at its 3rd token
        make_req("r6", 2, max_tokens=1, start=120),
        make_req("r7", 20, max_tokens=None, start=140),       # runs to max_model_len
    ]
    return reqs


CONFIGS = {
    "roomy": dict(num_blocks=64),
    "chunked-prefill": dict(num_blocks=64, max_num_batched_tokens=6),
    "few-seqs": dict(num_blocks=64, max_num_seqs=2),
    # 8 usable blocks (32 tokens) for requests of up to 28: preemption.
    "tight-recompute": dict(num_blocks=9, max_num_batched_tokens=8),
    "tight-swap": dict(num_blocks=9, max_num_batched_tokens=16, preemption_mode="swap",
                       num_swap_blocks=40),
    # 3 usable host blocks: bigger requests fall back to recompute.
    "tight-swap-small-host": dict(num_blocks=9, preemption_mode="swap", num_swap_blocks=4),
    "tight-no-caching": dict(num_blocks=10, enable_prefix_caching=False),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_async_run_equals_sync_run(config):
    """The same workload through a synchronous and an async scheduler, fed by the same
    fake model: identical output tokens, finish statuses and stop reasons, under
    chunked prefill, prefix caching, max_num_seqs, and preemption (recompute and swap);
    the placeholder accounting holds at every step (checked in run_async); every block
    (device and host) is free at the end; and async really overlapped steps."""
    kw = dict(CONFIGS[config], max_model_len=28)
    sync_sched = make_sched(async_scheduling=False, **kw)
    sync_reqs = _workload()
    for r in sync_reqs:
        sync_sched.add_request(r)
    run_sync(sync_sched, FakeRunner())

    async_sched = make_sched(async_scheduling=True, **kw)
    async_reqs = _workload()
    for r in async_reqs:
        async_sched.add_request(r)
    num_overlapped = run_async(async_sched, FakeRunner())

    def summary(reqs):
        return [(r.req_id, r.output_token_ids, r.status, r.stop_reason) for r in reqs]

    assert summary(async_reqs) == summary(sync_reqs)
    by_id = {r.req_id: r for r in sync_reqs}
    assert by_id["r4"].status == RequestStatus.FINISHED_STOPPED
    assert by_id["r4"].num_output_tokens == 5
    assert by_id["r5"].stop_reason == model_token("r5", 5)
    assert by_id["r7"].num_tokens == 28
    # (A request stopped at step N may keep step N + 1's placeholder: it is gone from
    # the scheduler by then. Those finished by length had no extra step.)
    assert all(r.num_output_placeholders == 0 for r in async_reqs
               if r.status == RequestStatus.FINISHED_LENGTH)
    assert num_overlapped > 0
    if config.startswith("tight"):
        assert sync_sched.num_preemptions > 0
        assert async_sched.num_preemptions > 0
    for sched in (sync_sched, async_sched):
        assert free_blocks(sched) == kw["num_blocks"] - 1
        assert not sched.requests and sched.num_swapped_blocks == 0
