"""lora_apply (cpu_lora.cpp) against a float64 reference, row selection, and row results
independent of how many rows share the call (decode splits a row across threads,
prefills give each thread tiles of rows, and the rows left over one by one: the same
bits)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import ops

pytestmark = pytest.mark.skipif(not ops.load_cpu_kernels(), reason="needs the native kernels")


def _case(m, k, r, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    out = torch.randn(m, n, generator=g).to(dtype)
    a_t = torch.randn(k, r, generator=g) * 0.1
    b_t = torch.randn(r, n, generator=g) * 0.1
    return x, out, a_t, b_t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64, 4, 48), (3, 576, 48, 960), (33, 100, 17, 130),
                                   (1, 1536, 16, 3000)])
def test_matches_reference(dtype, shape):
    m, k, r, n = shape
    x, out, a_t, b_t = _case(m, k, r, n, dtype)
    want = (out.double() + (x.double() @ a_t.double()) @ b_t.double())
    got = out.clone()
    ops.lora_apply(got, x, a_t, b_t)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 4)


def test_rows_are_independent_of_the_batch():
    x, out, a_t, b_t = _case(42, 300, 40, 200, torch.bfloat16, seed=1)
    whole = out.clone()
    ops.lora_apply(whole, x, a_t, b_t)  # 42 rows: tiles of 4 rows per thread, 2 alone
    for i in (0, 7, 39, 41):
        one = out[i:i + 1].clone()
        ops.lora_apply(one, x[i:i + 1], a_t, b_t)  # one row: split across threads
        assert torch.equal(one[0], whole[i])
    # Selected rows: only they change, to the same bits.
    rows = torch.tensor([3, 5, 30])
    part = out.clone()
    ops.lora_apply(part, x, a_t, b_t, rows)
    assert torch.equal(part[rows], whole[rows])
    others = torch.ones(42, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(part[others], out[others])


def test_bad_arguments():
    x, out, a_t, b_t = _case(2, 16, 4, 8, torch.float32)
    with pytest.raises(RuntimeError, match="row out of range"):
        ops.lora_apply(out, x, a_t, b_t, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.lora_apply(out, x, a_t.double(), b_t)
