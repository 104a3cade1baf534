"""fp8 KV cache end to end with the bundled SmolLM2 (the CPU's default compute dtype:
bfloat16 with AVX512-BF16, float32 elsewhere): greedy outputs and logprobs stay close to
the model-dtype ("auto") KV cache, the same kv_cache_space holds two (four) times the
blocks, outputs stay independent of the batch, swap preemption moves fp8 blocks intact,
and the option parses and validates."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu.features import has_avx512_bf16
from tests.engine.partings import assert_near_tie_partings, greedy_dists

PROMPTS = ["The capital of France is", "Here is a recipe for pancakes:\n1.",
           "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of"]
MAX_TOKENS = 32
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based inks and a wooden press adapted "
        "from wine making. Within decades printing spread across Europe, lowering the cost "
        "of books and helping ideas travel faster than ever before. Scholars argue about "
        "how much the press caused the Reformation and the scientific revolution, but few "
        "doubt that it changed how people read.")
# 0.25 GiB: 728 bfloat16 blocks of SmolLM2 (30 layers x K,V x 16 tokens x 3 heads x 64).
SPACE = 0.25
# What `dtype="auto"` picks on this CPU. The closeness bounds below were measured in
# bfloat16 on Zen 4; on an AVX2 CPU (Zen 3), where float32 is the default, fp8 against a
# float32 cache measured mean 0.110 / max 0.503 teacher-forced (against a bfloat16 cache,
# not the default there: 0.152 / 0.844).
DTYPE = "bfloat16" if has_avx512_bf16() else "float32"


@pytest.fixture(scope="module")
def engines():
    """{kv_cache_dtype: LLM} for "auto" (the model dtype) and "fp8_e4m3"."""
    llms = {kv: LLM(dtype=DTYPE, kv_cache_dtype=kv, kv_cache_space=SPACE)
            for kv in ("auto", "fp8_e4m3")}
    yield llms
    for llm in llms.values():
        llm.shutdown()


def _greedy(llm: LLM, prompts) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""
    return [(tokens, [d[t] for d, t in zip(dists, tokens)])
            for tokens, dists in greedy_dists(llm, prompts, MAX_TOKENS)]


def test_fp8_greedy_stays_close_to_model_dtype_kv(engines):
    """Greedy runs of this Q4_1 model meet near-ties early, so where the two part is a
    matter of the machine (measured on the 6 prompts, first differences at tokens 18, 12,
    32, 5, 3 and 25 in bfloat16 on Zen 4; 14, 12, 13, 5, 3 and 9 in float32 on Zen 3).
    What must hold: while they agree, the sampled tokens' logprobs differ by at most 0.6
    (measured 0.305 on Zen 4), and every parting is a near-tie of the model-dtype run: the
    fp8 run's token was among its top 5, within 1.0 logprob of its choice (the largest
    teacher-forced difference the next test allows)."""
    assert_near_tie_partings(greedy_dists(engines["auto"], PROMPTS, MAX_TOKENS),
                             greedy_dists(engines["fp8_e4m3"], PROMPTS, MAX_TOKENS),
                             max_diff=0.6, max_gap=1.0)


def test_fp8_prompt_logprobs_stay_close_to_bf16_kv(engines):
    """Teacher-forced (prompt logprobs of a 79-token text, the same context for both):
    measured |logprob difference| mean 0.088, max 0.480 (bfloat16 against float32
    compute: 0.035, 0.163; fp8_e5m2: 0.163, 0.854)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def logprobs(llm: LLM) -> np.ndarray:
        out = llm.generate([TEXT], params, use_tqdm=False)[0]
        return np.array([d[t].logprob for d, t in zip(out.prompt_logprobs[1:],
                                                        out.prompt_token_ids[1:])])

    diff = np.abs(logprobs(engines["fp8_e4m3"]) - logprobs(engines["auto"]))
    assert diff.mean() <= 0.15 and diff.max() <= 1.0, (diff.mean(), diff.max())


def test_fp8_doubles_the_blocks_of_the_same_space(engines):
    auto = engines["auto"].llm_engine.engine_core
    fp8 = engines["fp8_e4m3"].llm_engine.engine_core
    # 2**28 // 368640 bytes per bfloat16 block = 728 (float32: 364), // 184320 = 1456.
    assert auto.num_blocks == {"bfloat16": 728, "float32": 364}[DTYPE]
    assert fp8.num_blocks == 1456
    runner = fp8.executor.runner
    assert {c.dtype for c in runner.kv_caches} == {runner.kv_cache_dtype}
    assert str(runner.kv_cache_dtype) == "torch.float8_e4m3fn"


def test_fp8_outputs_do_not_depend_on_the_batch(engines):
    """Each prompt alone, and in a batch in either order: bit-identical tokens and
    logprobs (the native kernels read fp8 through the same invariant tile pass)."""
    llm = engines["fp8_e4m3"]
    alone = [_greedy(llm, [p])[0] for p in PROMPTS[:4]]
    assert _greedy(llm, PROMPTS[:4]) == alone
    assert _greedy(llm, PROMPTS[:4][::-1])[::-1] == alone


def test_fp8_swap_preemption_matches_unconstrained():
    """Six usable 16-token blocks for four requests of up to 40 tokens: requests are
    swapped out and back in, fp8 blocks copied byte for byte."""
    prompts = [{"prompt_token_ids": p} for p in (
        [1, 504, 3575, 282, 4649, 314], [1, 19842, 314, 253, 11185, 327],
        [1, 1488, 28120, 30, 94, 30], [1, 10983, 2013, 253, 655, 28])]
    params = SamplingParams(temperature=0, max_tokens=34, ignore_eos=True)
    results = []
    for kw in (dict(), dict(preemption_mode="swap", num_kv_blocks=7)):
        llm = LLM(dtype=DTYPE, kv_cache_dtype="fp8_e4m3", kv_cache_space=SPACE, **kw)
        try:
            results.append([o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)])
            sched = llm.llm_engine.engine_core.scheduler
            swaps = sched.num_swaps_out
        finally:
            llm.shutdown()
    unconstrained, swapped = results
    assert swaps > 0
    assert swapped == unconstrained


def test_kv_cache_dtype_flag_and_validation():
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    for sub in ("generate", "serve", "bench throughput"):
        ns = build_parser().parse_args([*sub.split(), "--kv-cache-dtype", "fp8_e5m2"])
        assert engine_args_from(ns).kv_cache_dtype == "fp8_e5m2"
    args = engine_args_from(build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8"]))
    config = args.create_engine_config()
    assert config.cache.cache_dtype == "fp8_e4m3" and config.kv_cache_dtype == "fp8_e4m3"
    default = engine_args_from(build_parser().parse_args(["generate"]))
    assert default.kv_cache_dtype == "auto"
    assert default.create_engine_config().kv_cache_dtype == default.create_engine_config(
    ).model.dtype
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-dtype", "int8"])
    with pytest.raises(ValueError, match="auto.*fp8_e4m3.*fp8_e5m2"):
        LLM(kv_cache_dtype="int8")
