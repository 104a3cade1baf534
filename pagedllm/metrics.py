"""Prometheus metrics of a serving engine, and the periodic stats log line.

Everything lives on one `EngineMetrics` instance with its own CollectorRegistry (no
process-global registry), fed by the front end from the engine core's output batches:
per-request token counts and timestamps (time.monotonic, shared across processes on
Linux) and the scheduler's stats (running/waiting, KV usage, prefix-cache counters).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from pagedllm.request import Request

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0, 10.0, 20.0)
# A KV block's stay: milliseconds between hits up to half an hour in the cache.
_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                      10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)

# The engine core's messages are described here by the fields this module reads, not
# imported: metrics sits below engine/ and must not import it (DESIGN.md section 5).
class SchedulerStatsLike(Protocol):
    """The scheduler's counters (engine/core_proc.py's SchedulerStats)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable KV blocks held by requests
    prefix_cache_queries: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # cumulative prompt tokens served from it
    num_preemptions: int  # cumulative
    num_swapped: int  # requests swapped out to the host pool now
    num_swaps_out: int  # cumulative
    num_swaps_in: int  # cumulative
    num_draft_tokens: int  # cumulative speculative proposals
    num_accepted_tokens: int  # cumulative proposals accepted
    external_prefix_cache_queries: int  # cumulative prompt tokens looked up in the KV store
    external_prefix_cache_hits: int  # cumulative prompt tokens loaded from it
    # enable_mfu_metrics: cumulative estimates per worker (core/perf.py)
    estimated_flops: float
    estimated_read_bytes: float
    estimated_write_bytes: float
    # kv_cache_metrics: (lifetime, idle, reuse gaps) of sampled blocks since the last stats
    kv_block_residency: list[tuple[float, float, tuple[float, ...]]]


class CoreOutputLike(Protocol):
    """What one request gained in one step (engine/core_proc.py's EngineCoreOutput)."""

    req_id: str
    new_token_ids: list[int]
    status: str  # a RequestStatus value
    first_scheduled_time: float | None  # set on a request's first output only


class CoreOutputsLike(Protocol):
    """One step's batch of outputs (engine/core_proc.py's EngineCoreOutputs)."""

    timestamp: float  # time.monotonic() of the step

    @property
    def outputs(self) -> Sequence[CoreOutputLike]: ...


@dataclass
class FinishedRequestTimes:
    """When a finished request passed each stage (time.monotonic; None: never reached)."""

    req_id: str
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int


# Finished requests kept for the dashboard's timeline.
NUM_RECENT_REQUESTS = 256


