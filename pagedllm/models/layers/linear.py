"""Linear layers that know how they are split for tensor parallelism.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` so a model's
`load_weights` can fill fused projections (qkv_proj, gate_up_proj) from the separate HF
tensors and, with tp_size > 1, keep only this rank's slice. With tp_size == 1 (today's
executors) the slices are whole tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.cpu_kernels import cpu_ops_available
from pagedllm.config import cpu_has_avx512_bf16
from pagedllm.models.layers.module import Module

# Largest total of linear weights for which plain copies are kept for the GEMV (bytes).
GEMV_MAX_BYTES = 2 << 30


class LinearBase(Module):
    """y = x W^T (+ b) with W of shape [output_size, input_size] (this rank's part)."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.weight, self.bias, self.packed_weight, self.gemv_weight,
                          self.gemv_bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        _copy_checked(param.data, loaded)

    # oneDNN-packed copy of `weight` (CPU eager runs; see pack_linear_weights), else None.
    packed_weight: torch.Tensor | None = None
    # Plain bfloat16 weight [out, in] (and float32 bias) for the native single-token GEMV,
    # else None.
    gemv_weight: torch.Tensor | None = None
    gemv_bias: torch.Tensor | None = None

    def pack_for_cpu(self, release: bool = True, gemv: bool = False) -> None:
        """Use a oneDNN-packed copy of the weight from now on. With `gemv` (bfloat16) the
        plain weight is also kept for one-token steps; otherwise, with `release`, it is
        dropped (replaced by an empty tensor) so weights are not held twice."""
        if self.packed_weight is not None or not can_pack(self.weight):
            return
        self.packed_weight = pack_weight(self.weight)
        if gemv and can_gemv(self.weight):
            self.gemv_weight = self.weight.data.contiguous()
            if self.bias is not None and self.tp_rank == 0:
                self.gemv_bias = self.bias.data.float().contiguous()
        elif release:
            self.weight.data = self.weight.data.new_empty(0)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing pays off on CPU for float32 (~2x MKL's sgemm) and bfloat16."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


def can_gemv(weight: torch.Tensor) -> bool:
    """The native single-token GEMV (AVX512-BF16) applies to this bfloat16 weight."""
    return (weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0
            and cpu_has_avx512_bf16() and cpu_ops_available(weight))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> an opaque oneDNN tensor laid out for its GEMM (same values)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed_weight: torch.Tensor | None, gemv_weight: torch.Tensor | None = None,
               gemv_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, through the packed weight when there is one. x [N, in] -> [N, out].

    One token with a gemv_weight: the native GEMV, which streams the weight faster than
    oneDNN does at N = 1 (single-request decode is bound by reading the weights).
    """
    if gemv_weight is not None and x.shape[0] == 1 and x.dim() == 2 and x.stride(1) == 1:
        out = torch.empty((1, gemv_weight.shape[0]), dtype=x.dtype)
        torch.ops.pagedllm_cpu.gemv_bf16.default(out, x, gemv_weight, gemv_bias)
        return out
    if packed_weight is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise.default(x, packed_weight, bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Pack the weights of every layer that supports it (`pack_for_cpu`: linear layers, the
    LM head) for oneDNN; for eager CPU runs. Returns how many layers were packed.

    Models whose linear weights are small (<= GEMV_MAX_BYTES, bfloat16) also keep the plain
    weights for the single-token GEMV: twice the weight memory for ~25% faster
    single-request decoding.
    NOTE: other packed linear layers hold an empty `.weight`; nothing may read it afterwards.
    """
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    gemv = weight_bytes <= GEMV_MAX_BYTES
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            # A weight tied elsewhere (an embedding) must keep its plain values.
            module.pack_for_cpu(release=uses.get(id(module.weight), 0) == 1, gemv=gemv)
        elif callable(getattr(module, "pack_for_cpu", None)):
            module.pack_for_cpu()
        count += getattr(module, "packed_weight", None) is not None
    return count


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(dst.shape)}, "
                         f"got {tuple(src.shape)}")
    dst.copy_(src)


def _rank_slice(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if size == 1:
        return t
    part = t.shape[dim] // size
    return t.narrow(dim, rank * part, part)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (no communication after it)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(input_size, output_size // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        _copy_checked(param.data, _rank_slice(loaded, 0, self.tp_rank, self.tp_size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs need an all-reduce (TP > 1)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(input_size // tp_size, output_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        dim = 1 if param.dim() == 2 else None
        src = loaded if dim is None else _rank_slice(loaded, dim, self.tp_rank, self.tp_size)
        _copy_checked(param.data, src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: with tp_size > 1 the bias must be added once, after the all-reduce.
        return cpu_linear(x, self.weight, self.bias if self.tp_rank == 0 else None,
                          self.packed_weight, self.gemv_weight, self.gemv_bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one matrix (e.g. gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is None:  # checkpoint already fused
            return super().weight_loader(param, loaded)
        sizes = [s // self.tp_size for s in self.output_sizes]
        offset = sum(sizes[:shard_id])
        src = _rank_slice(loaded, 0, self.tp_rank, self.tp_size)
        _copy_checked(param.data.narrow(0, offset, sizes[shard_id]), src)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix: rows [q | k | v] of this rank's heads."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_size = head_size
        self.num_heads = num_heads // tp_size
        # MQA/GQA with fewer KV heads than ranks replicates KV heads.
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        # Ranks sharing one KV head when KV heads are replicated (1 otherwise).
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        total = (self.q_size + 2 * self.kv_size) * tp_size
        super().__init__(hidden_size, total, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is None:  # checkpoint already fused
            return super().weight_loader(param, loaded)
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        offset, size = offsets[shard_id]
        # This rank's slice index: its q heads, or the KV head group it reads.
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        src = loaded if self.tp_size == 1 else loaded.narrow(0, rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), src)
