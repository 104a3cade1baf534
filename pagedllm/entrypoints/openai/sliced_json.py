"""JSON of responses whose logprobs are many, a slice at a time.

A reply's logprobs at 20 alternatives are ~1 KB a token. Encoded in one call, 1,200
tokens' took 30-90 ms (pydantic's and json's encoders hold the GIL for the whole call,
so a worker thread stalled the event loop as much: /health waited up to 119 ms), and a
Responses stream sends them four more times as it ends (output_text.done,
content_part.done, output_item.done, response.completed). Here a list of logprobs is
encoded 64 entries per call, and a model holding one is encoded around it: the loop
gets the GIL back between calls. The Responses API writes every object and event this
way; a chat or completions choice with logprobs, built in a worker thread, too. Keys of
a model's nested fields come after its other fields (JSON objects have no order).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, TypeAdapter

from pagedllm.entrypoints.openai.protocol import ChatLogprobToken

_SLICE = 64
_LOGPROBS = TypeAdapter(list[ChatLogprobToken])


def to_json(value: Any) -> str:
    """JSON of a model, a list of models or a plain value; logprobs lists in slices."""
    if isinstance(value, RawJSON):
        return value
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        if isinstance(value[0], ChatLogprobToken):
            parts = (_LOGPROBS.dump_json(value[i:i + _SLICE]).decode()[1:-1]
                     for i in range(0, len(value), _SLICE))
        else:
            parts = (to_json(item) for item in value)
        return "[" + ",".join(parts) + "]"
    if not isinstance(value, BaseModel):
        return json.dumps(value, ensure_ascii=False)
    nested = {name for name, field in value if _holds_models(field)}
    raw = getattr(value, "logprobs_json", None)  # OutputText's logprobs kept as JSON
    head = value.model_dump_json(exclude=nested | ({"logprobs"} if raw is not None else set()))
    fields = [(name, getattr(value, name)) for name in sorted(nested)]
    return _append(head, fields + ([("logprobs", RawJSON(raw))] if raw is not None else []))


class RawJSON(str):
    """Text that is JSON already: written as it is."""


def logprobs_fragment(logprobs: list[ChatLogprobToken]) -> str:
    """The entries of a JSON list of `logprobs`, without its brackets (fragments join
    with commas into one list)."""
    return to_json(logprobs)[1:-1]


def fragments_json(fragments: list[str]) -> RawJSON:
    return RawJSON("[" + ",".join(f for f in fragments if f) + "]")


def fields_json(fields: dict[str, Any]) -> str:
    """JSON of an object (an event's payload) whose values may be models."""
    nested = [(name, value) for name, value in fields.items() if _holds_models(value)]
    plain = {name: value for name, value in fields.items() if not _holds_models(value)}
    return _append(json.dumps(plain, ensure_ascii=False), nested)


def _holds_models(value: Any) -> bool:
    """Whether `value` is written by to_json rather than json.dumps."""
    return isinstance(value, (BaseModel, RawJSON)) or (
        isinstance(value, list) and bool(value) and isinstance(value[0], BaseModel))


def _append(head: str, fields: list[tuple[str, Any]]) -> str:
    """The JSON object `head` with `fields` added at its end."""
    if not fields:
        return head
    tail = ",".join(f"{json.dumps(name)}:{to_json(value)}" for name, value in fields)
    return head[:-1] + ("," if head != "{}" else "") + tail + "}"
