"""The event log of a background stream (`background` and `stream`): every event the
response's task writes, kept so that a client can read the stream from any point, as
OpenAI's resumable streams (GET /v1/responses/{id}?stream=true&starting_after=N).

The task appends and never waits: whoever reads (the client that asked, a client that
resumes, several at once) follows the log at its own pace, and a reader that leaves
costs the task nothing. Events are numbered from 0 (`sequence_number`), so event i is
the log's entry i. Finished, the log goes into the response store with its response
(ResponseStore.add_events), counted in the store's bound; running, it is held here, one
per running background stream (--max-background-responses bounds them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence


class EventLog:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.done = False
        # Set when an event is added or the log ends, then replaced: a reader waits on
        # the one current when it ran out of events.
        self._changed = asyncio.Event()

    def add(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def finish(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, start: int = 0) -> AsyncIterator[str]:
        """The events from number `start` on, as they come, until the log ends."""
        i = start
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await self._changed.wait()


async def replay(events: Sequence[str], start: int = 0) -> AsyncIterator[str]:
    """A finished log's events from number `start` on."""
    for event in events[start:]:
        yield event
