"""Stored responses of the Responses API (`--enable-responses-store`), in memory.

A stored response keeps its response object (GET /v1/responses/{id}) and its whole
conversation as input items: the conversation it continued (`previous_response_id`),
its own input, then its output items, which the Responses API takes back as input
(messages, function calls, reasoning). A request naming it as `previous_response_id`
continues that conversation; as OpenAI's, the previous `instructions` are not carried
over.

Memory is bounded by `max_bytes`, counted as what each response added: its JSON size
plus a Python object's overhead per item (measured: ~750 bytes for a small item, whose
JSON is ~90), while a conversation shares its earlier items with the response it
continued, by reference. Past the bound the least recently used responses are dropped.
Ids are random (uuid4), so one client cannot guess another's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pagedllm.entrypoints.openai.responses_protocol import INPUT_ITEMS, ResponseObject

# What a reference to an earlier item costs (a list slot): counted so that a long chain
# of tiny responses is bounded too.
_REFERENCE_BYTES = 8
# What one item (a pydantic model with its parts) costs beyond its JSON size.
_ITEM_OVERHEAD_BYTES = 768


class ResponseNotFoundError(LookupError):
    """No stored response of that id (never stored, dropped, or deleted): a 404."""


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: tuple[BaseModel, ...]
    """Input items (request models) of the whole conversation, outputs included."""
    nbytes: int


class ResponseStore:
    """Responses by id, least recently used dropped first past `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

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
            added: list[BaseModel]) -> None:
        """Store `response`, whose conversation is `earlier` (shared with the response it
        continued) followed by `added` (its input and output items)."""
        nbytes = (len(response.model_dump_json()) + _REFERENCE_BYTES * len(earlier)
                  + _ITEM_OVERHEAD_BYTES * (1 + len(response.output) + len(added))
                  + sum(len(item.model_dump_json(exclude_none=True)) for item in added))
        if nbytes > self.max_bytes:
            return  # it would evict everything and still not fit
        self.delete(response.id)
        self._responses[response.id] = StoredResponse(response, earlier + tuple(added),
                                                      nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, dropped = self._responses.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self.nbytes -= stored.nbytes
        return True


def as_input_items(output: list[Any]) -> list[BaseModel]:
    """A response's output items as the input items that send them back."""
    return INPUT_ITEMS.validate_python([item.model_dump(mode="json") for item in output])
