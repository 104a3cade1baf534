"""ParallelState: a worker's place in its tensor-parallel group, passed down explicitly.

Each worker process builds one with `init_tensor_parallel` and hands it to the model's
constructor, which hands it to every sharded layer (as tp_rank / tp_size were before):
there is no process-global "current group". The group is a gloo ProcessGroup made
directly from a TCP store the executor hosts, so nothing is registered in
torch.distributed's default world either (several groups can live in one process, which
the tests use to run ranks as threads).
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
    """This worker's tensor-parallel rank, the group size and the group itself."""

    tp_rank: int = 0
    """Rank within the tensor-parallel group (0 samples and answers the engine)."""
    tp_size: int = 1
    """Ranks in the group; 1 means no sharding and no communication."""
    group: Any = None
    """The torch.distributed ProcessGroup of the ranks (None when tp_size == 1)."""

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, (self.tp_rank, self.tp_size)
        assert self.tp_size == 1 or self.group is not None, "tp_size > 1 needs a group"

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns the step's ModelRunnerOutput."""
        return self.tp_rank == 0


# One rank, no group: what every layer assumes without an explicit state (immutable).
SINGLE_RANK = ParallelState()


def init_tensor_parallel(host: str, port: int, tp_rank: int, tp_size: int,
                         timeout_s: float = DEFAULT_TIMEOUT_S,
                         prefix: str = "tp") -> ParallelState:
    """Join the gloo group of `tp_size` ranks that meet at the TCP store host:port.

    The store is hosted by whoever created it (the executor, as master); every rank
    connects as a client. `prefix` namespaces the group's keys in the store.
    """
    if tp_size == 1:
        return SINGLE_RANK
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, None, False, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), tp_rank, tp_size, timeout)
    return ParallelState(tp_rank=tp_rank, tp_size=tp_size, group=group)
