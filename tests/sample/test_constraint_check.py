"""The check of a structured-output constraint before its request is queued
(sample/constraint_check.py): in a child process under a CPU-time limit (the server), or
in the calling thread (offline); outcomes remembered.

`(a|b){1,3000}` as a JSON schema's `pattern` takes xgrammar about a second to expand
into its grammar (the time grows with the square of the count), so a schema of a few
hundred bytes with dozens of them parses for a minute.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("xgrammar")

from pagedllm.errors import InvalidRequestError  # noqa: E402
from pagedllm.sample.constraint_check import ConstraintChecker  # noqa: E402
from pagedllm.sampling_params import StructuredOutputsParams  # noqa: E402

LIMIT_NAMES = ("--render-timeout", "--grammar-compile-memory")


def _slow_schema(n: int) -> StructuredOutputsParams:
    """A schema of n string properties with a slow pattern each (~n seconds to parse)."""
    return StructuredOutputsParams(json={"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "(a|b){1,3000}"} for i in range(n)}})


MALFORMED = [StructuredOutputsParams(json={"type": "strin"}),
             StructuredOutputsParams(regex="(ab"),
             StructuredOutputsParams(grammar="root ::= "),
             StructuredOutputsParams(json='{"type": "object", "required": 3}')]


@pytest.fixture(scope="module")
def checker():
    c = ConstraintChecker(cpu_limit_s=0.5, memory_limit_bytes=4 << 30,
                          limit_names=LIMIT_NAMES)
    c.warm_up()
    yield c
    c.shutdown()


def _error(checker: ConstraintChecker, params: StructuredOutputsParams) -> str:
    with pytest.raises(InvalidRequestError) as e:
        checker.check(params)
    return str(e.value)


def test_a_parse_over_the_cpu_limit_is_cut_off_and_its_refusal_remembered(checker):
    start = time.monotonic()
    message = _error(checker, _slow_schema(60))  # a minute of CPU without the limit
    assert time.monotonic() - start < 20
    assert message == ("checking the structured output constraint took more than 0.5 s of "
                       "CPU time (--render-timeout): send a simpler constraint")
    assert checker._process.pid is None  # killed with its parse
    start = time.monotonic()
    assert _error(checker, _slow_schema(60)) == message  # remembered: no new parse
    assert time.monotonic() - start < 0.1 and checker._process.pid is None
    checker.check(StructuredOutputsParams(regex=r"\d{3}-\d{4}"))  # on a new process
    assert checker._process.pid is not None


def test_a_remembered_constraint_is_answered_while_another_one_parses(checker):
    valid = StructuredOutputsParams(json={"type": "object", "properties": {
        "name": {"type": "string"}}})
    checker.check(valid)
    refused: list[str] = []
    # 61 properties: not the schema the test above had refused (that is remembered)
    slow = threading.Thread(target=lambda: refused.append(_error(checker,
                                                                 _slow_schema(61))))
    slow.start()
    time.sleep(0.2)  # the slow parse is under way in the child
    start = time.monotonic()
    checker.check(valid)
    assert time.monotonic() - start < 0.05
    assert slow.is_alive()
    slow.join(30)
    assert "took more than" in refused[0]


@pytest.mark.parametrize("params", MALFORMED, ids=lambda p: p.kind)
def test_malformed_constraints_get_the_same_message_in_the_child_and_in_thread(checker,
                                                                                params):
    in_thread = ConstraintChecker()
    message = _error(in_thread, params)
    assert message.startswith(f"invalid structured_outputs.{params.kind}: ")
    assert len(message) > len(f"invalid structured_outputs.{params.kind}: ") + 5
    assert _error(checker, params) == message
    assert checker._process.pid is not None  # a refusal by xgrammar kills nothing


def test_valid_constraints_pass_and_are_remembered(checker):
    kinds = [StructuredOutputsParams(json={"type": "integer"}),
             StructuredOutputsParams(regex="[a-z]+"),
             StructuredOutputsParams(choice=["yes", "no"]),
             StructuredOutputsParams(grammar='root ::= "a" | "b"'),
             StructuredOutputsParams(json_object=True)]
    for params in kinds:
        checker.check(params)
    checker._process._stop()  # a remembered constraint does not need the process
    for params in kinds:
        checker.check(params)
    assert checker._process.pid is None
