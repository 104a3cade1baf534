"""The cost budget of prefill chunks (SchedulerConfig.attention_pairs_per_token): a
chunk also pays for its attention over the tokens before it, so deep into a long prompt
the chunks shrink and no step costs much more than the first. And the cap on one
prompt's chunk (long_prefill_token_threshold), which leaves the rest of the budget to
the requests behind a long prompt."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from pagedllm.core.step_state import StepState
from pagedllm.engine.arg_utils import _attention_pairs_per_token, _prompt_logprob_cost

BUDGET, PAIRS = 64, 32
POOL = dict(num_blocks=400, block_size=4, max_model_len=1500, max_num_batched_tokens=BUDGET)


def cost(num_computed: int, n: int) -> float:
    return n * (1 + (num_computed + n / 2) / PAIRS)


def prefill_chunks(sched, req_id: str, step) -> list[tuple[int, int]]:
    """(tokens computed before, chunk) of each step until req_id's prompt is done."""
    chunks = []
    while True:
        request = sched.requests[req_id]
        before = request.num_computed_tokens
        if before >= request.num_prompt_tokens:
            return chunks
        output, _ = step(sched)
        chunks.append((before, output.num_scheduled_tokens[req_id]))


def test_long_prompt_chunks_shrink_to_the_cost_of_a_fresh_chunk(
        make_scheduler, make_request, step) -> None:
    sched = make_scheduler(attention_pairs_per_token=PAIRS, **POOL)
    sched.add_request(make_request("long", 1000, max_tokens=2))
    chunks = prefill_chunks(sched, "long", step)
    assert sum(n for _, n in chunks) == 1000
    assert chunks[0] == (0, BUDGET)  # a fresh prompt: the whole token budget
    limit = cost(0, BUDGET)
    for before, n in chunks:
        # Each chunk is the largest within the cost budget (or what is left).
        assert cost(before, n) <= limit
        assert before + n == 1000 or cost(before, n + 1) > limit
    sizes = [n for _, n in chunks]
    assert sizes == sorted(sizes, reverse=True) and sizes[-2] < BUDGET // 4
    # Counting tokens only, the same prompt goes in full-budget chunks.
    plain = make_scheduler(**POOL)
    plain.add_request(make_request("long", 1000, max_tokens=2))
    assert {n for _, n in prefill_chunks(plain, "long", step)[:-1]} == {BUDGET}


def test_decodes_are_not_cut_and_chunks_share_the_budget(
        make_scheduler, make_request, step) -> None:
    sched = make_scheduler(attention_pairs_per_token=PAIRS, **POOL)
    sched.add_request(make_request("dec", 300, max_tokens=200))
    while sched.requests["dec"].num_output_tokens == 0:
        step(sched)
    # Distinct token ids: no prefix-cache hits.
    sched.add_request(make_request("long", list(range(5000, 5600)), max_tokens=2))
    output, _ = step(sched)
    # The decode at 300 tokens keeps its token, the fresh prompt the rest of the budget.
    assert output.num_scheduled_tokens == {"dec": 1, "long": BUDGET - 1}
    while sched.requests["long"].num_computed_tokens < 300:
        step(sched)
    sched.add_request(make_request("short", list(range(7000, 7040)), max_tokens=2))
    p_long = sched.requests["long"].num_computed_tokens
    output, _ = step(sched)
    n_long, n_short = (output.num_scheduled_tokens[r] for r in ("long", "short"))
    # "long" (running, first) takes the largest chunk within the cost budget; "short"
    # what cost is left, at least one token.
    assert cost(p_long, n_long) <= cost(0, BUDGET) < cost(p_long, n_long + 1)
    left = cost(0, BUDGET) - cost(p_long, n_long)
    assert n_short == max((n for n in range(1, 41) if cost(0, n) <= left), default=1)
    assert output.num_scheduled_tokens["dec"] == 1
    limit = cost(0, BUDGET)
    while sched.requests.get("long") and sched.requests["long"].num_output_tokens == 0:
        before = {r.req_id: r.num_computed_tokens for r in sched.running}
        output, _ = step(sched)
        assert output.num_scheduled_tokens["dec"] == 1
        chunks = {r: n for r, n in output.num_scheduled_tokens.items() if n > 1}
        # The chunks together stay within the budget (a chunk cut to its one-token
        # minimum is not counted against it).
        assert sum(cost(before[r], n) for r, n in chunks.items()) <= limit
        assert chunks, "a prompt still being prefilled always gets a chunk"


def test_prompts_that_must_fit_one_step_are_not_cut(make_scheduler, make_request,
                                                    step) -> None:
    sched = make_scheduler(attention_pairs_per_token=PAIRS, enable_chunked_prefill=False,
                           **POOL | dict(max_num_batched_tokens=1500))
    sched.add_request(make_request("whole", 1000, max_tokens=2))
    output, _ = step(sched)
    assert output.num_scheduled_tokens == {"whole": 1000}


def test_cap_chunk_solves_the_cost_exactly() -> None:
    step = StepState(token_budget=2048, max_num_tokens=10 ** 6, enable_chunked_prefill=True,
                     attention_pairs_per_token=3456)
    request = SimpleNamespace(is_pooling=False,
                              sampling_params=SimpleNamespace(prompt_logprobs=None))
    assert step.cap_chunk(request, 0, 2048) == 2048
    for before in (100, 2000, 7500, 30000):
        n = step.cap_chunk(request, before, 2048)
        assert step.chunk_cost(before, n) <= step.cost_left < step.chunk_cost(before, n + 1)
    assert step.cap_chunk(request, 7500, 1) == 1  # a decode
    step.cost_left = 0
    assert step.cap_chunk(request, 7500, 500) == 1  # nothing left: one token still
    assert math.isinf(StepState(64, 100, True).cost_left)  # counting tokens only


