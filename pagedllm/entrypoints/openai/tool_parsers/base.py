"""The contract of a tool-call parser and the plain data it produces.

A parser turns the text a model generates into OpenAI tool calls. It is fed the text
piece by piece (a stream's deltas, or the whole output at once) and answers each piece
with what can be released *now*: content that can no longer turn out to be part of a
call, and the calls found so far. Non-streaming responses run the same parser over the
whole text, so a stream and a full response of the same output always agree (whatever
the chunking: tests feed it character by character).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCallDelta:
    """A piece of one tool call: its first piece has `id` and `name`, every later piece
    of the same `index` only appends to `arguments` (a JSON text in the end)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What a parser releases for one piece of text: content and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


@dataclass
class ToolCall:
    """A whole call, assembled from its pieces."""

    id: str
    name: str
    arguments: str


def make_call_id() -> str:
    """OpenAI's shape of a call id: 'call_' and 24 random characters."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser(ABC):
    """Finds tool calls in generated text, incrementally.

    Contract: `feed` is given successive pieces of the output and `finish` is called
    once at its end; together they release every character of the output either as
    content or inside a call (whitespace next to a call may be dropped), and the result
    must not depend on how the output was split into pieces. Text that might still
    become a call (a partial marker, an unfinished JSON object) is held back until it
    is clear. Malformed calls come back as content, never as an error.
    """

    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of the output; return what can be released now."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The output has ended: release everything still held."""

    def new_call(self, name: str, arguments: str) -> ToolCallDelta:
        """A complete call as one piece (parsers that see a call only once it is whole
        send its full arguments in its first delta: OpenAI clients accept that)."""
        call = ToolCallDelta(index=self.num_calls, id=make_call_id(), name=name,
                             arguments=arguments)
        self.num_calls += 1
        return call


def parse_all(parser: ToolParser, text: str) -> ParsedDelta:
    """Run a fresh parser over a whole output."""
    return parser.feed(text).extend(parser.finish())


def assemble_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Join the pieces of each call (by index, in index order)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            assert d.id is not None and d.name is not None, "a call's first piece names it"
            calls[d.index] = ToolCall(id=d.id, name=d.name, arguments=d.arguments)
        else:
            call.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def function_call_of(value: Any, argument_keys: tuple[str, ...] = ("arguments",),
                     ) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call object, or None if it is not
    one: a dict with a non-empty string `name` and, under the first present key of
    `argument_keys`, an object (or a JSON text of one; absent means {})."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (what must
    be held back: the next piece may complete the marker)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
