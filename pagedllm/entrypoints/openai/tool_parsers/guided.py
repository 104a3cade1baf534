"""Readers of outputs forced by guided decoding (`tool_choice` "required" or named).

The grammar guarantees the shape, so these only translate: a named choice's output
*is* the arguments of that function, and "required" produces a JSON array of
{"name", "parameters"} objects (vLLM's format). An output cut short (max_tokens) is
read as far as it goes.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (ParsedDelta, ToolCallDelta,
                                                           ToolParser)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import JsonCallSequenceParser


class NamedToolParser(ToolParser):
    """One call of the named function whose arguments are the output itself, streamed
    as it is generated (the first delta names the call)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ParsedDelta:
        if self.num_calls == 0:
            return ParsedDelta(tool_calls=[self.new_call(self.name, text)])
        return ParsedDelta(tool_calls=[ToolCallDelta(index=0, arguments=text)] if text
                           else [])

    def finish(self) -> ParsedDelta:
        return self.feed("") if self.num_calls == 0 else ParsedDelta()


class RequiredToolParser(JsonCallSequenceParser):
    """Each array item becomes a call once it is complete."""

    def __init__(self) -> None:
        super().__init__(openers=("[",), separator=",", closer="]",
                         argument_keys=("parameters", "arguments"))
