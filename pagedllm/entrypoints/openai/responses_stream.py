"""The typed events of a streamed Responses reply, from the pieces the chat readers give.

`ItemStream` opens and closes output items as reasoning, text and calls arrive (a
reasoning item, a message with one output_text part, one function_call item per call),
writing each item's added / delta / done events through the caller's `event` function
(which numbers them and encodes the models it is given: sliced_json.py); `output`
collects the closed items for the final response.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatLogprobToken
from pagedllm.entrypoints.openai.responses_protocol import (FunctionCallOutput,
                                                            OutputMessage, OutputText,
                                                            ReasoningItem, ReasoningText,
                                                            item_id)
from pagedllm.entrypoints.openai.sliced_json import (RawJSON, fragments_json,
                                                     logprobs_fragment, to_json)


@dataclass
class OpenItem:
    kind: str  # "reasoning" or "message"
    id: str
    text: str = ""
    logprobs: list[str] = field(default_factory=list)
    """The JSON of the logprobs its deltas carried (sliced_json.logprobs_fragment):
    strings, not a model per entry (~100 objects a token for the collector to walk)."""

    def add_logprobs(self, logprobs: list[ChatLogprobToken]) -> RawJSON:
        """Keep `logprobs` (a delta's); their JSON, for the delta event."""
        fragment = logprobs_fragment(logprobs)
        self.logprobs.append(fragment)
        return fragments_json([fragment])


class ItemStream:
    """Turns a reply's pieces into the events of its output items, in the order they
    come: a reasoning item, a message, one item per call. An item is closed (its done
    events) when another opens or the reply ends; `output` collects the closed items,
    which the final response event carries."""

    def __init__(self, event: Callable[..., str]) -> None:
        self.event = event
        self.output: list[Any] = []  # the closed items (models)
        self.open: OpenItem | None = None

    @property
    def reasoned(self) -> bool:
        return any(isinstance(item, ReasoningItem) for item in self.output)

    @property
    def has_reasoning(self) -> bool:
        """A reasoning item has opened (it may still be open)."""
        return self.reasoned or (self.open is not None and self.open.kind == "reasoning")

    @property
    def index(self) -> int:
        """The output_index of the open item (or of the next one)."""
        return len(self.output)

    def feed(self, reasoning: str, content: str, calls: list[Any],
             logprobs: Callable[[], list[ChatLogprobToken]]) -> list[str]:
        """Events of new pieces; `logprobs()` gives those a text delta carries."""
        events: list[str] = []
        for kind, text in (("reasoning", reasoning), ("message", content)):
            if not text:
                continue
            events += self._open(kind)
            item = self.open
            assert item is not None
            item.text += text
            extra: dict[str, Any] = {}
            if kind == "message":
                extra["logprobs"] = item.add_logprobs(logprobs())
            delta = ("response.reasoning_text.delta" if kind == "reasoning"
                     else "response.output_text.delta")
            events.append(self.event(delta, item_id=item.id, output_index=self.index,
                                     content_index=0, delta=text, **extra))
        for call in calls:
            events += self._close("completed")
            call_item = FunctionCallOutput(id=item_id("fc"), call_id=call.id,
                                           name=call.function.name, arguments="",
                                           status="in_progress")
            where = {"item_id": call_item.id, "output_index": self.index}
            args = call.function.arguments
            events.append(self.event("response.output_item.added", output_index=self.index,
                                     item=call_item))  # encoded now, as it is
            events.append(self.event("response.function_call_arguments.delta", **where,
                                     delta=args))
            events.append(self.event("response.function_call_arguments.done", **where,
                                     arguments=args))
            call_item.arguments, call_item.status = args, "completed"
            events.append(self.event("response.output_item.done", output_index=self.index,
                                     item=call_item))
            self.output.append(call_item)
        return events

    def close(self, status: str, logprobs: list[ChatLogprobToken]) -> list[str]:
        """The reply ended: close the open item (a reply with nothing at all still has
        its empty message, as the non-streaming response does). An open message gets
        the `logprobs` no delta carried yet (a last token with no text, as EOS), in a
        delta of no text, so that a client adding up the deltas has them all."""
        events = self._open("message") if not self.output and self.open is None else []
        item = self.open
        if logprobs and item is not None and item.kind == "message":
            events.append(self.event("response.output_text.delta", item_id=item.id,
                                     output_index=self.index, content_index=0, delta="",
                                     logprobs=item.add_logprobs(logprobs)))
        return events + self._close(status)

    @property
    def has_calls(self) -> bool:
        return any(isinstance(item, FunctionCallOutput) for item in self.output)

    def set_text_logprobs(self, logprobs: list[ChatLogprobToken]) -> None:
        """Set the logprobs of the (closed) message's text."""
        for item in self.output:
            if isinstance(item, OutputMessage):
                item.content[0].logprobs_json = to_json(logprobs)

    def _open(self, kind: str) -> list[str]:
        if self.open is not None and self.open.kind == kind:
            return []
        events = self._close("completed")
        self.open = OpenItem(kind, item_id("rs" if kind == "reasoning" else "msg"))
        item, part = self._item("in_progress")
        return events + [
            self.event("response.output_item.added", output_index=self.index, item=item),
            self.event("response.content_part.added", item_id=self.open.id,
                       output_index=self.index, content_index=0, part=part)]

    def _close(self, status: str) -> list[str]:
        if self.open is None:
            return []
        item, part = self._item(status)
        where = {"item_id": self.open.id, "output_index": self.index, "content_index": 0}
        events = [self.event("response.reasoning_text.done", **where, text=self.open.text)
                  if self.open.kind == "reasoning" else
                  self.event("response.output_text.done", **where, text=self.open.text,
                             logprobs=fragments_json(self.open.logprobs)),
                  self.event("response.content_part.done", **where, part=part),
                  self.event("response.output_item.done", output_index=self.index,
                             item=item)]
        self.output.append(item)
        self.open = None
        return events

    def _item(self, status: str) -> tuple[Any, Any]:
        """(the open item, its content part), with its text so far."""
        assert self.open is not None
        opened = self.open
        done = status != "in_progress"
        part: Any
        if opened.kind == "reasoning":
            part = ReasoningText(text=opened.text)
            item: Any = ReasoningItem(id=opened.id, status=status,
                                      content=[part] if done else [])
        else:
            part = OutputText(text=opened.text,
                              logprobs_json=fragments_json(opened.logprobs) if done else None)
            item = OutputMessage(id=opened.id, status=status, content=[part] if done else [])
        return item, part
