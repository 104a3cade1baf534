"""How long KV blocks stay and how often they are reused, on a sample of blocks
(vLLM's --kv-cache-metrics): the block pool reports allocations and prefix hits, and
each sampled block's stay ends, as an event, when the pool hands it out again (its
cached K/V evicted) or the cache is reset.

An event is (lifetime: allocation to its end, idle: last use to its end, reuse gaps:
between its last few uses), in seconds; the engine process sends them with its stats
and the front end's Prometheus histograms take them (metrics.py).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable

# Uses remembered per sampled block (a block hit many times keeps only its last ones).
MAX_ACCESSES = 4

ResidencyEvent = tuple[float, float, tuple[float, ...]]


class BlockResidency:
    """Sampled blocks' allocation time and recent uses (block id -> state), and the
    events of the stays that ended since the last `drain`."""

    def __init__(self, sample_rate: float, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert 0 < sample_rate <= 1, sample_rate
        self.sample_rate = sample_rate
        # Its own generator: sampling must not draw from (or reseed) anyone else's.
        self.rng = random.Random(seed)
        self.clock = clock
        self.states: dict[int, tuple[float, deque[float]]] = {}
        self.events: list[ResidencyEvent] = []

    def allocated(self, block_id: int) -> None:
        """The pool handed the block out: its previous stay (if sampled) ends here."""
        now = self.clock()
        self._end(block_id, now)
        if self.rng.random() < self.sample_rate:
            self.states[block_id] = (now, deque([now], maxlen=MAX_ACCESSES))

    def accessed(self, block_id: int) -> None:
        """A request took the block as a prefix hit."""
        state = self.states.get(block_id)
        if state is not None:
            state[1].append(self.clock())

    def reset(self) -> None:
        """The prefix cache was cleared: every sampled stay ends now."""
        now = self.clock()
        for block_id in list(self.states):
            self._end(block_id, now)

    def drain(self) -> list[ResidencyEvent]:
        events, self.events = self.events, []
        return events

    def _end(self, block_id: int, now: float) -> None:
        state = self.states.pop(block_id, None)
        if state is None:
            return
        born, uses = state
        gaps = tuple(b - a for a, b in zip(uses, list(uses)[1:]))
        self.events.append((now - born, now - uses[-1], gaps))
