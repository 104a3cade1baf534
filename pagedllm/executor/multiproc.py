"""MultiprocExecutor: one worker process per tensor-parallel rank on this machine.

The engine process keeps the scheduler; every step it pickles the SchedulerOutput once
and writes the bytes to each worker's socket (a multiprocessing Connection over a socket
pair). All ranks run the same forward pass, their layers talking over gloo; rank 0 samples
and is the only one that answers, with the ModelRunnerOutput.

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
from pagedllm.executor.mp_worker import BOOT, EXECUTE, WorkerInit, worker_config

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
# Grace a worker gets to exit after "shutdown" (then SIGTERM, then SIGKILL).
SHUTDOWN_GRACE_S = 5.0
# The directory holding the pagedllm package, for the workers' sys.path.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class MultiprocExecutor:
    """tensor_parallel_size worker processes, each with one ModelRunner (its shard)."""

    def __init__(self, config: EngineConfig) -> None:
        import torch.distributed as dist

        self.world_size = config.parallel.tensor_parallel_size
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
            conn.send(("init", WorkerInit(rank, self.world_size, STORE_HOST,
                                          self._store.port, config)))
        # Loading errors (an unsupported model, a bad checkpoint) keep their type.
        self._collect(range(self.world_size), during="start-up", reraise=True)
        logger.info("started %d tensor parallel workers (pids %s)", self.world_size,
                    [p.pid for p in self._procs])

    def determine_num_blocks(self) -> int:
        # Every rank must fit the same block ids: the smallest budget wins.
        return min(self._call_all("determine_num_blocks"))

    def determine_num_swap_blocks(self) -> int:
        # Every rank must hold the same host block ids too.
        return min(self._call_all("determine_num_swap_blocks"))

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int = 0) -> None:
        self._call_all("initialize_kv_cache", num_blocks, num_swap_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(EXECUTE, scheduler_output)
        return self._collect([0], during="execute_model")[0]

    def shutdown(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ messaging

    def _call_all(self, method: str, *args: Any) -> list[Any]:
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
                self._fail(f"tensor parallel worker {rank} is gone "
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
                    self._fail(f"tensor parallel worker {rank} died during {during} "
                               f"({self._exit_status(rank)})")
                if reply[0] == "error":
                    _, exc, text = reply
                    exc.add_note(f"(raised in tensor parallel worker {rank})")
                    self._fail(f"tensor parallel worker {rank} failed during {during}: "
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
