"""Executor: the engine's handle on the model runner(s).

`distributed_executor_backend` picks one: "uni", the in-process executor, calls one
ModelRunner directly; "mp" (multiproc.py) runs one worker process per rank on this
machine and "ray" (ray_executor.py) one Ray actor per rank on any node of a Ray cluster;
both ship SchedulerOutput / ModelRunnerOutput (plain dataclasses) to and from their
workers (worker/worker.py).
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.step_future import StepFuture


class Executor(Protocol):
    # Steps the engine may keep in flight (pipeline_parallel_size; 1: strictly one).
    max_concurrent_batches: int

    def determine_num_blocks(self) -> int: ...

    def determine_num_swap_blocks(self) -> int: ...

    def kv_bytes_per_block(self) -> int:
        """K and V bytes of one block summed over every rank (sizes the host tier)."""
        ...

    def kv_cache_group_windows(self) -> tuple[int | None, ...]:
        """Per KV cache group, its sliding window (core/kv_groups.py)."""
        ...

    def splits_prompt_rows(self) -> bool:
        """Whether the model computes prompt rows on other kernels than generated ones
        (worker/prompt_rows.py)."""
        ...

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int = 0,
                            num_offload_blocks: int = 0) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> ModelRunnerOutput | StepFuture: ...

    def sleep(self, level: int) -> None:
        """Release the KV cache (and at level 2 the weights) of every runner."""
        ...

    def wake_up(self, tags: list[str]) -> None:
        """Take back what sleep released ("weights", "kv_cache")."""
        ...

    def update_weights(self, weights: list) -> None:
        """New weights for every runner ((hf_name, tensor) pairs; each rank keeps its
        shard)."""
        ...

    def start_profile(self) -> None:
        """Record every runner's steps with torch's profiler."""
        ...

    def stop_profile(self) -> list[str]:
        """Stop recording; the traces' paths, one per runner."""
        ...

    def collective_rpc(self, payload: bytes) -> list:
        """An encoded call (worker/rpc.py) run on every rank's worker; the results in
        rank order."""
        ...

    def shutdown(self) -> None: ...


class InProcExecutor:
    """One model runner in this process."""

    max_concurrent_batches = 1

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        self.rpc_worker = None  # built on the first collective_rpc

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def determine_num_swap_blocks(self) -> int:
        return self.runner.determine_num_swap_blocks()

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def kv_cache_group_windows(self) -> tuple[int | None, ...]:
        return self.runner.kv_cache_group_windows()

    def splits_prompt_rows(self) -> bool:
        return self.runner.splits_prompt_rows()

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int = 0,
                            num_offload_blocks: int = 0) -> None:
        self.runner.initialize_kv_cache(num_blocks, num_swap_blocks, num_offload_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> ModelRunnerOutput | StepFuture:
        """The step's output; with `non_block` a future of it, whose `result()` waits for
        the device (under async scheduling the step may still be running)."""
        launched = self.runner.launch(scheduler_output)
        if not non_block:
            return launched.get()
        future = StepFuture(lambda: future.set_result(launched.get()))
        return future

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self.runner.wake_up(tags)

    def update_weights(self, weights: list) -> None:
        self.runner.update_weights(weights)

    def start_profile(self) -> None:
        self.runner.start_profile()

    def stop_profile(self) -> list[str]:
        return [self.runner.stop_profile()]

    def collective_rpc(self, payload: bytes) -> list:
        from pagedllm.worker.rpc import make_rank_worker, run_call

        if self.rpc_worker is None:
            self.rpc_worker = make_rank_worker(
                self.runner, 0, self.runner.config.parallel.worker_extension_cls)
        return [run_call(self.rpc_worker, payload)]

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        # Imports Ray only now: it is an optional dependency (pagedllm[ray]).
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    assert backend == "uni", backend  # ParallelConfig validated it
    return InProcExecutor(config)
