"""MultiprocExecutor: one worker process per rank (tp x pp) on this machine.

The engine process keeps the scheduler; every step it pickles the SchedulerOutput once
and writes the bytes to each worker's socket (a multiprocessing Connection over a socket
pair). All ranks run the same step, their layers talking over gloo (TP all-reduces within
a stage, hidden states from stage to stage); the driver (TP rank 0 of the last stage)
samples and is the only one that answers, with the ModelRunnerOutput.

Pipeline parallelism keeps up to pp steps in flight: `execute_model(..., non_block=True)`
returns a future at once, the workers queue the steps in their sockets and run them in
order, and the driver's answers resolve the futures in the same order.

Workers are plain `python` subprocesses (mp_worker.py) rather than multiprocessing
children: the server's engine-core process is itself a daemonic multiprocessing child,
which multiprocessing forbids to have children. They meet through a TCPStore this process
hosts (an OS-chosen port, so no port guessing).

Failure: a worker that raises answers with its error; one that dies closes its socket.
Either wakes the engine, which shuts every worker down and raises EngineDeadError, so
nothing waits on a dead group. Shutdown (explicit, on garbage collection or at
interpreter exit, through a weakref finalizer) stops every worker process.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import weakref
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.errors import EngineDeadError
from pagedllm.distributed.parallel_state import driver_rank
from pagedllm.executor.step_future import StepFuture, StepsInFlight
from pagedllm.executor.worker_group import WorkerGroupExecutor
from pagedllm.executor.mp_worker import BOOT
from pagedllm.worker.worker import EXECUTE, WorkerInit, worker_config

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
# Grace a worker gets to exit after "shutdown" (then SIGTERM, then SIGKILL).
SHUTDOWN_GRACE_S = 5.0
# The directory holding the pagedllm package, for the workers' sys.path.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class MultiprocExecutor(WorkerGroupExecutor):
    """tp x pp worker processes, each with one ModelRunner (its shard)."""

    def __init__(self, config: EngineConfig) -> None:
        import torch.distributed as dist

        self.tp_size = config.parallel.tensor_parallel_size
        self.pp_size = config.parallel.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        self.driver = driver_rank(self.tp_size, self.pp_size)
        # Steps in flight: one per pipeline stage keeps every stage busy.
        self.max_concurrent_batches = self.pp_size
        self._pending = StepsInFlight(
            lambda _: self._collect([self.driver], during="execute_model")[0])
        # The rendezvous: workers connect as clients; port 0 lets the OS pick one.
        self._store = dist.TCPStore(STORE_HOST, 0, None, True, wait_for_workers=False)
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        self._failed: str | None = None
        try:
            self._start_workers(worker_config(config, self.world_size))
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, config: EngineConfig) -> None:
        for rank in range(self.world_size):
            parent, child = Pipe()  # duplex: a socket pair on POSIX
            fd = child.fileno()
            proc = subprocess.Popen([sys.executable, "-c", BOOT, str(fd), _PACKAGE_ROOT],
                                    pass_fds=(fd,), stdin=subprocess.DEVNULL)
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        for rank, conn in enumerate(self._conns):
            conn.send(("init", WorkerInit(rank, self.tp_size, self.pp_size, STORE_HOST,
                                          self._store.port, config)))
        # Loading errors (an unsupported model, a bad checkpoint) keep their type.
        self._collect(range(self.world_size), during="start-up", reraise=True)
        logger.info("started %d workers (tp=%d, pp=%d; pids %s)", self.world_size,
                    self.tp_size, self.pp_size, [p.pid for p in self._procs])

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> ModelRunnerOutput | StepFuture:
        """Send the step to every worker; its output, or (non_block) a future of it."""
        self._broadcast(EXECUTE, scheduler_output)
        # The driver's answers come back in order: the next one is the oldest step's.
        future = self._pending.add()
        return future if non_block else future.result()

    def shutdown(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ messaging

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        assert not self._pending, "a call to every worker while steps are in flight"
        self._broadcast(method, *args)
        return self._collect(range(self.world_size), during=method)

    def _broadcast(self, method: str, *args: Any) -> None:
        """Pickle the call once and write it to every worker."""
        if self._failed is not None:
            raise EngineDeadError(self._failed)
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                self._fail(f"worker {rank} is gone "
                           f"({self._exit_status(rank)})")

    def _collect(self, ranks: Any, during: str, reraise: bool = False) -> list[Any]:
        """The results of `ranks`, in order. Waits on every worker's socket, so a rank
        outside `ranks` that fails or dies ends the wait too."""
        results: dict[int, Any] = {}
        wanted = set(ranks)
        while not wanted <= results.keys():
            for conn in wait(self._conns):
                rank = self._conns.index(conn)
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    self._fail(f"worker {rank} died during {during} "
                               f"({self._exit_status(rank)})")
                if reply[0] == "error":
                    _, exc, text = reply
                    exc.add_note(f"(raised in worker {rank})")
                    self._fail(f"worker {rank} failed during {during}: "
                               f"{type(exc).__name__}: {exc}\n{text}",
                               exc if reraise else None)
                results[rank] = reply[1]
        return [results[r] for r in ranks]

    def _fail(self, message: str, exc: BaseException | None = None) -> None:
        """Stop every worker (the group cannot go on without one) and raise."""
        self._failed = message
        logger.error("%s", message)
        # No graceful exit: the others may be blocked in a collective with the failed one.
        for proc in self._procs:
            proc.terminate()
        self.shutdown()
        if exc is not None:
            raise exc
        raise EngineDeadError(message)

    def _exit_status(self, rank: int) -> str:
        proc = self._procs[rank]
        try:
            code = proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return f"pid {proc.pid}, still running"
        return f"pid {proc.pid}, exit code {code}"


def _stop_workers(procs: list[subprocess.Popen], conns: list[Connection]) -> None:
    """Ask each worker to exit, then terminate / kill stragglers; close the sockets.

    A weakref finalizer (never a method): it runs at shutdown(), when the executor is
    collected, or at interpreter exit, and must not keep the executor alive.
    """
    shutdown = pickle.dumps(("shutdown", ()))
    for conn in conns:
        try:
            conn.send_bytes(shutdown)
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=SHUTDOWN_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for conn in conns:
        conn.close()
