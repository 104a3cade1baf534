"""Swap preemption (core/swap.py and the scheduler's swapped queue), to the exact block id.

The usual setting: 4-token blocks, 4 usable device blocks, two 7-token prompts that fill
them after their prefill; the third decode of `a` needs a fifth block, so `b` (the last
running request) is preempted.
"""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.request import RequestStatus

B_PROMPT = list(range(10, 17))


@pytest.fixture
def two_requests(make_scheduler, make_request, step):
    """Scheduler factory: a and b admitted and decoded until a needs a new block."""

    def build(**kw):
        sched = make_scheduler(num_blocks=5, block_size=4, preemption_mode="swap", **kw)
        sched.add_request(make_request("a", 7, max_tokens=3))
        sched.add_request(make_request("b", B_PROMPT, max_tokens=4))
        out, _ = step(sched)
        assert [(n.req_id, n.block_ids) for n in out.scheduled_new_reqs] == [
            ("a", [[1, 2]]), ("b", [[3, 4]])]
        step(sched)  # both decode into their second block: 8 tokens computed each
        return sched

    return build


def test_swap_out_then_in_without_prefix_cache(two_requests, step):
    sched = two_requests(num_swap_blocks=9, enable_prefix_caching=False)
    b = sched.requests["b"]
    out, _ = step(sched)
    # b's two blocks go to host blocks 1, 2; a takes b's freed block 4 in the same step
    # (the runner copies 4 out before the forward pass writes it).
    assert out.blocks_to_swap_out == [(3, 1), (4, 2)]
    assert out.preempted_req_ids == {"b"} and out.blocks_to_swap_in == []
    assert [(c.req_id, c.new_block_ids) for c in out.scheduled_cached_reqs] == [("a", [[4]])]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 8
    assert list(sched.swapped) == [b] and "b" not in sched.kv_cache_manager.req_to_blocks
    assert (sched.num_swaps_out, sched.num_swapped, sched.num_swapped_blocks) == (1, 1, 2)
    assert sched.num_preemptions == 1 and sched.has_unfinished_requests()
    # a finished (max_tokens 3) and freed 4, 2, 1: b comes back with fresh blocks 3, 4
    # for its two computed blocks and 2 for its next token, and resumes at 8 tokens.
    out, _ = step(sched)
    assert out.finished_req_ids == {"a"}
    assert [(n.req_id, n.block_ids, n.num_computed_tokens)
            for n in out.scheduled_new_reqs] == [("b", [[3, 4, 2]], 8)]
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.blocks_to_swap_in == [(1, 3), (2, 4)]
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 9
    assert (sched.num_swaps_in, sched.num_swapped, sched.num_swapped_blocks) == (1, 0, 0)
    assert sched.swap_space.host_pool.get_num_free_blocks() == 8
    step(sched)
    assert b.is_finished and b.output_token_ids == [0] * 4


def test_swap_in_rereferences_cached_blocks(two_requests, step):
    sched = two_requests(num_swap_blocks=9)
    step(sched)  # b swapped out; its block 3 stays cached in the free queue, 4 is reused
    out, _ = step(sched)
    # Block 0 of b (tokens 10..13) is still cached in device block 3: touched, not
    # copied. Block 1 lost its device copy (4 went to a): host block 2 -> fresh block 4.
    assert [(n.req_id, n.block_ids) for n in out.scheduled_new_reqs] == [("b", [[3, 4, 2]])]
    assert out.blocks_to_swap_in == [(2, 4)]
    pool = sched.kv_cache_manager.block_pool
    # Both full blocks of b are in the prefix cache again, block 2 is not full yet.
    assert [pool.blocks[i].block_hash is not None for i in (3, 4, 2)] == [True, True, False]
    assert pool.get_cached_block(sched.requests["b"].block_hashes[1]) is pool.blocks[4]


def test_host_pool_too_small_falls_back_to_recompute(two_requests, step):
    sched = two_requests(num_swap_blocks=2)  # one usable host block, b holds two
    out, _ = step(sched)
    b = sched.requests["b"]
    assert out.preempted_req_ids == {"b"} and out.blocks_to_swap_out == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and not sched.swapped
    assert (sched.num_swaps_out, sched.num_preemptions) == (0, 1)
    out, _ = step(sched)
    # Re-admitted as a recompute: 9 tokens, the first 4 a prefix-cache hit.
    assert [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [("b", 4)]
    assert out.blocks_to_swap_in == []


def test_no_host_pool_under_recompute_mode(make_scheduler):
    sched = make_scheduler(num_swap_blocks=9)  # preemption_mode "recompute"
    assert sched.swap_space is None and sched.num_swapped_blocks == 0


def test_abort_swapped_request_frees_host_blocks(two_requests, step):
    sched = two_requests(num_swap_blocks=9)
    step(sched)
    (b,) = sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and not sched.swapped
    assert sched.num_swapped_blocks == 0 and "b" not in sched.requests
    out, _ = step(sched)
    assert "b" in out.finished_req_ids and out.blocks_to_swap_in == []


def test_deadline_of_swapped_request(two_requests, make_request, step):
    sched = two_requests(num_swap_blocks=9)
    step(sched)
    sched.requests["b"].deadline = 0.0
    sched._deadlines.push(sched.requests["b"])
    out, _ = step(sched)
    (b,) = sched.pop_timed_out_requests()
    assert b.req_id == "b" and b.status == RequestStatus.FINISHED_TIMEOUT
    assert "b" in out.finished_req_ids and sched.num_swapped_blocks == 0


def test_swapped_requests_go_before_waiting_ones(two_requests, make_request, step):
    sched = two_requests(num_swap_blocks=9, enable_prefix_caching=False)
    sched.add_request(make_request("c", 5, max_tokens=1))
    out, _ = step(sched)  # b swapped out; nobody admitted in a step that had to preempt
    assert out.preempted_req_ids == {"b"} and out.scheduled_new_reqs == []
    out, _ = step(sched)
    # a finished: b comes back first (3 blocks); c (2 blocks) does not fit the last one.
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert [r.req_id for r in sched.waiting] == ["c"]


def test_priority_policy_orders_swapped_against_waiting(make_scheduler, make_request, step):
    sched = make_scheduler(num_blocks=5, block_size=4, policy="priority",
                           preemption_mode="swap", num_swap_blocks=9,
                           enable_prefix_caching=False)
    sched.add_request(make_request("a", 7, max_tokens=3, priority=1, arrival_time=0))
    sched.add_request(make_request("b", B_PROMPT, max_tokens=4, priority=2, arrival_time=1))
    step(sched)
    step(sched)
    # A better waiting request preempts b (swapped) and is admitted in its place.
    sched.add_request(make_request("c", 3, max_tokens=1, priority=0, arrival_time=2))
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"} and out.blocks_to_swap_out == [(3, 1), (4, 2)]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c"]
    # a and c finished: a new waiting request of priority 1 goes before b (priority 2).
    sched.add_request(make_request("d", 3, max_tokens=1, priority=1, arrival_time=3))
    out, _ = step(sched)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["d", "b"]
    # Freed c's 3, then a's 4, 2, 1: d takes 3, b's host blocks 1, 2 land in 4, 2.
    assert out.blocks_to_swap_in == [(1, 4), (2, 2)]
    for _ in range(4):
        step(sched)
    assert sched.requests == {} and sched.num_swaps_in == 1


def test_preemption_mode_is_validated():
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8,
                        preemption_mode="offload")
