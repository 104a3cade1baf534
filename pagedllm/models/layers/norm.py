"""Normalization layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.ops import cpu_ops_available
from pagedllm.kernels.triton import layer_ops_for
from pagedllm.nn import Module


class RMSNorm(Module):
    """x / rms(x) * w, computed in float32. `offset=1.0` gives Gemma's (1 + w) form."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops_available(x):
            # One fused native op, same float32 math (kernels/cpu/csrc/cpu_ops.cpp).
            rows = x.reshape(-1, x.shape[-1])
            out = torch.empty(rows.shape, dtype=x.dtype)
            cpu_ops.rms_norm(out, rows, self.weight, self.eps, self.offset)
            return out.view(x.shape)
        if (gpu_ops := layer_ops_for(x)) is not None:
            return gpu_ops.rms_norm(x, self.weight, self.eps, self.offset)  # one kernel
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (self.weight.float() + self.offset)).to(dtype)


class LayerNorm(Module):
    """(x - mean) / std * w + b over the last dim, in float32 (nn.LayerNorm's math).

    `elementwise_affine=False` (some OPT checkpoints) has no parameters; `bias=False` keeps
    the scale only.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = self.bias = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
            if bias:
                self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(x.float(), (self.hidden_size,), weight, bias, self.eps)
        return out.to(x.dtype)
