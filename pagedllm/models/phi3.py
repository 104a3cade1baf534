"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama whose checkpoint stores `qkv_proj` and
`gate_up_proj` already fused (rows [q | k | v] and [gate | up], the layout of the fused
layers here), with optional partial rotary (`partial_rotary_factor`) and a config-wide
sliding window.

NOTE: `longrope` (formerly `su`) scaling uses the short factors, as HF does while the
sequence stays within `original_max_position_embeddings`; HF switches the whole sequence
to the long factors (recomputing its cache) beyond that, which is not implemented here.
"""

from __future__ import annotations

from typing import Any

from pagedllm.distributed.parallel_state import ParallelState
from pagedllm.models.llama import LlamaForCausalLM, LlamaVariant


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__(cfg, attn_backend, LlamaVariant(stacked_params=()), parallel)
