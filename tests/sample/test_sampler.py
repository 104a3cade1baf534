"""Sampler transforms against transformers' logits processors on random logits, the
per-row state gathering (penalty counts, bans, bias) and the sampling distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper)

from pagedllm.core.contracts import NewRequestData
from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.build import load_cpu_kernels
from pagedllm.sample.logprobs import gather_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops import (NUCLEUS_CANDIDATES, apply_min_p, apply_top_k_top_p,
                                 draw_top_k_top_p, draw_uniforms, inverse_cdf_draw)
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampling_state import SamplingState

VOCAB = 64
EOS = 1


def make_state(requests: list[tuple[SamplingParams, list[int], list[int]]],
               vocab: int = VOCAB) -> tuple[SamplingState, np.ndarray]:
    """A SamplingState holding `requests` (params, prompt ids, output ids) in rows
    placed out of order (rows 3, 0, 5, ...) so row != logits index is exercised."""
    max_reqs, max_len = 2 * len(requests) + 2, 64
    token_ids = np.zeros((max_reqs, max_len), dtype=np.int64)
    num_tokens = np.zeros(max_reqs, dtype=np.int64)
    num_prompt = np.zeros(max_reqs, dtype=np.int64)
    state = SamplingState(max_reqs, vocab, torch.device("cpu"), token_ids, num_tokens,
                          num_prompt)
    rows = np.array([(3 + 2 * i) % max_reqs for i in range(len(requests))])
    for row, (params, prompt, output) in zip(rows.tolist(), requests):
        token_ids[row, :len(prompt) + len(output)] = prompt + output
        num_tokens[row], num_prompt[row] = len(prompt) + len(output), len(prompt)
        state.add(row, NewRequestData(req_id=str(row), prompt_token_ids=prompt,
                                      output_token_ids=output, sampling_params=params,
                                      block_ids=[[]], num_computed_tokens=0,
                                      eos_token_id=EOS))
    return state, rows


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_repetition_penalty_matches_transformers():
    rng = np.random.default_rng(0)
    penalties = [1.0, 1.3, 0.7, 2.0]
    reqs = [(SamplingParams(repetition_penalty=p), random_ids(rng, 10), random_ids(rng, 6))
            for p in penalties]
    state, rows = make_state(reqs)
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    actual = Sampler.apply_logits_processors(logits.clone(), state.metadata(rows))
    for i, (params, prompt, output) in enumerate(reqs):
        ref = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
            torch.tensor([prompt + output]), logits[i:i + 1].clone())
        assert_same_logits(actual[i:i + 1], ref)


def test_frequency_and_presence_penalties():
    rng = np.random.default_rng(1)
    reqs = [(SamplingParams(frequency_penalty=f, presence_penalty=p), random_ids(rng, 8),
             random_ids(rng, 20)) for f, p in [(0.5, 0.0), (0.0, 1.5), (-0.4, 0.3), (0, 0)]]
    state, rows = make_state(reqs)
    md = state.metadata(rows)
    assert md.penalties is not None and md.penalties.prompt_token_mask is None
    assert md.penalties.repetition is None
    logits = torch.randn(len(reqs), VOCAB)
    actual = Sampler.apply_logits_processors(logits.clone(), md)
    for i, (params, prompt, output) in enumerate(reqs):
        expected = logits[i].clone()
        for token in set(output):  # prompt tokens are not penalized (OpenAI / vLLM)
            expected[token] -= (params.frequency_penalty * output.count(token)
                                + params.presence_penalty)
        torch.testing.assert_close(actual[i], expected)


def test_no_penalties_skips_the_work():
    state, rows = make_state([(SamplingParams(), [1, 2], [3]),
                              (SamplingParams(temperature=0), [4], [])])
    md = state.metadata(rows)
    assert md.penalties is None and md.banned is None and md.logit_bias is None
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.disallowed_mask is None and md.max_num_logprobs is None


@pytest.mark.parametrize("name, values, warper", [
    ("top_k", [1, 5, 20, VOCAB], TopKLogitsWarper),
    ("top_p", [0.1, 0.5, 0.9, 1.0], TopPLogitsWarper),
    ("min_p", [0.0, 0.05, 0.3, 1.0], MinPLogitsWarper),
])
def test_truncation_matches_transformers(name, values, warper):
    logits = torch.randn(len(values), VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    param = torch.tensor(values)
    if name == "min_p":
        actual = apply_min_p(logits.clone(), param.float())
    else:
        kw = {"top_k": param.long(), "top_p": None} if name == "top_k" else \
            {"top_k": None, "top_p": param.float()}
        actual = apply_top_k_top_p(logits.clone(), **kw)
    for i, value in enumerate(values):
        if name == "min_p" and value == 0.0:
            expected = logits[i:i + 1]  # MinPLogitsWarper rejects 0; 0 disables
        else:
            expected = warper(value)(None, logits[i:i + 1].clone())
        assert_same_logits(actual[i:i + 1], expected)


def test_top_k_then_top_p_matches_transformers_chain():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    top_k, top_p = [3, 10, 40], [0.5, 0.8, 0.95]
    actual = apply_top_k_top_p(logits.clone(), torch.tensor(top_k), torch.tensor(top_p))
    for i in range(3):
        expected = TopPLogitsWarper(top_p[i])(None, TopKLogitsWarper(top_k[i])(
            None, logits[i:i + 1].clone()))
        assert_same_logits(actual[i:i + 1], expected)


def test_logit_bias_and_allowed_token_ids():
    bias = {5: 10.0, 7: -3.5, 63: 1.25}
    reqs = [(SamplingParams(logit_bias=bias), [1], []),
            (SamplingParams(), [1], []),
            (SamplingParams(allowed_token_ids=[2, 9, 11]), [1], [])]
    state, rows = make_state(reqs)
    logits = torch.randn(3, VOCAB)
    actual = Sampler.apply_logits_processors(logits.clone(), state.metadata(rows))
    expected = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(
        torch.tensor([[1]]), logits[:1].clone())
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[1], logits[1])
    allowed = torch.isfinite(actual[2]).nonzero().flatten().tolist()
    assert allowed == [2, 9, 11]
    torch.testing.assert_close(actual[2, allowed], logits[2, allowed])


def test_bias_and_allowed_tokens_apply_at_every_position_of_a_verified_row():
    """A request verifying k proposed tokens samples k + 1 positions of one row: each
    position gets the row's bias and mask."""
    bias = {4: 2.0, 60: -1.5}
    state, rows = make_state([(SamplingParams(logit_bias=bias), [1], []),
                              (SamplingParams(allowed_token_ids=[3, 8]), [1], [])])
    positions = np.array([rows[0]] * 3 + [rows[1]] * 2)
    logits = torch.randn(5, VOCAB)
    actual = Sampler.apply_logits_processors(logits.clone(), state.metadata(positions))
    expected = logits.clone()
    for t, b in bias.items():
        expected[:3, t] += b
    expected[3:] = float("-inf")
    expected[3:, [3, 8]] = logits[3:, [3, 8]]
    assert torch.equal(actual, expected)


