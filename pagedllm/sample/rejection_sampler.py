"""Verification of proposed tokens (speculative decoding).

The target model scores a request's last token and its k proposed tokens d_1..d_k in
one forward pass; the sampler then draws s_0..s_k, one token per position, exactly as
plain decoding draws each (s_j follows the sequence extended by d_1..d_j). The request
emits s_0..s_a, where a is the number of leading proposals equal to the target's own
draw (s_{j-1} == d_j for j <= a).

Why this keeps the target distribution exactly: the proposals here are deterministic
(prompt lookup, or a draft model's argmax), i.e. a one-hot proposal q = [d]. Standard
rejection sampling accepts d with probability min(1, p(d) / q(d)) = p(d) and on
rejection draws from (p - q)+ normalized, which is p without d. Drawing s ~ p and
accepting iff s == d has the same law: P(accept) = p(d), and s given s != d is p
without d. Every emitted token is one draw from p, so a seeded request consumes its
generator exactly as without speculation (the runner rewinds the draws of the
positions after the first rejection) and emits the very same tokens; a greedy one
emits the argmax at every position, the tokens of plain greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def accept_drafts(sampled: np.ndarray, counts: np.ndarray,
                  drafts: Sequence[Sequence[int] | None]) -> list[list[int]]:
    """Per request: the tokens it emits this step.

    `sampled` holds the target's draws of all requests, flattened: request i has
    counts[i] consecutive entries (1 + its number of proposals); drafts[i] is its
    proposals (None or empty for a request without). Returns s_0..s_a per request.
    """
    emitted: list[list[int]] = []
    offset = 0
    values = sampled.tolist()
    for count, proposal in zip(counts.tolist(), drafts):
        draws = values[offset:offset + count]
        offset += count
        num_accepted = 0
        if proposal:
            while num_accepted < count - 1 and draws[num_accepted] == proposal[num_accepted]:
                num_accepted += 1
        emitted.append(draws[:num_accepted + 1])
    return emitted
