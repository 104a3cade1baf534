"""Logits transforms of the sampler, each over the whole batch with per-row parameters.

All take and return float32 logits [N, V]; rows whose parameter is neutral come out
unchanged, so one call serves a batch that mixes requests with and without the option.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.ops import cpu_ops_available
from pagedllm.sample.metadata import PenaltyMetadata

_NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, p: PenaltyMetadata) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens).

    repetition: logit / r where logit > 0, logit * r otherwise (HF / vLLM semantics);
    frequency:  logit - f * count;   presence: logit - p * (count > 0)  (OpenAI).
    """
    counts = p.output_token_counts  # [N, V]
    in_output = counts > 0
    if p.repetition is not None:
        rep = p.repetition[:, None]
        # Scale factor per entry: 1/r for positive logits, r otherwise; 1 where unseen.
        scale = torch.where(logits > 0, rep.reciprocal(), rep)
        scale.masked_fill_(~(in_output | p.prompt_token_mask), 1.0)
        logits = logits * scale
    if p.frequency is not None:
        logits = logits - p.frequency[:, None] * counts.to(logits.dtype)
    if p.presence is not None:
        logits = logits - p.presence[:, None] * in_output.to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with probability < min_p * (probability of the most likely token)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None, max_top_k: int | None = None,
                      ) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k, then outside its top-p nucleus.

    max_top_k: an upper bound of top_k known on the host (else read from the tensor,
    a device sync on a GPU)."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    if top_p is None:
        # Top-k alone needs no full sort: the k-th largest value of each row is the
        # threshold (ties with it stay, as transformers' TopKLogitsWarper).
        k = top_k.clamp(1, vocab)
        width = max(1, min(max_top_k, vocab)) if max_top_k is not None else int(k.max())
        top_values = logits.topk(width, dim=-1).values
        kth = top_values.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending
    if top_k is not None:
        # Ascending order: the k largest are the last k; the threshold is at index V - k.
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab))[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        # Drop the low tail whose total mass is <= 1 - top_p; the top token always stays.
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] (any float dtype) -> index of each row's first maximum, int64 [N].

    On CPU a native kernel reads the row once; torch's argmax is ~6 ms for 64 bfloat16
    rows of a 49k vocabulary (and ~1 ms in float32) against ~0.2 ms.
    """
    if x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1 and cpu_ops_available(x):
        out = torch.empty(x.shape[0], dtype=torch.int64)
        cpu_ops.argmax(out, x)
        return out
    return x.argmax(dim=-1)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator],
                     ) -> torch.Tensor:
    """Sample one id per row: argmax(p / q) with q ~ Exp(1) is a draw from p.

    Seeded rows draw their q from their own generator (V draws per step, whatever the
    batch), so their choice depends only on their seed and their own history.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return argmax_rows(probs / q)


def output_token_counts(token_ids: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """counts[i, t] = occurrences of t in token_ids[i, start[i]:end[i]].

    token_ids [N, L] int64 (padded rows); start, end [N]. Positions outside the range
    scatter into a dump column V that is cut off.
    """
    n, length = token_ids.shape
    pos = torch.arange(length, device=token_ids.device)[None, :]
    inside = (pos >= start[:, None]) & (pos < end[:, None])
    ids = torch.where(inside, token_ids, vocab_size)
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]