def test_a_full_vocabulary_bias_costs_a_step_what_a_one_token_bias_costs():
    """The bias and the allowed tokens are tables built once per request: gathering the
    step's rows does not grow with the number of entries (from Python lists each
    step, 64 rows biasing all of 49,152 tokens took ~100x a one-token bias's time)."""
    import time

    vocab = 49152

    def gather_time(params: SamplingParams) -> float:
        state, rows = make_state([(params, [1], [])] * 64, vocab=vocab)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            state.metadata(rows)
            best = min(best, time.perf_counter() - start)
        return best

    one = gather_time(SamplingParams(logit_bias={5: 1.0}, allowed_token_ids=[5, 6]))
    full = gather_time(SamplingParams(logit_bias={t: 0.5 for t in range(vocab)},
                                      allowed_token_ids=list(range(vocab))))
    assert full < 5 * one + 0.005, (full, one)


def test_a_preempted_seeded_request_resumes_its_generator_without_replaying():
    """A seeded row's generator is saved when the row is preempted and restored when the
    request comes back with the same output tokens; with fewer (a token sampled here
    was dropped since) the draws are replayed, one per output token (as sampling draws)."""
    params = SamplingParams(temperature=0.8, seed=7)
    state, rows = make_state([(params, [1, 2], [])])
    row = int(rows[0])
    draws = torch.empty(VOCAB)
    for _ in range(5):  # an arbitrary state, not what 3 tokens' replay gives
        draws.exponential_(generator=state.generators[row])
    saved = state.generators[row].get_state()
    state.num_tokens[row] += 3  # 3 tokens sampled
    state.save_generator(row, str(row))
    state.remove(row)

    def resume(num_output: int) -> torch.Tensor:
        state.add(row, NewRequestData(req_id=str(row), prompt_token_ids=[1, 2],
                                      output_token_ids=[9] * num_output,
                                      sampling_params=params, block_ids=[[]],
                                      num_computed_tokens=0, eos_token_id=EOS))
        restored = state.generators[row].get_state()
        state.remove(row)
        return restored

    assert torch.equal(resume(3), saved)
    replay = torch.Generator().manual_seed(7)
    for _ in range(3):
        draw_uniforms(1, {0: replay}, torch.device("cpu"))
    assert torch.equal(resume(3), replay.get_state())  # used once: replayed now
    state.add(row, NewRequestData(req_id=str(row), prompt_token_ids=[1, 2],
                                  output_token_ids=[], sampling_params=params,
                                  block_ids=[[]], num_computed_tokens=0, eos_token_id=EOS))
    state.num_tokens[row] = 2 + 3
    state.save_generator(row, str(row))
    state.remove(row)
    replay = torch.Generator().manual_seed(7)
    for _ in range(2):
        draw_uniforms(1, {0: replay}, torch.device("cpu"))
    assert torch.equal(resume(2), replay.get_state())  # a token dropped: replayed
    state.add(row, NewRequestData(req_id="gone", prompt_token_ids=[1, 2],
                                  output_token_ids=[], sampling_params=params,
                                  block_ids=[[]], num_computed_tokens=0, eos_token_id=EOS))
    state.save_generator(row, "gone")
    assert "gone" in state._saved_generators
    state.forget("gone")  # finished while preempted
    assert not state._saved_generators


