"""Executor: the engine's handle on the model runner(s).

The in-process executor calls one ModelRunner directly. Multi-process (tensor parallel)
and Ray executors will implement the same four methods and ship SchedulerOutput /
ModelRunnerOutput (plain dataclasses) across processes.
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    def determine_num_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class InProcExecutor:
    """One model runner in this process."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig) -> Executor:
    return InProcExecutor(config)
