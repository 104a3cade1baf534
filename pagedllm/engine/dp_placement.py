"""Where each data parallel replica runs: its share of the cores (CPU) or its GPU.

On CPU the replicas split the physical cores this process may use into contiguous,
equal shares (the first shares take one more when they do not divide evenly), ordered
by socket and core id, so a replica's cores sit on one socket where the counts allow
(two replicas on a two-socket machine: one per socket). A core's hyper-thread siblings
go with it: two replicas on the two threads of one core would share its vector units.
Each replica's engine process is pinned to its share and runs one intra-op thread per
core of it. On CUDA replica r takes GPU r (tensor parallelism does not run on CUDA yet,
so a replica is one GPU).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.errors import ConfigError

_SYS_CPU = "/sys/devices/system/cpu"


def physical_cores(cpus: Iterable[int], sys_cpu: str = _SYS_CPU) -> list[tuple[int, ...]]:
    """`cpus` grouped into physical cores (each its logical CPUs, ascending), ordered by
    socket, then lowest CPU id. A CPU whose topology is unreadable is a core of its own."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(set(cpus)):
        try:
            with open(f"{sys_cpu}/cpu{cpu}/topology/physical_package_id") as f:
                package = int(f.read())
            with open(f"{sys_cpu}/cpu{cpu}/topology/core_id") as f:
                core = int(f.read())
        except (OSError, ValueError):
            package, core = -1, -1 - cpu
        cores.setdefault((package, core), []).append(cpu)
    return [tuple(cpus) for _, cpus in sorted(cores.items(), key=lambda kv: (kv[0][0],
                                                                            kv[1][0]))]


def split_cores(cores: list[tuple[int, ...]], parts: int) -> list[list[tuple[int, ...]]]:
    """`parts` contiguous shares of `cores`, the first len(cores) % parts shares one core
    larger; ConfigError when there are fewer cores than parts."""
    if len(cores) < parts:
        raise ConfigError(f"data_parallel_size={parts} needs a physical core per replica, "
                          f"but this process may run on {len(cores)}")
    size, extra = divmod(len(cores), parts)
    shares, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        shares.append(cores[start:end])
        start = end
    return shares


def _allowed_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def check_placement(parallel: ParallelConfig, device: str) -> None:
    """Raise ConfigError when the replicas cannot each get their own cores or GPU."""
    dp = parallel.data_parallel_size
    if device == "cpu":
        split_cores(physical_cores(_allowed_cpus()), dp)
        return
    import torch

    count = torch.cuda.device_count()
    if count < dp:
        raise ConfigError(f"data_parallel_size={dp} needs a GPU per replica, but torch "
                          f"sees {count}")


def replica_configs(config: EngineConfig) -> list[EngineConfig]:
    """One engine config per replica: its rank, its cores and threads or its GPU."""
    dp = config.parallel.data_parallel_size
    if config.device.device == "cpu":
        cores = physical_cores(_allowed_cpus())
        shares = split_cores(cores, dp)
        # The intra-op threads the whole engine would have, split as the cores are.
        devices = [dataclasses.replace(
            config.device, cpu_ids=tuple(cpu for core in share for cpu in core),
            num_threads=max(1, config.device.num_threads * len(share) // len(cores)))
            for share in shares]
    else:
        devices = [dataclasses.replace(config.device, device_index=r) for r in range(dp)]
    return [dataclasses.replace(
        config, device=device,
        parallel=dataclasses.replace(config.parallel, data_parallel_rank=r))
        for r, device in enumerate(devices)]
