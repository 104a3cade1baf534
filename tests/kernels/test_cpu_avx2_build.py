"""The native kernels as a CPU without AVX-512 builds and runs them (PAGEDLLM_CPU_ISA=avx2:
compiled with -mno-avx512f, the engine ignoring AVX-512), in a subprocess of its own.

- The quantized GEMM there (its AVX2 kernels, compiled for AVX2 alone) gives the same bits
  as this build's widest kernels, for every block type; its AVX-512 path is not built.
- Its fused SiLU-and-multiply (8 lanes, exp16's arithmetic) gives this build's bits in
  float32, bfloat16 and float16, a row tail included.
- The engine there picks float32 and the native quantized weights for the bundled GGUF.
  Dequantized (float32 weights: the generic attention item 8 lanes wide, the portable
  norms and float32 GEMM) it agrees with this build to float32 rounding: measured logprobs
  within 2.6e-5, the same tokens. Quantized, its greedy tokens stay close to its own
  dequantized run (measured on the six prompts, 32 tokens: 5, 32, 32, 32, 32, 32 tokens
  agreed; this build, float32: 5, 32, 25, 5, 32, 1: the int8 activations turn any
  last-bit difference into a different rounding, so the two builds' quantized runs differ
  as much as either differs from dequantized).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu import ops
from pagedllm.kernels.cpu.build import load_cpu_kernels
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


def _silu(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    ops.silu_and_mul(out, x)
    return out


def _greedy(dequantize: bool) -> tuple[list[list[int]], list[list[float]], str, str | None]:
    llm = LLM(kv_cache_space=0.05, dequantize=dequantize,
              **({"dtype": "float32"} if dequantize else {}))
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    model = llm.llm_engine.config.model
    llm.shutdown()
    return ([o.token_ids for o in outs],
            [[next(iter(d.values())).logprob for d in o.logprobs] for o in outs],
            str(model.dtype), model.quantization)


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
    torch.save({"gemm": gemm, "silu": silu, "avx512_error": avx512_error,
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

    tokens, logprobs, dtype, quantization = got["dequantized"]
    assert (dtype, quantization) == ("float32", None)
    ours_tokens, ours_logprobs, _, _ = _greedy(True)
    assert tokens == ours_tokens
    assert torch.allclose(torch.tensor(logprobs), torch.tensor(ours_logprobs), atol=2e-4)

    quant_tokens, _, dtype, quantization = got["quantized"]
    assert (dtype, quantization) == ("float32", "gguf")
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), TOKENS)
              for x, y in zip(quant_tokens, tokens)]
    assert min(agreed) >= 2 and sum(agreed) >= 96, agreed
