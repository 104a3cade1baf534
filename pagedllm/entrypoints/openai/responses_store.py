"""Stored responses of the Responses API (`--enable-responses-store`), in memory.

A stored response keeps its response object (GET /v1/responses/{id}) and its whole
conversation as input items: the conversation it continued (`previous_response_id`),
its own input, then its output items, which the Responses API takes back as input
(messages, function calls, reasoning). A request naming it as `previous_response_id`
continues that conversation; as OpenAI's, the previous `instructions` are not carried
over.

A response's text logprobs are held as their JSON (OutputText.logprobs_json), not as
objects. Memory is bounded by `max_bytes`, counted as each response's own JSON size and
each conversation item's (its JSON plus a Python object's overhead: measured ~750 bytes
for a small item, whose JSON is ~90) once, however many conversations hold it: a
conversation shares its earlier items with the response it continued, by reference,
and an item is counted until the last response holding it is gone (so dropping a
response whose items a continuation still holds frees only what no one else holds).
Past the bound the least recently used responses are dropped.
Ids are random (uuid4), so one client cannot guess another's. An input item sent without
an id gets one when stored (as OpenAI's), so that GET /v1/responses/{id}/input_items can
page through a conversation by item id.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from pagedllm.entrypoints.openai.responses_protocol import (INPUT_ITEMS, InputMessage,
                                                            ResponseObject, item_id)
from pagedllm.errors import InvalidRequestError

# What a reference to an earlier item costs (a list slot): counted so that a long chain
# of tiny responses is bounded too.
_REFERENCE_BYTES = 8
# What one item (a pydantic model with its parts) costs beyond its JSON size.
_ITEM_OVERHEAD_BYTES = 768
# The id prefix of a stored input item of each type (OpenAI's).
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


class ResponseNotFoundError(LookupError):
    """No stored response of that id (never stored, dropped, or deleted): a 404."""


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: tuple[BaseModel, ...]
    """Input items (request models) of the whole conversation, outputs included."""
    nbytes: int
    """The response's own bytes (its object and its conversation's references); its
    items are counted by the store, once each."""
    events: tuple[str, ...] = ()
    """A background stream's events (responses_replay.py), for reading it again."""

    @property
    def input_items(self) -> tuple[BaseModel, ...]:
        """The items the response was generated from: its conversation without its own
        output items (one input item each)."""
        return self.conversation[:len(self.conversation) - len(self.response.output)]


class ResponseStore:
    """Responses by id, least recently used dropped first past `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        # Every item a stored conversation holds, by id(): [its bytes, how many stored
        # conversations hold it]. The conversations keep the items alive, so an id is
        # not reused while it is here.
        self._items: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._responses.get(response_id)
        if stored is None:
            raise ResponseNotFoundError(f"Response with id {response_id[:100]!r} not found: "
                                        f"never stored, deleted, or dropped from the "
                                        f"server's store (--responses-store-max-bytes)")
        self._responses.move_to_end(response_id)
        return stored

    def put(self, response: ResponseObject, earlier: tuple[BaseModel, ...],
            added: list[BaseModel], json_bytes: int | None = None) -> None:
        """Store `response`, whose conversation is `earlier` (shared with the response it
        continued) followed by `added` (its input and output items). `json_bytes`: its
        JSON's size when known (a large response is serialized off the event loop)."""
        for item in added:
            if getattr(item, "id", None) is None:
                item.id = item_id(_ID_PREFIXES[item.type])
        conversation = earlier + tuple(added)
        if json_bytes is None:
            json_bytes = len(response.model_dump_json())
        own = (json_bytes + _ITEM_OVERHEAD_BYTES * (
            1 + len(response.output)) + _REFERENCE_BYTES * len(conversation))
        sizes = {id(item): (self._items[id(item)][0] if id(item) in self._items
                            else _item_bytes(item)) for item in conversation}
        if own + sum(sizes.values()) > self.max_bytes:
            return  # alone with its conversation it would not fit
        self.delete(response.id)
        self._responses[response.id] = StoredResponse(response, conversation, own)
        self.nbytes += own
        for item in conversation:
            counted = self._items.get(id(item))
            if counted is None:
                self._items[id(item)] = counted = [sizes[id(item)], 0]
                self.nbytes += counted[0]
            counted[1] += 1
        while self.nbytes > self.max_bytes:
            self.delete(next(iter(self._responses)))

    def add_events(self, response_id: str, events: tuple[str, ...]) -> None:
        """Keep a stored response's stream events with it (counted; the least recently
        used responses make room, as for put). Nothing when it is no longer stored."""
        stored = self._responses.get(response_id)
        if stored is None:
            return
        nbytes = sum(map(len, events)) + _REFERENCE_BYTES * len(events)
        self._responses[response_id] = replace(stored, events=events,
                                               nbytes=stored.nbytes + nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self.delete(next(iter(self._responses)))

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self.nbytes -= stored.nbytes
        for item in stored.conversation:
            counted = self._items[id(item)]
            counted[1] -= 1
            if counted[1] == 0:
                del self._items[id(item)]
                self.nbytes -= counted[0]
        return True


def _item_bytes(item: BaseModel) -> int:
    return len(item.model_dump_json(exclude_none=True)) + _ITEM_OVERHEAD_BYTES


def as_input_items(output: list[Any]) -> list[BaseModel]:
    """A response's output items as the input items that send them back (the text's
    logprobs left out: a model reads none)."""
    return INPUT_ITEMS.validate_python([
        item.model_dump(mode="json", exclude={"content": {"__all__": {"logprobs"}}})
        for item in output])


def list_input_items(stored: StoredResponse, after: str | None = None,
                     before: str | None = None, limit: int = 20,
                     order: str = "desc") -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: a page of the items the response was
    generated from (OpenAI's list object), newest first under "desc"; `after` / `before`
    are item ids of the same order."""
    if not 1 <= limit <= 100:
        raise InvalidRequestError(f"limit must be between 1 and 100, got {limit}")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"order must be 'asc' or 'desc', got {order[:100]!r}")
    items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    ids = [item.id for item in items]
    start, end = 0, len(items)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise InvalidRequestError(f"{name}: no input item {cursor[:100]!r} in response "
                                      f"{stored.response.id!r}")
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        end = ids.index(before)
    page = items[start:max(start, end)][:limit]
    return {"object": "list", "data": [_item_resource(item) for item in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": start + len(page) < end}


def _item_resource(item: BaseModel) -> dict[str, Any]:
    """A stored input item as OpenAI lists it: a message's text as one content part
    (input_text, or output_text for the assistant's), and a status."""
    data = item.model_dump(mode="json", exclude_none=True)
    if isinstance(item, InputMessage) and isinstance(item.content, str):
        data["content"] = [{"type": "input_text", "text": item.content}
                           if item.role != "assistant"
                           else {"type": "output_text", "text": item.content,
                                 "annotations": []}]
    data.setdefault("status", "completed")
    return data
