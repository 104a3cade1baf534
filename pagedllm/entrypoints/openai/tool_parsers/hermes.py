"""Hermes-style tool calls (Hermes 2/3, Qwen 2.5/3 and others):

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Any number of calls, with text before, between or after them. A call left open when
the output ends (a model that stops at the closing tag's token) still counts if its
JSON is complete. A call whose JSON is not a call object stays in the content,
markers included. The content is the text around the calls as written, less the
whitespace that only separates it from them: right before a call, at the content's
start after a call and at the output's end after a call. So
"Sure.\\n<tool_call>...</tool_call>\\n" has the content "Sure." and
"A <tool_call>...</tool_call> then B" has "A then B".
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import (ParsedDelta, ToolParser,
                                                           function_call_of,
                                                           partial_marker_len)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import ObjectScanner

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    """Content streams as it comes, except an end that may be the start of a marker and
    trailing whitespace (dropped if a call follows); a call is released once closed."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""            # text not yet released (after the last decision)
        self._is_in_call = False  # _buf is the inside of an open <tool_call>
        self._pending_ws = ""     # trailing whitespace held back: a call may follow
        self._has_content = False    # some content was released
        self._is_after_call = False  # a call, and no content since
        # Inside a call: where the search for its closing tag resumes (everything
        # before was searched, so a long call is scanned once, not once per chunk).
        self._end_search = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        while True:
            if self._is_in_call:
                end = self._find_end()
                if end < 0:
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(END):]
                self._is_in_call = False
                self._resolve_call(body, START + body + END, out)
                continue
            start = self._buf.find(START)
            if start < 0:
                keep = partial_marker_len(self._buf, START)
                self._emit_text(self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            self._emit_text(self._buf[:start], out)
            self._buf = self._buf[start + len(START):]
            self._is_in_call = True
            self._end_search = 0
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._is_in_call:
            self._resolve_call(self._buf, START + self._buf, out)
        else:
            self._emit_text(self._buf, out)
        self._buf, self._is_in_call = "", False
        if not self._is_after_call:
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    def _find_end(self) -> int:
        """Where the open call's closing tag is, or -1: a tag inside a JSON string of
        a still open object (arguments that mention "</tool_call>") is skipped."""
        end = self._buf.find(END, self._end_search)
        while end >= 0 and _is_open_object(self._buf[:end]):
            # Inside a string for good: what follows cannot close the object before it.
            self._end_search = end + 1
            end = self._buf.find(END, end + 1)
        if end < 0:
            # A tag may still complete across the buffer's end.
            self._end_search = max(self._end_search, len(self._buf) - len(END) + 1)
        return end

    def _emit_text(self, text: str, out: ParsedDelta) -> None:
        """Release content, holding its trailing whitespace back (dropped if a call
        follows) and dropping leading whitespace of content that starts after a call."""
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        if self.num_calls and not self._has_content:
            body = body.lstrip()
        if body:
            out.content += body
            self._has_content = True
            self._is_after_call = False

    def _call_of(self, body: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of a call's body, or None (not a call)."""
        try:
            return function_call_of(json.loads(body))
        except ValueError:
            return None

    def _resolve_call(self, body: str, raw: str, out: ParsedDelta) -> None:
        call = self._call_of(body)
        if call is None:  # not a call after all: the markers and all are content
            self._emit_text(raw, out)
            return
        self._pending_ws = ""
        self._is_after_call = True
        out.tool_calls.append(self.new_call(*call))


def _is_open_object(text: str) -> bool:
    """True if `text` starts a JSON object (after whitespace) that is not closed yet."""
    body = text.lstrip()
    return body.startswith("{") and ObjectScanner(0).end(body) is None
