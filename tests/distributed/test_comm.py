"""The collectives of pagedllm/distributed/comm.py over 2 and 3 gloo ranks (threads)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed import comm
from pagedllm.distributed.parallel_state import SINGLE_RANK
from tests.distributed.ranks import run_ranks


def _rank_tensor(rank: int, dtype=torch.float32) -> torch.Tensor:
    # Rank r holds [[r, r + 1, r + 2], [10 r, 10 r + 1, 10 r + 2]].
    return (torch.arange(3) + torch.tensor([[1], [10]]) * rank).to(dtype)


@pytest.mark.parametrize("tp", [2, 3])
def test_all_reduce_sums_in_place(tp):
    def fn(ps):
        x = _rank_tensor(ps.tp_rank)
        out = comm.all_reduce(x, ps)
        assert out is x
        return x

    expected = sum(_rank_tensor(r) for r in range(tp))
    for got in run_ranks(tp, fn):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, -1])
def test_all_gather_and_gather_concatenate_in_rank_order(dim):
    def fn(ps):
        x = _rank_tensor(ps.tp_rank)
        return comm.all_gather(x, ps, dim=dim), comm.gather(x, ps, dim=dim)

    expected = torch.cat([_rank_tensor(0), _rank_tensor(1)], dim=dim)
    (all0, gathered0), (all1, gathered1) = run_ranks(2, fn)
    for got in (all0, all1, gathered0):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert gathered1 is None  # only the destination rank gets the result


def test_broadcast_and_broadcast_object():
    def fn(ps):
        x = torch.full((4,), float(ps.tp_rank + 5), dtype=torch.bfloat16)
        comm.broadcast(x, ps, src=1)
        obj = {"rank": ps.tp_rank, "ids": [1, 2, 3]} if ps.tp_rank == 0 else None
        return x, comm.broadcast_object(obj, ps)

    for x, obj in run_ranks(2, fn):
        assert x.tolist() == [6.0] * 4
        assert obj == {"rank": 0, "ids": [1, 2, 3]}


def test_single_rank_is_identity():
    x = torch.ones(2, 3)
    assert comm.all_reduce(x, SINGLE_RANK) is x
    assert comm.all_gather(x, SINGLE_RANK) is x
    assert comm.gather(x, SINGLE_RANK) is x
    assert comm.broadcast(x, SINGLE_RANK) is x
    assert comm.broadcast_object([1], SINGLE_RANK) == [1]
