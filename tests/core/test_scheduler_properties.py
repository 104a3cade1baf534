"""Property test: random add / step / abort sequences keep the DESIGN.md §2 invariants.

Both scheduling policies and both preemption modes run, with random priorities and
deadlines on a fake clock that advances one unit per step, with and without KV cache
groups of sliding-window layers (core/kv_groups.py), which give back the blocks their
window left behind. Under swap preemption the
invariants hold on the host block pool too, whose size is drawn small enough that some
preemptions fall back to recompute.

A fake runner mirrors what the real one must do with the contracts: it keeps its own
copy of each request (tokens, block_ids, num_computed_tokens) built only from
`SchedulerOutput`, "writes" K/V into a slot -> context map through the block table and
checks every token it attends to (in a window group: the keys its window sees) was
written for the same context, in every group. Swaps copy those
slot contexts between the device map and a host one, swap-outs first; the prefix
cache's host tier (core/kv_offload.py) loads whole blocks from a third map before the
step and saves them after it. So a wrong prefix hit, a block handed to two requests, a
bad preemption, a wrong swap pair or a tier slot that holds another block shows up as a
wrong read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import given, settings, target
from hypothesis import strategies as st

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request_queue import priority_key
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_groups import cdiv, num_skipped_blocks
from pagedllm.core.kv_offload import HostKVStore
from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import InvalidRequestError
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

MAX_MODEL_LEN = 24
EOS = 3
MAX_STEPS = 3000


def fake_next_token(token_ids: list[int]) -> int:
    """Deterministic 'greedy model': depends on the whole context (EOS now and then)."""
    return (sum(token_ids) * 7 + len(token_ids)) % 10


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    # Per KV cache group.
    block_ids: list[list[int]]
    num_computed_tokens: int


@dataclass
class FakeRunner:
    block_size: int
    group_windows: tuple[int | None, ...] = (None,)
    requests: dict[str, _RunnerRequest] = field(default_factory=dict)
    # slot -> the context (token ids up to and including that position) whose K/V it holds
    kv: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # The same for host slots (swap preemption).
    host_kv: dict[int, tuple[int, ...] | None] = field(default_factory=dict)
    # The same for the prefix cache's host tier (core/kv_offload.py), by tier slot.
    tier_kv: dict[int, tuple[int, ...] | None] = field(default_factory=dict)

    def tier_copy(self, src: dict, dst: dict, pairs: list[tuple[int, int]]) -> None:
        """Whole blocks between the device map and the tier's (its slot 0 is a slot)."""
        for src_id, dst_id in pairs:
            for offset in range(self.block_size):
                dst[dst_id * self.block_size + offset] = src.get(
                    src_id * self.block_size + offset)

    def slot(self, state: _RunnerRequest, pos: int, group: int) -> int:
        block_id = state.block_ids[group][pos // self.block_size]
        assert block_id != 0, "the null block must never hold K/V"
        return block_id * self.block_size + pos % self.block_size

    def swap(self, src: dict, dst: dict, pairs: list[tuple[int, int]]) -> None:
        for src_block, dst_block in pairs:
            assert src_block != 0 and dst_block != 0, "the null block is never swapped"
            for offset in range(self.block_size):
                dst[dst_block * self.block_size + offset] = src.get(
                    src_block * self.block_size + offset)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # Before the forward pass: all swap-outs, then all swap-ins.
        self.swap(self.kv, self.host_kv, out.blocks_to_swap_out)
        self.swap(self.host_kv, self.kv, out.blocks_to_swap_in)
        # Then the tier's loads, into fresh blocks.
        assert all(block != 0 for _, block in out.kv_blocks_to_load)
        self.tier_copy(self.tier_kv, self.kv, out.kv_blocks_to_load)
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.requests
            self.requests[new.req_id] = _RunnerRequest(
                new.prompt_token_ids + new.output_token_ids,
                [list(ids) for ids in new.block_ids], new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            assert cached.num_computed_tokens == state.num_computed_tokens
            for ids, new_ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                ids.extend(new_ids)
        for state in self.requests.values():
            # What the model runner does: the blocks out of the window are null.
            for ids, window in zip(state.block_ids, self.group_windows, strict=True):
                skip = num_skipped_blocks(state.num_computed_tokens, window, self.block_size)
                ids[:skip] = [0] * min(skip, len(ids))
        req_ids = [r.req_id for r in out.scheduled_new_reqs + out.scheduled_cached_reqs]
        assert sorted(req_ids) == sorted(out.num_scheduled_tokens)
        # Every layer writes this step's K/V for all requests before any attention reads.
        starts = {}
        for req_id in req_ids:
            state = self.requests[req_id]
            starts[req_id] = start = state.num_computed_tokens
            end = start + out.num_scheduled_tokens[req_id]
            assert end <= len(state.token_ids)
            for group in range(len(self.group_windows)):
                for pos in range(start, end):
                    self.kv[self.slot(state, pos, group)] = tuple(state.token_ids[:pos + 1])
            state.num_computed_tokens = end
        sampled: list[list[int]] = []
        for req_id in req_ids:
            state = self.requests[req_id]
            for group, window in enumerate(self.group_windows):
                # The keys some query of this step sees: (start - window, end).
                first = 0 if window is None else max(0, starts[req_id] - window + 1)
                for pos in range(first, state.num_computed_tokens):
                    assert self.kv.get(self.slot(state, pos, group)) == \
                        tuple(state.token_ids[:pos + 1])
        # After the forward pass, the tier's saves: whole blocks, every position of
        # them computed (a block's position p holds a context of p + 1 tokens), one slot
        # each.
        saved_slots = [slot for _, slot in out.kv_blocks_to_save]
        assert len(set(saved_slots)) == len(saved_slots)
        for block, _ in out.kv_blocks_to_save:
            contexts = [self.kv.get(block * self.block_size + o)
                        for o in range(self.block_size)]
            assert all(c is not None for c in contexts)
            assert [len(c) for c in contexts] == list(range(
                len(contexts[0]), len(contexts[0]) + self.block_size))
            assert len(contexts[0]) % self.block_size == 1 % self.block_size
        self.tier_copy(self.kv, self.tier_kv, out.kv_blocks_to_save)
        for req_id in req_ids:
            state = self.requests[req_id]
            if state.num_computed_tokens == len(state.token_ids):
                token = fake_next_token(state.token_ids)
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])  # partial prefill
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def check_pool(pool: BlockPool,
               req_to_blocks: dict[str, list[list[KVCacheBlock | None]]]) -> None:
    """DESIGN.md §2 block invariants of one pool (device or host), whose requests hold
    blocks per KV cache group (null entries, or None on the host, held by nobody)."""
    holdings = Counter(b.block_id for groups in req_to_blocks.values()
                       for blocks in groups for b in blocks
                       if b is not None and not b.is_null)
    assert sum(b.ref_cnt for b in pool.blocks) == sum(holdings.values())
    assert all(b.ref_cnt == holdings[b.block_id] for b in pool.blocks)
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert set(free_ids) == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    assert 0 not in free_ids and 0 not in holdings and pool.blocks[0].ref_cnt == 0
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in pool.blocks) == len(
        pool.cached_block_hash_to_block)


