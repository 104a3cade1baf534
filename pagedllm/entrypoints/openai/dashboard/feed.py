"""DashboardFeed: the JSON that `/dashboard/state` serves, sampled, never per token.

Three sources, none of which adds work to the engine's step loop:
- the KV block grid: a `kv_snapshot` utility call to the engine core (core/kv_snapshot.py),
  made only while someone polls and at most once per `snapshot_interval_s` however many
  pages are open (concurrent polls share one call), and less often when the pool is so
  big that building snapshots would take more than `MAX_CORE_SHARE` of the core's time
  (measured: ~1 ms for 11k blocks, ~10 ms for 100k on a busy 2-core machine);
- counters and the history of the last minutes: the front end's own metrics (the
  scheduler stats each output batch already carries, the Prometheus counters), read
  once per `history_interval_s` by `run_sampler`;
- the request timeline: the front end's mirrors of live requests and the metrics'
  per-request stage times (first scheduled, first token, finished).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from array import array
from collections import deque
from typing import TYPE_CHECKING, Any

from pagedllm.core.kv_snapshot import CACHED, FREE, NULL, SHARED
from pagedllm.errors import EngineDeadError

if TYPE_CHECKING:
    from pagedllm.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# Prometheus sample names the history reads (summed over their labels).
_GEN_TOKENS = "pagedllm:generation_tokens_total"
_PROMPT_TOKENS = "pagedllm:prompt_tokens_total"
_FINISHED = "pagedllm:request_success_total"
_TTFT_SUM = "pagedllm:time_to_first_token_seconds_sum"
_TTFT_COUNT = "pagedllm:time_to_first_token_seconds_count"
_TOTALS = (_GEN_TOKENS, _PROMPT_TOKENS, _FINISHED, _TTFT_SUM, _TTFT_COUNT)
# The most of the engine core's time that building snapshots may take.
MAX_CORE_SHARE = 0.01


class DashboardFeed:
    """Builds the dashboard's state; `run_sampler()` must run for the history."""

    def __init__(self, engine: AsyncLLM, model_name: str, snapshot_interval_s: float = 0.25,
                 snapshot_wait_s: float = 0.5, history_interval_s: float = 1.0,
                 history_s: float = 600.0, timeline_s: float = 120.0,
                 max_timeline_requests: int = 200) -> None:
        self.engine = engine
        self.model_name = model_name
        self.snapshot_interval_s = snapshot_interval_s
        self.snapshot_wait_s = snapshot_wait_s
        self.history_interval_s = history_interval_s
        self.timeline_s = timeline_s
        self.max_timeline_requests = max_timeline_requests
        self.history: deque[dict[str, Any]] = deque(
            maxlen=max(1, int(history_s / history_interval_s)))
        # (time, counter totals, prefix-cache queries, hits) of the previous sample.
        self._last_totals: tuple[float, dict[str, float], int, int] | None = None
        self._kv: dict[str, Any] | None = None
        self._kv_time = float("-inf")
        # The utility call refreshing the snapshot, while one is in flight.
        self._refresh: asyncio.Future | None = None
        # Seconds between snapshots: snapshot_interval_s, or more for a huge pool.
        self._kv_interval = snapshot_interval_s
        # Snapshots taken from the core so far (tests check the rate limit with it).
        self.num_snapshots = 0

    # ------------------------------------------------------------------ history

    async def run_sampler(self) -> None:
        """Append one history point every `history_interval_s` (front-end data only)."""
        while True:
            try:
                self.sample()
            except Exception:  # a dashboard bug must not take the server down
                logger.exception("dashboard sampling failed")
            await asyncio.sleep(self.history_interval_s)

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        totals = _counter_totals(self.engine.metrics.registry)
        stats = self.engine.metrics.stats_log.scheduler_stats
        queries = stats.prefix_cache_queries if stats else 0
        hits = stats.prefix_cache_hits if stats else 0
        last = self._last_totals
        self._last_totals = (now, totals, queries, hits)
        if last is None:
            return  # rates need two samples
        then, before, last_queries, last_hits = last
        dt = max(now - then, 1e-6)

        def delta(name: str) -> float:
            return totals[name] - before[name]

        num_ttft = delta(_TTFT_COUNT)
        self.history.append({
            "t": now,
            "generation_tps": delta(_GEN_TOKENS) / dt,
            "prompt_tps": delta(_PROMPT_TOKENS) / dt,
            "finished_per_s": delta(_FINISHED) / dt,
            # Mean TTFT of the requests that got their first token in this interval.
            "ttft_s": delta(_TTFT_SUM) / num_ttft if num_ttft else None,
            "hit_rate": ((hits - last_hits) / (queries - last_queries)
                         if queries > last_queries else None),
            "running": stats.num_running if stats else 0,
            "waiting": stats.num_waiting if stats else 0,
            "kv_usage": stats.kv_cache_usage if stats else 0.0,
        })

    # ------------------------------------------------------------------ state

    async def state(self, since: float | None = None) -> dict[str, Any]:
        """Everything the page shows; history points newer than `since` only."""
        kv = await self._kv_snapshot() if not self.engine.is_dead else None
        now = time.monotonic()
        alive = not self.engine.is_dead
        return {
            "now": now,
            "model": self.model_name,
            "engine_alive": alive,
            "stats": self._stats(),
            "kv": kv,
            "requests": self._timeline(now, kv),
            "history": [p for p in self.history if since is None or p["t"] > since],
            "intervals": {"snapshot_s": self._kv_interval,
                          "history_s": self.history_interval_s,
                          "timeline_s": self.timeline_s},
        }

    def _stats(self) -> dict[str, Any]:
        metrics = self.engine.metrics
        stats = metrics.stats_log.scheduler_stats
        totals = _counter_totals(metrics.registry)
        out: dict[str, Any] = {
            "num_finished": int(totals[_FINISHED]),
            "num_generation_tokens": int(totals[_GEN_TOKENS]),
            "num_prompt_tokens": int(totals[_PROMPT_TOKENS]),
        }
        if stats is not None:
            out.update({f: getattr(stats, f) for f in stats.__struct_fields__})
            out["prefix_cache_hit_rate"] = (stats.prefix_cache_hits / stats.prefix_cache_queries
                                            if stats.prefix_cache_queries else None)
        return out

    async def _kv_snapshot(self) -> dict[str, Any] | None:
        """The latest block snapshot. One older than the snapshot interval is refreshed
        by one utility call shared by every poll; a poll waits for it at most
        snapshot_wait_s (the core answers after its current step) and otherwise gets
        the previous snapshot, whose `taken_at` tells its age."""
        if self._refresh is None and time.monotonic() - self._kv_time >= self._kv_interval:
            self._refresh = asyncio.ensure_future(self._take_snapshot())
        if self._refresh is not None:
            # asyncio.wait does not cancel the refresh when the wait times out.
            await asyncio.wait({self._refresh}, timeout=self.snapshot_wait_s)
        return self._kv

    async def _take_snapshot(self) -> None:
        try:
            result = await self.engine.call_utility("kv_snapshot")
        except EngineDeadError:
            self._kv = None  # no grid for a dead engine
            return
        except asyncio.TimeoutError:
            logger.warning("dashboard: the engine core did not answer a snapshot in time")
            return  # the previous snapshot stays, showing its age
        except Exception:  # a bug here must not fail the page's polls
            logger.exception("dashboard snapshot failed")
            return
        finally:
            self._refresh = None
        self.num_snapshots += 1
        self._kv_time = time.monotonic()
        self._kv_interval = max(self.snapshot_interval_s, result["build_s"] / MAX_CORE_SHARE)
        self._kv = _encode_snapshot(result, self._kv_time, self.num_snapshots,
                                    self.engine.core_client.block_size)

    def _timeline(self, now: float, kv: dict[str, Any] | None) -> list[dict[str, Any]]:
        """Live requests and those finished in the last timeline_s, newest first."""
        metrics = self.engine.metrics
        progress = kv["progress"] if kv else {}
        rows: list[dict[str, Any]] = []
        for req in list(self.engine.core_client.requests.values()):
            scheduled, first_token = metrics.stage_times(req.req_id)
            computed = progress.get(req.req_id, (None, None))[0]
            rows.append(_row(req.req_id, req.arrival_time, scheduled, first_token, None,
                             None, req.num_prompt_tokens, req.num_output_tokens, computed))
        for done in reversed(metrics.recent_requests):
            if now - done.finished_time > self.timeline_s:
                break
            rows.append(_row(done.req_id, done.arrival_time, done.first_scheduled_time,
                             done.first_token_time, done.finished_time, done.finish_reason,
                             done.num_prompt_tokens, done.num_output_tokens, None))
        rows.sort(key=lambda r: r["arrival"], reverse=True)
        return rows[:self.max_timeline_requests]


