"""How one chat request uses its tools, decided once per request (`plan_tools`).

- The chat template always gets `tools` (also with tool_choice "none", as vLLM).
- "none": the output is plain content.
- "auto": the server's --tool-call-parser reads each output (needs
  --enable-auto-tool-choice, else 400 as vLLM).
- "required" and a named function: guided decoding forces the calls, so even a model
  that knows nothing of tools makes them: a named choice's output is a JSON object
  matching that function's parameters (its arguments), "required" a JSON array of 1..N
  (1 with parallel_tool_calls false) {"name", "parameters"} objects, one per call.
  Forced JSON is compact (no free whitespace): arguments are read by programs, and a
  small model left free to emit whitespace can spend its max_tokens on newlines.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, DeltaToolCall,
                                                  NamedToolChoice, ToolCall, ToolParam)
from pagedllm.entrypoints.openai.tool_parsers.base import (ParsedDelta, ToolCallDelta,
                                                           ToolParser, assemble_calls)
from pagedllm.entrypoints.openai.tool_parsers.guided import (NamedToolParser,
                                                             RequiredToolParser)
from pagedllm.entrypoints.openai.tool_protocol import DeltaFunctionCall, FunctionCall
from pagedllm.errors import InvalidRequestError

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')


@dataclass
class ToolPlan:
    """A request's use of tools: what the template sees, what constrains generation,
    and how each choice's output is read."""

    template_tools: list[dict[str, Any]] | None
    """`tools` as plain dicts for the chat template (None: no tools)."""
    constraint: dict[str, Any] | None = None
    """structured_outputs keywords forcing the calls ("required", named)."""
    make_parser: Callable[[], ToolParser] | None = None
    """A fresh parser per choice; None: the output is plain content."""
    max_calls: int | None = None
    """Calls kept per choice (1 with parallel_tool_calls false)."""
    is_named: bool = False
    """A named choice finishes with "stop", as OpenAI's, not "tool_calls"."""

    def new_reader(self) -> ToolCallReader | None:
        """A reader for one choice's output (None: plain content)."""
        if self.make_parser is None:
            return None
        return ToolCallReader(self.make_parser(), self.max_calls, self.is_named)


def plan_tools(request: ChatCompletionRequest, auto_parser: type[ToolParser] | None,
               exclude_tools_when_none: bool = False) -> ToolPlan:
    """The plan of a validated request, `auto_parser` the server's parser of
    tool_choice "auto" (None: off); InvalidRequestError for what this server's flags do
    not allow, or a constraint that cannot be built. `exclude_tools_when_none`: a
    tool_choice "none" request's prompt shows no tools."""
    tools = request.tools or []
    plan = ToolPlan([t.model_dump(exclude_none=True) for t in tools] or None)
    choice = request.effective_tool_choice
    plan.max_calls = 1 if request.parallel_tool_calls is False else None
    if choice == "none":
        if exclude_tools_when_none:
            plan.template_tools = None
        return plan
    if choice == "auto":
        if auto_parser is None:
            raise InvalidRequestError(AUTO_NEEDS_FLAGS)
        parser = auto_parser
        if getattr(parser, "reads_tool_schemas", False):  # typed by the tools' schemas
            template_tools = plan.template_tools
            plan.make_parser = lambda: parser(template_tools)
        else:
            plan.make_parser = parser
        return plan
    if request.structured_outputs_kwargs() is not None:
        raise InvalidRequestError(
            "tool_choice \"required\" or a named function is forced by guided decoding and "
            "cannot be combined with response_format, structured_outputs or guided_*")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next(t for t in tools if t.function.name == name)  # validated
        plan.constraint = {"json": arguments_schema(tool.function.parameters),
                           "disable_any_whitespace": True}
        plan.make_parser = lambda: NamedToolParser(name)
        plan.is_named = True
    else:  # "required"
        plan.constraint = {"json": required_schema(tools, plan.max_calls),
                           "disable_any_whitespace": True}
        plan.make_parser = RequiredToolParser
    return plan


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema of a function's arguments: always an object (OpenAI's default for a
    function without parameters is {})."""
    if not parameters:
        return {"type": "object", "properties": {}}
    return parameters if "type" in parameters else {"type": "object", **parameters}


def required_schema(tools: list[ToolParam], max_calls: int | None) -> dict[str, Any]:
    """A JSON array of calls, each {"name": one of the functions, "parameters": its
    arguments}. Definitions ($defs / definitions) move to the root, where the
    functions' "#/$defs/..." references now point; two functions defining one name
    differently cannot be combined (400)."""
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    items = []
    for tool in tools:
        params = copy.deepcopy(arguments_schema(tool.function.parameters))
        for key, found in defs.items():
            for name, sub in params.pop(key, {}).items():
                if found.setdefault(name, sub) != sub:
                    raise InvalidRequestError(
                        f"tools: {key}/{name} is defined differently by two functions; "
                        f"tool_choice \"required\" needs them to agree")
        items.append({"type": "object",
                      "properties": {"name": {"type": "string",
                                              "enum": [tool.function.name]},
                                     "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    schema.update({key: found for key, found in defs.items() if found})
    return schema


class ToolCallReader:
    """One choice's parser, with the request's call limit and finish reason."""

    def __init__(self, parser: ToolParser, max_calls: int | None, is_named: bool) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.is_named = is_named
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        return self._limit(self.parser.feed(text))

    def finish(self) -> ParsedDelta:
        return self._limit(self.parser.finish())

    def read_all(self, text: str) -> ParsedDelta:
        return self.feed(text).extend(self.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        """The engine's reason, or "tool_calls" for an output that ended normally with
        calls (a named choice keeps "stop", as OpenAI's; "length" always stays)."""
        if reason == "stop" and self.num_calls and not self.is_named:
            return "tool_calls"
        return reason

    def _limit(self, delta: ParsedDelta) -> ParsedDelta:
        """Drop calls past max_calls (parallel_tool_calls false: the first is kept)."""
        if self.max_calls is not None:
            delta.tool_calls = [d for d in delta.tool_calls if d.index < self.max_calls]
        self.num_calls = max([self.num_calls] + [d.index + 1 for d in delta.tool_calls])
        return delta


def response_tool_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls of a whole output, as a response message holds them."""
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in assemble_calls(deltas)]


def stream_tool_calls(deltas: list[ToolCallDelta]) -> list[DeltaToolCall]:
    """A stream chunk's pieces of calls: the first piece of a call has its id, type and
    name; later ones only append arguments."""
    out = []
    for d in deltas:
        if d.id is not None:
            out.append(DeltaToolCall(index=d.index, id=d.id, type="function",
                                     function=DeltaFunctionCall(name=d.name,
                                                                arguments=d.arguments)))
        else:
            out.append(DeltaToolCall(index=d.index,
                                     function=DeltaFunctionCall(arguments=d.arguments)))
    return out
