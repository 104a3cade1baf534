"""The worker process of the multiprocess executor: one rank (worker/worker.py).

Started by `MultiprocExecutor` as `python -c BOOT FD ROOT`: FD is its end of a socket pair
with the engine (a multiprocessing Connection), ROOT the directory holding the pagedllm
package. Messages, all pickled:

  engine -> worker   ("init", WorkerInit)      once: join the group, build the runner
                     (method, args)            "determine_num_blocks", "initialize_kv_cache",
                                               "execute_model" (args pre-pickled once for
                                               all workers), "shutdown"
  worker -> engine   ("ok", result)            every call, except that only the driver
                                               (TP rank 0 of the last stage) answers
                                               "execute_model"
                     ("error", exc, traceback) any call that raised

A worker exits when told to shut down or when the engine's end of the socket closes (the
engine process is gone), so none outlives its engine.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from pagedllm.loader.hf_config import import_remote_code_modules
from pagedllm.worker.worker import EXECUTE, Worker

# The script a worker process runs (see the module docstring).
BOOT = ("import sys; sys.path.insert(0, sys.argv[2]); "
        "from pagedllm.executor.mp_worker import main; main(int(sys.argv[1]))")


def main(fd: int) -> None:
    """Entry point of a worker process."""
    # Ctrl-C reaches the whole process group: the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        worker = _init(conn)
        if worker is not None:
            _serve(conn, worker)
    except (EOFError, OSError):
        pass  # the engine is gone: nothing to answer
    conn.close()
    # As multiprocessing's children do: skip the interpreter's teardown (a second or more
    # with torch loaded, and the gloo group's threads), nothing is left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _init(conn: Connection) -> Worker | None:
    """Receive WorkerInit, join the groups, build the runner; None after a failure
    (already reported)."""
    blob = conn.recv_bytes()
    # A config of a model directory's own code unpickles only with its module importable.
    import_remote_code_modules()
    kind, init = pickle.loads(blob)
    assert kind == "init", kind
    try:
        worker = Worker(init)
    except BaseException as e:  # noqa: BLE001 - reported to the engine, which raises
        _send_error(conn, e)
        return None
    conn.send(("ok", None))
    return worker


def _serve(conn: Connection, worker: Worker) -> None:
    """Answer calls until "shutdown"."""
    is_driver = worker.is_driver
    while True:
        method, args = pickle.loads(conn.recv_bytes())
        if method == "shutdown":
            conn.send(("ok", None))
            return
        try:
            result = worker.execute(method, *args)
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
