"""Verification of proposed tokens: which draws are emitted, and that the emitted tokens
follow the target distribution (a chi-square test through the real Sampler)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection_sampler import accept_drafts
from pagedllm.sample.sampler import Sampler


def test_accept_drafts_emits_the_accepted_run_plus_one_draw():
    sampled = np.array([5, 6, 7, 9, 1, 2, 3, 4, 8])
    counts = np.array([4, 1, 4])
    # Request 0 (draws 5 6 7 9): proposals 5, 6 match, 8 does not -> 5, 6, 7.
    # Request 1 (draw 1): no proposals -> its one draw.
    # Request 2 (draws 2 3 4 8): all three match -> them plus the bonus draw.
    emitted = accept_drafts(sampled, counts, [[5, 6, 8], None, [2, 3, 4]])
    assert emitted == [[5, 6, 7], [1], [2, 3, 4, 8]]
    # The first proposal rejected: only the first draw.
    assert accept_drafts(np.array([3, 3]), np.array([2]), [[4]]) == [[3]]


# A 6-token target distribution, the same at every position (a context-free "model").
PROBS = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
# The chi-square critical value for 5 degrees of freedom at p = 0.001: a correct
# sampler fails this test once in a thousand runs (the seed below fixes the outcome).
CHI2_CRIT_DF5 = 20.515


def _chi_square(counts: np.ndarray, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs.numpy()
    return float(((counts - expected) ** 2 / expected).sum())


def test_emitted_tokens_follow_the_target_distribution():
    """Proposals [1, 1] (a likely token, then a likely one again) verified by the
    sampler at temperature 1: the first emitted token is distributed as p, and so is
    the second one given that the first proposal was accepted."""
    torch.manual_seed(0)
    trials, k = 20000, 2
    logits = PROBS.log().repeat(trials * (k + 1), 1)
    n = logits.shape[0]
    md = SamplingMetadata(temperature=torch.ones(n), is_greedy=torch.zeros(n, dtype=bool),
                          all_greedy=False, all_random=True)
    sampled = Sampler()(logits, md).sampled_token_ids.numpy()
    emitted = accept_drafts(sampled, np.full(trials, k + 1), [[1, 1]] * trials)
    first = np.bincount([e[0] for e in emitted], minlength=6)
    assert _chi_square(first, PROBS) < CHI2_CRIT_DF5
    second = np.bincount([e[1] for e in emitted if len(e) > 1], minlength=6)
    assert second.sum() == first[1]  # the second draw is emitted iff 1 was accepted
    assert _chi_square(second, PROBS) < CHI2_CRIT_DF5
    # The acceptance rate of the first proposal is p(1).
    assert abs(first[1] / trials - PROBS[1].item()) < 0.015


def test_greedy_rows_emit_the_argmax_run():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    md = SamplingMetadata(temperature=torch.ones(3), is_greedy=torch.ones(3, dtype=bool),
                          all_greedy=True, all_random=False)
    sampled = Sampler()(logits, md).sampled_token_ids.numpy()
    assert sampled.tolist() == [1, 0, 2]
    assert accept_drafts(sampled, np.array([3]), [[1, 0]]) == [[1, 0, 2]]
    assert accept_drafts(sampled, np.array([3]), [[1, 2]]) == [[1, 0]]