@pytest.mark.parametrize("cfg, pairs", [
    (dict(hidden_size=576, intermediate_size=1536), 2 * 576 + 1536 * 3 // 2),  # SmolLM2
    (dict(n_embd=768), 2 * 768 + 6 * 768),  # GPT-2: 4h MLP
    (dict(hidden_size=4096, intermediate_size=14336, num_experts_per_tok=2),
     2 * 4096 + 3 * 14336),  # Mixtral: two experts per token
])
def test_pairs_per_token_from_the_model_config(cfg, pairs) -> None:
    assert _attention_pairs_per_token(SimpleNamespace(**cfg)) == pairs
    # Native GGUF weights: linear layers ~3x faster than attention on CPU.
    assert _attention_pairs_per_token(SimpleNamespace(**cfg), True) == pairs // 3


def test_engine_sets_the_ratio() -> None:
    from pagedllm import EngineArgs

    # The bundled SmolLM2 (hidden 576, intermediate 1536), native Q4_1 where it runs.
    config = EngineArgs().create_engine_config()
    pairs = 2 * 576 + 1536 * 3 // 2
    expected = pairs // 3 if config.model.quantization == "gguf" else pairs
    assert config.scheduler.attention_pairs_per_token == expected
    dequantized = EngineArgs(quantization="none").create_engine_config()
    assert dequantized.scheduler.attention_pairs_per_token == pairs


def test_prompt_logprobs_chunks_pay_for_their_scoring() -> None:
    step = StepState(token_budget=2048, max_num_tokens=10 ** 6, enable_chunked_prefill=True,
                     attention_pairs_per_token=1152, prompt_logprob_cost=0.7)
    plain = SimpleNamespace(is_pooling=False,
                            sampling_params=SimpleNamespace(prompt_logprobs=None))
    scored = SimpleNamespace(is_pooling=False,
                             sampling_params=SimpleNamespace(prompt_logprobs=0))
    for before in (0, 2000, 7500):
        n = step.cap_chunk(scored, before, 2048)
        assert (step.chunk_cost(before, n, scored=True) <= step.cost_left
                < step.chunk_cost(before, n + 1, scored=True))
        assert n < step.cap_chunk(plain, before, 2048)
    # A scored chunk uses up more of the step: what is left after it is what is left
    # after the plain chunk of the same cost.
    n = step.cap_chunk(scored, 0, 2048)
    left = step.cost_left
    step.add(SimpleNamespace(req_id="s", num_computed_tokens=0, is_pooling=False,
                             sampling_params=scored.sampling_params), n)
    assert step.cost_left == pytest.approx(left - n * (1.7 + n / 2 / 1152))
    # An embedding request scores nothing (its params are a placeholder).
    pooling = SimpleNamespace(is_pooling=True, sampling_params=scored.sampling_params)
    assert step.cap_chunk(pooling, 0, 100) == 100


@pytest.mark.parametrize("cfg, native, expected", [
    # SmolLM2: 49,152 / (30 (4 * 576 + 3 * 1536)); 3x with its GGUF blocks.
    (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152),
     False, 49152 / (30 * 6912)),
    (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152),
     True, 3 * 49152 / (30 * 6912)),
    (dict(n_embd=768, n_layer=12, vocab_size=50257), False, 50257 / (12 * 16 * 768)),  # 4h MLP
    (dict(hidden_size=64), False, 0.0),  # no vocabulary or layers known: not counted
])
def test_prompt_logprob_cost_from_the_model_config(cfg, native, expected) -> None:
    assert _prompt_logprob_cost(SimpleNamespace(**cfg), native) == pytest.approx(expected)


def test_a_long_prompt_leaves_room_to_the_requests_behind_it(
        make_scheduler, make_request, step) -> None:
    """Capped at 16 tokens a step while others are live, a 1000-token prompt leaves 48
    of the 64 to a short request that arrives while it is prefilled: its first token
    comes in the step it arrives, not after the whole long prompt. Alone it takes the
    whole budget; decodes are not cut."""
    def first_token_step(threshold: int) -> int:
        sched = make_scheduler(long_prefill_token_threshold=threshold, **POOL)
        sched.add_request(make_request("long", 1000, max_tokens=2))
        output, _ = step(sched)
        assert output.num_scheduled_tokens["long"] == BUDGET  # alone: not cut
        sched.add_request(make_request("short", 20, max_tokens=4))
        for i in range(1, 100):
            output, _ = step(sched)
            if "long" in output.num_scheduled_tokens:
                assert output.num_scheduled_tokens["long"] <= (threshold or BUDGET)
            if sched.requests["short"].num_output_tokens:
                return i
        raise AssertionError("no first token")

    assert first_token_step(16) == 1
    assert first_token_step(0) == 1000 // BUDGET
    # A decode beside a capped prefill takes its one token.
    sched = make_scheduler(long_prefill_token_threshold=8, **POOL)
    sched.add_request(make_request("dec", 6, max_tokens=50))
    step(sched)
    sched.add_request(make_request("long", 200, max_tokens=2))
    output, _ = step(sched)
    assert output.num_scheduled_tokens == {"dec": 1, "long": 8}
