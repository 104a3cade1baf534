"""Grammars compiled (or only parsed) in a child process, under CPU-time and memory limits.

What a constraint costs xgrammar to compile is not what it costs to send: a JSON-schema
enum of 200,000 short strings (1.9 MB) takes ~27 s of CPU and 5.6 GB of memory at its
peak, and an xgrammar compile cannot be interrupted. In a process of its own a compile
that overruns is killed (the process is started again for the next one), so one request
can neither hold the compiler for minutes nor take the engine's memory. The compiled
grammar comes back serialized (xgrammar's JSON; deserializing releases the GIL).

Parsing alone can cost as much: a JSON schema's `pattern` of `(a|b){1,10000}` (a
47-byte schema) takes xgrammar ~12 s to turn into a grammar, and the time grows with
the square of the count. A child given no tokenizer info only parses (the server's
check of a request's constraint before it is queued, constraint_check.py).

Started by `GrammarCompileProcess` as `python -c BOOT FD ROOT` (as the multiprocess
executor starts its workers: the engine core may itself be a daemonic multiprocessing
child, which may not have children of its own). Messages over the socket pair, pickled:

  engine  -> compiler   tokenizer info (xgrammar JSON)     once, first (None: parse only)
                        (kind, spec, any_whitespace)      one compile
  compiler -> engine    ("ready", None)                   once the compiler is built
                        ("ok", compiled grammar JSON)     per compile (None: it parsed)
                        ("error", message)                per compile that raised

The child exits when the engine's end of the socket closes, or (mid-compile) within a
second of the engine process dying. Limits are read from /proc
(Linux); elsewhere the time limit is wall-clock and memory is not limited.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Nice value of the compiler process. Measured on 2 cores, a completion of 8 tokens while
# a 60,000-string enum compiled: 0.54 s at 0, 0.12 s at 10, 0.09 s at 19 (0.06 s alone);
# 10 leaves compiles most of a core when the engine is not using it.
COMPILE_NICE = 10
# Niced first: its start-up (importing xgrammar and torch) is seconds of CPU too.
BOOT = (f"import os, sys; os.nice({COMPILE_NICE}); sys.path.insert(0, sys.argv[2]); "
        "from pagedllm.sample.grammar_process import main; main(int(sys.argv[1]))")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# How often the limits are checked while a compile runs.
POLL_S = 0.02
# Importing xgrammar (and torch with it) and building the tokenizer's info.
START_TIMEOUT_S = 300.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class GrammarCompileError(Exception):
    """A compile failed, ran over a limit, or its process died; the message says which.
    `lasting`: the same constraint would fail again (not so when the process died or
    did not start: something else may have killed it). `over_limit`: it ran over the
    CPU-time or memory limit (otherwise xgrammar refused the constraint)."""

    def __init__(self, message: str, lasting: bool = True, over_limit: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting
        self.over_limit = over_limit


class GrammarCompileProcess:
    """One compile at a time in a child process; `compile` returns the serialized grammar.

    `tokenizer_info_json`: None for a child that only parses (`compile` returns None).
    `cpu_limit_s`: CPU seconds one compile may use (its threads together); 0: no limit.
    `memory_limit_bytes`: resident memory of the process during a compile; 0: no limit.
    `what` and `limit_names` word the errors of a limit: what ran over, and the options
    that set the time and the memory limit; `name` is the process's in messages.
    Not thread-safe: the engine calls it from its one compile thread.
    """

    def __init__(self, tokenizer_info_json: str | None, cpu_limit_s: float,
                 memory_limit_bytes: int, what: str = "compiling the grammar",
                 limit_names: tuple[str, str] = ("grammar_compile_timeout",
                                                 "grammar_compile_memory"),
                 name: str = "grammar compiler") -> None:
        self.tokenizer_info_json = tokenizer_info_json
        self.cpu_limit_s = cpu_limit_s
        self.memory_limit_bytes = memory_limit_bytes
        self.what = what
        self.limit_names = limit_names
        self.name = name
        # [process, connection] of the running child, emptied when it is stopped.
        self._child: list[Any] = []
        self._finalizer = weakref.finalize(self, _stop, self._child)
        self._closed = False

    def compile(self, kind: str, spec: str, any_whitespace: bool) -> str | None:
        reused = bool(self._child)
        try:
            return self._compile(kind, spec, any_whitespace)
        except GrammarCompileError as e:
            if e.lasting or not reused:
                raise
            # A child killed from outside between compiles can still look alive to
            # start() (its threads are still exiting): once more, on a new child.
            logger.warning("%s process lost (%s); compiling again", self.name, e)
            return self._compile(kind, spec, any_whitespace)

    def _compile(self, kind: str, spec: str, any_whitespace: bool) -> str | None:
        proc, conn = self.start()
        try:
            conn.send((kind, spec, any_whitespace))
        except OSError:  # it died after start() looked (the OOM killer, say)
            self._stop()
            raise GrammarCompileError(f"the {self.name} process died",
                                     lasting=False) from None
        start = time.monotonic()
        cpu_start = _cpu_seconds(proc.pid)
        while not conn.poll(POLL_S):
            cpu = _cpu_seconds(proc.pid)
            used = (time.monotonic() - start if cpu is None or cpu_start is None
                    else cpu - cpu_start)
            if self.cpu_limit_s and used > self.cpu_limit_s:
                self._stop()
                raise GrammarCompileError(
                    f"{self.what} took more than {self.cpu_limit_s:g} s of CPU time "
                    f"({self.limit_names[0]})", over_limit=True)
            rss = _resident_bytes(proc.pid)
            if self.memory_limit_bytes and rss is not None and rss > self.memory_limit_bytes:
                self._stop()
                raise GrammarCompileError(
                    f"{self.what} needed more than "
                    f"{self.memory_limit_bytes / (1 << 30):g} GiB of memory "
                    f"({self.limit_names[1]})", over_limit=True)
            if proc.poll() is not None:
                break
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            code = proc.wait()
            self._stop()
            raise GrammarCompileError(
                f"the {self.name} process died (exit code {code})", lasting=False,
            ) from None
        if status == "error":
            raise GrammarCompileError(payload)
        return payload

    def start(self) -> tuple[subprocess.Popen, Connection]:
        """The running child, started (and waited for) if there is none or it died
        between compiles."""
        if self._closed:
            raise GrammarCompileError(f"the {self.name} was shut down", lasting=False)
        if self._child:
            if self._child[0].poll() is None:
                return self._child[0], self._child[1]
            logger.warning("the %s process had exited (code %s); starting another",
                           self.name, self._child[0].returncode)
            self._stop()
        parent, child = Pipe()  # duplex: a socket pair on POSIX
        fd = child.fileno()
        proc = subprocess.Popen([sys.executable, "-c", BOOT, str(fd), _PACKAGE_ROOT],
                                pass_fds=(fd,), stdin=subprocess.DEVNULL)
        child.close()
        self._child[:] = [proc, parent]
        parent.send(self.tokenizer_info_json)
        if not parent.poll(START_TIMEOUT_S):
            self._stop()
            raise GrammarCompileError(f"the {self.name} process did not start",
                                      lasting=False)
        try:
            status, payload = parent.recv()
        except (EOFError, OSError):
            self._stop()
            raise GrammarCompileError(f"the {self.name} process failed to start "
                                      f"(exit code {proc.wait()})", lasting=False) from None
        if status != "ready":
            self._stop()
            raise GrammarCompileError(f"the {self.name} failed to start: {payload}",
                                      lasting=False)
        logger.info("%s process started (pid %d)", self.name, proc.pid)
        return proc, parent

    @property
    def closed(self) -> bool:
        """Whether shutdown() was called (nothing starts after it)."""
        return self._closed

    @property
    def pid(self) -> int | None:
        """The running child's pid (None before the first compile or after a kill)."""
        return self._child[0].pid if self._child else None

    def _stop(self) -> None:
        _stop(self._child)

    def shutdown(self) -> None:
        self._closed = True
        self._finalizer()


