"""Swap preemption end to end (float32): greedy tokens with a KV cache too small for the
batch are the same whether preempted requests are swapped to host memory, recomputed,
or never preempted; swapped requests really resume without recomputation; a host pool
too small for a request falls back to recompute."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.contracts import SchedulerOutput
from tests.utils import hf_greedy, random_prompts, save_tiny_model, tiny_llama_config

MAX_NEW = 16
VOCAB = 256
# Tiny Llama KV bytes per 4-token block: 2 layers x K,V x 4 tokens x 2 heads x 16 x 4 B.
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4
GiB = 1 << 30
# 24 usable 4-token blocks: far fewer than 8 requests of up to 57 tokens need.
TINY_CACHE = dict(block_size=4, num_kv_blocks=25)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama_swap"),
                           tiny_llama_config(vocab_size=VOCAB))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, VOCAB, 3, 41, seed=1)


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    return hf_greedy(tiny_llama, prompts, MAX_NEW)


def _generate(model_path, prompts, max_tokens: int = MAX_NEW, **engine_kw):
    """Greedy outputs, the LLM, and every SchedulerOutput the runner was given."""
    llm = LLM(str(model_path), dtype="float32", skip_tokenizer_init=True, **engine_kw)
    steps: list[SchedulerOutput] = []
    executor = llm.llm_engine.engine_core.executor
    execute = executor.execute_model

    def recording_execute(so: SchedulerOutput):
        steps.append(so)
        return execute(so)

    executor.execute_model = recording_execute
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm, steps


def _resumed_with_swap(steps: list[SchedulerOutput]) -> list[tuple[str, int]]:
    """(req_id, num_computed_tokens) of requests sent again after a swap-out: they come
    back with everything computed before (> 0), not from scratch."""
    swapped_out: set[str] = set()
    resumed = []
    for so in steps:
        for new in so.scheduled_new_reqs:
            if new.req_id in swapped_out:
                resumed.append((new.req_id, new.num_computed_tokens))
                swapped_out.discard(new.req_id)
        if so.blocks_to_swap_out:
            swapped_out |= so.preempted_req_ids
    return resumed


def test_swap_matches_recompute_and_unconstrained(tiny_llama, prompts, reference):
    unconstrained, _, _ = _generate(tiny_llama, prompts)
    recompute, llm_r, _ = _generate(tiny_llama, prompts, **TINY_CACHE)
    swap, llm_s, steps = _generate(tiny_llama, prompts, preemption_mode="swap",
                                   swap_space=0.01, **TINY_CACHE)
    assert unconstrained == reference
    assert recompute == reference
    assert swap == reference
    assert llm_r.llm_engine.engine_core.scheduler.num_preemptions > 0
    sched = llm_s.llm_engine.engine_core.scheduler
    assert sched.num_swaps_out > 0 and sched.num_swaps_in == sched.num_swaps_out
    assert sched.num_preemptions == sched.num_swaps_out  # the host pool never ran short
    resumed = _resumed_with_swap(steps)
    assert resumed and all(n > 0 for _, n in resumed)
    assert any(so.blocks_to_swap_in for so in steps)
    # Nothing leaks: both pools are free again.
    assert sched.kv_cache_manager.get_num_free_blocks() == TINY_CACHE["num_kv_blocks"] - 1
    assert sched.num_swapped == sched.num_swapped_blocks == 0
    # Swapping recomputes nothing: fewer tokens ran through the model than recomputing.
    swap_tokens = sum(so.total_num_scheduled_tokens for so in steps)
    assert swap_tokens == sum(len(p) + MAX_NEW - 1 for p in prompts)


def test_too_small_host_pool_falls_back_to_recompute(tiny_llama, prompts, reference):
    # Three usable host blocks (plus the unused block 0): requests holding more than
    # three blocks are recomputed instead.
    swap_space = 4 * BLOCK_BYTES / GiB
    swap, llm, steps = _generate(tiny_llama, prompts, preemption_mode="swap",
                                 swap_space=swap_space, **TINY_CACHE)
    assert swap == reference
    sched = llm.llm_engine.engine_core.scheduler
    assert llm.llm_engine.engine_core.num_swap_blocks == 4
    assert sched.num_preemptions > sched.num_swaps_out  # some fell back to recompute
    assert all(len(so.blocks_to_swap_out) <= 3 for so in steps)
    assert sched.num_swapped == sched.num_swapped_blocks == 0


def test_swap_space_without_room_for_a_block(tiny_llama, prompts, reference):
    # Less than two blocks fit: no host pool at all, every preemption recomputes.
    swap, llm, steps = _generate(tiny_llama, prompts, preemption_mode="swap",
                                 swap_space=BLOCK_BYTES / GiB, **TINY_CACHE)
    assert swap == reference
    sched = llm.llm_engine.engine_core.scheduler
    assert sched.swap_space is None and sched.num_swaps_out == 0
    assert sched.num_preemptions > 0


def test_swap_with_bundled_smollm2():
    """The bundled SmolLM2 GGUF (30 layers, GQA 9:3): 12 usable 4-token blocks for four
    requests of 22 tokens force swaps."""
    from pagedllm.config import default_model_path

    path = default_model_path()
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 19842, 314, 253, 11185, 327],
               [1, 1488, 28120, 30, 94, 30], [1, 10983, 2013, 253, 655, 28]]
    unconstrained, _, _ = _generate(path, prompts)
    swap, llm, steps = _generate(path, prompts, preemption_mode="swap", block_size=4,
                                 num_kv_blocks=13)
    assert swap == unconstrained
    sched = llm.llm_engine.engine_core.scheduler
    assert sched.num_swaps_out > 0 and _resumed_with_swap(steps)


def test_cli_flags_and_config(tiny_llama):
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    ns = build_parser().parse_args(["generate", str(tiny_llama), "--preemption-mode", "swap",
                                    "--swap-space", "0.5"])
    args = engine_args_from(ns)
    assert (args.preemption_mode, args.swap_space) == ("swap", 0.5)
    config = args.create_engine_config()
    assert config.scheduler.preemption_mode == "swap" and config.cache.swap_space == 0.5
    default = engine_args_from(build_parser().parse_args(["generate"]))
    assert (default.preemption_mode, default.swap_space) == ("recompute", 4.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--preemption-mode", "offload"])
    with pytest.raises(ValueError, match="swap_space"):
        LLM(str(tiny_llama), preemption_mode="swap", swap_space=-1)
