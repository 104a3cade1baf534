"""Executor: the engine's handle on the model runner(s).

`distributed_executor_backend` picks one: "uni", the in-process executor, calls one
ModelRunner directly; "mp" (multiproc.py) runs one worker process per tensor-parallel
rank and ships SchedulerOutput / ModelRunnerOutput (plain dataclasses) to and from them.
Ray is not built yet (ParallelConfig rejects it).
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def determine_num_blocks(self) -> int: ...

    def determine_num_swap_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int = 0) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class InProcExecutor:
    """One model runner in this process."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def determine_num_swap_blocks(self) -> int:
        return self.runner.determine_num_swap_blocks()

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int = 0) -> None:
        self.runner.initialize_kv_cache(num_blocks, num_swap_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    assert backend == "uni", backend  # ParallelConfig validated it
    return InProcExecutor(config)
