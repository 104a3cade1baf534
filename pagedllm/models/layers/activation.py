"""Activations, including the gated forms applied to fused gate_up outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.ops import cpu_ops_available
from pagedllm.kernels.triton import layer_ops_for
from pagedllm.nn import Module


class SiluAndMul(Module):
    """[.., 2d] (gate | up) -> silu(gate) * up [.., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and cpu_ops_available(x):
            out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
            cpu_ops.silu_and_mul(out, x)
            return out
        if x.dim() == 2 and (gpu_ops := layer_ops_for(x)) is not None:
            return gpu_ops.silu_and_mul(x)  # one kernel
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(Module):
    """[.., 2d] (gate | up) -> gelu(gate) * up, with `approximate` as in HF's act names."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


class GeluTanh(Module):
    """GELU's tanh approximation: HF's gelu_new, gelu_fast, gelu_pytorch_tanh and Bloom's
    bloom_gelu are all this formula (they differ only in how the constants are spelled)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class QuickGelu(Module):
    """x * sigmoid(1.702 x) (HF's quick_gelu)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


# HF activation name (config.activation_function / hidden_act) -> module factory.
_ACTIVATIONS = {
    "gelu": nn.GELU,
    "gelu_new": GeluTanh,
    "gelu_fast": GeluTanh,
    "gelu_pytorch_tanh": GeluTanh,
    "bloom_gelu": GeluTanh,
    "quick_gelu": QuickGelu,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
}


def get_act_fn(name: str) -> nn.Module:
    """The element-wise activation HF calls `name` (ACT2FN's keys)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()