def test_min_tokens_and_bad_words_bans():
    params = SamplingParams(min_tokens=3, stop_token_ids=[4])
    words = SamplingParams(bad_words=["x"])
    words.bad_words_token_ids = [[20], [30, 31, 32]]
    reqs = [(params, [9, 9], [7]),  # 1 output < 3: EOS and 4 banned
            (params, [9], [7, 7, 7]),  # 3 outputs: nothing banned
            (words, [30], [30, 31]),  # ends with 30 31: 32 banned, 20 always
            (words, [30, 31], [5])]  # prefix in the prompt only: 32 allowed
    state, rows = make_state(reqs)
    logits = Sampler.apply_logits_processors(torch.zeros(4, VOCAB), state.metadata(rows))
    banned = [torch.isinf(row).nonzero().flatten().tolist() for row in logits]
    assert banned == [[EOS, 4], [], [20, 32], [20]]


def test_greedy_rows_equal_argmax_in_a_mixed_batch():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    reqs = [(SamplingParams(temperature=0), [1], []), (SamplingParams(top_k=1), [1], []),
            (SamplingParams(temperature=1.5), [1], []),
            (SamplingParams(top_k=1, temperature=0.3, seed=3), [1], [])]
    state, rows = make_state(reqs)
    out = Sampler()(logits.clone(), state.metadata(rows)).sampled_token_ids
    argmax = logits.argmax(dim=-1)
    assert out[[0, 1, 3]].tolist() == argmax[[0, 1, 3]].tolist()


def _sample_n(params_list: list[SamplingParams], logits: torch.Tensor, num_steps: int,
              vocab: int = VOCAB) -> list[list[int]]:
    """num_steps draws per request from fixed logits (rows keep their generators)."""
    state, rows = make_state([(p, [1], []) for p in params_list], vocab)
    sampler, draws = Sampler(), [[] for _ in params_list]
    for _ in range(num_steps):
        out = sampler(logits.clone(), state.metadata(rows)).sampled_token_ids.tolist()
        for i, token in enumerate(out):
            draws[i].append(token)
    return draws


def test_seed_reproducible_whatever_the_batch():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone = _sample_n([seeded], logits, 20)[0]
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0),
              SamplingParams(seed=7, top_k=5), SamplingParams(min_p=0.1)]
    batch_logits = torch.cat([torch.randn(2, VOCAB), logits, torch.randn(2, VOCAB)])
    in_batch = _sample_n(others[:2] + [seeded] + others[2:], batch_logits, 20)[2]
    assert in_batch == alone
    assert _sample_n([SamplingParams(temperature=1.0, top_p=0.9, seed=43)], logits,
                     20)[0] != alone


