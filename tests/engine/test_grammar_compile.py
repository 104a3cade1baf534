"""Grammars compile off the engine loop (engine/structured_output.py).

A grammar can take seconds to compile; its request waits outside the scheduler while
everything else keeps running. Compiling is made slow here on purpose (the compile
waits for an Event), so what is checked is ordering, not timing.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.sample.grammar_process import GrammarCompileError
from pagedllm.sample.structured_output import GrammarManager

PHONE = StructuredOutputsParams(regex=r"\d{3}-\d{4}")
MAX_STEPS = 500


@pytest.fixture
def gated_compile(default_llm, monkeypatch):
    """The default LLM's grammar compiles wait until the returned Event is set."""
    grammar = default_llm.llm_engine.engine_core.structured_output.grammar
    release = threading.Event()
    real = grammar.compile

    def compile_when_released(params, key=None):
        assert release.wait(60), "the test never released the compile"
        return real(params, key)

    monkeypatch.setattr(grammar, "compile", compile_when_released)
    yield release
    release.set()  # a compile the test left waiting ends (its result is dropped)


def _run(engine, until, finished: dict) -> None:
    for _ in range(MAX_STEPS):
        if until():
            return
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError(f"not done after {MAX_STEPS} steps: {sorted(finished)}")


def test_a_compiling_grammar_holds_back_only_its_own_request(default_llm, gated_compile):
    engine = default_llm.llm_engine
    core = engine.engine_core
    engine.add_request("grammar", "My phone number is",
                       SamplingParams(temperature=0, max_tokens=20, structured_outputs=PHONE))
    engine.add_request("plain", "The capital of France is",
                       SamplingParams(temperature=0, max_tokens=6))
    finished: dict = {}
    _run(engine, lambda: "plain" in finished, finished)
    # The plain request ran to its end while the grammar was still compiling.
    assert "Paris" in finished["plain"].outputs[0].text
    assert "grammar" not in finished and core.num_compiling == 1
    assert core.scheduler.get_request("grammar") is None  # not in the scheduler yet
    gated_compile.set()
    _run(engine, lambda: not engine.has_unfinished_requests(), finished)
    out = finished["grammar"].outputs[0]
    assert re.fullmatch(r"\d{3}-\d{4}", out.text) and out.finish_reason == "stop"


def test_small_grammars_compile_before_big_ones_that_arrived_first(default_llm,
                                                                  gated_compile):
    """While one compile runs, a short regex sent after two long ones compiles first."""
    engine = default_llm.llm_engine
    grammar = engine.engine_core.structured_output.grammar
    order = []
    gated = grammar.compile

    def recording(params, key=None):
        order.append(params.regex)
        return gated(params, key)

    grammar.compile = recording  # undone with gated_compile's monkeypatch
    long_a, long_b = "a" * 50 + r"\d+", "b" * 60 + r"\d+"
    for req_id, regex in [("running", long_a), ("long", long_b), ("short", r"\d{3}")]:
        engine.add_request(req_id, "Numbers:", SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
                regex=regex)))
        deadline = time.monotonic() + 30
        while not order:  # the first one is running before the others queue
            assert time.monotonic() < deadline
            time.sleep(0.01)
    gated_compile.set()
    finished: dict = {}
    _run(engine, lambda: not engine.has_unfinished_requests(), finished)
    assert order == [long_a, r"\d{3}", long_b]
    assert re.fullmatch(r"\d{3}", finished["short"].outputs[0].text)
    assert set(finished) == {"running", "long", "short"}


