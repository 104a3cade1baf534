"""The response store's memory bound: least recently used responses go first, shared
conversation items are counted once and until their last holder is gone, a response
larger than the bound is not kept."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.protocol import ChatLogprobToken
from pagedllm.entrypoints.openai.responses_protocol import (InputMessage, OutputMessage,
                                                            OutputText, ResponseObject)
from pagedllm.entrypoints.openai.responses_store import (ResponseNotFoundError,
                                                         ResponseStore, as_input_items)


def _response(rid: str, text: str) -> ResponseObject:
    return ResponseObject(id=rid, created_at=0, status="completed", model="m", output=[
        OutputMessage(id=f"msg_{rid}", status="completed", content=[OutputText(text=text)])])


def _put(store: ResponseStore, rid: str, text: str, earlier: tuple = ()) -> None:
    response = _response(rid, text)
    store.put(response, earlier,
              [InputMessage(role="user", content="q")] + as_input_items(response.output))


def test_outputs_become_the_input_items_that_send_them_back():
    (item,) = as_input_items(_response("r", "hello").output)
    assert isinstance(item, InputMessage)
    assert item.role == "assistant" and item.text() == "hello" and item.id == "msg_r"
    # The text's logprobs are the response's, not the conversation's: left out.
    response = _response("r", "hello")
    response.output[0].content[0].logprobs = [ChatLogprobToken(token="hello", logprob=-1.0)]
    (item,) = as_input_items(response.output)
    assert item.content[0].logprobs is None and item.text() == "hello"


def test_least_recently_used_go_first_past_the_bound():
    probe = ResponseStore(1 << 30)
    _put(probe, "a", "x" * 1000)
    one = probe.nbytes
    assert one > 2000  # the text in the response and in its conversation, and overheads
    store = ResponseStore(3 * one + one // 2)  # room for three
    for rid in "abc":
        _put(store, rid, "x" * 1000)
    store.get("a")  # now the most recently used
    _put(store, "d", "x" * 1000)
    assert len(store) == 3 and store.nbytes <= store.max_bytes
    with pytest.raises(ResponseNotFoundError, match="'b' not found"):
        store.get("b")
    assert [store.get(rid).response.id for rid in "acd"] == ["a", "c", "d"]
    assert store.delete("a") and not store.delete("a")
    assert store.nbytes == 2 * one


def test_a_chain_shares_its_earlier_items_and_a_too_large_response_is_not_kept():
    store = ResponseStore(1 << 20)
    _put(store, "a", "x" * 10_000)
    first = store.get("a")
    _put(store, "b", "short", earlier=first.conversation)
    second = store.get("b")
    assert second.conversation[:len(first.conversation)] == first.conversation
    assert second.conversation[0] is first.conversation[0]  # shared, not copied
    assert second.nbytes < first.nbytes / 3  # the 2 x 10 KB of "a" are not counted again
    _put(store, "huge", "x" * (2 << 20))
    with pytest.raises(ResponseNotFoundError):
        store.get("huge")
    assert len(store) == 2  # and nothing was evicted for it


def test_shared_items_are_counted_until_their_last_holder_goes():
    """Dropping a response whose items a continuation still holds frees only its own
    bytes; the items go (and their bytes) with the continuation."""
    store = ResponseStore(1 << 20)
    _put(store, "a", "x" * 10_000)
    alone = store.nbytes
    _put(store, "b", "short", earlier=store.get("a").conversation)
    both = store.nbytes
    assert store.delete("a")
    held = store.nbytes
    # a's response object (10 KB of text) is gone; its 10 KB output item, which b's
    # conversation holds, is still counted.
    assert 10_000 + (both - alone) < held < alone
    _put(store, "c", "short")
    assert store.delete("b") and store.delete("c")
    assert store.nbytes == 0 and not store._items
    # A chain dropped from its oldest end past the bound never counts below what it holds.
    store = ResponseStore(alone * 3)
    _put(store, "a", "x" * 10_000)
    previous = "a"
    for rid in "bcdefgh":
        _put(store, rid, "y" * 5_000, earlier=store.get(previous).conversation)
        previous = rid
        held = {id(i): i for r in list(store._responses) for i in store.get(r).conversation}
        assert store.nbytes >= sum(len(i.model_dump_json()) for i in held.values())
        assert store.nbytes <= store.max_bytes
    assert both - alone < alone / 3


def test_stream_events_are_kept_counted_and_dropped_with_their_response():
    store = ResponseStore(1 << 20)
    _put(store, "a", "x")
    before = store.nbytes
    events = ("event: one\ndata: {}\n\n", "event: two\ndata: {}\n\n")
    store.add_events("a", events)
    assert store.get("a").events == events
    assert store.nbytes == before + sum(map(len, events)) + 8 * len(events)
    store.add_events("gone", events)  # not stored: nothing kept
    assert store.nbytes == before + sum(map(len, events)) + 8 * len(events)
    # Past the bound, the least recently used response goes, events and all.
    _put(store, "b", "y")
    store.add_events("b", ("z" * (1 << 20),))
    assert len(store) == 0 and store.nbytes == 0
