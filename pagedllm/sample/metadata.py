"""Per-step sampling parameters of the requests that sample, gathered into tensors.

Every optional part is None when no row of the step uses it, so the sampler skips its
work entirely (the common case: plain temperature or greedy sampling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PenaltyMetadata:
    """Inputs of presence / frequency / repetition penalties. Rows without one are
    neutral (0, 0, 1); a penalty no row of the step uses is None."""

    presence: torch.Tensor | None  # [N] float32
    frequency: torch.Tensor | None  # [N] float32
    repetition: torch.Tensor | None  # [N] float32
    # How often each token occurs in the row's output so far.
    output_token_counts: torch.Tensor  # [N, V] int64
    # Tokens present in the row's prompt; None when no row uses repetition_penalty.
    prompt_token_mask: torch.Tensor | None  # [N, V] bool


@dataclass
class SamplingMetadata:
    """Row i describes the i-th logits row of the step."""

    # [N] float32; rows with temperature 0 are greedy (their value here is 1.0). None
    # when all_greedy: nothing reads it then (no copy to the device each greedy step).
    temperature: torch.Tensor | None
    # [N] bool: greedy rows (temperature 0 or top_k 1); None when all_greedy.
    is_greedy: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [N] float32, None when no row uses top-p (< 1).
    top_p: torch.Tensor | None = None
    # [N] int64 (vocab size = disabled), None when no row uses top-k.
    top_k: torch.Tensor | None = None
    # [N] float32, None when no row uses min-p (> 0).
    min_p: torch.Tensor | None = None
    # row -> torch.Generator for requests with a seed (reproducible whatever the batch).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # [R] int64: the rows that draw, when the step mixes greedy and random rows (the
    # draw then runs on those rows only); None when all_greedy or all_random.
    random_rows: torch.Tensor | None = None
    # The same rows on the host (maps generators to positions without a device sync).
    random_row_ids: list[int] | None = None
    # None when every row is neutral.
    penalties: PenaltyMetadata | None = None
    # (row index [B], token id [B]) pairs set to -inf: EOS / stop ids until min_tokens,
    # the last token of a bad word whose prefix was just generated.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # (logits row index [B], bias [B, V]) added to those rows (zero where a token has
    # no bias), for the rows with a logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    # [N, V] bool, True where a token is NOT allowed (rows without a list: all False).
    disallowed_mask: torch.Tensor | None = None
    # xgrammar token bitmask of the structured-output rows, and those rows.
    grammar_bitmask: torch.Tensor | None = None  # [M, ceil(V / 32)] int32
    grammar_rows: list[int] | None = None
    # (logits row, its (processor, function) pairs, output token ids) of the rows whose
    # request has custom logits processors (pagedllm.logits_process); None when no row
    # has any.
    custom: list[tuple[int, list[tuple[Any, Any]], list[int]]] | None = None
    # Set by the sampler: logits row -> why a custom processor failed on it (the runner
    # fails those requests).
    custom_failures: dict[int, str] | None = None
    # Most top-k logprobs any row asked for (0: chosen token only); None: no row asked.
    max_num_logprobs: int | None = None
    # logits row -> the token ids whose logprobs it returns in place of its top-k
    # (SamplingParams.logprob_token_ids); None when no row has any.
    label_ids: dict[int, torch.Tensor] | None = None
