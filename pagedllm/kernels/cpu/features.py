"""The CPU's feature flags (/proc/cpuinfo), read in one place; with PAGEDLLM_CPU_ISA=avx2,
those of the same CPU without AVX-512 (what the kernels are then built for)."""

from __future__ import annotations

import functools
from pathlib import Path

from pagedllm.config import env_cpu_isa


@functools.lru_cache(maxsize=1)
def cpu_flags_line() -> str:
    """The "flags" line of /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def native_cpu_flags() -> frozenset[str]:
    """The CPU's own flags, whatever PAGEDLLM_CPU_ISA says."""
    return frozenset(cpu_flags_line().partition(":")[2].split())


def cpu_flags() -> frozenset[str]:
    flags = native_cpu_flags()
    if env_cpu_isa() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith("avx512"))
    return flags


def has_avx512_bf16() -> bool:
    """True when the CPU has AVX512-BF16 (bf16 matmuls run ~4x faster than fp32; the
    native bf16 GEMM needs it)."""
    return "avx512_bf16" in cpu_flags()


def has_native_bf16_gemm() -> bool:
    """True when the native GEMM (csrc/cpu_gemm.cpp) multiplies bfloat16 weights: with
    AVX512-BF16 (vdpbf16ps), or with AVX2 and FMA (weights widened to float32 in
    registers: Zen 2/3, Intel since Haswell); elsewhere bfloat16 linears run torch's
    GEMM."""
    return has_avx512_bf16() or {"avx2", "fma"} <= cpu_flags()


def has_f32_gemm_over_16bit() -> bool:
    """True when the native float32 GEMM also reads weights packed as bfloat16 or float16
    (csrc/cpu_gemm.cpp: gemm_f32, widened exactly in registers): its AVX2 kernels, which
    this CPU runs when it has AVX2, FMA and F16C but no AVX-512 (the AVX-512 float32
    kernel reads float32 panels only)."""
    flags = cpu_flags()
    return {"avx2", "fma", "f16c"} <= flags and "avx512f" not in flags


def has_quant_simd() -> bool:
    """True when the quantized GEMM (csrc/cpu_quant.cpp) has SIMD kernels for this CPU:
    AVX512-VNNI (Zen 4, Zen 5, Intel since Ice Lake) or AVX2 with FMA and F16C (Zen 2 and
    3, Intel since Haswell, csrc/quant_avx2.h); elsewhere it takes a portable scalar path
    (same bits, many times slower)."""
    flags = cpu_flags()
    return {"avx512_vnni", "avx512bw"} <= flags or {"avx2", "fma", "f16c"} <= flags
