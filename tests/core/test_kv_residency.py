"""vLLM's kv_cache_metrics (core/kv_residency.py): a sample of KV blocks' stays, from
allocation until the pool hands the block out again, with their idle time and the gaps
between their uses; on a fake clock, so every figure is exact."""

from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_residency import MAX_ACCESSES, BlockResidency


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_stay_from_allocation_to_reuse() -> None:
    clock = Clock()
    r = BlockResidency(1.0, clock=clock)
    r.allocated(7)
    for t in (101.0, 103.0, 103.5):
        clock.now = t
        r.accessed(7)
    r.accessed(8)  # not sampled (never allocated): nothing
    clock.now = 110.0
    assert r.drain() == []
    r.allocated(7)  # handed out again: the first stay ends, a second begins
    ((lifetime, idle, gaps),) = r.drain()
    assert (lifetime, idle) == (10.0, 6.5)
    assert gaps == (1.0, 2.0, 0.5)  # allocation, then three uses
    for t in range(111, 121):  # only the last MAX_ACCESSES uses are kept
        clock.now = float(t)
        r.accessed(7)
    clock.now = 125.0
    r.reset()
    ((lifetime, idle, gaps),) = r.drain()
    assert (lifetime, idle) == (15.0, 5.0) and gaps == (1.0,) * (MAX_ACCESSES - 1)
    assert r.states == {}


def test_sampling_is_its_own_and_seeded() -> None:
    import random

    random.seed(0)
    before = random.random()
    counts = []
    for _ in range(2):
        r = BlockResidency(0.25, seed=3)
        for block_id in range(1000):
            r.allocated(block_id)
        counts.append(len(r.states))
    random.seed(0)
    assert random.random() == before  # the global generator untouched
    assert counts[0] == counts[1] and 180 < counts[0] < 320


def test_the_pool_reports_allocations_hits_and_resets(make_request) -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, residency_sample_rate=1.0)
    clock = Clock()
    kv.residency.clock = clock
    a = make_request("a", 12)
    kv.allocate_slots(a, 12)  # blocks 1, 2, 3
    kv.free(a)
    clock.now = 104.0
    b = make_request("b", 12)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    kv.allocate_slots(b, 4, hits, num_hit)  # touches 1 and 2, takes a new block
    assert kv.take_residency_events() == []
    kv.free(b)
    clock.now = 110.0
    assert kv.reset_prefix_cache()
    # Blocks 1, 2: hit again at 104; block 3: never; block 4: b's new one, from 104.
    assert sorted(kv.take_residency_events()) == [
        (6.0, 6.0, ()), (10.0, 6.0, (4.0,)), (10.0, 6.0, (4.0,)), (10.0, 10.0, ())]


def test_observability_options_are_checked() -> None:
    import pytest

    from pagedllm.config import ObservabilityConfig
    from pagedllm.errors import ConfigError

    ok = ObservabilityConfig(0.5, {"time_to_first_token": [0.5, 1, 100],
                                   "iteration_tokens": [1, 2]})
    assert ok.histogram_buckets["time_to_first_token"] == (0.5, 1.0, 100.0)
    for buckets, match in (({"ttft": [1]}, "family must be one of"),
                           ({"request_latency": []}, "strictly increasing"),
                           ({"request_latency": [1, 1]}, "strictly increasing"),
                           ({"request_latency": [0, 1]}, "positive"),
                           ({"request_latency": [1, float("inf")]}, "finite"),
                           ({"request_latency": "1,2"}, "list")):
        with pytest.raises(ConfigError, match=match):
            ObservabilityConfig(histogram_buckets=buckets)
    for sample in (-0.1, 1.5, True):
        with pytest.raises(ConfigError, match="kv_cache_metrics_sample"):
            ObservabilityConfig(kv_cache_metrics_sample=sample)
