"""EngineCore: the schedule -> execute -> update loop over one scheduler and executor.

It owns no tokenizer and no text: it moves Requests. The offline LLMEngine calls it
in-process; the server's engine process wraps it behind a socket.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.executor.executor import create_executor
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = create_executor(config)
        self.num_blocks = self.executor.determine_num_blocks()
        # Host blocks of swap preemption (0 unless preemption_mode is "swap").
        self.num_swap_blocks = self.executor.determine_num_swap_blocks()
        self.executor.initialize_kv_cache(self.num_blocks, self.num_swap_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks,
                                   num_swap_blocks=self.num_swap_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens)", self.num_blocks,
                    config.cache.block_size, (self.num_blocks - 1) * config.cache.block_size)
        if self.num_swap_blocks:
            logger.info("swap space: %d host blocks", self.num_swap_blocks - 1)

    def add_request(self, request: Request) -> None:
        """Queue a validated request; raises InvalidRequestError if it can never fit."""
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Finish requests as "stop" (a stop string was found in their text)."""
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[Request]:
        """Run one forward pass; return the requests that got tokens or finished
        (including those whose deadline passed: finished with FINISHED_TIMEOUT)."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        # Timed out inside schedule(): no runner output will mention them.
        timed_out = self.scheduler.pop_timed_out_requests()
        if scheduler_output.is_empty:
            # Every live request timed out: nothing to run. The runner still gets the
            # output so it drops their state (an empty step skips the forward pass).
            self.executor.execute_model(scheduler_output)
            return timed_out
        runner_output = self.executor.execute_model(scheduler_output)
        return timed_out + self.scheduler.update_from_output(scheduler_output, runner_output)

    def shutdown(self) -> None:
        self.executor.shutdown()
