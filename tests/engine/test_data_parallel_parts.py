"""Data parallel replicas' parts that need no process: how the cores are split, how the
replicas' stats and KV grids combine, where a request is routed, and the options
refused."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest

from pagedllm.core.kv_snapshot import CACHED, FIRST_REQ, FREE, NULL, SHARED, KVSnapshot, \
    concat_snapshots
from pagedllm.engine.core_proc import SchedulerStats
from pagedllm.engine.dp_client import combine_utility, sum_scheduler_stats
from pagedllm.engine.dp_placement import physical_cores, split_cores
from pagedllm.engine.dp_routing import ReplicaRouter, affinity_key
from pagedllm.lora_request import LoRARequest
from pagedllm.mm_inputs import PromptEmbedsInput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.errors import ConfigError


def _fake_sysfs(root: Path, topology: dict[int, tuple[int, int]]) -> str:
    """cpu -> (socket, core id) as /sys/devices/system/cpu lays it out."""
    for cpu, (package, core) in topology.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")
    return str(root)


def test_hyperthread_siblings_stay_together(tmp_path):
    # Linux numbers the second threads after all first threads: 0-3 then 4-7.
    sysfs = _fake_sysfs(tmp_path, {cpu: (0, cpu % 4) for cpu in range(8)})
    cores = physical_cores(range(8), sysfs)
    assert cores == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert split_cores(cores, 2) == [[(0, 4), (1, 5)], [(2, 6), (3, 7)]]


def test_sockets_split_before_cores(tmp_path):
    # Two sockets whose core ids restart at 0, CPUs interleaved between them.
    sysfs = _fake_sysfs(tmp_path, {cpu: (cpu % 2, cpu // 2) for cpu in range(8)})
    cores = physical_cores(range(8), sysfs)
    assert cores == [(0,), (2,), (4,), (6,), (1,), (3,), (5,), (7,)]
    assert [sum(share, ()) for share in split_cores(cores, 2)] == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_uneven_split_and_too_few_cores(tmp_path):
    sysfs = _fake_sysfs(tmp_path, {cpu: (0, cpu) for cpu in range(5)})
    cores = physical_cores([0, 1, 2, 3, 4], sysfs)
    assert [len(s) for s in split_cores(cores, 3)] == [2, 2, 1]
    with pytest.raises(ConfigError, match="data_parallel_size=6 needs a physical core per "
                                          "replica, but this process may run on 5"):
        split_cores(cores, 6)


def test_unreadable_topology_counts_each_cpu_as_a_core(tmp_path):
    assert physical_cores([3, 1], str(tmp_path / "missing")) == [(1,), (3,)]


def _stats(running: int, blocks: int, usage: float, hits: int) -> SchedulerStats:
    return SchedulerStats(num_running=running, num_waiting=1, kv_cache_usage=usage,
                          prefix_cache_queries=10 * hits, prefix_cache_hits=hits,
                          num_preemptions=0, num_free_blocks=blocks // 2,
                          num_blocks=blocks)


def test_scheduler_stats_sum_over_replicas():
    total = sum_scheduler_stats([_stats(2, 101, 0.5, 3), _stats(1, 301, 0.25, 4)])
    assert (total.num_running, total.num_waiting, total.prefix_cache_hits,
            total.prefix_cache_queries, total.num_blocks) == (3, 2, 7, 70, 402)
    # Usage of all usable blocks: (50 + 75) / 400.
    assert total.kv_cache_usage == pytest.approx(125 / 400)


def test_get_stats_and_prefix_reset_combine():
    replicas = [{"num_running": 1, "num_blocks": 11, "kv_cache_usage": 0.5, "engine_pid": 7,
                 "engine_rss_bytes": 100},
                {"num_running": 2, "num_blocks": 11, "kv_cache_usage": 0.0, "engine_pid": 9,
                 "engine_rss_bytes": 50}]
    stats = combine_utility("get_stats", replicas)
    assert stats["num_running"] == 3 and stats["engine_rss_bytes"] == 150
    assert stats["kv_cache_usage"] == 0.25 and stats["engine_pid"] == 7
    assert stats["replicas"] == replicas
    assert combine_utility("reset_prefix_cache", [True, False]) is False
    assert combine_utility("reset_prefix_cache", [True, True]) is True


def _snapshot(states: list[int], req_ids: list[str]) -> KVSnapshot:
    return KVSnapshot(array("H", states).tobytes(), req_ids, [1] * len(req_ids))


def test_kv_grids_laid_end_to_end():
    a = _snapshot([NULL, FIRST_REQ, FIRST_REQ + 1, CACHED], ["r0", "r1"])
    b = _snapshot([NULL, FIRST_REQ, SHARED, FREE], ["s0"])
    merged = concat_snapshots([a, b])
    states = array("H")
    states.frombytes(merged.block_states)
    # The second pool's request 0 is request 2 of the whole.
    assert list(states) == [NULL, FIRST_REQ, FIRST_REQ + 1, CACHED,
                            NULL, FIRST_REQ + 2, SHARED, FREE]
    assert merged.req_ids == ["r0", "r1", "s0"] and merged.num_held_blocks == [1, 1, 1]


def test_data_parallel_options_refused():
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ConfigError, match="data_parallel_size must be >= 1"):
        EngineArgs(data_parallel_size=0).create_engine_config()
    with pytest.raises(ConfigError, match="needs a physical core per replica"):
        EngineArgs(data_parallel_size=4096).create_engine_config()


def _request(ids, **kw) -> Request:
    return Request("r", list(ids), SamplingParams(max_tokens=4), None, **kw)


def test_affinity_keys_are_the_first_blocks_and_the_adapter():
    long = list(range(100))
    key = affinity_key(_request(long), block_size=16)
    assert key == affinity_key(_request(long[:65] + [7, 7]), 16)  # same first 64 tokens
    assert key != affinity_key(_request([1] + long[1:]), 16)
    assert key != affinity_key(_request(long, lora_request=LoRARequest("a", 1, "/a")), 16)
    assert affinity_key(_request(long[:64]), 16) is None  # no whole block before the end
    embeds = PromptEmbedsInput(rows=None, hash="h", offset=0, length=100)
    assert affinity_key(_request([0] * 100, mm_inputs=[embeds]), 16) is None


def test_router_keeps_a_prefix_on_its_replica_while_it_keeps_up():
    router = ReplicaRouter(max_entries=2)
    assert router.route(None, [3, 1, 2]) == 1  # no key: the least loaded
    assert router.route("a", [0, 0]) == 0
    # Back to replica 0 while it is at most max(2, a quarter) above the least loaded.
    assert router.route("a", [2, 0]) == 0
    assert router.route("a", [3, 0]) == 1  # too busy: the least loaded, remembered
    assert router.route("a", [5, 2]) == 1
    assert router.route("a", [9, 40]) == 0 and router.route("a", [11, 10]) == 0
    # Least recently used prefixes are forgotten past max_entries.
    router.route("b", [0, 1])
    router.route("c", [1, 0])
    assert router.route("a", [1, 0]) == 1  # "a" was forgotten: least loaded