def check_invariants(sched: Scheduler) -> None:
    """DESIGN.md §2 invariants on both pools plus the scheduler's own bookkeeping."""
    kv = sched.kv_cache_manager
    assert set(kv.req_to_blocks) == {r.req_id for r in sched.running}
    check_pool(kv.block_pool, kv.req_to_blocks)
    swapped = list(sched.swapped)
    if sched.swap_space is None:
        assert not swapped
    else:
        host = sched.swap_space
        assert set(host.req_to_host_blocks) == {r.req_id for r in swapped}
        check_pool(host.host_pool, host.req_to_host_blocks)
        assert not host.host_pool.cached_block_hash_to_block
        # A swapped request keeps num_computed_tokens: one host entry per computed
        # block, per group.
        for r in swapped:
            assert [len(g) for g in host.req_to_host_blocks[r.req_id]] == [
                kv.num_blocks_needed(r.num_computed_tokens)] * kv.num_groups
            assert kv.num_blocks_needed(r.num_computed_tokens) > 0
    # A window group holds the window's blocks and this step's (<= budget tokens).
    for r in sched.running:
        for window, blocks in zip(kv.group_windows, kv.req_to_blocks[r.req_id]):
            if window is not None:
                bound = cdiv(window - 1 + sched.max_num_batched_tokens, kv.block_size) + 1
                assert sum(not b.is_null for b in blocks) <= bound
    assert all(r.status == RequestStatus.SWAPPED for r in swapped)
    assert len(sched.running) <= sched.max_num_seqs
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
               for r in sched.waiting)
    assert len(sched.requests) == len(sched.running) + len(sched.waiting) + len(swapped)
    if sched.policy == "priority":
        # Sorted queues: admission and "preempt the last" follow (priority, arrival).
        for queue in (list(sched.waiting), sched.running, swapped):
            keys = [priority_key(r) for r in queue]
            assert keys == sorted(keys)


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def do_step(sched: Scheduler, runner: FakeRunner, clock: FakeClock) -> None:
    clock.now += 1.0
    swapped_before = {r.req_id: r.num_computed_tokens for r in sched.swapped}
    out = sched.schedule()
    # Every request whose deadline has come is finished, with its id sent to the runner.
    for request in sched.pop_timed_out_requests():
        assert request.status == RequestStatus.FINISHED_TIMEOUT
        assert request.deadline <= clock.now and request.req_id in out.finished_req_ids
    assert all(r.deadline is None or r.deadline > clock.now for r in sched.requests.values())
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= sched.max_num_seqs
    assert all(n > 0 for n in out.num_scheduled_tokens.values())
    # A swap-in resumes where the request was: nothing it computed is recomputed, and
    # at most its blocks are copied back.
    swapped_in = [new for new in out.scheduled_new_reqs if new.req_id in swapped_before]
    for new in swapped_in:
        assert new.num_computed_tokens == swapped_before[new.req_id] > 0
    assert len(out.blocks_to_swap_in) <= sum(len(ids) for new in swapped_in
                                             for ids in new.block_ids)
    assert bool(out.blocks_to_swap_out) <= bool(out.preempted_req_ids)
    sched.update_from_output(out, runner.execute(out))
    for request in sched.running:
        assert runner.requests[request.req_id].token_ids[:request.num_tokens] == \
            request.all_token_ids
    check_invariants(sched)