def test_abort_while_compiling(default_llm, gated_compile):
    engine = default_llm.llm_engine
    engine.add_request("aborted", "My phone number is",
                       SamplingParams(temperature=0, max_tokens=8, structured_outputs=PHONE))
    assert engine.has_unfinished_requests()
    aborted = engine.abort_request("aborted")
    assert [o.request_id for o in aborted] == ["aborted"]
    assert aborted[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.num_compiling == 0


def test_deadline_passes_while_compiling(default_llm, gated_compile):
    engine = default_llm.llm_engine
    engine.add_request("late", "My phone number is",
                       SamplingParams(temperature=0, max_tokens=8, structured_outputs=PHONE),
                       timeout=0.05)
    time.sleep(0.1)
    finished: dict = {}
    _run(engine, lambda: not engine.has_unfinished_requests(), finished)
    assert finished["late"].outputs[0].finish_reason == "timeout"
    assert engine.engine_core.num_compiling == 0


def test_a_failed_compile_aborts_its_request_only(default_llm, monkeypatch):
    engine = default_llm.llm_engine
    grammar = engine.engine_core.structured_output.grammar

    def fail(params, key=None):
        raise RuntimeError("out of grammar memory")

    monkeypatch.setattr(grammar, "compile", fail)
    engine.add_request("bad", "My phone number is",
                       SamplingParams(temperature=0, max_tokens=8, structured_outputs=PHONE))
    engine.add_request("fine", "The capital of France is",
                       SamplingParams(temperature=0, max_tokens=6))
    finished: dict = {}
    _run(engine, lambda: not engine.has_unfinished_requests(), finished)
    assert finished["bad"].outputs[0].finish_reason == "abort"
    assert finished["bad"].outputs[0].token_ids == []
    assert "Paris" in finished["fine"].outputs[0].text


def test_a_grammar_over_a_compile_limit_finishes_its_request_saying_why(default_llm,
                                                                       monkeypatch, caplog):
    engine = default_llm.llm_engine
    grammar = engine.engine_core.structured_output.grammar

    def over_limit(params, key=None):
        raise GrammarCompileError("compiling the grammar took more than 1 s "
                                  "(grammar_compile_timeout)")

    monkeypatch.setattr(grammar, "compile", over_limit)
    engine.add_request("slow", "My phone number is",
                       SamplingParams(temperature=0, max_tokens=8, structured_outputs=PHONE))
    finished: dict = {}
    with caplog.at_level("WARNING", logger="pagedllm.engine.structured_output"):
        _run(engine, lambda: not engine.has_unfinished_requests(), finished)
    assert finished["slow"].outputs[0].finish_reason == "abort"
    assert "request slow: its grammar did not compile: compiling the grammar took more " \
           "than 1 s (grammar_compile_timeout)" in caplog.text


def test_warm_up_starts_the_compiler_process_before_any_request(smollm2_tokenizer):
    manager = StructuredOutputManager(GrammarManager(
        lambda: smollm2_tokenizer, 49152, compile_cpu_limit_s=60.0))
    try:
        manager.warm_up()
        manager._pool.submit(0, lambda: None).result(120)  # the warm-up ran before this
        pid = manager.grammar._compiler.pid
        assert pid is not None and pid != os.getpid()
        manager.grammar.compile(PHONE)
        assert manager.grammar._compiler.pid == pid  # the compile used that process
    finally:
        manager.shutdown()


def test_a_warm_up_cut_short_by_shutdown_starts_nothing_and_logs_no_error(
        smollm2_tokenizer, caplog):
    """A server stopped in its first seconds stops its core during the grammar warm-up:
    the warm-up then started a compiler process after the shutdown (left running until
    the core exited), or, stopped while that process started, logged its failure as
    an error."""
    loading = threading.Event()
    release = threading.Event()

    def load_tokenizer():
        loading.set()
        assert release.wait(60), "the test never released the warm-up"
        return smollm2_tokenizer

    manager = StructuredOutputManager(GrammarManager(load_tokenizer, 49152,
                                                     compile_cpu_limit_s=60.0))
    with caplog.at_level("WARNING", logger="pagedllm"):
        manager.warm_up()
        assert loading.wait(60)
        manager.shutdown()
        release.set()
        manager._pool._thread.join(60)
    assert not manager._pool._thread.is_alive()
    assert manager.grammar._compiler is None
    assert not caplog.records, caplog.text


def test_grammar_state_survives_recompute_preemption(default_llm):
    """The matcher lives on the request, so a preempted request resumes in its grammar
    where it left off: the same outputs as with a cache big enough for all."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    prompts = [f"Describe person number {i} in JSON:" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json=schema))
    expected = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params,
                                                                      use_tqdm=False)]
    small = LLM(num_kv_blocks=12, max_num_seqs=6)
    try:
        outputs = small.generate(prompts, params, use_tqdm=False)
        assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        small.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for o in outputs:
        assert set(json.loads(o.outputs[0].text)) == {"name", "age"}


def test_compiled_grammar_cache_drops_least_recently_used(smollm2_tokenizer):
    manager = GrammarManager(lambda: smollm2_tokenizer, 49152, max_cache_bytes=1)
    a, b = StructuredOutputsParams(regex="a+"), StructuredOutputsParams(regex="b+")
    first = manager.compile(a)
    assert manager.compile(a) is first  # cached
    manager.compile(b)  # over budget: a is dropped, the newest always stays
    assert manager.num_cached == 1
    assert manager.compile(a) is not first  # compiled again
    big = GrammarManager(lambda: smollm2_tokenizer, 49152)
    for p in (a, b):
        big.compile(p)
    assert big.num_cached == 2 and big.cache_bytes > 0


def test_a_grammar_that_failed_a_limit_fails_again_at_once(smollm2_tokenizer, monkeypatch):
    """Limits are in CPU time and memory, so a retry would fail alike: the failure is
    remembered (a dead compiler process is not: something else may have killed it)."""
    manager = GrammarManager(lambda: smollm2_tokenizer, 49152)
    calls = []

    def over_limit(params):
        calls.append(params.regex)
        lasting = params.regex != "killed"
        raise GrammarCompileError(f"{params.regex} failed", lasting=lasting)

    monkeypatch.setattr(manager, "_compile", over_limit)
    for regex in ["slow", "slow", "killed", "killed"]:
        with pytest.raises(GrammarCompileError, match=f"{regex} failed"):
            manager.compile(StructuredOutputsParams(regex=regex))
    assert calls == ["slow", "killed", "killed"]
