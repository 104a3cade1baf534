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


# Top-p looks for each row's nucleus among its largest this many logits (sorted by
# topk: 6 ms for 64 rows of a 49k vocabulary, against 101 ms to sort them whole); only
# rows whose nucleus may reach past them are sorted whole.
NUCLEUS_CANDIDATES = 256


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k, then outside its top-p nucleus: the
    most likely tokens while the mass of those before each (its probability renormalized
    over the row's top-k) is below top_p; the most likely always stays.

    The masked-logits form of what the sampler draws from (`draw_top_k_top_p` and the
    native nucleus never build it): the definition the tests hold the draws and
    transformers' warpers to."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    if top_p is None:
        # Top-k alone needs no full sort: the k-th largest value of each row is the
        # threshold (ties with it stay, as transformers' TopKLogitsWarper).
        k = top_k.clamp(1, vocab)
        top_values = logits.topk(int(k.max()), dim=-1).values
        kth = top_values.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, _NEG_INF)
    k, has_k, plain = _top_k_rows(logits, top_k, top_p)
    values, order, inside = _top_k_top_p_among(logits, min(vocab, NUCLEUS_CANDIDATES), k,
                                               has_k, top_p)
    out = torch.full_like(logits, _NEG_INF).scatter_(1, order, values)
    out[plain] = logits[plain]
    rest = (~plain & ~inside).nonzero().squeeze(1)
    if len(rest):
        values, order, _ = _top_k_top_p_among(logits[rest], vocab, k[rest], has_k[rest],
                                              top_p[rest])
        out[rest] = torch.full_like(values, _NEG_INF).scatter_(1, order, values)
    return out


def draw_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                     top_p: torch.Tensor | None, u: torch.Tensor,
                     candidates: bool = True) -> torch.Tensor:
    """One token per row drawn from the softmax of apply_top_k_top_p(logits, top_k,
    top_p) with the uniforms u, without building the masked rows: a row draws among its
    kept candidates in their sorted order (the 256 largest, or the whole row sorted
    when its top-k or nucleus may reach past them), a row with neither option from the
    whole row. Each row's path depends on that row alone, so its draw does not depend
    on the batch.

    candidates=False sorts every row whole, so that nothing depends on a row count
    read back from the device (a GPU sorts fast and should never wait)."""
    n, vocab = logits.shape
    if top_p is None:
        top_p = torch.ones(n, dtype=torch.float32, device=logits.device)
    k, has_k, plain = _top_k_rows(logits, top_k, top_p)
    ones = torch.ones(n, dtype=torch.float32, device=logits.device)
    width = min(vocab, NUCLEUS_CANDIDATES) if candidates else vocab
    values, order, inside = _top_k_top_p_among(logits, width, k, has_k, top_p)
    tokens = order.gather(1, draw_tempered(values, ones, u)[:, None]).squeeze(1)
    if not candidates:
        return tokens
    rest = (~plain & ~inside).nonzero().squeeze(1)
    if len(rest):
        values, order, _ = _top_k_top_p_among(logits[rest], vocab, k[rest], has_k[rest],
                                              top_p[rest])
        drawn = draw_tempered(values, ones[rest], u[rest])
        tokens[rest] = order.gather(1, drawn[:, None]).squeeze(1)
    plain = plain.nonzero().squeeze(1)
    if len(plain):
        tokens[plain] = draw_tempered(logits[plain], ones[plain], u[plain])
    return tokens


def _top_k_rows(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's k (the vocabulary without top-k), whether it has a top-k, and whether
    it uses neither option."""
    vocab = logits.shape[-1]
    k = (top_k.clamp(1, vocab) if top_k is not None
         else torch.full(top_p.shape, vocab, dtype=torch.long, device=logits.device))
    has_k = k < vocab
    return k, has_k, ~has_k & (top_p >= 1)


def _top_k_top_p_among(logits: torch.Tensor, width: int, k: torch.Tensor,
                       has_k: torch.Tensor, top_p: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """apply_top_k_top_p looking only among each row's `width` largest logits (all of
    them: a full sort): their values, -inf where masked, and token ids [N, width], in
    descending order; also whether each row's top-k and nucleus lie among them."""
    vocab = logits.shape[-1]
    values, order = (logits.sort(dim=-1, descending=True) if width == vocab
                     else logits.topk(width, dim=-1))
    kth = values.gather(1, (k.clamp(max=width) - 1)[:, None])
    values = values.masked_fill(has_k[:, None] & (values < kth), _NEG_INF)
    # Probabilities over the row's top-k (all among the candidates when its last
    # candidate is masked), else over the whole row.
    lse = torch.where(has_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - lse[:, None]).exp()
    cum = probs.cumsum(dim=-1)
    keep = ((cum - probs) < top_p[:, None]) | (top_p[:, None] >= 1)  # mass before each
    keep[:, 0] = True
    inside = torch.where(has_k, values[:, -1] == _NEG_INF, cum[:, -1] >= top_p)
    return values.masked_fill(~keep, _NEG_INF), order, inside


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


