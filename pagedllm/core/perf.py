"""Estimated work per step, for model-FLOPs utilization (vLLM's --enable-mfu-metrics).

An analytic count from the model's shape and each step's tokens, per worker (the
tensor- and pipeline-parallel ranks split it evenly): what the step's math needs, not
what the kernels did. Per step:

- FLOPs: 2 per weight of every linear layer and token (the MoE layers' active experts
  only), 2 per LM-head weight and sampled row, and the attention's 4 x heads x head_dim
  per query token and position it attends to.
- Bytes read: every weight once (a step streams the whole model; the MoE layers' every
  expert), and each request's K/V over its context.
- Bytes written: the new tokens' K/V.

rate(flops) / peak FLOP/s is the MFU; rate(read + write) / peak bandwidth the memory
utilization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Per expert for MoE layers."""
    vocab_size: int
    num_experts: int = 0
    """0: a dense MLP."""
    experts_per_token: int = 0
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_elem: float = 2.0
    num_workers: int = 1

    @classmethod
    def from_hf_config(cls, hf_config: Any, weight_bytes_per_param: float,
                       kv_bytes_per_elem: float, num_workers: int) -> ModelShape:
        cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") \
            else hf_config
        hidden = cfg.hidden_size
        heads = cfg.num_attention_heads
        experts = (getattr(cfg, "num_local_experts", None)
                   or getattr(cfg, "num_experts", None) or 0)
        inter = (getattr(cfg, "moe_intermediate_size", None) if experts else None) \
            or getattr(cfg, "intermediate_size", None) or 4 * hidden
        return cls(num_layers=cfg.num_hidden_layers, hidden_size=hidden, num_heads=heads,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
                   intermediate_size=inter, vocab_size=cfg.vocab_size,
                   num_experts=experts,
                   experts_per_token=getattr(cfg, "num_experts_per_tok", 0) or 0,
                   weight_bytes_per_param=weight_bytes_per_param,
                   kv_bytes_per_elem=kv_bytes_per_elem, num_workers=num_workers)

    @property
    def attention_params(self) -> int:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv)  # q, k, v and o projections

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    @property
    def active_params_per_layer(self) -> int:
        experts = self.experts_per_token if self.num_experts else 1
        return self.attention_params + experts * self.expert_params

    @property
    def weight_params(self) -> int:
        experts = self.num_experts or 1
        return (self.num_layers * (self.attention_params + experts * self.expert_params)
                + self.vocab_size * self.hidden_size)

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token, every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_elem


class PerfCounter:
    """Cumulative estimates of one engine's steps, per worker."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self.flops = 0.0
        self.read_bytes = 0.0
        self.write_bytes = 0.0

    def observe(self, steps: list[tuple[int, int, int]]) -> None:
        """One step: per request (context before the step, tokens computed, rows
        sampled)."""
        if not steps:
            return
        s = self.shape
        tokens = sum(n for _, n, _ in steps)
        rows = sum(r for _, _, r in steps)
        # Positions each new token attends to: its own and every one before it.
        attended = sum(n * c + n * (n + 1) // 2 for c, n, _ in steps)
        flops = (2 * tokens * s.num_layers * s.active_params_per_layer
                 + 2 * rows * s.vocab_size * s.hidden_size
                 + 4 * s.num_layers * s.num_heads * s.head_dim * attended)
        read = (s.weight_params * s.weight_bytes_per_param
                + s.kv_bytes_per_token * sum(c + n for c, n, _ in steps))
        written = s.kv_bytes_per_token * tokens
        self.flops += flops / s.num_workers
        self.read_bytes += read / s.num_workers
        self.write_bytes += written / s.num_workers
