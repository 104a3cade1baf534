"""A sequence of JSON call objects, parsed as it streams in.

Shared by the Llama 3 JSON parser (`{...}; {...}`, optionally after `<|python_tag|>`)
and by `tool_choice: "required"` (a JSON array `[{...}, {...}]` forced by guided
decoding). Each call is released once its object is complete, with its whole
arguments text in one delta (OpenAI clients accept the arguments in any number of
pieces, one included). When the text stops looking like calls, the rest is content:
all of it if no call was found yet (so prose that merely starts with "{" is kept
intact), else what follows the last call.
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import (ParsedDelta, ToolParser,
                                                           function_call_of)


class ObjectScanner:
    """Finds the end of the JSON object that starts at `start` (a "{"), resuming where
    it stopped as the text grows: each character is looked at once. It only balances
    braces outside strings; json.loads judges the object afterwards."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, text: str) -> int | None:
        """Index just past the object's closing brace, or None while it is open."""
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c == "{":
                self._depth += 1
            elif c == "}":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i + 1
                    return i + 1
        self._pos = len(text)
        return None


class JsonCallSequenceParser(ToolParser):
    """Calls as JSON objects: an opener, objects between separators, maybe a closer.

    Modes: "open" (before the opener), "item" (a call object expected), "sep" (after a
    call), "closed" (after the closer), "text" (everything from here is content).
    """

    def __init__(self, openers: tuple[str, ...], separator: str,
                 closer: str | None = None, is_separator_optional: bool = False,
                 argument_keys: tuple[str, ...] = ("arguments",)) -> None:
        """`openers`: what the output may start with ("" = a "{" directly);
        `separator` between calls (whitespace is always allowed around it)."""
        super().__init__()
        self.openers = openers
        self.separator = separator
        self.closer = closer
        self.is_separator_optional = is_separator_optional
        self.argument_keys = argument_keys
        self._buf = ""      # the whole output so far
        self._pos = 0       # parsed up to here
        self._mode = "open"
        self._scanner: ObjectScanner | None = None

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        if self._mode == "text":
            self._pos = len(self._buf)
            return ParsedDelta(content=text)
        out = ParsedDelta()
        while self._mode != "text" and self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode in ("open", "item", "sep") and (self.num_calls == 0
                                                      or self._pos < len(self._buf)):
            # Never became calls, or ends in an unfinished one: that is content.
            self._to_text(self._pos, out)
        return out

    # ------------------------------------------------------------------ steps

    def _step(self, out: ParsedDelta) -> bool:
        """Advance one token of the grammar; False when more text is needed."""
        if self._mode == "open":
            return self._step_open(out)
        self._skip_whitespace()
        if self._pos == len(self._buf):
            return False
        c = self._buf[self._pos]
        if self._mode == "item":
            if c == "{":
                return self._step_object(out)
            if c == self.closer and self.num_calls:
                return self._close()
        elif self._mode == "sep":
            if c == self.separator:
                self._pos += 1
                self._mode = "item"
                return True
            if c == self.closer:
                return self._close()
            if c == "{" and self.is_separator_optional:
                self._mode = "item"
                return True
        self._to_text(self._pos, out)  # mode "closed" or an unexpected character
        return True

    def _step_open(self, out: ParsedDelta) -> bool:
        rest = self._buf[self._pos:].lstrip()
        if not rest:
            return False
        start = len(self._buf) - len(rest)
        if any(len(opener) > len(rest) and opener.startswith(rest)
               for opener in self.openers):
            return False  # maybe the start of a (longer) opener: wait
        for opener in sorted(self.openers, key=len, reverse=True):  # longest first
            if opener and rest.startswith(opener):
                self._pos, self._mode = start + len(opener), "item"
                return True
        if "" in self.openers and rest.startswith("{"):
            self._pos, self._mode = start, "item"
            return True
        self._to_text(0, out)
        return True

    def _step_object(self, out: ParsedDelta) -> bool:
        if self._scanner is None:
            self._scanner = ObjectScanner(self._pos)
        end = self._scanner.end(self._buf)
        if end is None:
            return False
        self._scanner = None
        try:
            call = function_call_of(json.loads(self._buf[self._pos:end]),
                                    self.argument_keys)
        except ValueError:
            call = None
        if call is None:
            self._to_text(self._pos, out)
        else:
            out.tool_calls.append(self.new_call(*call))
            self._pos, self._mode = end, "sep"
        return True

    def _close(self) -> bool:
        self._pos += 1
        self._mode = "closed"
        return True

    def _skip_whitespace(self) -> None:
        while self._pos < len(self._buf) and self._buf[self._pos].isspace():
            self._pos += 1

    def _to_text(self, start: int, out: ParsedDelta) -> None:
        """The rest is content: from `start`, or from the very beginning if no call was
        made (the output was never calls)."""
        out.content += self._buf[start if self.num_calls else 0:]
        self._pos, self._mode = len(self._buf), "text"
