"""Worker: one rank of a distributed executor (its groups and its ModelRunner).

The multiprocess and Ray executors host one per rank; both build it from a `WorkerInit`
and forward the engine's calls to `execute`. The in-process executor needs none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig

# The call every rank runs each step; only the driver's answer carries a result.
EXECUTE = "execute_model"


@dataclass
class WorkerInit:
    """What a worker needs to join its groups and build its ModelRunner."""

    rank: int
    """Global rank: pp_rank * tp_size + tp_rank."""
    tp_size: int
    pp_size: int
    # The engine's rendezvous store (torch.distributed.TCPStore) address.
    store_host: str
    store_port: int
    # The engine's config with num_threads already divided among the workers.
    config: EngineConfig


def worker_config(config: EngineConfig, num_workers: int) -> EngineConfig:
    """`config` with the engine's intra-op threads split among `num_workers` workers on
    this machine (at least one each), so they do not oversubscribe its cores."""
    threads = max(1, config.device.num_threads // num_workers)
    return dataclasses.replace(
        config, device=dataclasses.replace(config.device, num_threads=threads))


class Worker:
    """Joins the rank's groups and builds its shard of the model."""

    def __init__(self, init: WorkerInit) -> None:
        from pagedllm.distributed.parallel_state import init_parallel
        from pagedllm.worker.model_runner import ModelRunner

        parallel = init_parallel(
            init.store_host, init.store_port, init.rank, init.tp_size, init.pp_size,
            expert_parallel=init.config.parallel.enable_expert_parallel,
            expert_placement=init.config.parallel.expert_placement_strategy)
        self.runner = ModelRunner(init.config, parallel)
        self.rank = init.rank
        self.rpc_worker: Any = None  # built on the first collective_rpc

    @property
    def is_driver(self) -> bool:
        """The rank whose execute_model result the engine uses."""
        return self.runner.parallel.is_driver

    def execute(self, method: str, *args: Any) -> Any:
        """Run one of the runner's executor-facing methods: determine_num_blocks,
        determine_num_swap_blocks, kv_bytes_per_block, kv_cache_group_windows,
        splits_prompt_rows, initialize_kv_cache, execute_model, sleep, wake_up,
        start_profile, stop_profile, update_weights; or collective_rpc (worker/rpc.py)."""
        if method == "collective_rpc":
            from pagedllm.worker.rpc import make_rank_worker, run_call

            if self.rpc_worker is None:
                self.rpc_worker = make_rank_worker(
                    self.runner, self.rank, self.runner.config.parallel.worker_extension_cls)
            return run_call(self.rpc_worker, *args)
        return getattr(self.runner, method)(*args)
