"""The native row argmax behind greedy sampling equals torch.argmax (first maximum wins,
NaN counts as the maximum) for every dtype the logits come in."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu.ops import load_cpu_kernels
from pagedllm.sample.ops import argmax_rows

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="native CPU ops not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 4099])
def test_argmax_rows_matches_torch(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=gen).to(dtype)
    if width > 3:
        x[1, :] = 0.5  # all tied: index 0
        x[2, [1, width - 1]] = 100.0  # tie between two maxima: the first
        x[3, width // 2] = float("nan")  # NaN is the maximum
        x[3, width - 1] = float("nan")
        x[4, :] = float("-inf")
        x[5, width - 1] = float("inf")
    x[6, 0] = 50.0  # maximum at index 0
    got = argmax_rows(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()


def test_argmax_rows_strided_rows():
    x = torch.randn(6, 300)[:, 20:250]  # rows not adjacent in memory
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
