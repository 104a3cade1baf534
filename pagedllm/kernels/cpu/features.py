"""The CPU's feature flags (/proc/cpuinfo), read in one place."""

from __future__ import annotations

import functools
from pathlib import Path


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


def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_flags_line().partition(":")[2].split())


def has_avx512_bf16() -> bool:
    """True when the CPU has AVX512-BF16 (bf16 matmuls run ~4x faster than fp32; the
    native bf16 GEMM needs it)."""
    return "avx512_bf16" in cpu_flags()


def has_avx512_vnni() -> bool:
    """True when the CPU has AVX512-VNNI (and BW): the quantized GEMM's int8 dot products
    (csrc/cpu_quant.cpp). Zen 4, Zen 5 and Intel since Ice Lake have it; elsewhere the
    kernel takes a portable scalar path (same bits, many times slower)."""
    flags = cpu_flags()
    return "avx512_vnni" in flags and "avx512bw" in flags
