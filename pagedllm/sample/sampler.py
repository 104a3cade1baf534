"""Sampler: logits [N, vocab] -> one token id per row, all rows in one pass.

Steps (vLLM's order; each is skipped when no row of the step uses it):
 1. raw logits kept for the logprobs (step 6), before any transform
 2. masks: allowed_token_ids, bad words and min_tokens bans, grammar bitmask;
    then logit_bias, then custom logits processors (pagedllm.logits_process)
 3. penalties: repetition, frequency, presence
 4. greedy rows: argmax of the result
 5. random rows: temperature, min_p, top_k, top_p, then one draw per row from the
    softmax (inverse CDF: u ~ U[0, 1) against its cumulative sums; on CPU one native
    call does temperature, top-p, softmax and draw); seeded rows draw u from their own
    generator
 6. logprobs of the chosen token (with its rank) and the top-k: the log-softmax of
    step 1's logits (on CPU one native pass, sample/logprobs.py); with another
    `logprobs_mode` (vLLM's) the raw logits themselves, or the processed logits (after
    steps 2-3, temperature, min_p, top-k and top-p: what the token was drawn from) or
    their log-softmax
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.logits_process import processor_failure
from pagedllm.sample.logprobs import (LogprobsTensors, gather_logprobs, put_label_logprobs,
                                      score_logprobs)
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops import (apply_min_p, apply_penalties, apply_top_k_top_p,
                                 argmax_rows, draw_tempered, draw_top_k_top_p,
                                 draw_uniforms)

logger = logging.getLogger(__name__)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # None when no row asked for logprobs.
    logprobs: LogprobsTensors | None = None


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits [N, V] in the model's dtype (float32 logits are modified in place) ->
        sampled token ids [N] int64."""
        if md.all_greedy and md.max_num_logprobs is None and not self.transforms(md):
            # Nothing but the argmax: no float32 copy of the logits (same result: the
            # conversion is exact).
            return SamplerOutput(sampled_token_ids=argmax_rows(logits))
        scored = None
        processed = self.logprobs_mode.startswith("processed")
        if md.max_num_logprobs is not None and not processed:
            # Scored after the draw, from the logits as the model gave them (float32 ones
            # are transformed in place below: kept as a copy).
            scored = logits.clone() if logits.dtype == torch.float32 else logits
        logits = self.apply_logits_processors(logits.float(), md)
        if md.max_num_logprobs is not None and processed:
            scored = processed_logits(logits, md)
        sampled = self.sample(logits, md)
        lp = None
        if scored is not None:
            lp = score_values(scored, sampled, md.max_num_logprobs, self.logprobs_mode)
            if md.label_ids:
                put_label_logprobs(lp, scored, md.label_ids,
                                   self.logprobs_mode.endswith("_logits"))
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp)

    @staticmethod
    def transforms(md: SamplingMetadata) -> bool:
        """Whether any row of the step has an argmax-changing transform (steps 2-3)."""
        return (md.disallowed_mask is not None or md.banned is not None
                or md.grammar_bitmask is not None or md.logit_bias is not None
                or md.penalties is not None or md.custom is not None)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Steps 2-3: masks, logit bias, custom processors, penalties (argmax-changing
        transforms)."""
        if md.disallowed_mask is not None:
            logits.masked_fill_(md.disallowed_mask, float("-inf"))
        if md.banned is not None:
            logits[md.banned] = float("-inf")
        if md.grammar_bitmask is not None:
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(logits, md.grammar_bitmask,
                                                 indices=md.grammar_rows)
        if md.logit_bias is not None:
            rows, bias = md.logit_bias  # zero where a token has no bias: x + 0 == x
            logits.index_add_(0, rows, bias)
        for i, fns, output_ids in md.custom or ():
            Sampler._apply_custom(logits, i, fns, output_ids, md)
        if md.penalties is not None:
            logits = apply_penalties(logits, md.penalties)
        return logits

    @staticmethod
    def _apply_custom(logits: torch.Tensor, i: int, fns: list[tuple[Any, Any]],
                      output_ids: list[int], md: SamplingMetadata) -> None:
        """Row i through its request's custom functions. One that raises (or returns
        no row of the right size) fails that request alone, noted in md.custom_failures:
        user code must not take the engine and the batch's other requests down."""
        row = logits[i]
        for processor, fn in fns:
            try:
                row = fn(output_ids, row)
                if not isinstance(row, torch.Tensor) or row.shape != logits[i].shape:
                    raise TypeError(f"returned {_describe(row)}, not a logits row of "
                                    f"shape {tuple(logits[i].shape)}")
            except Exception as e:  # noqa: BLE001 - any failure of user code
                logger.exception("custom logits processor %s failed",
                                 type(processor).__qualname__)
                if md.custom_failures is None:
                    md.custom_failures = {}
                md.custom_failures[i] = processor_failure(processor, e)
                return
        if row.data_ptr() != logits[i].data_ptr():
            logits[i] = row

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Steps 4-5: greedy rows take the argmax, the others draw."""
        greedy = None if md.all_random else argmax_rows(logits)
        if md.all_greedy:
            return greedy
        if greedy is None or md.random_rows is None:
            sampled = Sampler._draw(logits, md.temperature, md.min_p, md.top_k, md.top_p,
                                    md.generators)
            return sampled if greedy is None else torch.where(md.is_greedy, greedy, sampled)
        # A mixed step: only the random rows pay for softmax and the [R, V] draw (a few
        # sampled rows in a large greedy batch would otherwise cost a full-batch draw).
        rows = md.random_rows
        positions = {r: i for i, r in enumerate(md.random_row_ids)}

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        sampled = Sampler._draw(logits[rows], md.temperature[rows], pick(md.min_p),
                                pick(md.top_k), pick(md.top_p),
                                {positions[r]: g for r, g in md.generators.items()})
        return greedy.index_copy_(0, rows, sampled)

    @staticmethod
    def _draw(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None,
              top_k: torch.Tensor | None, top_p: torch.Tensor | None,
              generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One draw per row of `logits` [R, V] from its tempered, truncated softmax."""
        u = draw_uniforms(logits.shape[0], generators, logits.device)
        if min_p is not None or top_k is not None:
            # Divided here (the same bits as the draw's own division): min_p and top-k
            # look at the tempered logits.
            logits = logits / temperature[:, None]
            temperature = torch.ones_like(temperature)
            if min_p is not None:
                logits = apply_min_p(logits, min_p)
        # Each row's path follows its own options, never the batch's (batch invariance):
        # rows without top-k draw over the row (within its nucleus with top-p), rows
        # with one among their sorted candidates.
        sampled = draw_tempered(logits, temperature, u, top_p)
        if top_k is None:
            return sampled
        has_k = top_k < logits.shape[-1]
        if logits.device.type != "cpu":
            # Every row drawn both ways: picking the top-k rows would read a row count
            # back from the device.
            return torch.where(has_k, draw_top_k_top_p(logits, top_k, top_p, u,
                                                       candidates=False), sampled)
        rows = has_k.nonzero().squeeze(1)
        if len(rows):
            sampled[rows] = draw_top_k_top_p(logits[rows], top_k[rows],
                                             None if top_p is None else top_p[rows], u[rows])
        return sampled


def processed_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """A new tensor of the logits a row's token is drawn from: `logits` (after the
    processors and penalties) divided by the temperature, min_p, top-k and top-p
    masked (-inf). Greedy rows keep their logits (temperature 1.0 in md; top-k 1, the
    other greedy kind, masks all but the argmax)."""
    if md.all_greedy:
        return logits.clone()
    out = logits / md.temperature[:, None]
    if md.min_p is not None:
        out = apply_min_p(out, md.min_p)
    return apply_top_k_top_p(out, md.top_k, md.top_p)


def score_values(values: torch.Tensor, token_ids: torch.Tensor, k: int,
                 logprobs_mode: str) -> LogprobsTensors:
    """The chosen tokens' and the top-k entries of `values` (logits of some kind): their
    log-softmax, or in a *_logits mode the values themselves (ranked the same way)."""
    if logprobs_mode.endswith("_logits"):
        return gather_logprobs(values.float(), token_ids, min(k, values.shape[-1]))
    return score_logprobs(values, token_ids, k)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
