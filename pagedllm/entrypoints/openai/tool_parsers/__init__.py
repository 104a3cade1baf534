"""Tool-call parsers by name (`--tool-call-parser`), imported only when chosen.

`tool_choice: "auto"` runs the server's parser over each output; "required" and a
named function are forced by guided decoding instead, and their outputs are read by
the parsers of guided.py.
"""

from __future__ import annotations

import importlib

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser

# name -> (module in this package, class)
_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("hermes", "HermesToolParser"),
    "llama3_json": ("llama3_json", "Llama3JsonToolParser"),
    "mistral": ("mistral", "MistralToolParser"),
    "pythonic": ("pythonic", "PythonicToolParser"),
    "qwen3_coder": ("qwen3_coder", "Qwen3CoderToolParser"),
    "phi4_mini_json": ("phi4_mini_json", "Phi4MiniJsonToolParser"),
    # vLLM's other names of these formats.
    "llama4_json": ("llama3_json", "Llama3JsonToolParser"),
    "llama4_pythonic": ("pythonic", "PythonicToolParser"),
    "qwen3_xml": ("qwen3_coder", "Qwen3CoderToolParser"),
}
TOOL_PARSER_NAMES: tuple[str, ...] = tuple(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name` (ValueError naming the choices)."""
    if name not in _PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(TOOL_PARSER_NAMES)}")
    module, cls = _PARSERS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