# inverse_cdf_draw sums the probabilities in blocks of this many tokens first.
DRAW_BLOCK = 256


def draw_tempered(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                  top_p: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logits` [N, V] drawn from softmax(logits / temperature)
    with the uniforms u (float64 [N]), within each row's top-p nucleus when given.

    On CPU one native call (cpu_ops.sample_draw): temperature, softmax and the two-level
    draw in a row's thread-local buffer; the nucleus from a histogram of the
    probabilities (1/32-octave buckets: only the bucket where it ends is sorted). torch
    took ~9 ms of a 64-row step over a 49k vocabulary for the plain draw (five passes over
    [N, V] tensors) and up to ~100 ms for top-p (a full sort of rows whose nucleus passes
    the 256 candidates). Elsewhere torch: softmax then inverse_cdf_draw, or
    draw_top_k_top_p."""
    if logits.dim() == 2 and logits.stride(1) == 1 and cpu_ops_available(logits):
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        cpu_ops.sample_draw(out, logits, temperature.float().contiguous(),
                            None if top_p is None else top_p.float().contiguous(), u)
        return out
    if top_p is not None:
        return draw_top_k_top_p(logits / temperature[:, None], None, top_p, u,
                                candidates=logits.device.type == "cpu")
    return inverse_cdf_draw(torch.softmax(logits / temperature[:, None], dim=-1), u)


def inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One id per row of `probs` [N, V] (each row's total need not be 1): the token whose
    interval of the row's cumulative distribution holds u * total, u [N] float64 in
    [0, 1) (`draw_uniforms`).

    In two levels: the block of DRAW_BLOCK tokens whose interval holds it (cumulative
    sums of the blocks' sums), then the token within that block. The sums are float64,
    so a token's interval is as wide as its probability to ~1e-16 (float32 would round
    away the tail tokens' ~1e-8 widths next to a sum near 1), and a token of probability
    0 (masked) has an empty interval: never drawn. Rows are summed independently, so a
    row's draw does not depend on the batch.

    An exponential race (argmax(p / q), q ~ Exp(1)) draws from p too, but needs V random
    numbers per row: 53 ms of the step for 64 rows of a 49k vocabulary on 2 cores; one
    float64 cumulative sum of the whole rows took 12 ms, these two levels ~3.
    """
    n, vocab = probs.shape
    if vocab % DRAW_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, -vocab % DRAW_BLOCK))
    blocks = probs.view(n, -1, DRAW_BLOCK)
    block_cum = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    target = u * block_cum[:, -1]
    # The block b with block_cum[b - 1] <= target < block_cum[b]: it has mass.
    b = torch.searchsorted(block_cum, target[:, None], right=True).squeeze(1)
    b.clamp_(max=block_cum.shape[1] - 1)
    before = block_cum.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1)
    target = target - torch.where(b > 0, before, torch.zeros_like(before))
    inner = blocks[torch.arange(n, device=probs.device), b].cumsum(dim=-1,
                                                                    dtype=torch.float64)
    j = torch.searchsorted(inner, target[:, None], right=True)
    # The block's sum and its cumulative sums may differ in the last bit: a target past
    # the latter takes the block's last token of nonzero probability.
    last = torch.searchsorted(inner, inner[:, -1:].contiguous(), right=False)
    token = b * DRAW_BLOCK + torch.minimum(j, last).squeeze(1)
    return token.clamp_(max=vocab - 1)


def draw_uniforms(n: int, generators: dict[int, torch.Generator],
                  device: torch.device) -> torch.Tensor:
    """n float64 draws from U[0, 1): row r's from generators[r] when it has one (one draw
    per sampled token: `skip_draws` replays them), the others' from torch's generator."""
    u = torch.empty(n, dtype=torch.float64, device=device)
    if len(generators) < n:
        u.uniform_()
    for row, gen in generators.items():
        u[row:row + 1].uniform_(generator=gen)
    return u


def skip_draws(gen: torch.Generator, count: int, device: torch.device) -> None:
    """Advance `gen` as `count` sampled tokens did (one `draw_uniforms` draw each)."""
    scratch = torch.empty(1, dtype=torch.float64, device=device)
    for _ in range(count):
        scratch.uniform_(generator=gen)


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
