"""KV cache memory on CPU: zero, aligned, and not written up front."""

from __future__ import annotations

import pytest
import torch

from pagedllm.worker.memory import HUGE_PAGE, lazy_zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lazy_zeros_is_zero_aligned_and_writable(dtype):
    shape = (2, 37, 16, 3, 8)
    t = lazy_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0  # huge pages can back it from the first byte
    assert not t.any()
    t[1, 36, 15] = 1.5
    assert t.sum().item() == 1.5 * 3 * 8
