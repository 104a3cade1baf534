"""Gemma 3 text model (Gemma3ForCausalLM: gemma-3-1b and the text towers' checkpoints
saved as such): Gemma 2's decoder plus a per-head q/k RMSNorm (1 + w), with rope
parameters per layer type (`rope_parameters["sliding_attention"]` is the local base,
`["full_attention"]` the global one, optionally scaled) and, by default, no soft-capping.
The multimodal Gemma3ForConditionalGeneration is not supported."""

from __future__ import annotations

from typing import Any

from pagedllm.distributed.parallel_state import ParallelState
from pagedllm.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__(cfg, attn_backend, qk_norm=True, parallel=parallel)
