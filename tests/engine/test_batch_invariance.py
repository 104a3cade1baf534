"""Batch invariance in every dtype (DESIGN.md §10): with the bundled model in bfloat16 (the
default: its GGUF blocks through the quantized GEMM) and in float32 (dequantized: the
native float32 GEMM), each request's greedy and seeded-sampled tokens and its logprobs
are bit-identical alone, in a batch (in any order), under chunked prefill with
prefix-cache hits (full and partial), with long prompts' chunks capped, and after
preemption."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu.features import has_native_bf16_gemm
from pagedllm.kernels.cpu.ops import (load_cpu_kernels, quant_amx_bf16_usable,
                                      quant_splits_prompt_rows)

# (dtype, quantization): the default path, and float32 on dequantized weights; and
# bfloat16 with the GGUF blocks dequantized onto AMX bfloat16 tiles (opt-in, an
# environment variable: csrc/quant_amx_bf16.h).
CONFIGS = {"bf16": dict(dtype="bfloat16"),
           "f32-dequantized": dict(dtype="float32", quantization="none"),
           "bf16-amx-tiles": dict(dtype="bfloat16")}
ENVIRONMENT = {"bf16-amx-tiles": {"PAGEDLLM_CPU_QUANT_GEMM": "amx_bf16"}}

PARAMS = [SamplingParams(temperature=0, max_tokens=12, logprobs=3),
          SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, logprobs=3)]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(70)]
    own = [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 90))]
           for _ in range(5)]
    return own + [shared + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 30))]
                  for _ in range(4)]


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [sorted((t, lp.logprob, lp.rank) for t, lp in d.items())
              for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_outputs_do_not_depend_on_the_batch(config, monkeypatch):
    kwargs = CONFIGS[config]
    if kwargs["dtype"] == "bfloat16" and not has_native_bf16_gemm():
        pytest.skip("bfloat16 runs natively only with AVX512-BF16 or AVX2")
    if config in ENVIRONMENT:
        if not (load_cpu_kernels() and quant_amx_bf16_usable()):
            pytest.skip("no AMX-BF16 tiles here")
        for name, value in ENVIRONMENT[config].items():
            monkeypatch.setenv(name, value)
    prompts = _prompts()
    llm = LLM(enable_prefix_caching=False, **kwargs)
    try:
        alone = [[_run(llm, [p], params)[0] for p in prompts] for params in PARAMS]
        for params, expected in zip(PARAMS, alone):
            assert _run(llm, prompts, params) == expected
            assert _run(llm, prompts[::-1], params)[::-1] == expected
    finally:
        llm.shutdown()
    # 7-token steps: every prompt prefilled in chunks, next to other requests' decodes;
    # the second round hits the prefix cache (the 70-token prefix, or whole prompts).
    llm = LLM(max_num_batched_tokens=7, max_num_seqs=4, **kwargs)
    try:
        for params, expected in zip(PARAMS, alone):
            assert _run(llm, prompts, params) == expected
            assert _run(llm, prompts, params) == expected
    finally:
        llm.shutdown()
    # At most 5 tokens of a prompt a step (long_prefill_token_threshold): the prompts
    # prefill side by side in small chunks.
    llm = LLM(long_prefill_token_threshold=5, enable_prefix_caching=False, **kwargs)
    try:
        for params, expected in zip(PARAMS, alone):
            assert _run(llm, prompts, params) == expected
    finally:
        llm.shutdown()
    # A cache of 23 usable blocks for 9 requests: some are preempted and recomputed.
    llm = LLM(num_kv_blocks=24, **kwargs)
    try:
        for params, expected in zip(PARAMS, alone):
            assert _run(llm, prompts, params) == expected
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


def test_a_prompt_holding_another_requests_output() -> None:
    """A prompt that holds an earlier request's prompt and output (a chat's next turn)
    gives the same outputs whether that request's blocks are in the prefix cache or not.
    Where prompt rows run on other kernels than generated ones (the default GGUF run on
    a CPU with AMX bfloat16 tiles: worker/prompt_rows.py), the blocks holding the
    earlier output are not hits: those tokens are generated rows there, prompt rows
    here; the earlier prompt's blocks still are."""
    if not has_native_bf16_gemm():
        pytest.skip("bfloat16 runs natively only with AVX512-BF16 or AVX2")
    first = _prompts()[0]
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=3, ignore_eos=True)
    llm = LLM(dtype="bfloat16")
    try:
        splits = llm.llm_engine.engine_core.scheduler.kv_cache_manager.hash_prompt_rows
        assert splits == (load_cpu_kernels() and quant_splits_prompt_rows())
        (output, _), = _run(llm, [first], params)
        turn = first + list(output) + [1500, 2500, 3500]
        cached = _run(llm, [turn], params)
        hits = llm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_hits
        assert hits == (len(first) // 16 if splits else (len(first) + 40) // 16) * 16
    finally:
        llm.shutdown()
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
    try:
        assert _run(llm, [turn], params) == cached
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["mixtral_4x_top2", "qwen3_moe_4x_top2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mixture_of_experts_does_not_depend_on_the_batch(family, dtype, tmp_path):
    """The experts run the native GEMM: a token's output is the same whatever else was
    routed to its experts (alone, batched, in 5-token chunks beside other decodes)."""
    from tests.models.test_decoder_parity import SPECS
    from tests.utils import random_prompts, save_tiny_model, scale_saved_weights

    if dtype == "bfloat16" and not has_native_bf16_gemm():
        pytest.skip("bfloat16 runs natively only with AVX512-BF16 or AVX2")
    spec = SPECS[family]
    save_tiny_model(tmp_path, spec.make_config())
    scale_saved_weights(tmp_path, spec.scales)
    prompts = random_prompts(6, 256, 3, 40, seed=4)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True)
    llm = LLM(str(tmp_path), dtype=dtype, skip_tokenizer_init=True,
              enable_prefix_caching=False)
    try:
        alone = [_run(llm, [p], params)[0] for p in prompts]
        assert _run(llm, prompts, params) == alone
        assert _run(llm, prompts[::-1], params)[::-1] == alone
    finally:
        llm.shutdown()
    llm = LLM(str(tmp_path), dtype=dtype, skip_tokenizer_init=True,
              max_num_batched_tokens=5, max_num_seqs=3)
    try:
        assert _run(llm, prompts, params) == alone
    finally:
        llm.shutdown()