def _stop(child: list[Any]) -> None:
    """Kill the child (it holds no state worth a graceful exit) and reap it."""
    if not child:
        return
    proc, conn = child
    child.clear()
    conn.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of the process, all its threads; None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After "pid (comm)": state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _resident_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, IndexError):
        return None


# ---------------------------------------------------------------------- the child


def main(fd: int) -> None:
    """Entry point of the compiler process."""
    # Ctrl-C reaches the whole process group: the engine decides when this one stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    try:
        _serve(conn)
    except (EOFError, OSError):
        pass  # the engine is gone
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown: nothing is left to flush


def _exit_with_parent(parent_pid: int) -> None:
    """An engine that died mid-compile (SIGKILL) cannot kill this process, and a compile
    runs on past any limit; a compile releases the GIL, so this thread sees it."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _serve(conn: Connection) -> None:
    info_json = conn.recv()
    compiler = None  # parse only
    try:
        import xgrammar as xgr

        if info_json is not None:
            info = xgr.TokenizerInfo.deserialize_json(info_json)
            # Its own cache is unbounded: the engine's (by constraint, bounded) replaces it.
            compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    except Exception as e:
        conn.send(("error", repr(e)))
        return
    conn.send(("ready", None))
    while True:
        kind, spec, any_whitespace = conn.recv()
        try:
            if compiler is None:
                parse_constraint(kind, spec, any_whitespace)
                reply = ("ok", None)
            else:
                compiled = compile_constraint(compiler, kind, spec, any_whitespace)
                reply = ("ok", compiled.serialize_json())
        except Exception as e:  # xgrammar reports a grammar it cannot handle this way
            reply = ("error", xgrammar_message(e))
        conn.send(reply)


def xgrammar_message(e: Exception) -> str:
    """The last line of an xgrammar error without its "[time] file.cc:line: " prefix."""
    text = str(e).strip()
    if not text:
        return repr(e)
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[-1])


def compile_constraint(compiler: Any, kind: str, spec: str, any_whitespace: bool) -> Any:
    """Compile one constraint: `spec` is a JSON schema's text, a regex or EBNF (choices
    arrive as EBNF; "json_object" ignores it)."""
    if kind == "json":
        return compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(spec)
    raise ValueError(f"unknown constraint kind {kind!r}")


def parse_constraint(kind: str, spec: str, any_whitespace: bool) -> None:
    """Parse one constraint into xgrammar's grammar, without a tokenizer (what a compile
    does first); xgrammar's exception if it is malformed."""
    import xgrammar as xgr

    if kind == "json":
        xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace)
    elif kind == "regex":
        xgr.Grammar.from_regex(spec)
    elif kind == "grammar":
        xgr.Grammar.from_ebnf(spec)
    elif kind == "structural_tag":
        xgr.Grammar.from_structural_tag(spec)
    elif kind != "json_object":
        raise ValueError(f"unknown constraint kind {kind!r}")
