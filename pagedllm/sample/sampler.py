"""Sampler: logits [N, vocab] -> one token id per row, all rows in one pass.

Steps: (1) mask banned ids (min_tokens), (2) greedy argmax for greedy rows,
(3) temperature, (4) top-k then top-p on the sorted distribution (skipped when unused),
(5) sample by the exponential race argmax(p / q), q ~ Exp(1) — per-request generators
draw q for seeded rows so their choice does not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from pagedllm.sample.metadata import SamplingMetadata


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits [N, V] float32 -> sampled token ids [N] int64."""
        for row, ids in md.banned_token_ids.items():
            logits[row, ids] = float("-inf")
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy
        logits = logits / md.temperature[:, None]
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        sampled = exponential_race(probs, md.generators)
        if md.all_random:
            return sampled
        return torch.where(md.is_greedy, greedy, sampled)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k and top-p nucleus."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        # Ascending order: the k largest are the last k; the threshold is at index V - k.
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab))[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        # Drop the low tail whose total mass is <= 1 - top_p; the top token always stays.
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator],
                     ) -> torch.Tensor:
    """Sample one id per row: argmax(p / q) with q ~ Exp(1) is a draw from p."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return (probs / q).argmax(dim=-1)
