"""ParallelState: a worker's place in the tensor- and pipeline-parallel groups, passed
down explicitly.

Each worker process builds one with `init_parallel` and hands it to the model's
constructor, which hands it to every sharded layer: there is no process-global "current
group". The groups are gloo ProcessGroups made directly from a TCP store the executor
hosts, so nothing is registered in torch.distributed's default world either (several
groups can live in one process, which the tests use to run ranks as threads).

Ranks: world = tp x pp, rank = pp_rank * tp_size + tp_rank. The TP group of a stage holds
its tp_size consecutive ranks; pipeline traffic goes from (stage s, tp rank r) to
(stage s + 1, tp rank r) over a two-rank group per such pair (every TP rank of a stage
holds the whole hidden state after its all-reduce, so each sends its own copy and no
stage needs a gather or a scatter).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

# Collectives of a broken group fail after this long instead of hanging; the executor
# notices a dead worker much sooner (it watches the processes).
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ParallelState:
    """This worker's tensor- and pipeline-parallel ranks and the groups it talks in."""

    tp_rank: int = 0
    """Rank within the tensor-parallel group of its stage."""
    tp_size: int = 1
    """Ranks per stage; 1 means no sharding and no communication."""
    group: Any = None
    """The torch.distributed ProcessGroup of the stage's TP ranks (None when tp_size == 1)."""
    pp_rank: int = 0
    """Pipeline stage (0 embeds the tokens, pp_size - 1 computes logits and samples)."""
    pp_size: int = 1
    """Pipeline stages; each holds a contiguous range of the layers."""
    prev_group: Any = None
    """Two-rank group with the same TP rank of the previous stage (rank 0 there, this
    worker 1); None on the first stage."""
    next_group: Any = None
    """Two-rank group with the same TP rank of the next stage (this worker rank 0);
    None on the last stage."""
    expert_parallel: bool = False
    """Mixture-of-experts layers split their experts among the stage's TP ranks (each
    holds whole experts: vLLM's --enable-expert-parallel) instead of slicing every
    expert's width; the rest of the model stays tensor parallel."""
    expert_placement: str = "linear"
    """Which experts a rank holds: "linear" (contiguous ranges) or "round_robin"
    (expert e on rank e mod tp_size), as vLLM's --expert-placement-strategy."""

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, (self.tp_rank, self.tp_size)
        assert 0 <= self.pp_rank < self.pp_size, (self.pp_rank, self.pp_size)
        assert self.tp_size == 1 or self.group is not None, "tp_size > 1 needs a group"
        assert self.is_first_stage or self.prev_group is not None
        assert self.is_last_stage or self.next_group is not None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """TP rank 0 of the last stage samples and returns the step's ModelRunnerOutput."""
        return self.tp_rank == 0 and self.is_last_stage

    @property
    def ep_size(self) -> int:
        """Ranks the experts are split among (1: every rank holds a slice of each)."""
        return self.tp_size if self.expert_parallel else 1

    def local_experts(self, num_experts: int) -> list[int]:
        """The experts this rank holds, in the order it stores them: all of them without
        expert parallelism; else as vLLM places them (its determine_expert_map): linear
        gives each rank num_experts // ep_size contiguous experts, the first
        num_experts % ep_size ranks one more; round_robin gives rank r experts r,
        r + ep_size, ..."""
        size, rank = self.ep_size, self.tp_rank
        if size == 1:
            return list(range(num_experts))
        if self.expert_placement == "round_robin":
            return list(range(rank, num_experts, size))
        base, extra = divmod(num_experts, size)
        start = rank * base + min(rank, extra)
        return list(range(start, start + base + (rank < extra)))

    @property
    def rank(self) -> int:
        """Global rank: pp_rank * tp_size + tp_rank."""
        return self.pp_rank * self.tp_size + self.tp_rank


# One rank, no group: what every layer assumes without an explicit state (immutable).
SINGLE_RANK = ParallelState()


def driver_rank(tp_size: int, pp_size: int) -> int:
    """Global rank of the worker that samples: TP rank 0 of the last stage."""
    return (pp_size - 1) * tp_size


def init_parallel(host: str, port: int, rank: int, tp_size: int, pp_size: int = 1,
                  timeout_s: float = DEFAULT_TIMEOUT_S, prefix: str = "",
                  expert_parallel: bool = False,
                  expert_placement: str = "linear") -> ParallelState:
    """Join the groups of global `rank` among tp_size x pp_size ranks that meet at the
    TCP store host:port.

    The store is hosted by whoever created it (the executor, as master); every rank
    connects as a client. `prefix` namespaces the groups' keys in the store.
    """
    if tp_size * pp_size == 1:
        return SINGLE_RANK
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, None, False, timeout=timeout)
    pp_rank, tp_rank = divmod(rank, tp_size)

    def new_group(name: str, group_rank: int, size: int) -> Any:
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix + name, store), group_rank,
                                     size, timeout)

    # Every rank creates the groups it belongs to, in the same order (tp, then the link
    # to the previous stage, then to the next): gloo's rendezvous blocks until all
    # members of a group arrive, and this order can never wait in a cycle.
    group = new_group(f"tp{pp_rank}", tp_rank, tp_size) if tp_size > 1 else None
    prev_group = next_group = None
    if pp_rank > 0:
        prev_group = new_group(f"pp{pp_rank - 1}-{pp_rank}.{tp_rank}", 1, 2)
    if pp_rank < pp_size - 1:
        next_group = new_group(f"pp{pp_rank}-{pp_rank + 1}.{tp_rank}", 0, 2)
    return ParallelState(tp_rank=tp_rank, tp_size=tp_size, group=group, pp_rank=pp_rank,
                         pp_size=pp_size, prev_group=prev_group, next_group=next_group,
                         expert_parallel=expert_parallel and tp_size > 1,
                         expert_placement=expert_placement)


def init_tensor_parallel(host: str, port: int, tp_rank: int, tp_size: int,
                         timeout_s: float = DEFAULT_TIMEOUT_S,
                         prefix: str = "tp") -> ParallelState:
    """One stage of `tp_size` ranks (init_parallel with pp_size 1)."""
    return init_parallel(host, port, tp_rank, tp_size, 1, timeout_s, prefix)