@pytest.mark.parametrize("vocab", [VOCAB, 1000])
def test_every_kind_of_seeded_row_draws_alike_alone_and_in_any_batch(vocab):
    """A row's draw path (the whole row, its nucleus, its top-k candidates; after
    min-p) follows its own options only: each kind of seeded row draws the same tokens
    alone and beside rows of every other kind (which route the batch through min-p and
    top-k), over a vocabulary narrower and one wider than the 256 candidates."""
    kinds = [SamplingParams(temperature=0.9, seed=1),
             SamplingParams(temperature=1.0, top_p=0.8, seed=2),
             SamplingParams(temperature=0.7, top_k=20, seed=3),
             SamplingParams(temperature=1.1, top_k=300, top_p=0.9, seed=4),
             SamplingParams(temperature=1.0, min_p=0.05, seed=5),
             SamplingParams(temperature=0.8, min_p=0.02, top_p=0.95, seed=6),
             SamplingParams(temperature=0)]
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(len(kinds), vocab, generator=gen) * 2
    batched = _sample_n(kinds, logits, 12, vocab)
    for i, params in enumerate(kinds):
        assert _sample_n([params], logits[i:i + 1], 12, vocab)[0] == batched[i], params


def test_temperature_sampling_follows_softmax_chi_square():
    """20000 draws over 8 tokens, T = 0.7: Pearson's statistic with 7 degrees of freedom
    stays below 24.32, the 0.999 quantile of chi2(7); the same draws are far from the
    T = 1 distribution (the test has power)."""
    torch.manual_seed(0)
    num_draws, temperature = 20000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])
    md = SamplingMetadata(temperature=torch.full((num_draws,), temperature),
                          is_greedy=torch.zeros(num_draws, dtype=torch.bool),
                          all_greedy=False, all_random=True)
    draws = Sampler()(logits.expand(num_draws, -1).clone(), md).sampled_token_ids
    observed = torch.bincount(draws, minlength=8).double()

    def chi2(probs: torch.Tensor) -> float:
        expected = probs.double() * num_draws
        return float(((observed - expected) ** 2 / expected).sum())

    assert chi2(torch.softmax(logits / temperature, dim=0)) < 24.32
    assert chi2(torch.softmax(logits, dim=0)) > 100


def test_logprobs_ranks_and_top_k():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = torch.tensor([int(logits[0].argmax()), 5, 17])
    out = gather_logprobs(logprobs, chosen, 4)
    order = logprobs.argsort(dim=-1, descending=True)
    for i in range(3):
        assert out.token_ids[i, 0] == chosen[i]
        assert out.token_ids[i, 1:].tolist() == order[i, :4].tolist()
        torch.testing.assert_close(out.logprobs[i, 0], logprobs[i, chosen[i]])
        # No ties in random logits: a rank is 1 + the place in the sorted order.
        assert int(out.ranks[i, 0]) == order[i].tolist().index(int(chosen[i])) + 1
        assert out.ranks[i, 1:].tolist() == [1, 2, 3, 4]
    assert int(out.ranks[0, 0]) == 1


def test_logprobs_ranks_of_tied_tokens():
    # Row 0: tokens 3 and 5 tie for the max, 0 and 6 tie below them, then 2.
    # Row 1: every token ties.
    logits = torch.tensor([[2.0, -1.0, 1.0, 4.0, -3.0, 4.0, 2.0, -5.0],
                           [0.5] * 8])
    logprobs = torch.log_softmax(logits, dim=-1)
    # Either tied argmax, a token of the lower tie, the last token; any token of row 1.
    out = gather_logprobs(logprobs.repeat_interleave(torch.tensor([4, 1]), dim=0),
                          torch.tensor([3, 5, 6, 7, 4]), 5)
    # rank = 1 + the number of strictly larger logprobs: a tie shares the best rank.
    assert out.ranks[:, 0].tolist() == [1, 1, 3, 8, 1]
    top_ids, top_ranks = out.token_ids[:, 1:].tolist(), out.ranks[:, 1:].tolist()
    assert [sorted(ids[:2]) for ids in top_ids[:4]] == [[3, 5]] * 4
    assert [sorted(ids[2:4]) for ids in top_ids[:4]] == [[0, 6]] * 4
    assert top_ranks[:4] == [[1, 1, 3, 3, 5]] * 4
    assert top_ranks[4] == [1, 1, 1, 1, 1]
    # The chosen token and its copy among the top-k carry the same rank.
    for ids, ranks in zip(out.token_ids.tolist(), out.ranks.tolist()):
        for token_id, rank in zip(ids[1:], ranks[1:]):
            if token_id == ids[0]:
                assert rank == ranks[0]
    lists = out.tolists([5, 1, 0, -1, 2])
    assert [e.ranks for e in lists[:3]] == [[1, 1, 1, 3, 3, 5], [1, 1], [3]]
    assert lists[3] is None and lists[4].ranks == [1, 1, 1]


