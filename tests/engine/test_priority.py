"""Scheduling policies and deadlines through the engine, on a tiny random Llama (float32):
finish order under fcfs | priority, greedy tokens unchanged by priority preemption,
timeouts, and the priority / timeout arguments' validation."""

from __future__ import annotations

import math
import time

import pytest

from pagedllm import LLM, EngineArgs, InvalidRequestError, LLMEngine, SamplingParams
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.request import Request
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256
NUM_KV_BLOCKS = 128


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_priority"),
                           tiny_llama_config(vocab_size=VOCAB), seed=3)


def make_engine(tiny_path, policy: str = "fcfs", max_num_seqs: int = 2,
                async_scheduling: bool = False) -> LLMEngine:
    args = EngineArgs(model=str(tiny_path), dtype="float32", block_size=4,
                      num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=max_num_seqs,
                      scheduling_policy=policy, async_scheduling=async_scheduling)
    return LLMEngine.from_engine_args(args, skip_tokenizer_init=True)


def num_free_blocks(engine: LLMEngine) -> int:
    return engine.engine_core.scheduler.kv_cache_manager.get_num_free_blocks()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(9, VOCAB, 5, 12, seed=31)


@pytest.fixture(scope="module")
def alone_tokens(tiny_path, prompts):
    """Greedy tokens of each request run alone (8 low ones: 40 tokens, the last: 5)."""
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
              num_kv_blocks=NUM_KV_BLOCKS)
    return [llm.generate([{"prompt_token_ids": p}], greedy(40 if i < 8 else 5),
                         use_tqdm=False)[0].outputs[0].token_ids
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_high_priority_request_finishes_first(tiny_path, prompts, alone_tokens, policy,
                                              async_scheduling):
    # Async scheduling: the running requests are in flight whenever a step is scheduled,
    # so the high request's preemption waits for a step with nothing in flight, which
    # the scheduler asks for (can_overlap).
    engine = make_engine(tiny_path, policy, async_scheduling=async_scheduling)
    priority = 1 if policy == "priority" else 0
    for i, p in enumerate(prompts[:8]):
        engine.add_request(f"low{i}", {"prompt_token_ids": p}, greedy(40), priority=priority)
    finished = []
    for _ in range(2):  # two low requests are running (max_num_seqs=2)
        finished += [o for o in engine.step() if o.finished]
    engine.add_request("high", {"prompt_token_ids": prompts[8]}, greedy(5), priority=0)
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    order = [o.request_id for o in finished]
    assert sorted(order) == sorted([f"low{i}" for i in range(8)] + ["high"])
    sched = engine.engine_core.scheduler
    if policy == "priority":
        # It preempted the later of the two running low requests and ran at once.
        assert order[0] == "high" and sched.num_preemptions == 1
    else:
        assert order[-1] == "high" and sched.num_preemptions == 0
    tokens = {o.request_id: o.outputs[0].token_ids for o in finished}
    assert [tokens[f"low{i}"] for i in range(8)] + [tokens["high"]] == alone_tokens
    assert all(o.outputs[0].finish_reason == "length" for o in finished)
    assert num_free_blocks(engine) == NUM_KV_BLOCKS - 1


def test_timeout_on_a_busy_engine(tiny_path, prompts, alone_tokens, monkeypatch):
    engine = make_engine(tiny_path)
    sched = engine.engine_core.scheduler
    # The scheduler's clock runs `offset` seconds ahead: deadlines pass on demand.
    offset = [0.0]
    monkeypatch.setattr(sched, "clock", lambda: time.monotonic() + offset[0])
    engine.add_request("long", {"prompt_token_ids": prompts[0]}, greedy(40))
    engine.add_request("running", {"prompt_token_ids": prompts[1]}, greedy(40), timeout=200)
    engine.add_request("waiting", {"prompt_token_ids": prompts[2]}, greedy(40), timeout=100)
    for _ in range(3):
        assert engine.step()
    assert sched.num_running == 2 and sched.num_waiting == 1
    offset[0] = 150.0
    (out,) = [o for o in engine.step() if o.request_id == "waiting"]
    assert out.finished and out.outputs[0].finish_reason == "timeout"
    assert out.outputs[0].token_ids == []
    for _ in range(3):
        engine.step()
    offset[0] = 250.0
    (out,) = [o for o in engine.step() if o.request_id == "running"]
    assert out.finished and out.outputs[0].finish_reason == "timeout"
    # The tokens it got before its deadline are the greedy ones.
    assert out.outputs[0].token_ids == alone_tokens[1][:7]
    assert sched.num_running == 1
    last = []
    while engine.has_unfinished_requests():
        last += engine.step()
    assert last[-1].request_id == "long" and last[-1].outputs[0].token_ids == alone_tokens[0]
    assert num_free_blocks(engine) == NUM_KV_BLOCKS - 1


def test_all_requests_timed_out_runs_no_forward_pass(tiny_path, prompts, monkeypatch):
    engine = make_engine(tiny_path)
    runner = engine.engine_core.executor.runner
    num_forwards = [0]
    forward = runner._forward

    def counting_forward(*args, **kwargs):
        num_forwards[0] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "_forward", counting_forward)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, greedy(40), timeout=1000)
    # Arrived long ago: its deadline has passed already.
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, greedy(40),
                       arrival_time=time.monotonic() - 10.0, timeout=5.0)
    outputs = engine.step()
    assert [(o.request_id, o.finished) for o in outputs] == [("b", True), ("a", False)]
    assert outputs[0].outputs[0].finish_reason == "timeout"
    assert num_forwards[0] == 1
    offset = 2000.0
    monkeypatch.setattr(engine.engine_core.scheduler, "clock",
                        lambda: time.monotonic() + offset)
    (out,) = engine.step()
    assert out.request_id == "a" and out.outputs[0].finish_reason == "timeout"
    assert num_forwards[0] == 1  # nothing was left to run
    assert not engine.has_unfinished_requests()
    assert num_free_blocks(engine) == NUM_KV_BLOCKS - 1
    # The runner dropped the request: the id can be used again.
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    assert num_forwards[0] == 3


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, math.nan, "5", True])
def test_bad_timeout_is_rejected(tiny_path, prompts, timeout):
    engine = make_engine(tiny_path)
    with pytest.raises(InvalidRequestError, match="timeout"):
        engine.add_request("a", {"prompt_token_ids": prompts[0]}, greedy(2), timeout=timeout)
    assert not engine.has_unfinished_requests()


