"""The engine-core process (engine/core_proc.py) ends without the interpreter's
teardown once it has closed what it owns; one started before its config is known
(EngineProcess, the server's) ends when the config never comes."""

from __future__ import annotations

import subprocess
import sys

# A daemon thread inside a long native call (a torch matmul, the GIL released: as the
# grammar warm-up's xgrammar call in the core) while the process ends: the teardown
# ends that thread when the call returns, through C++ frames that cannot unwind, and
# the process aborts.
CHILD = """
import sys, threading, time, torch
from pagedllm.engine.core_proc import _exit_without_teardown

torch.set_num_threads(1)
started = threading.Event()

def work():
    a = torch.randn(3072, 3072)
    while True:
        started.set()
        a @ a

threading.Thread(target=work, daemon=True).start()
started.wait()
time.sleep(0.2)
print("closed", flush=True)
if sys.argv[1] == "teardown":
    sys.exit(0)
_exit_without_teardown(0)
"""


def _end(how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True,
                          text=True, timeout=120)


def test_the_core_ends_cleanly_with_a_thread_in_native_code():
    """A server stopped in its first seconds stopped its core during the grammar
    warm-up: "terminate called without an active exception", SIGABRT."""
    teardown = _end("teardown")  # what the core did before
    assert teardown.returncode == -6 and "terminate called" in teardown.stderr
    ended = _end("exit")
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout == "closed\n" and "terminate" not in ended.stderr


def test_an_engine_process_whose_config_never_comes_ends():
    """The server starts the engine process before reading the model's config: a
    refused option cancels it at once (it holds nothing yet), and a front end that
    goes away (its end of the pipe closed) ends it too, quietly."""
    import time

    from pagedllm.engine.core_client import EngineProcess

    cancelled = EngineProcess()
    start = time.monotonic()
    cancelled.cancel()
    assert not cancelled.proc.is_alive() and time.monotonic() - start < 5
    abandoned = EngineProcess()
    abandoned._writer.close()  # as when the front end's process ends
    abandoned.proc.join(120)
    assert abandoned.proc.exitcode == 0
