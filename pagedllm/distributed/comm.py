"""Collectives over a ParallelState's group, as small functions the layers call, and the
point-to-point transfer of hidden states between pipeline stages.

The collectives are no-ops (or identities) when tp_size == 1, so single-rank code pays
nothing. They call the ProcessGroup's own methods rather than torch.distributed's
module-level API, which needs the group registered in a process-global world.
NOTE: every rank of the group must make the same calls in the same order with tensors of
the same shape and dtype, or the group deadlocks until its timeout.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import ParallelState


def all_reduce(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Sum of `x` over the ranks, in place (x must be contiguous); returns x."""
    if ps.tp_size == 1:
        return x
    assert x.is_contiguous(), "all_reduce works in place on a contiguous tensor"
    ps.group.allreduce([x]).wait()
    return x


def all_gather(x: torch.Tensor, ps: ParallelState, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order, on every rank."""
    if ps.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ps.tp_size)]
    ps.group.allgather([parts], [x]).wait()
    return torch.cat(parts, dim=dim)


def gather(x: torch.Tensor, ps: ParallelState, dim: int = -1, dst: int = 0,
           ) -> torch.Tensor | None:
    """Every rank's `x` concatenated along `dim` in rank order on rank `dst`; None on the
    others (half the traffic of all_gather when one rank needs the result)."""
    if ps.tp_size == 1:
        return x
    x = x.contiguous()
    opts = dist.GatherOptions()
    opts.rootRank = dst
    if ps.tp_rank != dst:
        ps.group.gather([], [x], opts).wait()
        return None
    parts = [torch.empty_like(x) for _ in range(ps.tp_size)]
    ps.group.gather([parts], [x], opts).wait()
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, ps: ParallelState, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` on every rank, in place (every rank passes a tensor of the same
    shape and dtype; the others' values are overwritten); returns x."""
    if ps.tp_size == 1:
        return x
    assert x.is_contiguous(), "broadcast works in place on a contiguous tensor"
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    ps.group.broadcast([x], opts).wait()
    return x


def broadcast_object(obj: object, ps: ParallelState, src: int = 0) -> object:
    """Rank `src`'s picklable `obj` on every rank (the others pass anything, e.g. None):
    its length first, then its bytes."""
    if ps.tp_size == 1:
        return obj
    payload = pickle.dumps(obj) if ps.tp_rank == src else b""
    size = broadcast(torch.tensor([len(payload)], dtype=torch.int64), ps, src)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if ps.tp_rank == src:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    broadcast(buf, ps, src)
    return obj if ps.tp_rank == src else pickle.loads(buf.numpy().tobytes())


# ------------------------------------------------------------------ pipeline stages

def send_to_next_stage(x: torch.Tensor, ps: ParallelState) -> Any:
    """Start sending `x` to the same TP rank of the next stage; returns the pending Work
    (wait on it before `x` is reused or dropped). Not waiting here lets this stage start
    its next step while the next stage takes the tensor."""
    assert x.is_contiguous() and ps.next_group is not None
    return ps.next_group.send([x], 1, 0)


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, ps: ParallelState,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor the same TP rank of the previous stage sends (blocks until it arrives);
    the caller knows its shape and dtype from the step it runs."""
    assert ps.prev_group is not None
    x = torch.empty(shape, dtype=dtype, device=device)
    ps.prev_group.recv([x], 0, 0).wait()
    return x
