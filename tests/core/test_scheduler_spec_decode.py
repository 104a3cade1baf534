"""Scheduler side of speculative decoding: proposals scheduled after a decoding
request's last token (capped), rejected tokens' K/V taken back, drafts never cached,
lookahead slots reserved."""

from __future__ import annotations

from pagedllm.core.contracts import ModelRunnerOutput


def _decode_ready(sched, make_request, step, name="a", prompt_len=6, **kw):
    """A request whose prompt is computed and whose first token was sampled."""
    request = make_request(name, list(range(100, 100 + prompt_len)), **kw)
    sched.add_request(request)
    step(sched, lambda r: 7)
    assert request.num_tokens == prompt_len + 1
    assert request.num_computed_tokens == prompt_len
    return request


def test_proposals_are_verified_and_rejections_rolled_back(make_scheduler, make_request,
                                                           step):
    sched = make_scheduler()
    request = _decode_ready(sched, make_request, step)
    request.spec_token_ids = [8, 9, 10]
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"a": 4}
    assert output.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    assert request.spec_token_ids == []  # consumed
    assert request.num_computed_tokens == 6 + 4
    # Slots for positions 6..9: blocks 0-2 of size 4 (the pool hands out 1, 2, 3).
    assert sched.kv_cache_manager.get_block_ids("a") == [[1, 2, 3]]
    # 8 accepted, 9 rejected: the runner emits 8 and its own token 11.
    runner = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[8, 11]],
                               spec_token_ids={"a": [12, 13]})
    sched.update_from_output(output, runner)
    assert request.output_token_ids == [7, 8, 11]
    # K/V of positions 0..7 (prompt, 7, 8) stands; 11 is fed next step.
    assert request.num_computed_tokens == request.num_tokens - 1 == 8
    assert request.spec_token_ids == [12, 13]
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (3, 1)
    # Only blocks whose tokens are all the sequence's are cached: 0..7 -> blocks 1, 2.
    assert sched.kv_cache_manager.num_cached_blocks["a"] == 1
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"a": 3}
    assert sched.kv_cache_manager.num_cached_blocks["a"] == 2


def test_proposals_are_capped(make_scheduler, make_request, step):
    # max_tokens: 3 outputs allowed, 1 emitted -> at most 1 proposal (2 more tokens).
    sched = make_scheduler()
    request = _decode_ready(sched, make_request, step, max_tokens=3)
    request.spec_token_ids = [8, 9, 10]
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [8]}
    # The token budget: 2 tokens per step -> 1 proposal.
    sched = make_scheduler(max_num_batched_tokens=6)
    request = _decode_ready(sched, make_request, step)
    sched.max_num_batched_tokens = 2
    request.spec_token_ids = [8, 9, 10]
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [8]}
    # The longest sequence (max_model_len 10): 7 tokens now, emits up to 3 more.
    sched = make_scheduler(max_model_len=10)
    request = _decode_ready(sched, make_request, step, max_tokens=None)
    request.spec_token_ids = [8, 9, 10, 11]
    assert sched.schedule().scheduled_spec_decode_tokens == {"a": [8, 9]}


def test_no_proposals_while_prefilling_or_after_preemption(make_scheduler, make_request,
                                                          step):
    sched = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", 10)
    sched.add_request(request)
    step(sched)
    request.spec_token_ids = [1, 2]  # mid-prefill: ignored
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"a": 4}
    assert output.scheduled_spec_decode_tokens == {}
    # Preemption drops them.
    sched = make_scheduler(num_blocks=4)  # 3 usable blocks of 4 tokens
    a = _decode_ready(sched, make_request, step, "a", prompt_len=5)
    b = _decode_ready(sched, make_request, step, "b", prompt_len=3)
    b.spec_token_ids = [1, 2]
    a.spec_token_ids = [3, 4, 5, 6]  # a needs a third block: b is preempted
    output = sched.schedule()
    assert output.preempted_req_ids == {"b"}
    assert b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert output.scheduled_spec_decode_tokens == {"a": [3, 4, 5, 6]}


def test_lookahead_slots_are_reserved_but_not_cached(make_scheduler, make_request, step):
    sched = make_scheduler()
    sched.num_lookahead_tokens = 3
    request = make_request("a", 8)
    sched.add_request(request)
    sched.schedule()
    # 8 prompt tokens + 3 lookahead slots: 3 blocks; only the 2 full prompt blocks cached.
    assert sched.kv_cache_manager.get_block_ids("a") == [[1, 2, 3]]
    assert sched.kv_cache_manager.num_cached_blocks["a"] == 2
    # A partial prefill does not sample: no lookahead.
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.num_lookahead_tokens = 3
    sched.add_request(make_request("b", 8))
    sched.schedule()
    assert sched.kv_cache_manager.get_block_ids("b") == [[1]]
