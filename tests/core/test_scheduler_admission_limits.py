"""vLLM's admission limits: `max_num_active_seqs` (requests running at once, below
max_num_seqs) and `watermark` (the fraction of KV blocks an admission beside running
requests must leave free)."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.errors import ConfigError


def test_active_seqs_cap_running(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=40, max_num_seqs=8)
    sched.max_num_active_seqs = 2
    for i in range(5):
        sched.add_request(make_request(f"r{i}", [10 * i + j for j in range(4)], max_tokens=3))
    most = 0
    while sched.has_unfinished_requests():
        step(sched)
        most = max(most, sched.num_running)
    assert most == 2


def test_watermark_leaves_headroom_beside_running_requests(make_scheduler, make_request,
                                                          step) -> None:
    # 20 blocks of 4 tokens (19 usable); a watermark of 10 blocks.
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=64)
    sched.watermark_blocks = 10
    # Alone, a request is admitted whatever the watermark (it needs 8 blocks, 11 left).
    sched.add_request(make_request("a", 30, max_tokens=2))
    sched.add_request(make_request("b", [100 + i for i in range(6)], max_tokens=2))
    output, _ = step(sched)
    # b needs 2 blocks beside a: 11 - 2 < 10, so it waits for a.
    assert list(output.num_scheduled_tokens) == ["a"]
    seen = []
    while sched.has_unfinished_requests():
        output, _ = step(sched)
        seen.append(list(output.num_scheduled_tokens))
    assert seen[0] == ["a"] and seen[1] == ["b"]
    # Without the watermark both start at once.
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 30, max_tokens=2))
    sched.add_request(make_request("b", [100 + i for i in range(6)], max_tokens=2))
    assert list(step(sched)[0].num_scheduled_tokens) == ["a", "b"]


def test_limits_are_checked() -> None:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    for bad in (0, 9, 2.5, True):
        with pytest.raises(ConfigError, match="max_num_active_seqs must be an integer"):
            SchedulerConfig(**base, max_num_active_seqs=bad)
    for bad in (-0.1, 1.0, "0.1", True):
        with pytest.raises(ConfigError, match="watermark must be a fraction"):
            SchedulerConfig(**base, watermark=bad)
    assert SchedulerConfig(**base, max_num_active_seqs=8, watermark=0.5).watermark == 0.5


def test_the_engine_takes_them(tmp_path) -> None:
    from pagedllm import LLM, SamplingParams
    from tests.utils import save_tiny_model, tiny_llama_config

    path = save_tiny_model(tmp_path, tiny_llama_config())
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=100,
              max_num_active_seqs=3, watermark=0.2)
    sched = llm.llm_engine.engine_core.scheduler
    assert (sched.max_num_active_seqs, sched.watermark_blocks) == (3, 20)
    out = llm.generate([{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(6)],
                       SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_priority_preemption_counts_the_watermark(make_scheduler, make_request,
                                                  step) -> None:
    """A better waiting request that fits only without the watermark's headroom preempts
    a worse one (it would otherwise wait behind them, the watermark never met)."""
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=64, policy="priority")
    sched.watermark_blocks = 5
    sched.add_request(make_request("a", 30, max_tokens=20, priority=5))  # 8 blocks
    step(sched)
    sched.add_request(make_request("c", [50 + i for i in range(14)], max_tokens=20,
                                   priority=5))  # 4 blocks beside a's 8: 7 free after
    step(sched)
    assert [r.req_id for r in sched.running] == ["a", "c"]
    sched.add_request(make_request("h", [90 + i for i in range(22)], max_tokens=2,
                                   priority=0))  # 6 blocks: 6 + 5 > 7
    output, _ = step(sched)
    assert "c" in output.preempted_req_ids
    assert {r.req_id for r in sched.running} == {"a", "h"}


def test_max_num_scheduled_tokens_caps_the_steps(tmp_path) -> None:
    """vLLM's max_num_scheduled_tokens: the scheduler's budget, below the runner's
    max_num_batched_tokens; the same tokens either way."""
    from pagedllm import LLM, SamplingParams
    from tests.utils import save_tiny_model, tiny_llama_config

    path = save_tiny_model(tmp_path, tiny_llama_config())
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 200 + 1 for j in range(50)]}
               for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for scheduled in (None, 32):
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=100,
                  max_num_scheduled_tokens=scheduled)
        sched = llm.llm_engine.engine_core.scheduler
        steps = []
        original = sched.schedule

        def schedule(original=original, steps=steps):
            out = original()
            steps.append(out.total_num_scheduled_tokens)
            return out
        sched.schedule = schedule
        outs[scheduled] = [o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.llm_engine.config.scheduler.max_num_batched_tokens == 2048
        assert max(steps) == (150 if scheduled is None else 32)
    assert outs[None] == outs[32]
    with pytest.raises(ConfigError, match="max_num_scheduled_tokens"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                        max_num_scheduled_tokens=65)