class EngineMetrics:
    """vLLM-style `pagedllm:*` metrics, labelled with the served model name."""

    def __init__(self, model_name: str, buckets: dict[str, tuple[float, ...]] | None = None,
                 kv_cache_metrics: bool = False, mfu_metrics: bool = False) -> None:
        """`buckets`: bounds replacing a histogram family's defaults (vLLM's families,
        config.HISTOGRAM_FAMILIES); `kv_cache_metrics`: the block residency histograms;
        `mfu_metrics`: the estimated FLOPs and bytes counters (vLLM's names)."""
        buckets = buckets or {}
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, labels = self.registry, ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels + list(extra), registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=reg)

        self.request_success = counter("request_success", "Finished requests, by finish "
                                       "reason (stop, length, abort, timeout).",
                                       ("finished_reason",))
        self.request_rejected = counter("request_rejected", "Requests refused before they "
                                        "reached the engine, by reason (queue_full).",
                                        ("reason",))
        self.engine_alive = gauge("engine_alive", "1 while the engine process runs, 0 once "
                                                  "it is gone (the other gauges read 0).")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted.")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens served from the prefix cache.")
        self.external_prefix_cache_queries = counter(
            "external_prefix_cache_queries",
            "Prompt tokens looked up in the KV store or host tier of kv_transfer_config.")
        self.external_prefix_cache_hits = counter(
            "external_prefix_cache_hits",
            "Prompt tokens loaded from the KV store or host tier.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Tokens proposed by speculative decoding.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Proposed tokens accepted by verification.")
        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_swapped = gauge("num_requests_swapped", "Requests swapped out to host memory.")
        self.num_swaps = counter("num_swaps", "KV swaps of preempted requests, by direction "
                                 "(out to host memory, in back to the cache).", ("direction",))
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "Fraction of KV cache blocks in use (0..1).")
        latency = buckets.get("request_latency", _LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.",
                              buckets.get("time_to_first_token", _LATENCY_BUCKETS))
        self.tpot = histogram("time_per_output_token_seconds", "Mean time between output "
                              "tokens of a request (first to last).",
                              buckets.get("inter_token_latency", _TPOT_BUCKETS))
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", latency)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduled.", latency)
        # vLLM's model-FLOPs-utilization counters (mfu_metrics only): "gpu" is vLLM's
        # word for a worker, kept so its dashboards' queries work.
        self.perf: tuple[Counter, Counter, Counter] | None = None
        if mfu_metrics:
            self.perf = (
                counter("estimated_flops_per_gpu", "Estimated floating point operations "
                        "per worker (for model FLOPs utilization)."),
                counter("estimated_read_bytes_per_gpu", "Estimated bytes read from "
                        "memory per worker."),
                counter("estimated_write_bytes_per_gpu", "Estimated bytes written to "
                        "memory per worker."))
        # vLLM's KV cache residency histograms (kv_cache_metrics only).
        self.residency: tuple[Histogram, Histogram, Histogram] | None = None
        if kv_cache_metrics:
            residency = buckets.get("kv_cache_residency", _RESIDENCY_BUCKETS)
            self.residency = (
                histogram("kv_block_lifetime_seconds", "A sampled KV block's stay, from "
                          "allocation until it is handed out again.", residency),
                histogram("kv_block_idle_before_evict_seconds", "A sampled KV block's "
                          "time since its last use when its stay ended.", residency),
                histogram("kv_block_reuse_gap_seconds", "Time between a sampled KV "
                          "block's consecutive uses (its last few).", residency))
        # req_id -> time of its first token.
        self._first_token_time: dict[str, float] = {}
        # req_id -> time of its first scheduling step (the dashboard's timeline).
        self._first_scheduled_time: dict[str, float] = {}
        # The last finished requests, oldest first (one record per request, not per token).
        self.recent_requests: deque[FinishedRequestTimes] = deque(maxlen=NUM_RECENT_REQUESTS)
        # Previous cumulative values of the core's counters (Prometheus takes increments).
        self._last_stats: SchedulerStatsLike | None = None
        self.stats_log = StatsLog()
        self._labels(self.engine_alive).set(1)

    def _labels(self, metric: Counter | Gauge | Histogram):
        return metric.labels(model_name=self.model_name)

    def render(self) -> bytes:
        """The exposition text of this registry."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ recording

    def mark_engine_dead(self) -> None:
        """The engine process is gone: nothing runs, waits or holds KV blocks."""
        self._labels(self.engine_alive).set(0)
        for gauge in (self.num_running, self.num_waiting, self.num_swapped,
                      self.kv_cache_usage):
            self._labels(gauge).set(0)
        self.stats_log.scheduler_stats = None

    def observe_rejected(self, reason: str) -> None:
        self.request_rejected.labels(model_name=self.model_name, reason=reason).inc()

    def observe_scheduler_stats(self, stats: SchedulerStatsLike) -> None:
        if self.residency is not None:
            lifetime, idle, reuse = (self._labels(h) for h in self.residency)
            for life, idle_s, gaps in stats.kv_block_residency:
                lifetime.observe(life)
                idle.observe(idle_s)
                for gap in gaps:
                    reuse.observe(gap)
        self._labels(self.num_running).set(stats.num_running)
        self._labels(self.num_waiting).set(stats.num_waiting)
        self._labels(self.kv_cache_usage).set(stats.kv_cache_usage)
        self._labels(self.num_swapped).set(stats.num_swapped)
        last = self._last_stats
        for direction, now, before in (
                ("out", stats.num_swaps_out, last.num_swaps_out if last else 0),
                ("in", stats.num_swaps_in, last.num_swaps_in if last else 0)):
            if now > before:
                self.num_swaps.labels(model_name=self.model_name,
                                      direction=direction).inc(now - before)
        for metric, now, before in (
                (self.prefix_cache_queries, stats.prefix_cache_queries,
                 last.prefix_cache_queries if last else 0),
                (self.prefix_cache_hits, stats.prefix_cache_hits,
                 last.prefix_cache_hits if last else 0),
                (self.num_preemptions, stats.num_preemptions,
                 last.num_preemptions if last else 0),
                (self.external_prefix_cache_queries, stats.external_prefix_cache_queries,
                 last.external_prefix_cache_queries if last else 0),
                (self.external_prefix_cache_hits, stats.external_prefix_cache_hits,
                 last.external_prefix_cache_hits if last else 0),
                (self.spec_draft_tokens, stats.num_draft_tokens,
                 last.num_draft_tokens if last else 0),
                (self.spec_accepted_tokens, stats.num_accepted_tokens,
                 last.num_accepted_tokens if last else 0)):
            if now > before:
                self._labels(metric).inc(now - before)
        if self.perf is not None:
            for metric, now, before in zip(
                    self.perf, _perf_of(stats), _perf_of(last) if last else (0, 0, 0)):
                if now > before:
                    self._labels(metric).inc(now - before)
        self._last_stats = stats
        self.stats_log.scheduler_stats = stats

    def observe_outputs(self, batch: CoreOutputsLike, requests: dict[str, Request]) -> None:
        """Record one batch; call before it is applied to the `requests` mirrors."""
        ts = batch.timestamp
        for out in batch.outputs:
            req = requests.get(out.req_id)
            if req is None:
                continue
            if out.first_scheduled_time is not None:
                self._first_scheduled_time[out.req_id] = out.first_scheduled_time
                self._labels(self.queue_time).observe(
                    max(0.0, out.first_scheduled_time - req.arrival_time))
            num_new = len(out.new_token_ids)
            if num_new:
                self._labels(self.generation_tokens).inc(num_new)
                self.stats_log.num_generation_tokens += num_new
                if out.req_id not in self._first_token_time:
                    self._first_token_time[out.req_id] = ts
                    self._labels(self.ttft).observe(max(0.0, ts - req.arrival_time))
                    self._labels(self.prompt_tokens).inc(req.num_prompt_tokens)
                    self.stats_log.num_prompt_tokens += req.num_prompt_tokens
            if req.is_pooling and out.status == "finished_stopped":
                # An embedding request: prompt tokens, no generation tokens.
                self._labels(self.prompt_tokens).inc(req.num_prompt_tokens)
                self.stats_log.num_prompt_tokens += req.num_prompt_tokens
            if out.status.startswith("finished"):
                reason = {"finished_stopped": "stop", "finished_length": "length",
                          "finished_timeout": "timeout"}.get(out.status, "abort")
                self._finish(req, reason, ts, req.num_output_tokens + num_new)

    def observe_finished(self, req: Request) -> None:
        """A request finished by the front end (client gone, stop string)."""
        self._finish(req, req.status.finish_reason or "abort", time.monotonic(),
                     req.num_output_tokens)

    def stage_times(self, req_id: str) -> tuple[float | None, float | None]:
        """(first scheduled, first token) times of a live request, None where not yet."""
        return (self._first_scheduled_time.get(req_id),
                self._first_token_time.get(req_id))

    def _finish(self, req: Request, reason: str, ts: float, num_output_tokens: int) -> None:
        self._labels(self.e2e).observe(max(0.0, ts - req.arrival_time))
        first = self._first_token_time.pop(req.req_id, None)
        self.recent_requests.append(FinishedRequestTimes(
            req.req_id, req.arrival_time, self._first_scheduled_time.pop(req.req_id, None),
            first, ts, reason, req.num_prompt_tokens, num_output_tokens))
        if first is not None and num_output_tokens > 1:
            self._labels(self.tpot).observe((ts - first) / (num_output_tokens - 1))
        self.request_success.labels(model_name=self.model_name,
                                    finished_reason=reason).inc()


def _perf_of(stats: SchedulerStatsLike) -> tuple[float, float, float]:
    return stats.estimated_flops, stats.estimated_read_bytes, stats.estimated_write_bytes


class StatsLog:
    """The periodic "Avg prompt throughput ..." line, as vLLM prints it."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.scheduler_stats: SchedulerStatsLike | None = None
        self._last_time = time.monotonic()
        self._last_queries = 0
        self._last_hits = 0
        # Cumulative (swaps out, swaps in) at the last line.
        self._last_swaps = (0, 0)
        # Cumulative (flops, bytes read and written) at the last line (mfu metrics).
        self._last_perf = (0.0, 0.0, 0.0)
        self._was_idle = True

    def _perf_text(self, stats: SchedulerStatsLike | None, elapsed: float) -> str:
        """", Est. X TFLOP/s, Y GB/s per worker" once the mfu estimates count."""
        if stats is None or not stats.estimated_flops:
            return ""
        now = _perf_of(stats)
        flops, read, written = (a - b for a, b in zip(now, self._last_perf))
        self._last_perf = now
        return (f", Est. {flops / elapsed / 1e12:.3f} TFLOP/s, "
                f"{(read + written) / elapsed / 1e9:.1f} GB/s per worker")

    def _swap_text(self, stats: SchedulerStatsLike | None) -> str:
        """"Swapped: N reqs (out X, in Y since the last line), " once anything swapped."""
        if stats is None or not (stats.num_swaps_out or stats.num_swapped):
            return ""
        swaps_out = stats.num_swaps_out - self._last_swaps[0]
        swaps_in = stats.num_swaps_in - self._last_swaps[1]
        self._last_swaps = (stats.num_swaps_out, stats.num_swaps_in)
        return f"Swapped: {stats.num_swapped} reqs (out {swaps_out}, in {swaps_in}), "

    def log(self) -> str | None:
        """Log (and return) the line if anything happened since the last one."""
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-6)
        stats = self.scheduler_stats
        running = stats.num_running if stats else 0
        waiting = stats.num_waiting if stats else 0
        is_idle = not (self.num_prompt_tokens or self.num_generation_tokens or running
                       or waiting)
        line = None
        if not (is_idle and self._was_idle):
            queries = (stats.prefix_cache_queries if stats else 0) - self._last_queries
            hits = (stats.prefix_cache_hits if stats else 0) - self._last_hits
            line = (f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
                    f"Avg generation throughput: "
                    f"{self.num_generation_tokens / elapsed:.1f} tokens/s, "
                    f"Running: {running} reqs, Waiting: {waiting} reqs, "
                    f"{self._swap_text(stats)}"
                    f"KV cache usage: {100 * (stats.kv_cache_usage if stats else 0):.1f}%, "
                    f"Prefix cache hit rate: {100 * hits / queries if queries else 0:.1f}%"
                    f"{self._perf_text(stats, elapsed)}")
            logger.info(line)
        if stats:
            self._last_queries, self._last_hits = (stats.prefix_cache_queries,
                                                   stats.prefix_cache_hits)
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self._last_time = now
        self._was_idle = is_idle
        return line
