"""Per-step sampling parameters of the requests that sample, gathered into tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """Row i describes the i-th logits row of the step."""

    # [N] float32; rows with temperature 0 are greedy (their value here is 1.0).
    temperature: torch.Tensor
    # [N] bool: greedy rows (temperature 0 or top_k 1).
    is_greedy: torch.Tensor
    all_greedy: bool
    all_random: bool
    # [N] float32, None when no row uses top-p (< 1).
    top_p: torch.Tensor | None
    # [N] int64 (vocab size = disabled), None when no row uses top-k.
    top_k: torch.Tensor | None
    # row -> torch.Generator for requests with a seed (reproducible whatever the batch).
    generators: dict[int, torch.Generator]
    # row -> token ids to mask (-inf) this step: EOS / stop ids until min_tokens.
    banned_token_ids: dict[int, list[int]]
