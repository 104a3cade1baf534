"""Prompt-lookup proposals for speculative decoding (vLLM's "ngram" method).

The tokens that followed the latest earlier occurrence of the sequence's last n tokens
are proposed to come next; n is tried from prompt_lookup_max down to prompt_lookup_min.
Text that copies from its context (code edits, quotes, extraction) repeats long runs,
and each accepted proposal is a token the target model did not decode on its own step.
A function of the request's own tokens only, so outputs stay batch-independent.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray) -> list[int]:
        """Up to k tokens to follow `tokens` (1-D int array); [] when no suffix n-gram
        of length >= min_n occurred before."""
        length = len(tokens)
        if length < self.min_n + 1:
            return []
        # Candidates: earlier positions holding the last token (where a match ends);
        # each is extended backwards, all at once, up to max_n tokens.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if len(ends) == 0:
            return []
        match_len = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for n in range(1, min(self.max_n, length - 1)):
            before = ends - n
            alive &= before >= 0
            alive &= tokens[np.maximum(before, 0)] == tokens[length - 1 - n]
            if not alive.any():
                break
            match_len += alive
        best_n = int(match_len.max())
        if best_n < self.min_n:
            return []
        # The latest of the longest matches: recent text predicts best.
        best_end = int(ends[np.flatnonzero(match_len == best_n)[-1]])
        return tokens[best_end + 1:best_end + 1 + self.k].tolist()
