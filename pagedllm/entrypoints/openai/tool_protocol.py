"""Models and checks of tool calling in the chat API (OpenAI's `tools`).

Requests: `tools` (function definitions with a JSON schema of their parameters),
`tool_choice`, `parallel_tool_calls`, assistant messages with `tool_calls` and `tool`
messages answering them. Everything a template or the guided decoder would choke on
later is refused here with a 400 naming the field: a schema that is not a JSON schema,
two functions of one name, a named choice that is not among the tools, a tool_choice
without tools, arguments that are not a JSON object, a tool message that answers no
call (and, as OpenAI, a call left without an answer).
"""

from __future__ import annotations

import json
from typing import Any, Literal

# At import, with the server: imported by the first request with tools it took the event
# loop ~75 ms (a 2-core VM: 180 ms), in which /health and every stream stalled.
import jsonschema
from pydantic import field_validator, model_serializer

from pagedllm import json_limits
from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel, RequestModel
from pagedllm.errors import InvalidRequestError

# ------------------------------------------------------------------ requests


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (an object; absent = no arguments)."""
    strict: bool | None = None
    """Accepted; "required" and named choices are schema-exact anyway (guided
    decoding), "auto" is not constrained."""

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not name.strip():
            raise InvalidRequestError("a function name must not be empty")
        return name

    @field_validator("parameters")
    @classmethod
    def _schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return None
        if not isinstance(schema.get("$schema", ""), str):
            # jsonschema looks the dialect up by it (a list or dict was a TypeError).
            raise InvalidRequestError(f"the parameters schema's $schema must be a URI "
                                      f"string, got {type(schema['$schema']).__name__}")
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path)
            raise InvalidRequestError(f"not a valid JSON schema"
                                      f"{f' at {where!r}' if where else ''}: "
                                      f"{e.message[:200]}") from None
        except RecursionError:
            raise InvalidRequestError("the parameters schema is nested too deeply") from None
        if schema.get("type", "object") != "object":
            raise InvalidRequestError(f"the parameters schema must describe an object "
                                      f"(type 'object'), got type {schema['type']!r}")
        return schema


class ToolParam(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: call this one."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCallParam(RequestModel):
    name: str
    arguments: str
    """JSON text of an object (the model's call, as the API returned it)."""

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        value = json_limits.loads(arguments, "the JSON text")
        if not isinstance(value, dict):
            raise InvalidRequestError(f"must be a JSON object, got "
                                      f"{type(value).__name__}")
        return arguments


class ToolCallParam(RequestModel):
    """A call in an assistant message of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam

    def template_dict(self) -> dict[str, Any]:
        """As chat templates expect it: HF templates read `arguments` as a mapping
        (`arguments | tojson`, `arguments.items()`), so the JSON text is decoded."""
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name,
                             "arguments": json.loads(self.function.arguments)}}


def check_tools(tools: list[ToolParam] | None) -> list[ToolParam] | None:
    """Function names must be unique (a call names its function)."""
    seen: set[str] = set()
    for tool in tools or ():
        if tool.function.name in seen:
            raise InvalidRequestError(f"function names must be unique: "
                                      f"{tool.function.name!r} is defined twice")
        seen.add(tool.function.name)
    return tools


def check_tool_choice_form(choice: Any) -> None:
    """tool_choice is one of the three modes or exactly a named function."""
    if choice is None or choice in ("none", "auto", "required"):
        return
    usage = ('"none", "auto", "required" or {"type": "function", "function": {"name": '
             '"my_function"}}')
    if not isinstance(choice, dict):
        raise InvalidRequestError(f"must be {usage}, got {str(choice)[:80]!r}")
    function = choice.get("function")
    if (set(choice) != {"type", "function"} or choice["type"] != "function"
            or not isinstance(function, dict) or set(function) != {"name"}
            or not isinstance(function["name"], str)):
        raise InvalidRequestError(f"a named tool_choice must be exactly "
                                  f"{usage.split(' or ')[1]}, got {str(choice)[:80]!r}")


def check_tool_choice(choice: str | NamedToolChoice | None,
                      tools: list[ToolParam] | None) -> None:
    """Anything but "none" needs tools; a named choice must be one of them."""
    if choice is None or choice == "none":
        return
    if not tools:
        raise InvalidRequestError("When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise InvalidRequestError(
                f"the function {choice.function.name!r} is not one of the specified "
                f"`tools` ({', '.join(map(repr, names[:10]))})")


def check_message_tool_fields(role: str, content: Any, tool_calls: list | None,
                              tool_call_id: str | None) -> None:
    """The tool fields of one message fit its role."""
    if tool_calls and role != "assistant":
        raise InvalidRequestError(f"`tool_calls` is only allowed in assistant messages, "
                                  f"not in a {role!r} message")
    if role == "tool":
        if not tool_call_id:
            raise InvalidRequestError("a message with role 'tool' needs `tool_call_id` "
                                      "(the id of the call it answers)")
        if content is None:
            raise InvalidRequestError("a message with role 'tool' needs `content` (the "
                                      "call's result)")
    elif tool_call_id is not None:
        raise InvalidRequestError(f"`tool_call_id` is only allowed in tool messages, "
                                  f"not in a {role!r} message")


def check_tool_exchanges(messages: list[Any]) -> None:
    """OpenAI's rules for a conversation with calls: an assistant message's calls are
    answered by tool messages right after it, one per call id, and a tool message
    answers a call of that assistant message."""
    pending: dict[str, int] = {}  # call id -> index of the assistant message
    for i, m in enumerate(messages):
        if m.role == "tool":
            if m.tool_call_id not in pending:
                raise InvalidRequestError(
                    f"messages[{i}]: a tool message must answer a call of the assistant "
                    f"message before it, and {m.tool_call_id!r} is not an unanswered "
                    f"call id there")
            del pending[m.tool_call_id]
            continue
        _check_answered(pending)
        if m.role == "assistant" and m.tool_calls:
            for call in m.tool_calls:
                if call.id in pending:
                    raise InvalidRequestError(f"messages[{i}].tool_calls: the id "
                                              f"{call.id!r} is used twice")
                pending[call.id] = i
    _check_answered(pending)


def _check_answered(pending: dict[str, int]) -> None:
    if pending:
        i = next(iter(pending.values()))
        raise InvalidRequestError(
            f"messages[{i}]: an assistant message with `tool_calls` must be followed by "
            f"tool messages answering each tool_call_id; no answer to "
            f"{', '.join(map(repr, pending))}")


# ------------------------------------------------------------------ responses


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIBaseModel):
    """A stream's piece of a call: the first of an index carries id, type and name,
    later ones only more `function.arguments` (absent keys are left out, as OpenAI)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}