def test_mixed_step_draws_only_the_random_rows_and_keeps_seeded_draws():
    """Greedy rows take the argmax; the random rows draw on their own ([R, V], not the
    whole batch), and a seeded row draws exactly what it draws alone."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    is_greedy = torch.tensor([True, False, True, False, False, True])
    rows = [1, 3, 4]

    def gens() -> dict[int, torch.Generator]:
        return {1: torch.Generator().manual_seed(11), 3: torch.Generator().manual_seed(12)}

    md = SamplingMetadata(temperature=torch.where(is_greedy, 1.0, 0.9), is_greedy=is_greedy,
                          all_greedy=False, all_random=False, generators=gens(),
                          random_rows=torch.tensor(rows), random_row_ids=rows)
    out = Sampler.sample(logits.clone(), md)
    assert out[is_greedy].tolist() == logits[is_greedy].argmax(dim=-1).tolist()
    for row, seed in ((1, 11), (3, 12)):
        alone = SamplingMetadata(temperature=torch.tensor([0.9]),
                                 is_greedy=torch.tensor([False]), all_greedy=False,
                                 all_random=True,
                                 generators={0: torch.Generator().manual_seed(seed)})
        assert int(out[row]) == int(Sampler.sample(logits[row:row + 1].clone(), alone)[0])
    # The same step through the full-batch path (no random_rows) agrees on seeded rows.
    md_full = SamplingMetadata(temperature=md.temperature, is_greedy=is_greedy,
                               all_greedy=False, all_random=False, generators=gens())
    full = Sampler.sample(logits.clone(), md_full)
    assert full[[0, 1, 2, 3, 5]].tolist() == out[[0, 1, 2, 3, 5]].tolist()


def test_all_greedy_metadata_copies_no_temperature() -> None:
    """An all-greedy step leaves temperature and the greedy flags on the host (the sampler
    reads neither then: two device copies saved per step on a GPU); a mixed step has
    both, row for row."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    state, rows = make_state([(greedy, [2, 3], []), (greedy, [4], [5])])
    md = state.metadata(rows)
    assert md.all_greedy and md.temperature is None and md.is_greedy is None
    mixed, rows = make_state([(greedy, [2, 3], []),
                              (SamplingParams(temperature=0.7, max_tokens=4), [4], [5])])
    md = mixed.metadata(rows)
    assert not md.all_greedy
    assert torch.equal(md.is_greedy, torch.tensor([True, False]))
    torch.testing.assert_close(md.temperature, torch.tensor([1.0, 0.7]))


@pytest.mark.parametrize("extra", [
    {}, {"logprobs": 0}, {"min_tokens": 2}, {"repetition_penalty": 1.2},
    {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"logit_bias": {3: 1.0}},
    {"allowed_token_ids": [3, 4]}, {"bad_words_token_ids": [[7]]}])
def test_plain_greedy_fast_path_equals_the_general_metadata(extra) -> None:
    """Rows that are greedy with nothing else get the constant all-greedy metadata
    without the per-parameter gathers; it equals what the general path builds, and any
    extra parameter (here with a greedy row beside it) takes the general path."""
    from dataclasses import fields

    plain = SamplingParams(temperature=0.0, max_tokens=4)
    other = SamplingParams(temperature=0.0, max_tokens=4, **extra)
    state, rows = make_state([(plain, [2, 3], []), (other, [4], [5])])
    assert state.is_plain_greedy[rows].tolist() == [True, not extra]
    fast = state.metadata(rows)
    state.is_plain_greedy[:] = False  # force the general path
    general = state.metadata(rows)
    for f in fields(fast):
        a, b = getattr(fast, f.name), getattr(general, f.name)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and torch.equal(a, b), f.name
        elif f.name not in ("penalties", "banned", "logit_bias"):
            assert a == b, f.name
        else:
            assert (a is None) == (b is None), f.name
    state.remove(int(rows[0]))
    assert not state.is_plain_greedy[rows[0]]