def _row(req_id: str, arrival: float, scheduled: float | None, first_token: float | None,
         finished: float | None, reason: str | None, num_prompt_tokens: int,
         num_output_tokens: int, num_computed_tokens: int | None) -> dict[str, Any]:
    if finished is not None:
        phase = "finished"
    elif scheduled is None:
        phase = "queued"
    else:
        phase = "prefill" if first_token is None else "decode"
    return {"id": req_id, "arrival": arrival, "scheduled": scheduled,
            "first_token": first_token, "finished": finished, "reason": reason,
            "phase": phase, "prompt_tokens": num_prompt_tokens,
            "output_tokens": num_output_tokens, "computed_tokens": num_computed_tokens}


def _encode_snapshot(result: dict[str, Any], taken_at: float, seq: int,
                     block_size: int) -> dict[str, Any]:
    """The core's KVSnapshot as JSON: states base64 (uint16 LE per block), counts."""
    snap = result["snapshot"]
    states = array("H")
    states.frombytes(snap.block_states)  # little-endian; counts below are order-free
    num_free, num_cached, num_shared, num_null = (
        states.count(FREE), states.count(CACHED), states.count(SHARED), states.count(NULL))
    num_blocks = len(states)
    return {
        "seq": seq,
        "taken_at": taken_at,
        "build_s": result["build_s"],
        "num_blocks": num_blocks,
        "block_size": block_size,
        "states": base64.b64encode(snap.block_states).decode(),
        "req_ids": snap.req_ids,
        "num_held_blocks": snap.num_held_blocks,
        "num_free": num_free,
        "num_cached": num_cached,
        "num_shared": num_shared,
        # Block 0 (the null block; one per data parallel replica) is neither free nor
        # in use.
        "num_in_use": num_blocks - num_null - num_free - num_cached,
        "progress": {k: list(v) for k, v in result["progress"].items()},
    }


def _counter_totals(registry: Any) -> dict[str, float]:
    """The history's Prometheus samples, each summed over its labels."""
    totals = dict.fromkeys(_TOTALS, 0.0)
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals
