"""Rotary position embeddings, with every HF rope_type through transformers' own init.

The inverse frequencies (and yarn's / longrope's attention factor) come from
`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`, so scaled variants (linear,
llama3, yarn, ...) match HF by construction. cos/sin are tabulated once for every
position up to max_position and gathered by `positions` each step.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.ops import cpu_ops_available
from pagedllm.kernels.triton import layer_ops_for
from pagedllm.nn import Module


def rope_inv_freq(hf_config: Any, rotary_dim: int, layer_type: str | None = None,
                  ) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2], attention_factor) for the config's rope parameters."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (base ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kwargs)
    return inv_freq.float(), float(factor)


class RotaryEmbedding(Module):
    """Applies RoPE to q [T, H*D] and k [T, KVH*D] in place of their first rotary_dim dims.

    `is_neox_style` rotates halves (HF's rotate_half); otherwise adjacent pairs (GPT-J).
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int,
                 inv_freq: torch.Tensor, attention_factor: float = 1.0,
                 is_neox_style: bool = True) -> None:
        super().__init__()
        self.head_size, self.rotary_dim = head_size, rotary_dim
        self.is_neox_style = is_neox_style
        self._inv_freq, self._attention_factor = inv_freq, attention_factor
        self._cos, self._sin = self._table(max_position)

    def _table(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(num_positions, dtype=torch.float32)
        # [num_positions, rotary_dim // 2]
        freqs = positions[:, None] * self._inv_freq.to(positions.device)[None, :]
        # Plain tensors (not buffers): models are built on the meta device and loaded later.
        return (freqs.cos() * self._attention_factor), (freqs.sin() * self._attention_factor)

    @property
    def num_positions(self) -> int:
        return self._cos.shape[0]

    def cover(self, num_positions: int) -> None:
        """Tabulate at least `num_positions` positions: a max_model_len past the model's
        max_position_embeddings runs positions past the table, which the kernels read
        without a bounds check (memory beyond it: NaN logits some tokens later)."""
        if num_positions > self.num_positions:
            device, dtype = self._cos.device, self._cos.dtype
            cos, sin = self._table(num_positions)
            self._cos, self._sin = cos.to(device, dtype), sin.to(device, dtype)

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_position, rotary_dim // 2] on `device` in `dtype` (converted once)."""
        if self._cos.device != device or self._cos.dtype != dtype:
            self._cos, self._sin = self._cos.to(device, dtype), self._sin.to(device, dtype)
        return self._cos, self._sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H*D], k [T, KVH*D] -> rotated (q, k). NOTE: on CPU (the native op) and
        CUDA (a Triton kernel) q and k are rotated in place (they are fresh projections);
        use the returned tensors."""
        cos_t, sin_t = self.tables(q.device, q.dtype)
        if (q.dim() == 2 and k.dim() == 2 and q.stride(-1) == 1 and k.stride(-1) == 1
                and positions.dtype == torch.int64):
            if cpu_ops_available(q):
                cpu_ops.rotary_embedding(
                    q, k, positions, cos_t, sin_t, self.head_size, self.rotary_dim,
                    self.is_neox_style)
                return q, k
            if (gpu_ops := layer_ops_for(q)) is not None:
                gpu_ops.rotary_embedding(q, k, positions, cos_t, sin_t, self.head_size,
                                         self.rotary_dim, self.is_neox_style)
                return q, k
        cos, sin = cos_t[positions], sin_t[positions]  # [T, rotary_dim // 2]
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): HF's q*cos + rotate_half(q)*sin.
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if self.is_neox_style:
            rot = torch.cat((o1, o2), dim=-1)
        else:
            rot = torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((rot, rest), dim=-1).reshape(num_tokens, -1)


def get_rope(hf_config: Any, head_size: int, rotary_dim: int | None = None,
             max_position: int | None = None, is_neox_style: bool = True,
             layer_type: str | None = None) -> RotaryEmbedding:
    rotary_dim = rotary_dim or head_size
    max_position = max_position or getattr(hf_config, "max_position_embeddings", 8192)
    inv_freq, factor = rope_inv_freq(hf_config, rotary_dim, layer_type)
    return RotaryEmbedding(head_size, rotary_dim, max_position, inv_freq, factor, is_neox_style)
