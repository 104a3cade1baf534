"""Calls that stream their weight (a decode's few rows) prefetch it ahead of their reads on
Intel (pagedllm_simd::stream_prefetch_bytes; PAGEDLLM_CPU_STREAM_PREFETCH overrides, read
once per process): a hint, which must leave every output's bits alone. The bfloat16 GEMM
(1, 3 rows streaming; 6 rows not) and the quantized GEMM (Q8_0 and Q4_1, whose kernel
prefetches; Q4_K, whose kernel does not; 1 and 6 rows) run in a subprocess with it off
and in one with it at 8 KB, and the results are compared bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.kernels.cpu.build import load_cpu_kernels
from pagedllm.kernels.cpu.features import has_native_bf16_gemm

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not (load_cpu_kernels() and has_native_bf16_gemm()),
                                reason="needs the native bfloat16 GEMM")

_CHILD = """
import sys
import torch
from pagedllm.kernels.cpu import ops
from pagedllm.models.layers.linear import pack_native
from tests.kernels.test_cpu_quant import make_weight, run_gemm

assert ops.load_cpu_kernels()
torch.manual_seed(0)
outs = []
weight = pack_native(torch.randn(200, 1536).bfloat16())
for rows in (1, 3, 6):
    x = torch.randn(rows, 1536).bfloat16()
    out = torch.empty(rows, 200, dtype=torch.bfloat16)
    ops.gemm_bf16(out, x, weight, torch.zeros(200), False)
    outs.append(out)
for qtype in ("Q8_0", "Q4_1", "Q4_K"):
    blocks = make_weight(qtype, 200, 1536, seed=1)
    for rows in (1, 6):
        outs.append(run_gemm(blocks, torch.randn(rows, 1536)))
torch.save(outs, sys.argv[1])
"""


def test_stream_prefetch_keeps_the_bits(tmp_path):
    results = []
    for lead in ("0", "8192"):
        path = tmp_path / f"lead{lead}.pt"
        env = {**os.environ, "PAGEDLLM_CPU_STREAM_PREFETCH": lead, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(torch.load(path))
    off, on = results
    assert len(off) == len(on) == 9
    for a, b in zip(off, on, strict=True):
        assert torch.equal(a, b)
