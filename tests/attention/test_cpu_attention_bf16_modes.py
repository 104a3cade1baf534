"""The three forms of the bfloat16 attention pass: the tile pass (attention_avx512.h,
tile_rows) by vdpbf16ps (`dpbf16`, the default on AMD) or by float32 FMAs on widened inputs
(`fma`, the default on Intel without AMX, whose cores issue half a vdpbf16ps per cycle
against two FMAs), and AMX tiles (`amx`, attention_amx.h: the default where the CPU has
AMX-BF16 and the OS grants it; bfloat16 caches only, fp8 caches keep the tile pass). The
choice is fixed per process (PAGEDLLM_CPU_BF16_ATTENTION), so each mode runs in a
subprocess of its own:
- the bfloat16 cases of the reference, batch-invariance and fp8-cache tests pass in each;
- `fma` keeps the probabilities in float32, so its outputs are float32 attention over the
  widened inputs rounded once to bfloat16 (within 2^-8 relative, 1e-6 absolute); `dpbf16`
  and `amx` round the probabilities to bfloat16 first and miss that bound (which tells the
  modes apart: the variable took effect)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.kernels.cpu.features import has_avx512_bf16
from pagedllm.kernels.cpu.ops import load_cpu_kernels

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not (load_cpu_kernels() and has_avx512_bf16()),
                                reason="the tile pass needs the native ops with AVX512-BF16")

_PRECISION_CHECK = """
import torch
from tests.attention.test_cpu_attention import MIXED, make_metadata
from pagedllm.attention.backend import AttentionSpec
from pagedllm.attention.cpu import CpuAttention
from pagedllm.attention.torch_ref import TorchRefAttention

spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, scale=64 ** -0.5)
md = make_metadata([c for c, _ in MIXED], [q for _, q in MIXED], 16, 64)
gen = torch.Generator().manual_seed(0)
tokens = md.num_actual_tokens
cache = torch.randn(2, 64, 16, 2, 64, generator=gen).bfloat16()
q, k, v = (torch.randn(tokens, h, 64, generator=gen).bfloat16() for h in (8, 2, 2))
out = CpuAttention(spec, True).forward(q, k, v, cache.clone(), md).float()
ref = TorchRefAttention(spec).forward(q.float(), k.float(), v.float(), cache.float(), md)
within = bool(((out - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all())
print("within" if within else "beyond")
"""


def _amx_runs(env: dict[str, str]) -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "from pagedllm.kernels.cpu import ops; "
         "assert ops.load_cpu_kernels(); print(ops.bf16_attention_amx())"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    return probe.stdout.strip() == "True"


@pytest.mark.parametrize("mode", ["fma", "dpbf16", "amx"])
def test_bf16_attention_in_each_form(mode):
    env = {**os.environ, "PAGEDLLM_CPU_BF16_ATTENTION": mode, "PYTHONPATH": str(ROOT)}
    if mode == "amx" and not _amx_runs(env):
        pytest.skip("no AMX-BF16 tiles on this CPU (or the OS refuses them)")
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/attention/test_cpu_attention.py", "tests/attention/test_fp8_kv_cache.py",
         "tests/attention/test_cpu_attention_invariance.py",
         "-k", "bfloat16 or bf16 or e4m3 or e5m2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout
    check = subprocess.run([sys.executable, "-c", _PRECISION_CHECK], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-2000:]
    assert check.stdout.strip() == ("within" if mode == "fma" else "beyond")


def test_the_other_forms_leave_amx():
    """Naming another form turns the AMX pass off (and the probe reads the process's
    choice)."""
    env = {**os.environ, "PAGEDLLM_CPU_BF16_ATTENTION": "fma", "PYTHONPATH": str(ROOT)}
    assert not _amx_runs(env)
