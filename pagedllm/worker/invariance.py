"""Which configurations keep outputs independent of batching (DESIGN.md §10).

The guarantee rests on the native CPU kernels: the bfloat16, float32 and quantized GEMMs
sum each output in one chain over K whatever the number of rows, and attention reduces
every row, decode or prefill, in the same steps of keys at absolute positions, in every
dtype and block size. Paths outside them make no such promise; the runner logs the
reason at start-up so a user who needs bit-identical outputs knows to change it. An fp8
KV cache adds no caveat: a token's K/V are quantized alone (fixed per-layer scales) and
the kernels convert them exactly into the same passes. Neither do mixture-of-experts
layers: each expert's linear maps run the native GEMM (models/mixtral.py ExpertLinear),
so a token's expert output does not depend on how many tokens the expert got, and a
token's k expert outputs are summed in expert order.
"""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.kernels.cpu.features import has_native_bf16_gemm


def batch_invariance_caveat(config: EngineConfig, native_kernels: bool) -> str | None:
    """Why outputs may depend on the batch in this configuration, or None."""
    device = config.device
    if device.compile:
        return ("torch.compile (--compile) fuses its own GEMMs and attention, whose "
                "reductions depend on the batch shape")
    if torch.device(device.device).type != "cpu":
        return (f"on {device.device} the {device.attention_backend} kernels reduce in "
                f"tiles that depend on the batch (only the CPU kernels are batch invariant)")
    if not native_kernels:
        return "the native CPU kernels are not loaded (torch's fallback kernels are used)"
    if device.attention_backend != "cpu":
        return f"the {device.attention_backend} attention backend is not batch invariant"
    if config.model.dtype == "bfloat16" and not has_native_bf16_gemm():
        return ("bfloat16 linear layers run torch's GEMM on a CPU without AVX512-BF16 or "
                "AVX2, whose rounding depends on the batch shape")
    if config.model.dtype == "float16":
        return ("float16 linear layers run torch's GEMM, whose rounding depends on the batch "
                "shape (bfloat16 and float32 have batch-invariant native GEMMs)")
    return None
