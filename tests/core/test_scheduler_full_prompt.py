"""Admission reserves whole prompts (`reserve_full_prompt`, vLLM's
scheduler_reserve_full_isl): a request starts only when the free blocks hold all of its
prompt besides the rest of the prompts being prefilled, so chunked prompts admitted side
by side never preempt each other to finish."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager


def _run(sched, step) -> list[list[str]]:
    """Step to the end; each step's scheduled request ids."""
    seen = []
    while sched.has_unfinished_requests():
        output, _ = step(sched)
        seen.append(sorted(output.num_scheduled_tokens))
    return seen


def _two_long_prompts(make_scheduler, make_request, reserve: bool, num_blocks: int = 20):
    # Blocks of 4 tokens (num_blocks - 1 usable); each prompt needs 10, chunks of 8 tokens.
    sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=16,
                           long_prefill_token_threshold=8, reserve_full_prompt=reserve,
                           enable_prefix_caching=False)
    sched.add_request(make_request("a", 40, max_tokens=2))
    sched.add_request(make_request("b", [100 + i for i in range(40)], max_tokens=2))
    return sched


def test_prompts_that_do_not_fit_together_run_one_after_the_other(
        make_scheduler, make_request, step) -> None:
    # 19 usable blocks: after a's first chunk 17 are free, and b's 10 do not fit beside
    # the 8 a still needs. b starts once a has finished (its 5 chunks, then its second
    # token).
    sched = _two_long_prompts(make_scheduler, make_request, reserve=True)
    seen = _run(sched, step)
    assert seen[:6] == [["a"]] * 6 and all(ids == ["b"] for ids in seen[6:])
    assert sched.num_preemptions == 0
    assert sched.num_scheduled_tokens_total == 2 * (40 + 1)  # nothing computed twice


def test_prompts_that_fit_together_start_together(make_scheduler, make_request,
                                                  step) -> None:
    sched = _two_long_prompts(make_scheduler, make_request, reserve=True, num_blocks=23)
    assert _run(sched, step)[0] == ["a", "b"]
    assert sched.num_preemptions == 0


def test_without_it_they_preempt_each_other(make_scheduler, make_request, step) -> None:
    sched = _two_long_prompts(make_scheduler, make_request, reserve=False)
    seen = _run(sched, step)
    assert seen[0] == ["a", "b"]  # both admitted for their first chunks
    assert sched.num_preemptions >= 1
    # ... and the preempted prompt is computed again.
    assert sched.num_scheduled_tokens_total > 2 * (40 + 1)


def test_prefix_hits_count_as_held(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=16,
                           long_prefill_token_threshold=8)
    sched.add_request(make_request("a", 40, max_tokens=30))
    while sched.num_running == 0 or sched.requests["a"].num_output_tokens == 0:
        step(sched)
    # a holds 11 blocks and decodes; 8 are free. b repeats a's first 32 tokens: 8 blocks
    # hit, it needs 2 more (and the rest of nobody's prompt), so it starts at once.
    sched.add_request(make_request("b", list(range(32)) + [500 + i for i in range(8)],
                                   max_tokens=2))
    output, _ = step(sched)
    assert "b" in output.num_scheduled_tokens
    # c, a new 40-token prompt, needs 10: it waits for a and b.
    sched.add_request(make_request("c", [900 + i for i in range(40)], max_tokens=2))
    output, _ = step(sched)
    assert "c" not in output.num_scheduled_tokens
    seen = _run(sched, step)
    assert any("c" in ids for ids in seen)
    assert sched.num_preemptions == 0


def test_a_lone_prompt_takes_the_whole_pool(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=16)
    sched.add_request(make_request("a", 19 * 4 - 1, max_tokens=1))
    output, _ = step(sched)
    assert list(output.num_scheduled_tokens) == ["a"]
    _run(sched, step)
    assert sched.num_preemptions == 0


def test_priority_preemption_counts_the_reservation(make_scheduler, make_request,
                                                   step) -> None:
    """A better head that fits the free blocks but not beside the rest of a worse
    running prompt preempts that prompt (it would otherwise wait for it)."""
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=16,
                           long_prefill_token_threshold=8, policy="priority")
    sched.add_request(make_request("low", 40, max_tokens=2, priority=5))
    step(sched)  # low holds 2 blocks and needs 8 more
    sched.add_request(make_request("high", [100 + i for i in range(40)], max_tokens=2,
                                   priority=0))  # 10 blocks: 10 + 8 > 17 free
    output, _ = step(sched)
    assert "low" in output.preempted_req_ids
    assert "high" in output.num_scheduled_tokens


def test_blocks_to_finish_per_group() -> None:
    # A full-attention group and a window group of 8 tokens, blocks of 4.
    kvm = KVCacheManager(100, 4, enable_caching=False, group_windows=(None, 8))
    # 40 tokens in chunks of 8: the full group 10 blocks; the window group at most the
    # window's and a chunk's positions, one more when they straddle: 5.
    assert kvm.num_blocks_to_finish(40, None, chunk=8) == 10 + 5
    # A short prompt needs its own blocks in both.
    assert kvm.num_blocks_to_finish(6, None, chunk=8) == 2 + 2
    null = kvm.null_block
    held = [kvm.block_pool.get_new_blocks(4), [null, null] + kvm.block_pool.get_new_blocks(2)]
    # Holding 4 (full) and 2 live (window): 6 and 3 to go.
    assert kvm.num_blocks_to_finish(40, held, chunk=8) == 6 + 3


def test_the_engine_takes_it(tmp_path) -> None:
    """Long prompts through a small pool: the same tokens either way, without preemption
    only by default (`--no-scheduler-reserve-full-isl` turns it off)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.cli import build_parser, engine_args_from
    from tests.utils import save_tiny_model, tiny_llama_config

    path = save_tiny_model(tmp_path, tiny_llama_config())
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 100 + 1 for j in range(120)]}
               for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for reserve in (True, False):
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=24,
                  block_size=16, max_num_batched_tokens=64,
                  long_prefill_token_threshold=32, scheduler_reserve_full_isl=reserve)
        out = llm.generate(prompts, params, use_tqdm=False)
        runs[reserve] = ([o.outputs[0].token_ids for o in out],
                         llm.llm_engine.engine_core.scheduler.num_preemptions)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == 0 and runs[False][1] >= 1
    for flags, want in (([], True), (["--no-scheduler-reserve-full-isl"], False)):
        ns = build_parser().parse_args(["generate", *flags])
        assert engine_args_from(ns).scheduler_reserve_full_isl is want