def test_inverse_cdf_draw_never_picks_a_token_of_probability_zero():
    """Masked tokens (probability 0) have empty intervals of the cumulative sums, even
    next to tokens of ~1e-9 probability; a one-hot row always gives its token; a row's
    draw is the same alone or in a batch with the same uniform."""
    vocab = 50_000
    probs = torch.zeros(64, vocab)
    probs[:, 1::2] = 1e-9  # odd tokens tiny, even ones masked
    probs[:, 7] = 0.0
    probs[:, 9] = 1.0
    probs[0] = 0.0
    probs[0, vocab - 1] = 1.0  # one-hot at the last token
    probs /= probs.sum(dim=-1, keepdim=True)
    generators = {r: torch.Generator().manual_seed(r) for r in range(64)}
    cpu = torch.device("cpu")
    for _ in range(200):
        drawn = inverse_cdf_draw(probs, draw_uniforms(64, generators, cpu))
        assert drawn[0] == vocab - 1
        assert bool((drawn[1:] % 2 == 1).all()) and not bool((drawn == 7).any())
    u = draw_uniforms(64, {}, cpu)
    assert inverse_cdf_draw(probs[5:6], u[5:6])[0] == inverse_cdf_draw(probs, u)[5]


needs_native = pytest.mark.skipif(not load_cpu_kernels(),
                                  reason="the native CPU kernels did not build")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_draw_is_the_torch_draw(dtype):
    """cpu_ops.sample_draw (temperature, softmax and the two-level draw in one pass)
    against softmax(x / T) then inverse_cdf_draw, on 64 rows of a vocabulary that is no
    multiple of the block (a partial last block) with masked tokens, and the same row
    alone. The exps differ in the last bit (a polynomial against torch's), so a draw may
    differ where u * total falls within ~1e-7 of an interval's end: none did in 2,000."""
    gen = torch.Generator().manual_seed(3)
    vocab = 50_001
    x = torch.randn(64, vocab, generator=gen) * 4
    x[:, 100:300] = float("-inf")
    x = x.to(dtype)
    temperature = torch.rand(64, generator=gen) * 1.5 + 0.2
    same = total = 0
    for _ in range(32):
        u = torch.rand(64, dtype=torch.float64, generator=gen)
        native = torch.empty(64, dtype=torch.int64)
        cpu_ops.sample_draw(native, x, temperature, None, u)
        expected = inverse_cdf_draw(torch.softmax(x.float() / temperature[:, None], dim=-1),
                                    u)
        same += int((native == expected).sum())
        total += 64
        assert not bool(((native >= 100) & (native < 300)).any())
        alone = torch.empty(1, dtype=torch.int64)
        cpu_ops.sample_draw(alone, x[9:10], temperature[9:10], None, u[9:10])
        assert alone[0] == native[9]
    assert same >= total - 2, (same, total)


