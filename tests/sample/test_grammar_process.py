"""The grammar compiler process (sample/grammar_process.py): compiles in a child process,
kills it when a compile runs over its CPU-time or memory limit or dies, and starts a new
one for the next compile.

A vocabulary of ASCII characters and the numbers 0-999 stands in for a tokenizer. An
enum of 60,000 strings takes xgrammar seconds of CPU over it; one of 20,000 strings
~1 s and ~80 MB more memory than the idle process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

xgr = pytest.importorskip("xgrammar")

from pagedllm.sample.grammar_process import (GrammarCompileError,  # noqa: E402
                                             GrammarCompileProcess, _resident_bytes)

VOCAB = [chr(c) for c in range(32, 127)] + [str(i) for i in range(1000)] + ["</s>"]
EOS = len(VOCAB) - 1
PHONE = r"\d{3}-\d{4}"


def _enum(n: int) -> str:
    return json.dumps({"enum": [f"item{i}" for i in range(n)]})


@pytest.fixture(scope="module")
def info():
    return xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])


@pytest.fixture
def compiler(info):
    proc = GrammarCompileProcess(info.serialize_json(), cpu_limit_s=0, memory_limit_bytes=0)
    yield proc
    proc.shutdown()


def _matches(info, serialized: str, text: str) -> bool:
    """Whether the compiled grammar accepts `text` (one token per character) and then
    may end."""
    matcher = xgr.GrammarMatcher(xgr.CompiledGrammar.deserialize_json(serialized, info))
    return all(matcher.accept_token(VOCAB.index(ch)) for ch in text) \
        and matcher.accept_token(EOS) and matcher.is_terminated()


def test_compiles_in_a_child_process_and_the_result_matches(info, compiler):
    serialized = compiler.compile("regex", PHONE, True)
    assert compiler.pid is not None and compiler.pid != os.getpid()
    assert _matches(info, serialized, "123-4567")
    assert not _matches(info, serialized, "1234567")
    schema = compiler.compile("json", json.dumps({"enum": ["red", "green"]}), False)
    assert _matches(info, schema, '"green"') and not _matches(info, schema, '"blue"')
    pid = compiler.pid
    compiler.compile("json_object", "", True)
    assert compiler.pid == pid  # one process serves every compile


def test_a_grammar_xgrammar_rejects_fails_with_its_message(compiler):
    with pytest.raises(GrammarCompileError,
                       match=r'^EBNF parser error.*"undefined_rule" is not defined'):
        compiler.compile("grammar", 'root ::= undefined_rule', True)
    pid = compiler.pid
    assert _resident_bytes(pid) is not None  # the process is still there, and serves
    compiler.compile("regex", PHONE, True)
    assert compiler.pid == pid


def test_a_compile_over_the_cpu_limit_is_killed_and_the_next_one_runs(info, compiler):
    compiler.compile("regex", PHONE, True)  # started
    first = compiler.pid
    compiler.cpu_limit_s = 0.5
    with pytest.raises(GrammarCompileError, match="more than 0.5 s.*grammar_compile_timeout"):
        compiler.compile("json", _enum(60000), True)
    assert compiler.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # killed and reaped
    assert _matches(info, compiler.compile("regex", PHONE, True), "555-0100")
    assert compiler.pid not in (None, first)


def test_a_compile_over_the_memory_limit_is_killed(info, compiler):
    compiler.compile("regex", PHONE, True)
    idle = _resident_bytes(compiler.pid)
    assert idle is not None
    compiler.memory_limit_bytes = idle + (30 << 20)
    with pytest.raises(GrammarCompileError, match="grammar_compile_memory"):
        compiler.compile("json", _enum(20000), True)
    assert compiler.pid is None
    # Below the limit, a compile still runs.
    assert _matches(info, compiler.compile("regex", PHONE, True), "123-4567")


def test_a_compiler_killed_mid_compile_is_replaced_and_the_compile_retried(info,
                                                                          compiler):
    """Killed from outside (the OOM killer, say), the compile runs once more on a new
    process; killed again, it fails, saying the process died."""
    compiler.compile("regex", PHONE, True)
    victim = compiler.pid
    timer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
    timer.start()
    try:
        schema = compiler.compile("json", _enum(20000), True)
    finally:
        timer.cancel()
    assert compiler.pid not in (None, victim)
    assert _matches(info, schema, '"item123"') and not _matches(info, schema, '"other"')

    killed: list[int] = []

    def kill_each_new_process() -> None:
        deadline = time.monotonic() + 60
        while len(killed) < 2 and time.monotonic() < deadline:
            pid = compiler.pid
            if pid is not None and pid not in killed:
                time.sleep(0.3)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_each_new_process)
    killer.start()
    try:
        with pytest.raises(GrammarCompileError, match="died|start"):
            compiler.compile("json", _enum(60000), True)
    finally:
        killer.join(60)
    assert len(killed) == 2
    assert _matches(info, compiler.compile("regex", PHONE, True), "123-4567")


def test_shutdown_stops_the_process(info):
    proc = GrammarCompileProcess(info.serialize_json(), cpu_limit_s=10, memory_limit_bytes=0)
    proc.compile("regex", PHONE, True)
    pid = proc.pid
    proc.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_compiler_process_exits_when_its_engine_dies_mid_compile(tmp_path):
    """The engine (here a subprocess) is SIGKILLed while its compiler runs a compile of
    seconds: the compiler exits within about a second instead of compiling on."""
    script = tmp_path / "engine.py"
    script.write_text(
        "import json, sys, xgrammar as xgr\n"
        "from pagedllm.sample.grammar_process import GrammarCompileProcess\n"
        f"info = xgr.TokenizerInfo({VOCAB!r}, stop_token_ids=[{EOS}])\n"
        "proc = GrammarCompileProcess(info.serialize_json(), 0, 0)\n"
        "proc.start()\n"
        "print(proc.pid, flush=True)\n"
        f"proc.compile('json', {_enum(200000)!r}, True)\n")
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    compiler_pid = int(engine.stdout.readline())
    time.sleep(0.5)  # the compile is under way
    engine.kill()
    engine.wait()
    deadline = time.monotonic() + 10
    while _alive(compiler_pid):
        assert time.monotonic() < deadline, "the compiler outlived its engine"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (an exited child of a dead parent is reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_compiler_process_killed_between_compiles_is_replaced(info, compiler):
    compiler.compile("regex", PHONE, True)
    victim = compiler.pid
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(victim):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _matches(info, compiler.compile("regex", PHONE, True), "123-4567")
    assert compiler.pid != victim