# Prompts share prefixes of a fixed base sequence so prefix-cache hits are common.
_BASE = [1, 2, 0, 1, 1, 2, 2, 0, 1, 0, 2, 1, 0, 0, 2, 1]
_PROMPTS = st.builds(lambda k, suffix: _BASE[:k] + suffix, st.integers(0, 10),
                     st.lists(st.integers(0, 2), max_size=4)).filter(bool)
# (add, prompt, max_tokens, priority, deadline in steps from now or None)
_ADD = st.tuples(st.just("add"), _PROMPTS, st.integers(4, 12), st.integers(0, 3),
                 st.one_of(st.none(), st.none(), st.integers(0, 30)))
_STEP = st.tuples(st.just("step"))
_ABORT = st.tuples(st.just("abort"), st.integers(0, 50))
# KV cache groups: none (one full-attention group, most draws), a window in every
# layer (Mistral), full + window layers (Gemma 2), full + two window groups (Gemma 3).
_WINDOW = st.integers(1, 9)
_GROUP_WINDOWS = st.one_of(
    st.just((None,)), st.just((None,)), st.tuples(_WINDOW),
    st.tuples(st.none(), _WINDOW), _WINDOW.map(lambda w: (None, w, w)))
# Weights: add 3, step 4, abort 1.
_OPS = st.one_of(_ADD, _ADD, _ADD, _STEP, _STEP, _STEP, _STEP, _ABORT)