@needs_native
def test_native_draw_edges():
    """Masked tokens next to ones of ~1e-13 probability are never drawn; a u just below
    1 takes the last token with mass, not the masked tail after it; a row whose x / T
    overflows, and a NaN row, give their argmax."""
    vocab = 1000
    x = torch.full((4, vocab), float("-inf"))
    x[0, 1::2] = -30.0  # odd tokens tiny, even ones masked
    x[0, 9] = 0.0
    x[1, :700] = torch.linspace(-3, 3, 700)  # tokens 700.. masked
    x[2, 5], x[2, 6] = 1.0, 2.0
    x[3, :] = 0.0
    x[3, 17] = float("nan")
    temperature = torch.tensor([1.0, 1.0, 1e-38, 1.0])
    out = torch.empty(4, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        u = torch.rand(4, dtype=torch.float64, generator=gen)
        cpu_ops.sample_draw(out, x, temperature, None, u)
        assert out[0] % 2 == 1 and out[1] < 700 and out[2] == 6 and out[3] == 17
    cpu_ops.sample_draw(out, x, temperature, None,
                        torch.full((4,), 1 - 2**-53, dtype=torch.float64))
    assert out[1] == 699


def _chi2_limit(df: int, z: float = 3.09) -> float:
    """The 0.999 quantile of chi2(df) (Wilson-Hilferty's approximation)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("path", ["sampler", "candidates", "sorted"])
def test_top_p_draws_follow_the_truncated_softmax_chi_square(path):
    """8,000 draws from each of three rows of a 600-token vocabulary: a peaked one (its
    nucleus among the 256 candidates), a flat one (its nucleus past them: torch sorts
    the row whole) and one without top-p (the whole row); through the sampler (on CPU
    the native draw, its nucleus from a histogram) and through torch's
    draw_top_k_top_p (with candidates as on CPU, or sorting every row as on a GPU).
    Each row's draws stay in its kept set and follow
    softmax(apply_top_k_top_p(logits / T)) by Pearson's test (0.999 quantile); the
    peaked row's are far from its untruncated softmax (the test has power)."""
    torch.manual_seed(1)
    vocab, draws = 600, 8000
    gen = torch.Generator().manual_seed(2)
    rows = torch.stack([torch.randn(vocab, generator=gen) * 3,
                        torch.randn(vocab, generator=gen) * 0.1,
                        torch.randn(vocab, generator=gen)])
    temperature, top_p = torch.tensor([0.8, 1.0, 1.2]), torch.tensor([0.9, 0.5, 1.0])
    logits = rows.repeat_interleave(draws, dim=0)
    if path == "sampler":
        md = SamplingMetadata(temperature=temperature.repeat_interleave(draws),
                              is_greedy=torch.zeros(3 * draws, dtype=torch.bool),
                              all_greedy=False, all_random=True,
                              top_p=top_p.repeat_interleave(draws))
        tokens = Sampler()(logits, md).sampled_token_ids
    else:
        tokens = draw_top_k_top_p(logits / temperature.repeat_interleave(draws)[:, None],
                                  None, top_p.repeat_interleave(draws),
                                  draw_uniforms(3 * draws, {}, torch.device("cpu")),
                                  candidates=path == "candidates")
    truncated = apply_top_k_top_p(rows / temperature[:, None], None, top_p)
    kept = torch.isfinite(truncated).sum(dim=1).tolist()
    assert kept[0] < NUCLEUS_CANDIDATES < kept[1] and kept[2] == vocab  # all paths
    for i in range(3):
        drawn = tokens[i * draws:(i + 1) * draws]
        assert bool(torch.isfinite(truncated[i, drawn]).all())
        observed = torch.bincount(drawn, minlength=vocab).double()

        def chi2(probs: torch.Tensor) -> tuple[float, int]:
            # Tokens expected fewer than 5 times are pooled into one category.
            expected = probs.double() * draws
            small = expected < 5
            obs = torch.cat([observed[~small], observed[small].sum()[None]])
            exp = torch.cat([expected[~small], expected[small].sum()[None]])
            obs, exp = obs[exp > 0], exp[exp > 0]
            return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1

        stat, df = chi2(torch.softmax(truncated[i], dim=0))
        assert stat < _chi2_limit(df), (i, stat, df)
        if i == 0:
            stat, df = chi2(torch.softmax(rows[0] / temperature[0], dim=0))
            assert stat > 2 * _chi2_limit(df)


@needs_native
def test_native_top_p_reaches_exactly_the_nucleus():
    """Sweeping u over a grid of 4,000 values, the native top-p draw reaches every token
    of apply_top_k_top_p's nucleus whose share exceeds the grid's step, and nothing
    else: from peaked rows (a few tokens) to flat ones (thousands, many per bucket of
    the histogram), bfloat16 logits, and a vocabulary past one block."""
    gen = torch.Generator().manual_seed(6)
    vocab, grid = 3001, 4000
    for scale, temperature, top_p in ((4.0, 0.7, 0.9), (1.0, 1.0, 0.95), (0.05, 1.0, 0.5),
                                      (2.0, 0.3, 0.99), (3.0, 1.5, 0.2)):
        x = (torch.randn(1, vocab, generator=gen) * scale).to(torch.bfloat16)
        x[0, 7::13] = float("-inf")
        reference = apply_top_k_top_p(x.float() / temperature, None,
                                      torch.tensor([top_p]))[0]
        kept = torch.isfinite(reference)
        u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
        out = torch.empty(grid, dtype=torch.int64)
        cpu_ops.sample_draw(out, x.expand(grid, -1).contiguous(),
                            torch.full((grid,), temperature), torch.full((grid,), top_p), u)
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[out] = True
        assert not bool((seen & ~kept).any()), (scale, top_p)
        large = kept & (torch.softmax(reference, dim=0) > 2 / grid)
        assert bool(seen[large].all()), (scale, top_p)
        assert int(kept.sum()) > 1 or int(seen.sum()) == 1


def test_top_p_over_a_large_vocabulary_matches_transformers_in_a_mixed_batch():
    """A vocabulary wider than the nucleus candidates (NUCLEUS_CANDIDATES): peaked rows
    find their nucleus among them, flat ones (and a top-k past them) are sorted whole,
    rows with neither option are left alone; every row as transformers' warpers."""
    vocab = 5000
    gen = torch.Generator().manual_seed(4)
    scales = [6.0, 6.0, 0.05, 6.0, 0.05, 3.0, 6.0, 1.0]
    logits = torch.stack([torch.randn(vocab, generator=gen) * s for s in scales])
    top_k = [vocab, 40, vocab, 1000, 20, vocab, vocab, 300]
    top_p = [0.9, 0.95, 0.9, 0.8, 1.0, 1.0, 0.5, 0.99]
    actual = apply_top_k_top_p(logits.clone(), torch.tensor(top_k), torch.tensor(top_p))
    for i in range(len(scales)):
        expected = logits[i:i + 1].clone()
        if top_k[i] < vocab:
            expected = TopKLogitsWarper(top_k[i])(None, expected)
        if top_p[i] < 1:
            expected = TopPLogitsWarper(top_p[i])(None, expected)
        assert_same_logits(actual[i:i + 1], expected)
    assert torch.equal(actual[5], logits[5])  # neither option: untouched
    kept = torch.isfinite(actual).sum(dim=1).tolist()
    assert kept[0] < NUCLEUS_CANDIDATES < kept[2]  # both paths taken


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs",
                                  "processed_logits"])