def test_priority_needs_the_priority_policy(tiny_path, prompts):
    engine = make_engine(tiny_path)
    with pytest.raises(InvalidRequestError,
                       match="^Got priority 3 but Priority scheduling is not enabled.$"):
        engine.add_request("a", {"prompt_token_ids": prompts[0]}, greedy(2), priority=3)
    with pytest.raises(InvalidRequestError, match="priority must be an int"):
        engine.add_request("a", {"prompt_token_ids": prompts[0]}, greedy(2), priority=1.5)
    assert not engine.has_unfinished_requests()


def test_children_inherit_priority_and_deadline():
    request = Request("r", [1, 2, 3], SamplingParams(n=3, max_tokens=4), None,
                      arrival_time=7.0, priority=2, deadline=9.5)
    children = fan_out(request)
    assert [c.req_id for c in children] == ["r_0", "r_1", "r_2"]
    assert [(c.arrival_time, c.priority, c.deadline) for c in children] == [(7.0, 2, 9.5)] * 3


def test_llm_generate_with_priority(tiny_path, prompts, alone_tokens):
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
              num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=1, scheduling_policy="priority")
    token_prompts = [{"prompt_token_ids": p} for p in prompts[:3]]
    outs = llm.generate(token_prompts, greedy(5), use_tqdm=False, priority=[2, 0, 1])
    # Outputs in input order, tokens as alone (5 tokens: a prefix of the 40-token runs).
    assert [o.outputs[0].token_ids for o in outs] == [t[:5] for t in alone_tokens[:3]]
    # One at a time (max_num_seqs=1) in priority order: finish times follow it.
    finished_time = [o.metrics["finished_time"] for o in outs]
    assert finished_time[1] < finished_time[2] < finished_time[0]
    with pytest.raises(InvalidRequestError, match=r"prompts \(3\) and priority \(2\)"):
        llm.generate(token_prompts, greedy(5), use_tqdm=False, priority=[0, 1])
    with pytest.raises(InvalidRequestError, match="priority must be an int"):
        llm.generate(token_prompts, greedy(5), use_tqdm=False, priority=[0, "1", 2])
    assert not llm.llm_engine.has_unfinished_requests()
    fcfs = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
               num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="Got priority 3 but Priority"):
        fcfs.generate(token_prompts[:2], greedy(5), use_tqdm=False, priority=[0, 3])
    assert not fcfs.llm_engine.has_unfinished_requests()
    assert fcfs.generate(token_prompts[:1], greedy(5), use_tqdm=False,
                         priority=[0])[0].outputs[0].token_ids == alone_tokens[0][:5]
