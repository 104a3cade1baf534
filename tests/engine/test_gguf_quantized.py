"""The bundled SmolLM2 Q4_1 GGUF on the native quantized path (the default on CPU) against
the same file dequantized to bfloat16 (`dequantize=True`), and how the path is chosen.

Measured (Zen 4, bfloat16 activations, 6 prompts x 32 greedy tokens): the runs agree on
their first 5, 28, 32, 26, 32 and 32 tokens (3 of 6 identical throughout; 155 of 192
tokens before the first difference); on Zen 3 in float32: 5, 12, 32, 16, 32 and 1 (98),
every parting a near-tie of the dequantized run (its top two 0.22, 0.04, 0.005 and 0.06
logprob apart), the agreed tokens' logprobs within 0.23. For scale, the same file's
dequantized bfloat16 and float32 runs agree on 126 of 192 tokens of
tests/engine/test_fp8_kv_cache.py's prompts: both are precision changes meeting the
near-ties of greedy runs of a Q4_1 model, so where runs part is a matter of the machine
and the test checks how they part (tests/engine/partings.py). The runs use the CPU's
default dtype (float32 on an AVX2 CPU, where bfloat16 is not the default).
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM
from pagedllm.config import default_model_path
from pagedllm.engine import arg_utils
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kernels.cpu.features import has_avx512_bf16
from tests.engine.partings import assert_near_tie_partings, greedy_dists

PROMPTS = ["The capital of France is", "Here is a recipe for pancakes:\n1.",
           "def fibonacci(n):", "Once upon a time, in a small village,",
           "Explain quantum computing in simple terms.", "List three prime numbers:"]
MAX_TOKENS = 32


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds (parameters and packed copies), once each."""
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for t in (*module.parameters(recurse=False),
                  *(getattr(module, n, None) for n in ("packed_weight", "native_weight",
                                                        "quant_weight"))):
            if isinstance(t, torch.Tensor) and not t.is_mkldnn:
                seen[t.data_ptr() or id(t)] = t
    return sum(t.numel() * t.element_size() for t in seen.values())


# What `dtype="auto"` picks on this CPU.
DTYPE = "bfloat16" if has_avx512_bf16() else "float32"


def test_native_is_default_and_close_to_dequantized():
    native = LLM(dtype=DTYPE, kv_cache_space=0.05)
    model = native.llm_engine.engine_core.executor.runner.model
    assert native.llm_engine.config.model.quantization == "gguf"
    assert all(layer.mlp.down_proj.native_weight.dtype == torch.uint8
               for layer in model.model.layers)
    # Weights held in memory: at most 1.2x the file (measured: 0.98x; dequantized to
    # bfloat16: 3.3x, the tied table held twice, plain and packed for the LM head).
    assert _weight_bytes(model) <= 1.2 * os.path.getsize(default_model_path())
    got = greedy_dists(native, PROMPTS, MAX_TOKENS)
    native.shutdown()
    plain = LLM(dtype=DTYPE, kv_cache_space=0.05, dequantize=True)
    assert plain.llm_engine.config.model.quantization is None
    expected = greedy_dists(plain, PROMPTS, MAX_TOKENS)
    # The bounds of tests/engine/test_fp8_kv_cache.py's greedy test; a third of the tokens.
    agreed = assert_near_tie_partings(expected, got, max_diff=0.6, max_gap=1.0)
    assert sum(agreed) >= 64, agreed


def test_quantization_resolution(monkeypatch):
    gguf_path = default_model_path()
    resolve = lambda **kw: EngineArgs(model=gguf_path, **kw).create_engine_config().model
    assert resolve().quantization == "gguf"
    assert resolve(dequantize=True).quantization is None
    assert resolve(quantization="none").quantization is None
    assert resolve(compile=True).quantization is None  # compiled graphs: dense weights
    with pytest.raises(ValueError, match="cannot run here"):
        resolve(quantization="gguf", compile=True)
    with pytest.raises(ValueError, match="contradicts"):
        resolve(quantization="gguf", dequantize=True)
    # Without AVX512-VNNI or AVX2 auto keeps the dequantized path; asking for gguf still
    # gets it (the kernel's portable path, tests/kernels/test_cpu_quant.py).
    monkeypatch.setattr(arg_utils, "has_quant_simd", lambda: False)
    assert resolve().quantization is None
    assert resolve(quantization="gguf").quantization == "gguf"


def test_amx_bf16_native_is_the_dequantized_run(monkeypatch):
    """With PAGEDLLM_CPU_QUANT_GEMM=amx_bf16 (an AMX CPU) the native Q4_1 / Q8_0 weights are
    dequantized to bfloat16 inside the GEMM (csrc/quant_amx_bf16.h), with the bits of the
    dequantized model's GEMM: the same tokens and logprobs as `dequantize=True`, from
    weights held at the file's size."""
    from pagedllm.kernels.cpu import ops as cpu_ops
    if not (cpu_ops.load_cpu_kernels() and cpu_ops.quant_amx_bf16_usable()):
        pytest.skip("no AMX-BF16 tiles here")
    monkeypatch.setenv("PAGEDLLM_CPU_QUANT_GEMM", "amx_bf16")
    prompts = PROMPTS[:3]
    native = LLM(dtype="bfloat16", kv_cache_space=0.05)
    assert native.llm_engine.config.model.quantization == "gguf"
    got = greedy_dists(native, prompts, 16)
    native.shutdown()
    plain = LLM(dtype="bfloat16", kv_cache_space=0.05, dequantize=True)
    assert greedy_dists(plain, prompts, 16) == got
