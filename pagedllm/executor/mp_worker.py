"""The worker process of the multiprocess executor: one tensor-parallel rank.

Started by `MultiprocExecutor` as `python -c BOOT FD ROOT`: FD is its end of a socket pair
with the engine (a multiprocessing Connection), ROOT the directory holding the pagedllm
package. Messages, all pickled:

  engine -> worker   ("init", WorkerInit)      once: join the group, build the runner
                     (method, args)            "determine_num_blocks", "initialize_kv_cache",
                                               "execute_model" (args pre-pickled once for
                                               all workers), "shutdown"
  worker -> engine   ("ok", result)            every call, except that only rank 0
                                               answers "execute_model"
                     ("error", exc, traceback) any call that raised

A worker exits when told to shut down or when the engine's end of the socket closes (the
engine process is gone), so none outlives its engine.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.config import EngineConfig

# The script a worker process runs (see the module docstring).
BOOT = ("import sys; sys.path.insert(0, sys.argv[2]); "
        "from pagedllm.executor.mp_worker import main; main(int(sys.argv[1]))")
# Calls every rank answers; "execute_model" is answered by rank 0 only (the others stay
# silent unless they fail), so a step costs one reply.
EXECUTE = "execute_model"


@dataclass
class WorkerInit:
    """What a worker needs to join its group and build its ModelRunner."""

    tp_rank: int
    tp_size: int
    # The engine's rendezvous store (torch.distributed.TCPStore) address.
    store_host: str
    store_port: int
    # The engine's config with num_threads already divided among the workers.
    config: EngineConfig


def worker_config(config: EngineConfig, tp_size: int) -> EngineConfig:
    """`config` with the engine's intra-op threads split among `tp_size` workers (at
    least one each), so tp workers on n cores do not oversubscribe them."""
    threads = max(1, config.device.num_threads // tp_size)
    return dataclasses.replace(
        config, device=dataclasses.replace(config.device, num_threads=threads))


def main(fd: int) -> None:
    """Entry point of a worker process."""
    # Ctrl-C reaches the whole process group: the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        runner = _init(conn)
        if runner is not None:
            _serve(conn, runner)
    except (EOFError, OSError):
        pass  # the engine is gone: nothing to answer
    conn.close()
    # As multiprocessing's children do: skip the interpreter's teardown (a second or more
    # with torch loaded, and the gloo group's threads), nothing is left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _init(conn: Connection) -> Any:
    """Receive WorkerInit, join the TP group, build the runner; None after a failure
    (already reported)."""
    kind, init = conn.recv()
    assert kind == "init", kind
    try:
        from pagedllm.distributed.parallel_state import init_tensor_parallel
        from pagedllm.worker.model_runner import ModelRunner

        parallel = init_tensor_parallel(init.store_host, init.store_port, init.tp_rank,
                                        init.tp_size)
        runner = ModelRunner(init.config, parallel)
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises
        _send_error(conn, e)
        return None
    conn.send(("ok", None))
    return runner


def _serve(conn: Connection, runner: Any) -> None:
    """Answer calls until "shutdown"."""
    is_driver = runner.parallel.is_driver
    while True:
        method, args = pickle.loads(conn.recv_bytes())
        if method == "shutdown":
            conn.send(("ok", None))
            return
        try:
            result = getattr(runner, method)(*args)
        except BaseException as e:  # noqa: BLE001 - reported; the engine shuts us down
            _send_error(conn, e)
            continue
        if method != EXECUTE or is_driver:
            conn.send(("ok", result))


def _send_error(conn: Connection, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    print(text, file=sys.stderr, flush=True)
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - an exception that cannot travel goes as text
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    conn.send(("error", exc, text))
