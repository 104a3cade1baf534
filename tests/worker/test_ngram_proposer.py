"""Prompt lookup: the continuation of the latest longest suffix match."""

from __future__ import annotations

import numpy as np

from pagedllm.worker.ngram_proposer import NgramProposer


def propose(tokens, k=3, min_n=2, max_n=4):
    return NgramProposer(k, min_n, max_n).propose(np.array(tokens, dtype=np.int64))


def test_longest_match_wins_then_latest():
    # Suffix (2, 3, 4) occurs once at the start: propose what followed it.
    assert propose([1, 2, 3, 4, 5, 9, 7, 3, 4, 2, 3, 4]) == [5, 9, 7]
    # (1, 2) occurs twice before: the latest occurrence's continuation.
    assert propose([1, 2, 3, 1, 2, 7, 1, 2]) == [7, 1, 2]
    # A longer match earlier beats a shorter later one: (8, 1, 2) -> 5.
    assert propose([8, 1, 2, 5, 6, 1, 2, 9, 8, 1, 2]) == [5, 6, 1]


def test_min_and_max_n():
    # Only the last token matches: below min_n = 2.
    assert propose([5, 6, 7, 1, 6]) == []
    assert propose([5, 6, 7, 1, 6], min_n=1) == [7, 1, 6]
    # max_n bounds the match length considered, not the proposal.
    assert propose([1, 2, 3, 4, 0, 2, 3, 4], max_n=2) == [0, 2, 3]


def test_short_sequences_and_truncated_continuations():
    assert propose([]) == []
    assert propose([4]) == []
    assert propose([4, 4]) == []  # one token repeats: a 1-gram, below min_n
    # The continuation runs into the end of the sequence: fewer than k tokens.
    assert propose([5, 5, 5, 5], k=3) == [5]
    assert propose([1, 2, 9, 1, 2], k=5) == [9, 1, 2]
