"""Tool-call parsers by name (`--tool-call-parser`), imported only when chosen.

`tool_choice: "auto"` runs the server's parser over each output; "required" and a
named function are forced by guided decoding instead, and their outputs are read by
the parsers of guided.py.

Your own format: subclass `ToolParser` (base.py) and name it by its qualified name
(`--tool-call-parser mypkg.parsers:MyParser`), or, as vLLM's plugins, put it in a file
(`--tool-parser-plugin my_parser.py`) with a class attribute `name` and give that name
(`--tool-call-parser myformat`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser
from pagedllm.qualname import import_subclass

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


def get_tool_parser(name: str, plugin: str | None = None) -> type[ToolParser]:
    """The parser class `name` names: a plugin file's parser of that `name`, a built-in
    one, or a qualified class name (ValueError saying what was looked for)."""
    if plugin is not None:
        found = [cls for cls in vars(_load_plugin(plugin)).values()
                 if isinstance(cls, type) and issubclass(cls, ToolParser)
                 and getattr(cls, "name", None) == name]
        if found:
            return found[0]
    if name in _PARSERS:
        module, cls = _PARSERS[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    if not any(c in name for c in ":."):
        where = f"; nor does the plugin {plugin!r} define one" if plugin else ""
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(TOOL_PARSER_NAMES)}, or name a ToolParser class "
                         f"(package.module:Class){where}")
    return import_subclass(name, ToolParser, "tool call parser")


def _load_plugin(path: str) -> object:
    """The module of a plugin file (run once per call: the server resolves its parser
    once, at start-up)."""
    if not os.path.isfile(path):
        raise ValueError(f"tool parser plugin {path!r} is not a file")
    name = "pagedllm_tool_parser_plugin_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"tool parser plugin {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the plugin's own error, reported at start-up
        raise ValueError(f"tool parser plugin {path!r} failed to load: "
                         f"{type(e).__name__}: {e}") from e
    return module