def test_logprobs_modes(mode) -> None:
    """vLLM's logprobs_mode: the chosen token's and the top-k entries are the raw
    logits' log-softmax, the raw logits, or the logits the row drew from (bias,
    temperature, top-k, top-p applied) or their log-softmax; greedy rows' processed
    values are their logits after the processors; the draw is the same in every mode."""
    vocab = 64
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5))
    is_greedy = torch.tensor([True, False, False, True])
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0])
    bias = torch.zeros(2, vocab)
    bias[:, 7] = 3.0  # rows 1 and 3 favour token 7

    def md() -> SamplingMetadata:
        return SamplingMetadata(
            temperature=temperature, is_greedy=is_greedy, all_greedy=False,
            all_random=False, top_k=torch.tensor([vocab, 5, vocab, vocab]),
            top_p=torch.tensor([1.0, 1.0, 0.8, 1.0]), max_num_logprobs=3,
            logit_bias=(torch.tensor([1, 3]), bias),
            generators={1: torch.Generator().manual_seed(1),
                        2: torch.Generator().manual_seed(2)},
            random_rows=torch.tensor([1, 2]), random_row_ids=[1, 2])

    out = Sampler(mode)(logits.clone(), md())
    plain = Sampler()(logits.clone(), md())
    assert out.sampled_token_ids.tolist() == plain.sampled_token_ids.tolist()
    biased = logits.clone()
    biased[[1, 3]] += bias
    processed = apply_top_k_top_p(biased / temperature[:, None],
                                  torch.tensor([vocab, 5, vocab, vocab]),
                                  torch.tensor([1.0, 1.0, 0.8, 1.0]))
    values = {"raw_logprobs": logits.log_softmax(-1), "raw_logits": logits,
              "processed_logprobs": processed.log_softmax(-1),
              "processed_logits": processed}[mode]
    want = gather_logprobs(values, out.sampled_token_ids, 3)
    assert out.logprobs.token_ids.tolist() == want.token_ids.tolist()
    torch.testing.assert_close(out.logprobs.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    if mode.startswith("processed"):
        # The chosen tokens lie inside what their rows drew from; row 1 kept 5 tokens.
        assert torch.isfinite(out.logprobs.logprobs[:, 0]).all()
        assert int(torch.isfinite(processed[1]).sum()) == 5
