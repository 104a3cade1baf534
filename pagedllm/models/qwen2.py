"""Qwen2 / Qwen2.5: Llama with a bias on q/k/v (none on o_proj).

Sliding-window attention is per layer as in HF: only with `use_sliding_window`, and then
on layers i >= max_window_layers (HF's config turns both into `layer_types`).
"""

from __future__ import annotations

from typing import Any

from pagedllm.distributed.parallel_state import ParallelState
from pagedllm.models.llama import LlamaForCausalLM, LlamaVariant


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__(cfg, attn_backend, LlamaVariant(qkv_bias=True, o_bias=False), parallel)
