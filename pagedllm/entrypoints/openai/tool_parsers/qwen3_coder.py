"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder`), as its chat template asks:

    Let me check.<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The markers and the content around calls are Hermes's (hermes.py: this parser is its
subclass); only a call's body differs. Parameter values are text, one newline trimmed
at each end; each becomes the JSON type its tool's schema gives the parameter
(integer, number, boolean, null, object and array parsed from the text; a value that
does not parse as its type stays a string, as does a parameter the schema does not
name). A body that is not one function of such parameters is content, markers and all.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderToolParser(HermesToolParser):
    # plan_tools gives the request's tools (their schemas type the parameters).
    reads_tool_schemas = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self._properties: dict[str, dict[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function") or {}
            properties = (function.get("parameters") or {}).get("properties") or {}
            if isinstance(function.get("name"), str) and isinstance(properties, dict):
                self._properties[function["name"]] = properties

    def _call_of(self, body: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of a call's XML body, or None."""
        match = _FUNCTION.fullmatch(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        properties = self._properties.get(name, {})
        arguments: dict[str, Any] = {}
        position = 0
        for parameter in _PARAMETER.finditer(inner):
            if inner[position:parameter.start()].strip():
                return None  # text between parameters: not this format
            key = parameter.group(1).strip()
            arguments[key] = typed_value(_trim_newlines(parameter.group(2)),
                                         properties.get(key))
            position = parameter.end()
        if inner[position:].strip() or not name:
            return None
        return name, json.dumps(arguments, ensure_ascii=False)


def _trim_newlines(value: str) -> str:
    """The value without the one newline the format puts on each side of it."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def typed_value(text: str, schema: Any) -> Any:
    """`text` as the JSON type `schema` gives it (a string when it does not parse, or
    no type is known)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
        if text.strip() == "null" and "null" in kind:
            return None
        kind = next((k for k in kind if k != "null"), None)
    stripped = text.strip()
    try:
        if kind == "integer":
            return int(stripped)
        if kind == "number":
            number = float(stripped)
            return int(number) if re.fullmatch(r"-?\d+", stripped) else number
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind == "null" and stripped == "null":
            return None
        if kind in ("object", "array"):
            try:
                value = json.loads(stripped)
            except ValueError:
                value = ast.literal_eval(stripped)  # Python-style literals, never run
            if isinstance(value, dict if kind == "object" else list):
                return value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    return text

