"""Qwen3 (dense): Llama with an RMSNorm over each q and k head before RoPE, and an explicit
head_dim (128 in the released models, independent of hidden_size / num_heads)."""

from __future__ import annotations

from typing import Any

from pagedllm.distributed.parallel_state import ParallelState
from pagedllm.models.llama import LlamaForCausalLM, LlamaVariant


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        super().__init__(cfg, attn_backend, LlamaVariant(qk_norm=True), parallel)
