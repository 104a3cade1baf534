"""The native kernels as a CPU without AVX-512 builds and runs them (PAGEDLLM_CPU_ISA=avx2:
compiled with -mno-avx512f, the engine ignoring AVX-512), in a subprocess of its own.

- The quantized GEMM there (its AVX2 kernels, compiled for AVX2 alone) gives the same bits
  as this build's widest kernels, for every block type; its AVX-512 path is not built.
- Its fused SiLU-and-multiply (8 lanes, exp16's arithmetic) gives this build's bits in
  float32, bfloat16 and float16, a row tail included; so do its logprobs (score_rows:
  8 lanes in both builds).
- Its fp8 KV cache writes (8 lanes, fp8x8) store torch's conversion for every value
  tests/attention/test_fp8_kv_cache.py writes, and its in-place reads (float8_of) give
  every code's exact value, head sizes 64 and 24 (the AVX-512 build runs its own
  conversions in the AVX-512 item and reads only head size 24 through float8_of).
- The engine there picks float32 and the native quantized weights for the bundled GGUF.
  Dequantized (float32 weights: the generic attention item 8 lanes wide, the portable
  norms and float32 GEMM) it agrees with this build to float32 rounding: measured logprobs
  within 2.6e-5, the same tokens. Quantized, its greedy run stays close to its own
  dequantized run as tests/engine/test_gguf_quantized.py requires: partings only at
  near-ties (measured on the six prompts, 32 tokens, tokens agreed: 5, 32, 32, 32, 32, 32
  on Zen 4; this build, float32: 5, 32, 25, 5, 32, 1; on Zen 3, where both builds are
  AVX2: 5, 12, 32, 16, 32, 1: the int8 activations turn any last-bit difference into a
  different rounding, so the two builds' quantized runs differ as much as either differs
  from dequantized).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from pagedllm import LLM
from pagedllm.kernels.cpu import ops
from pagedllm.kernels.cpu.build import load_cpu_kernels
from pagedllm.attention.kv_quant import quantize_kv, raw_bytes
from pagedllm.sample.logprobs import score_logprobs
from tests.attention.test_fp8_kv_cache import FP8, kernel_reads, kernel_writes
from tests.engine.partings import assert_near_tie_partings, greedy_dists
from tests.engine.test_gguf_quantized import PROMPTS
from tests.kernels.test_cpu_quant import QTYPES, make_weight, run_gemm

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 32


def _gemm_cases() -> list[tuple[str, torch.dtype, torch.Tensor]]:
    """(qtype, dtype, x) for every block type: 11 rows, 45 columns."""
    torch.manual_seed(0)
    return [(qtype, dtype, (torch.randn(11, 512) * 3).to(dtype))
            for qtype in QTYPES for dtype in (torch.float32, torch.bfloat16)]


def _silu_cases() -> list[torch.Tensor]:
    """Gates and ups [5, 2 * 1541] (1541: 192 vectors of 8 and a tail of 5), three dtypes."""
    torch.manual_seed(1)
    return [(torch.randn(5, 2 * 1541) * 4).to(dtype)
            for dtype in (torch.float32, torch.bfloat16, torch.float16)]


def _score_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Logits [4, 50001] (a tail of 1 past the vectors of 8) and targets, three dtypes."""
    torch.manual_seed(2)
    return [((torch.randn(4, 50001) * 4).to(dtype), torch.tensor([0, 7, 50000, 123]))
            for dtype in (torch.float32, torch.bfloat16, torch.float16)]


def _score(x: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    scored = score_logprobs(x, targets, 20)
    return [scored.token_ids, scored.logprobs, scored.ranks]


def _silu(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    ops.silu_and_mul(out, x)
    return out


def _greedy(dequantize: bool) -> tuple[list, str, str | None]:
    """Greedy tokens and top-5 logprobs per prompt (greedy_dists), the dtype, the
    quantization."""
    llm = LLM(kv_cache_space=0.05, dequantize=dequantize,
              **({"dtype": "float32"} if dequantize else {}))
    dists = greedy_dists(llm, PROMPTS, TOKENS)
    model = llm.llm_engine.config.model
    llm.shutdown()
    return dists, str(model.dtype), model.quantization


def _child(out_path: str) -> None:
    """Run in the PAGEDLLM_CPU_ISA=avx2 subprocess: everything the test compares."""
    from pagedllm.kernels.cpu.features import has_avx512_bf16, has_quant_simd

    assert load_cpu_kernels() and has_quant_simd() and not has_avx512_bf16()
    gemm = [run_gemm(make_weight(qtype, 45, 512, seed=1), x) for qtype, _, x in _gemm_cases()]
    try:
        run_gemm(make_weight("Q4_0", 16, 64), torch.randn(1, 64), path="avx512")
        avx512_error = ""
    except RuntimeError as e:
        avx512_error = str(e)
    silu = [_silu(x) for x in _silu_cases()]
    score = [_score(x, targets) for x, targets in _score_cases()]
    fp8_writes = [kernel_writes(dtype) for dtype in FP8]
    fp8_reads = [kernel_reads(dtype, torch.float32, head_size)
                 for dtype in FP8 for head_size in (64, 24)]
    torch.save({"gemm": gemm, "silu": silu, "score": score, "avx512_error": avx512_error,
                "fp8_writes": fp8_writes, "fp8_reads": fp8_reads,
                "quantized": _greedy(False),
                "dequantized": _greedy(True)}, out_path)


def test_avx2_build_same_bits_and_engine(tmp_path):
    out = tmp_path / "avx2.pt"
    env = {**os.environ, "PAGEDLLM_CPU_ISA": "avx2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c",
         f"from tests.kernels.test_cpu_avx2_build import _child; _child({str(out)!r})"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out)
    assert load_cpu_kernels()
    assert "not in this build" in got["avx512_error"]
    for (qtype, dtype, x), theirs in zip(_gemm_cases(), got["gemm"], strict=True):
        assert torch.equal(theirs, run_gemm(make_weight(qtype, 45, 512, seed=1), x)), (qtype, dtype)
    for x, theirs in zip(_silu_cases(), got["silu"], strict=True):
        assert torch.equal(theirs, _silu(x)), x.dtype
    for (x, targets), theirs in zip(_score_cases(), got["score"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(theirs, _score(x, targets))), x.dtype
    for dtype, writes in zip(FP8, got["fp8_writes"], strict=True):
        assert len(writes) == 9
        for x, scale, stored in writes:
            assert torch.equal(stored, raw_bytes(quantize_kv(x, scale, dtype))), (dtype, scale)
    assert len(got["fp8_reads"]) == 4
    for out, expected in got["fp8_reads"]:
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)

    dequantized, dtype, quantization = got["dequantized"]
    assert (dtype, quantization) == ("float32", None)
    ours, _, _ = _greedy(True)
    assert [t for t, _ in dequantized] == [t for t, _ in ours]
    logprobs = [d[t] for tokens, dists in dequantized for d, t in zip(dists, tokens)]
    ours_logprobs = [d[t] for tokens, dists in ours for d, t in zip(dists, tokens)]
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(ours_logprobs), atol=2e-4)

    quantized, dtype, quantization = got["quantized"]
    assert (dtype, quantization) == ("float32", "gguf")
    agreed = assert_near_tie_partings(dequantized, quantized, max_diff=0.6, max_gap=1.0)
    assert sum(agreed) >= 64, agreed
