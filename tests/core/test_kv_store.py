"""The scheduler's side of the KV store (core/kv_store.py): what it asks the runner to
save and to load, with a fake runner (the files are made here: only names matter to
the scheduler). The engine's end to end: tests/engine/test_kv_transfer.py."""

from __future__ import annotations

import os

from pagedllm.core.kv_store import KVStore, block_file
from pagedllm.lora_request import LoRARequest


def _store(root, load=True, save=True) -> KVStore:
    return KVStore(str(root), "ns", num_ranks=2, block_size=4, load=load, save=save)


def _touch(store: KVStore, stem: str, ranks=(0, 1)) -> None:
    for r in ranks:
        path = block_file(store.root, stem, r)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()


def test_saves_are_the_prompt_blocks_each_step_completes(make_scheduler, make_request,
                                                         step, tmp_path) -> None:
    sched = make_scheduler(num_blocks=30, max_num_batched_tokens=6)
    sched.kv_store = store = _store(tmp_path)
    a = make_request("a", 14, max_tokens=6)
    sched.add_request(a)
    lora = make_request("b", 14, max_tokens=2)
    lora.lora_request = LoRARequest("x", 1, "/x")
    sched.add_request(lora)
    saved = []
    while sched.has_unfinished_requests():
        output, _ = step(sched)
        saved.append([stem for _, stem in output.kv_blocks_to_save])
    # 6 tokens a step: tokens 0-5 complete block 0, 6-11 blocks 1 and 2; block 3 (12-15)
    # holds generated tokens: never saved; nor are the LoRA request's blocks.
    blocks = [store.stem(h) for h in a.block_hashes]
    assert saved[:3] == [blocks[:1], blocks[1:3], []]
    assert not any(saved[3:])


def test_loads_follow_the_prefix_hits_up_to_the_first_missing_block(
        make_scheduler, make_request, tmp_path) -> None:
    producer = make_scheduler(num_blocks=30)
    producer.kv_store = pstore = _store(tmp_path)
    producer.add_request(make_request("p", 21))
    stems = [stem for _, stem in producer.schedule().kv_blocks_to_save]
    assert len(stems) == 5  # 21 prompt tokens: 5 full blocks
    for stem in stems[:4]:
        _touch(pstore, stem)
    _touch(pstore, stems[4], ranks=(0,))  # rank 1's file missing: not stored

    sched = make_scheduler(num_blocks=30)
    sched.kv_store = store = _store(tmp_path, save=False)
    sched.add_request(make_request("a", 21))
    lora = make_request("b", 21)
    lora.lora_request = LoRARequest("x", 1, "/x")
    sched.add_request(lora)
    output = sched.schedule()
    block_ids = {r.req_id: r.block_ids[0] for r in output.scheduled_new_reqs}
    assert output.kv_blocks_to_load == [(stem, block_ids["a"][i])
                                        for i, stem in enumerate(stems[:4])]
    assert output.num_scheduled_tokens == {"a": 21 - 16, "b": 21}
    assert output.kv_blocks_to_save == []  # a consumer saves nothing
    assert (store.hits, store.queries) == (16, 21)
    assert [r.num_computed_tokens for r in output.scheduled_new_reqs] == [16, 0]
    # Loaded blocks are cached like computed ones: a third request hits them locally,
    # with the block a computed after them (the stats count only local hits).
    sched.add_request(make_request("c", 21))
    output = sched.schedule()
    assert output.kv_blocks_to_load == [] and output.num_scheduled_tokens["c"] == 1
    assert sched.kv_cache_manager.prefix_cache_hits == 20


def test_a_failed_load_fails_or_requeues_the_requests_holding_the_block(
        make_scheduler, make_request, tmp_path) -> None:
    from pagedllm.core.contracts import ModelRunnerOutput

    for policy in ("fail", "recompute"):
        producer = make_scheduler(num_blocks=30)
        producer.kv_store = pstore = _store(tmp_path / policy)
        producer.add_request(make_request("p", 13))
        for _, stem in producer.schedule().kv_blocks_to_save:
            _touch(pstore, stem)
        sched = make_scheduler(num_blocks=30)
        sched.kv_store = store = _store(tmp_path / policy)
        sched.kv_load_failure_policy = policy
        for name in ("a", "b"):  # b hits a's loaded blocks locally
            sched.add_request(make_request(name, 13))
        sched.add_request(make_request("other", [200 + i for i in range(6)]))
        output = sched.schedule()
        (_, bad), *_ = output.kv_blocks_to_load[1:]
        runner = ModelRunnerOutput(req_ids=["a", "b", "other"],
                                   sampled_token_ids=[[1], [1], [1]],
                                   kv_load_failures={bad: "gone"})
        updated = sched.update_from_output(output, runner)
        assert store.num_load_failures == 1
        assert sched.kv_cache_manager.block_pool.blocks[bad].block_hash is None
        assert [r.num_output_tokens for r in (sched.requests["other"],)] == [1]
        if policy == "fail":
            assert {r.req_id for r in updated if r.is_finished} == {"a", "b"}
            assert all("KV cache load failed: gone" in r.error for r in updated
                       if r.is_finished)
        else:
            assert {r.req_id for r in sched.waiting} == {"a", "b"}
            assert all(sched.requests[n].num_output_tokens == 0 for n in ("a", "b"))
            output = sched.schedule()
            assert {"a", "b"} <= output.preempted_req_ids
            # The block before the failed one is still cached; the failed one is not
            # looked up again, so nothing loads and a computes the rest (which b, after
            # it in the step, hits).
            assert output.kv_blocks_to_load == []
            assert [r.num_computed_tokens for r in output.scheduled_new_reqs] == [4, 12]


def test_saving_pauses_when_space_or_files_run_short(tmp_path, monkeypatch) -> None:
    import os as os_module
    from types import SimpleNamespace

    store = KVStore(str(tmp_path), "ns", num_ranks=1, block_size=4, load=True, save=True,
                    min_free_bytes=1 << 30)
    for (blocks, inodes, files), room in (((1 << 20, 10**6, 10**6), True),
                                         ((1 << 10, 10**6, 10**6), False),
                                         ((1 << 20, 100, 10**6), False),
                                         ((1 << 20, 0, 0), True)):  # no inode limit
        st = SimpleNamespace(f_bavail=blocks, f_frsize=4096, f_favail=inodes, f_files=files)
        monkeypatch.setattr(os_module, "statvfs", lambda path, st=st: st)
        assert store.has_room() is room
