"""OfflineDPCore: data parallel replicas behind the offline engine's synchronous
EngineCore interface, so `LLM(data_parallel_size=N)` runs N engine-core processes.

The server's DPEngineCoreClient does the work (routing by load and prompt beginnings,
one process per replica pinned to its cores); its receiving side is asyncio, which
this class drives on a private event loop from the caller's thread: `step()` waits
until some replica has sent a batch (or a short poll passes), takes every batch that
has arrived and applies them. Utility calls (prefix-cache reset, sleep, profiling,
collective_rpc) go to every replica and wait for their answers, applying any request
outputs that arrive meanwhile.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import weakref
from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc import EngineCoreOutputs
from pagedllm.engine.dp_client import DPEngineCoreClient
from pagedllm.errors import ConfigError, EngineDeadError
from pagedllm.request import Request

# How long one step() waits for a batch before returning empty (the caller loops).
POLL_S = 0.5
# A utility call's answer from every replica.
UTILITY_TIMEOUT_S = 600.0


class OfflineDPCore:
    """EngineCore's methods that LLMEngine calls, over data_parallel_size replicas."""

    def __init__(self, config: EngineConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self.client = DPEngineCoreClient(config)
        # Dropping the engine (no shutdown call) still ends the replicas' processes.
        self._finalizer = weakref.finalize(self, _close, self.client, self._loop)
        try:
            self._loop.run_until_complete(self.client.wait_ready())
        except BaseException:
            self.shutdown()
            raise
        # Utility answers by (replica, call id), until their caller takes them.
        self._answers: dict[tuple[int, int], Any] = {}
        # Requests a replica failed (refused at admission, a grammar that did not
        # compile), finished here as aborted with their error, for the next step().
        self._failed: list[Request] = []

    @property
    def num_blocks(self) -> int:
        return self.client.num_blocks

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request, sibling_of: str | None = None) -> None:
        self.client.add_request(request, sibling_of)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self.client.abort_requests(req_ids)

    def stop_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self.client.stop_requests(req_ids)

    def has_unfinished_requests(self) -> bool:
        return self.client.has_unfinished_requests()

    def step(self) -> list[Request]:
        """The requests updated by the batches received by now (waiting up to POLL_S for
        the first one). A request a replica failed comes back finished as aborted with
        its `error`, as the in-process engine returns one."""
        if self.client.has_unfinished_requests():
            self._receive(POLL_S)
        failed, self._failed = self._failed, []
        updated = failed + self.client.step()
        self.client.take_finished_locally()  # (the server's metrics read these)
        return updated

    def _receive(self, timeout_s: float) -> None:
        """Take the batches that arrived, waiting up to timeout_s for the first."""
        batch = self._loop.run_until_complete(self.client.get_output(timeout_s))
        while batch is not None:
            self._take(batch)
            batch = self._loop.run_until_complete(self.client.get_output(0))

    def _take(self, batch: EngineCoreOutputs) -> None:
        for result in batch.utility_results:
            self._answers[(batch.engine_index, result.call_id)] = pickle.loads(result.result)
        for err in batch.errors:
            for request in self.client.abort_requests([err.req_id]):
                request.error, request.error_is_invalid = err.message, err.is_invalid
                self._failed.append(request)
        self.client.push_outputs(batch)

    # ------------------------------------------------------------------ utilities

    def _call(self, method: str, *args: Any) -> Any:
        """`method` run by every replica, their answers combined (an answer that is an
        exception is raised)."""
        keys = self.client.call_utility(method, *args)
        deadline = time.monotonic() + UTILITY_TIMEOUT_S
        while not all(key in self._answers for key in keys):
            if time.monotonic() > deadline:
                raise EngineDeadError(f"data parallel replicas did not answer {method!r} "
                                      f"within {UTILITY_TIMEOUT_S:.0f} s")
            self._receive(POLL_S)
        answers = [self._answers.pop(key) for key in keys]
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return self.client.combine_utility(method, answers)

    def get_stats(self) -> dict[str, Any]:
        """The replicas' scheduler counters summed, each one's under "replicas"."""
        return self._call("get_stats")

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        return self._call("reset_prefix_cache", reset_external)

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self._call("is_sleeping")

    def collective_rpc(self, payload: bytes) -> list:
        return self._call("collective_rpc", payload)

    def start_profile(self) -> None:
        self._call("start_profile")

    def stop_profile(self) -> list[str]:
        return self._call("stop_profile")

    def update_weights(self, weights: Any) -> None:
        raise ConfigError("update_weights with data parallel replicas is not supported "
                          "offline (each replica is a process of its own); use "
                          "collective_rpc with a worker extension, or one replica")

    def shutdown(self) -> None:
        self._finalizer()


def _close(client: DPEngineCoreClient, loop: asyncio.AbstractEventLoop) -> None:
    client.shutdown()
    loop.close()
