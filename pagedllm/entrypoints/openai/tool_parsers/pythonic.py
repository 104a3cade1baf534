"""Python-call tool calls (vLLM's `pythonic`: Llama 3.2 and Llama 4 with their tool
templates, and other models prompted that way):

    [get_weather(city="Paris", unit="celsius"), get_time()]

The output is calls when it starts (after whitespace, and Llama 4's
`<|python_start|>`, a special token) with a Python list of calls whose arguments are
keyword literals (strings, numbers, booleans, None, lists and dicts of them). The list
is parsed with `ast` once it closes, never evaluated; until then it is held back.
Output that does not start with such a list is content, whole, as generated; what
follows the list (less Llama 4's `<|python_end|>`) is content too.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ParsedDelta, ToolParser

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode = "open"  # "open": deciding; "after": past the calls; "text"

    def feed(self, text: str) -> ParsedDelta:
        if self._mode == "text":
            return ParsedDelta(content=text)
        self._buf += text
        if self._mode == "after":
            return self._after_calls()
        body = self._body()
        if body is None:
            return ParsedDelta()  # too short to tell
        if not body.startswith("["):
            return self._as_content()
        end = _list_end(body)
        if end is None:
            return ParsedDelta()  # the list is still open
        calls = _calls_of(body[:end])
        if calls is None:
            return self._as_content()
        self._buf, self._mode = body[end:], "after"
        out = ParsedDelta(tool_calls=[self.new_call(name, args) for name, args in calls])
        return out.extend(self._after_calls())

    def finish(self) -> ParsedDelta:
        if self._mode == "after" and self._buf == PYTHON_END[:len(self._buf)]:
            self._buf = ""  # a partial end tag at the very end: dropped
        return ParsedDelta() if self._mode == "text" and not self._buf else self._as_content()

    def _after_calls(self) -> ParsedDelta:
        """What follows the list is content, less a python_end tag right after it
        (held back while the text may still become one)."""
        if PYTHON_END.startswith(self._buf):
            return ParsedDelta()
        if self._buf.startswith(PYTHON_END):
            self._buf = self._buf[len(PYTHON_END):]
        return self._as_content()

    def _body(self) -> str | None:
        """The output without leading whitespace and python_start tag; None while it
        may still be the start of that tag."""
        body = self._buf.lstrip()
        if body.startswith(PYTHON_START):
            return body[len(PYTHON_START):].lstrip() or None
        if PYTHON_START.startswith(body):
            return None
        return body

    def _as_content(self) -> ParsedDelta:
        text, self._buf, self._mode = self._buf, "", "text"
        return ParsedDelta(content=text)


def _list_end(text: str) -> int | None:
    """Index just past the "]" closing the list that starts text[0], outside strings;
    None while it is open."""
    depth, quote, escaped = 0, None, False
    for i, c in enumerate(text):
        if quote is not None:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _calls_of(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments as JSON text) of each call in a list of calls; None when the
    text is not one (any other expression, positional arguments, non-literals)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name)
                or node.args or any(k.arg is None for k in node.keywords)):
            return None
        try:
            arguments: dict[str, Any] = {k.arg: ast.literal_eval(k.value)
                                         for k in node.keywords}
            text_args = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError):
            return None
        calls.append((node.func.id, text_args))
    return calls