@st.composite
def scenarios(draw: st.DrawFn, preemption_mode: str = "recompute",
              host_tier: bool = False) -> dict:
    chunked = draw(st.booleans())
    block_size = draw(st.sampled_from([1, 2, 4]))
    # 8..32 usable slots: a few requests fit, growing ones run out (preemption).
    num_slots = draw(st.integers(8, 32))
    num_blocks = 1 + -(-num_slots // block_size)
    # Host pools from none (< 2 blocks) through too small for some requests (recompute
    # fallback) to twice the device pool.
    num_swap_blocks = draw(st.integers(0, 2 * num_blocks)) if preemption_mode == "swap" else 0
    return dict(
        block_size=block_size,
        num_blocks=num_blocks,
        preemption_mode=preemption_mode,
        num_swap_blocks=num_swap_blocks,
        # The host tier: from one slot (recycled every save) to twice the device pool;
        # it needs prefix caching and one KV cache group.
        tier_slots=draw(st.integers(1, 2 * num_blocks)) if host_tier else 0,
        enable_prefix_caching=host_tier or draw(st.booleans()),
        group_windows=(None,) if host_tier else draw(_GROUP_WINDOWS),
        enable_chunked_prefill=chunked,
        budget=draw(st.integers(1, 12)) if chunked else MAX_MODEL_LEN,
        max_num_seqs=draw(st.integers(1, 6)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        ops=draw(st.lists(_OPS, min_size=16, max_size=60)),
    )


@settings(max_examples=80, deadline=None)
@given(scenario=scenarios())
def test_random_operations_keep_invariants(scenario: dict) -> None:
    run_scenario(scenario)


@settings(max_examples=80, deadline=None)
@given(scenario=scenarios(preemption_mode="swap"))
def test_random_operations_keep_invariants_with_swap(scenario: dict) -> None:
    sched = run_scenario(scenario)
    target(float(sched.num_swaps_out), label="swaps")
    # Every swap-out came back or was dropped by an abort / deadline.
    assert sched.num_swaps_in <= sched.num_swaps_out
    assert sched.num_swapped == sched.num_swapped_blocks == 0


@settings(max_examples=80, deadline=None)
@given(scenario=scenarios(host_tier=True))
def test_random_operations_keep_invariants_with_a_host_tier(scenario: dict) -> None:
    sched = run_scenario(scenario)
    target(float(sched.kv_store.hits), label="tier hits")
    # Every slot is either free or holds one block.
    tier = sched.kv_store
    assert sorted([*tier.slots.values(), *tier.free]) == list(range(tier.num_slots))


def run_scenario(scenario: dict) -> Scheduler:
    """Play the ops, then step until every request finished; check as it goes."""
    block_size, num_blocks = scenario["block_size"], scenario["num_blocks"]
    clock = FakeClock()
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=scenario["max_num_seqs"],
                        max_num_batched_tokens=scenario["budget"],
                        max_model_len=MAX_MODEL_LEN,
                        enable_chunked_prefill=scenario["enable_chunked_prefill"],
                        policy=scenario["policy"],
                        preemption_mode=scenario["preemption_mode"]),
        CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                    enable_prefix_caching=scenario["enable_prefix_caching"]),
        num_blocks, num_swap_blocks=scenario["num_swap_blocks"], clock=clock,
        group_windows=scenario["group_windows"])
    if scenario.get("tier_slots"):
        sched.kv_store = HostKVStore(scenario["tier_slots"], block_size)
    runner = FakeRunner(block_size, scenario["group_windows"])
    added: list[Request] = []
    for op in scenario["ops"]:
        if op[0] == "add":
            _, prompt_ids, max_tokens, priority, timeout = op
            deadline = None if timeout is None else clock.now + timeout
            request = Request(f"r{len(added)}", prompt_ids,
                              SamplingParams(max_tokens=max_tokens), eos_token_id=EOS,
                              arrival_time=clock.now, priority=priority, deadline=deadline)
            num_groups = len(scenario["group_windows"])
            fits = num_groups * -(-len(prompt_ids) // block_size) <= num_blocks - 1
            try:
                sched.add_request(request)
                assert fits
                added.append(request)
            except InvalidRequestError:
                assert not fits
        elif op[0] == "step":
            do_step(sched, runner, clock)
        elif added:
            req_id = added[op[1] % len(added)].req_id
            sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            check_invariants(sched)

    for _ in range(MAX_STEPS):
        if not sched.has_unfinished_requests():
            break
        do_step(sched, runner, clock)
    # Steer generation towards the interesting schedules.
    target(float(sched.num_preemptions), label="preemptions")
    assert not sched.has_unfinished_requests()
    assert all(r.is_finished for r in added)
    assert sched.kv_cache_manager.get_num_free_blocks() == num_blocks - 1
    if sched.swap_space is not None:
        host_pool = sched.swap_space.host_pool
        assert host_pool.get_num_free_blocks() == host_pool.num_blocks - 1
    for request in added:
        if request.status != RequestStatus.FINISHED_ABORTED:
            _check_greedy_output(request)
    return sched


def _check_greedy_output(request: Request) -> None:
    """Outputs are what the fake model gives for each context, whatever the batching."""
    prompt_len = request.num_prompt_tokens
    for i, token in enumerate(request.output_token_ids):
        assert token == fake_next_token(request.all_token_ids[:prompt_len + i])
    assert request.status.finish_reason in ("stop", "length", "timeout")
