"""Linear layers that know how they are split for tensor parallelism.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` so a model's
`load_weights` can fill fused projections (qkv_proj, gate_up_proj) from the separate HF
tensors and, with tp_size > 1, keep only this rank's slice. The layers take the worker's
`ParallelState` (distributed/parallel_state.py) at construction; without one they are
whole (one rank) and never communicate. A row-parallel layer all-reduces its output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.comm import all_reduce
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.features import has_f32_gemm_over_16bit, has_native_bf16_gemm
from pagedllm.kernels.cpu.ops import cpu_ops_available
from pagedllm.kernels.cpu.quant import QuantizedWeight, repack
from pagedllm.nn import Module

# Output columns per panel of a native-packed weight (kernels/cpu/csrc/cpu_gemm.cpp).
NATIVE_PANEL = 48


class StepRows:
    """The running step's prompt rows (bool [T]: the tokens that are prompt tokens of
    their request; worker/prompt_rows.py), which the quantized linears given this object
    pass to the quantized GEMM (gemm_quant's `prompt_rows`). One per model, bound by the
    runner around each forward pass, as the LoRA manager's LoRABatch is."""

    def __init__(self) -> None:
        self.prompt: torch.Tensor | None = None

    def of(self, x: torch.Tensor) -> torch.Tensor | None:
        """The marks of x's rows: the step's where x has one row per token of the step
        (a decoder layer's input), None otherwise."""
        prompt = self.prompt
        if prompt is None or x.dim() == 0 or x.numel() != prompt.shape[0] * x.shape[-1]:
            return None
        return prompt

    @contextlib.contextmanager
    def bound(self, prompt: torch.Tensor | None) -> Iterator[None]:
        """`prompt` as the step's marks for one forward pass."""
        self.prompt = prompt
        try:
            yield
        finally:
            self.prompt = None


class LinearBase(Module):
    """y = x W^T (+ b) with W of shape [output_size, input_size] (this rank's part)."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.parallel = parallel or SINGLE_RANK
        self.tp_rank, self.tp_size = self.parallel.tp_rank, self.parallel.tp_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        # GGUF blocks: this rank's part of them (rank_parts) run as they are stored.
        self.weight.quant_loader = self._load_quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x, self.bias)
        if self.lora is not None and self.lora.batch.active:
            self.lora.apply(x, y)
        return y

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T through whichever form the weight has, plus `bias` (a packed form
        adds its own: `_fused_bias`)."""
        prompt = self.step_rows.of(x) if self.step_rows is not None else None
        if self.native_shards is not None:
            return quantized_shards_linear(x, self.native_shards, prompt)
        return cpu_linear(x, self.weight, bias, self.packed_weight, self.native_weight,
                          self.native_bias, prompt)

    # The model's StepRows (set by the runner where the quantized GEMM runs prompt rows
    # on other kernels: worker/prompt_rows.py); None: every row alike.
    step_rows: StepRows | None = None

    # The LoRA adapters loaded for this layer (lora/layers.py LinearLoRA; set by the
    # worker's LoRA manager when an adapter targets it), applied to the rows of a step
    # that run one; None: never adapted.
    lora: Any = None

    def output_range(self, shard_id: str | int | None) -> tuple[int, int]:
        """(first row, rows) of a shard of the weight (None: all of it)."""
        assert shard_id is None, shard_id
        return 0, self.output_size

    def rank_parts(self, loaded: Any, shard_id: str | int | None = None,
                   ) -> list[tuple[str | int | None, Any]]:
        """This rank's part(s) of a checkpoint tensor (a torch.Tensor, or GGUF blocks:
        QuantizedWeight slices alike) of shard `shard_id`, each with the shard of the
        weight it fills (None: all of it)."""
        return [(None, loaded)]

    def lora_parts(self, a: torch.Tensor, b: torch.Tensor, shard_id: str | int | None,
                   ) -> list[tuple[str | int | None, torch.Tensor, torch.Tensor]]:
        """This rank's part of a LoRA adapter's A [r, in] and B [out, r] for shard
        `shard_id`: [(shard, A, B)]. Output rows split as the weight's (B's rows, A
        whole); input columns (a row-parallel layer) split A's columns, B whole, and
        each rank's partial delta joins its partial output before the all-reduce."""
        return [(sid, a, part) for sid, part in self.rank_parts(b, shard_id)]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | int | None = None) -> None:
        for sid, part in self.rank_parts(loaded, shard_id):
            dst = param.data if sid is None else param.data.narrow(0, *self.output_range(sid))
            _copy_checked(dst, part)

    # oneDNN-packed copy of `weight` (CPU eager float32 runs; see pack_linear_weights).
    packed_weight: torch.Tensor | None = None
    # bfloat16 weight packed for the native GEMM, or GGUF blocks (uint8) repacked for the
    # quantized GEMM (finalize_quantized), and its float32 bias (zeros without one; its
    # length is the output size), else None.
    native_weight: torch.Tensor | None = None
    native_bias: torch.Tensor | None = None
    # A fused projection whose GGUF shards differ in type (Q4_K_M files store v as Q6_K
    # next to Q4_K q and k): (repacked blocks, float32 bias) per shard in row order, each
    # multiplied into its columns of the output (not dequantized: the weights stay the
    # file's size).
    native_shards: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    # GGUF blocks loaded for the weight, by shard id, until finalize_quantized.
    _quant_shards: dict[str | int | None, QuantizedWeight] | None = None

    def _load_quantized(self, param: nn.Parameter, loaded: QuantizedWeight,
                        shard_id: str | int | None = None) -> None:
        try:
            parts = self.rank_parts(loaded, shard_id)
        except ValueError:  # a rank's columns cut through blocks: it runs dense
            self.weight_loader(param, loaded.dequantize(param.dtype), shard_id)
            return
        if self._quant_shards is None:
            self._quant_shards = {}
        self._quant_shards.update(parts)
        if None in self._quant_shards or set(self._shard_ids()) <= set(self._quant_shards):
            # Repack now, not after the whole model: the raw rows are freed as the load
            # goes, and the packed copy reuses their memory (peak RSS ~ the file).
            self.finalize_quantized()

    def _shard_ids(self) -> list[str | int | None]:
        """The weight's row shards in order (subclasses that fuse projections)."""
        return [None]

    def finalize_quantized(self) -> None:
        """Once the weight's shards are loaded (or after loading, for the rest): run the
        GGUF blocks loaded for the weight through the quantized GEMM when they cover it
        (repacked once, as one weight where the shards share a type, else shard by shard;
        the plain weight is released), else dequantize them into the weight (some shards
        came as plain tensors)."""
        shards, self._quant_shards = self._quant_shards, None
        if not shards:
            return
        ids = [None] if None in shards else self._shard_ids()
        parts = [shards.get(i) for i in ids]
        whole = (None not in parts and sum(p.shape[0] for p in parts) == self.output_size
                 and all(p.in_features == self.input_size for p in parts))
        if not whole:  # the parts are this rank's already: copied, not sliced again
            for shard_id, part in shards.items():
                dst = (self.weight.data if shard_id is None
                       else self.weight.data.narrow(0, *self.output_range(shard_id)))
                _copy_checked(dst, part.dequantize(self.weight.dtype))
            return
        shards = pack_quantized(parts, native_bias(self._fused_bias(), self.output_size))
        if len(shards) == 1:
            self.native_weight, self.native_bias = shards[0]
        else:
            self.native_shards = shards
        self.weight.data = self.weight.data.new_empty(0)

    def pack_for_cpu(self, release: bool = True) -> None:
        """Use a packed copy of the weight from now on: the native GEMM's layout for
        bfloat16 where the CPU has AVX512-BF16, oneDNN's otherwise. With `release` the
        plain weight is dropped (replaced by an empty tensor) so weights are not held
        twice."""
        if (self.packed_weight is not None or self.native_weight is not None
                or self.native_shards is not None):
            return
        self.packed_weight, self.native_weight, self.native_bias = pack_for_cpu(
            self.weight, self._fused_bias())
        if release and (self.packed_weight is not None or self.native_weight is not None):
            self.weight.data = self.weight.data.new_empty(0)

    def _fused_bias(self) -> torch.Tensor | None:
        """The bias the GEMM adds (a row-parallel layer adds its own after the reduce)."""
        return self.bias


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing pays off on CPU for float32 (~2x MKL's sgemm) and bfloat16, where
    oneDNN runs bfloat16 at all: its bf16 reorder needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT and raises elsewhere (Zen 2/3, Haswell-era Intel), where F.linear's
    plain path still computes bfloat16."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def can_native(weight: torch.Tensor) -> bool:
    """A native GEMM applies to this weight: bfloat16 on AVX512-BF16 or AVX2, or float32
    (every CPU: batch invariant, where oneDNN's float32 GEMM rounds by batch shape)."""
    if weight.dim() != 2 or not cpu_ops_available(weight):
        return False
    if weight.dtype == torch.bfloat16:
        return weight.shape[1] % 2 == 0 and has_native_bf16_gemm()
    return weight.dtype == torch.float32


def is_bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every float32 value of `weight` is a bfloat16 one (its low 16 bits zero), as
    when a bfloat16 checkpoint runs in float32."""
    if weight.dtype != torch.float32 or weight.numel() == 0:
        return False
    # Little-endian: each value's low half comes first.
    low = weight.detach().contiguous().view(torch.int16).view(-1)[0::2]
    # The first values settle a float32 checkpoint's weights at once; a whole check takes
    # ~40 ms per 28M values (SmolLM2's LM head).
    return not bool(low[:4096].any()) and not bool(low.any())


def is_f16_exact(weight: torch.Tensor) -> bool:
    """Whether every float32 value of `weight` is a float16 one (NaN counts as not), as
    when a float16 checkpoint or GGUF file runs in float32."""
    if weight.dtype != torch.float32 or weight.numel() == 0:
        return False
    flat = weight.detach().reshape(-1)
    head = flat[:4096]  # settles most other weights at once, as in is_bf16_exact
    return torch.equal(head.half().float(), head) and torch.equal(flat.half().float(), flat)


def pack_native(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> panels of 48 output columns (rows past N are zero), as
    cpu_gemm.cpp reads them: bfloat16 [ceil(N / 48), K / 2, 48, 2] (each pair of K of 48
    columns one contiguous run), float32 or float16 [ceil(N / 48), K, 48].

    A float32 weight whose values are all bfloat16 (is_bf16_exact) or else all float16
    (is_f16_exact) is packed in that dtype where gemm_f32 reads it
    (has_f32_gemm_over_16bit: AVX2 without AVX-512): the same bits from half the bytes,
    which a decode step streams from memory (measured on Zen 3: bfloat16 checkpoints in
    float32 decode ~1.8x faster, as in bfloat16)."""
    if weight.dtype == torch.float32 and has_f32_gemm_over_16bit():
        if weight.shape[1] % 2 == 0 and is_bf16_exact(weight):
            weight = weight.detach().bfloat16()
        elif is_f16_exact(weight):
            weight = weight.detach().half()
    n, k = weight.shape
    panels = -(-n // NATIVE_PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, panels * NATIVE_PANEL - n))
    if weight.dtype != torch.bfloat16:
        return padded.view(panels, NATIVE_PANEL, k).transpose(1, 2).contiguous()
    return padded.view(panels, NATIVE_PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def native_bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The native GEMM's float32 bias: zeros without one (it also carries N)."""
    if bias is None:
        return torch.zeros(out_features, dtype=torch.float32)
    return bias.detach().float().contiguous()


def pack_for_cpu(weight: torch.Tensor, bias: torch.Tensor | None,
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(packed_weight, native_weight, native_bias) for `weight`: the native GEMM's layout
    (float32, or bfloat16 where the CPU has AVX512-BF16 or AVX2), oneDNN's otherwise,
    none if neither fits."""
    if can_native(weight):
        return None, pack_native(weight), native_bias(bias, weight.shape[0])
    if can_pack(weight):
        return pack_weight(weight), None, None
    return None, None, None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> an opaque oneDNN tensor laid out for its GEMM (same values)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed_weight: torch.Tensor | None, native_weight: torch.Tensor | None = None,
               native_bias: torch.Tensor | None = None,
               prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, through the packed weight when there is one. x [..., in] -> [..., out].

    bfloat16 with a native_weight: the native GEMM (faster than oneDNN's at every row count
    measured, most at decode batches: weights stream from memory every step); float32:
    the native GEMM whose rows do not depend on the batch. A uint8
    native_weight holds GGUF blocks: the quantized GEMM (bfloat16 or float32 x), given
    `prompt_rows` (StepRows).
    """
    if native_weight is not None and native_weight.dtype == torch.uint8:
        return quantized_shards_linear(x, ((native_weight, native_bias),), prompt_rows)
    if native_weight is not None:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(1) != 1 or x2.stride(0) % 2:
            x2 = x2.contiguous()
        out = torch.empty((x2.shape[0], native_bias.numel()), dtype=x.dtype)
        # float32 x may meet 16-bit panels (pack_native): the GEMM goes by x's dtype.
        gemm = cpu_ops.gemm_f32 if x.dtype == torch.float32 else cpu_ops.gemm_bf16
        gemm(out, x2, native_weight, native_bias)
        return out.view(*x.shape[:-1], out.shape[1])
    if packed_weight is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise.default(x, packed_weight, bias, "none", [], "")


def pack_quantized(parts: list[QuantizedWeight], bias: torch.Tensor,
                   ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The GGUF blocks of a weight's row shards (in order, covering it) as the quantized
    GEMM runs them: each run of shards of one type stacked and repacked once (one run
    for most weights), with its rows of the float32 `bias`."""
    runs = [[parts[0]]]
    for part in parts[1:]:
        if part.qtype == runs[-1][-1].qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    blocks = [repack(QuantizedWeight.cat(run) if len(run) > 1 else run[0]) for run in runs]
    rows = [sum(p.shape[0] for p in run) for run in runs]
    return tuple(zip(blocks, (b.contiguous() for b in bias.split(rows))))


def quantized_shards_linear(x: torch.Tensor,
                            shards: tuple[tuple[torch.Tensor, torch.Tensor], ...],
                            prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for W stored as GGUF blocks, in shards stacked by rows (one, or
    LinearBase.native_shards' runs of different types): each shard's quantized GEMM
    writes its own columns of the output. x [..., in] -> [..., out]; `prompt_rows`
    (bool, one per row of x) as gemm_quant takes them."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], sum(bias.numel() for _, bias in shards)), dtype=x.dtype)
    start = 0
    for blocks, bias in shards:
        cpu_ops.gemm_quant(out.narrow(1, start, bias.numel()), x2, blocks, bias,
                           prompt_rows=prompt_rows)
        start += bias.numel()
    return out.view(*x.shape[:-1], out.shape[1])


def finalize_quantized_weights(model: nn.Module) -> None:
    """After `load_weights`: every module holding GGUF blocks (`finalize_quantized`)
    repacks them for the quantized GEMM or dequantizes them (see LinearBase)."""
    for module in model.modules():
        if callable(getattr(module, "finalize_quantized", None)):
            module.finalize_quantized()


def pack_linear_weights(model: nn.Module) -> int:
    """Pack the weights of every layer that supports it (`pack_for_cpu`: linear layers, the
    LM head) for eager CPU runs. Returns how many layers were packed.

    NOTE: packed linear layers hold an empty `.weight` (unless tied to another module);
    nothing may read it afterwards.
    """
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            # A weight tied elsewhere (an embedding) must keep its plain values.
            module.pack_for_cpu(release=uses.get(id(module.weight), 0) == 1)
        elif callable(getattr(module, "pack_for_cpu", None)):
            module.pack_for_cpu()
        count += any(getattr(module, name, None) is not None
                     for name in ("packed_weight", "native_weight", "native_shards"))
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


def _tp_size(parallel: ParallelState | None) -> int:
    return (parallel or SINGLE_RANK).tp_size


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks (no communication after it): rank r holds
    output rows [r * out / tp, (r + 1) * out / tp) of the weight and bias."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 parallel: ParallelState | None = None) -> None:
        super().__init__(input_size, output_size // _tp_size(parallel), bias, parallel)

    def rank_parts(self, loaded, shard_id=None):
        return [(None, _rank_slice(loaded, 0, self.tp_rank, self.tp_size))]


class RowParallelLinear(LinearBase):
    """Input features split across ranks (rank r holds input columns
    [r * in / tp, (r + 1) * in / tp)); each rank's partial output is all-reduced, so every
    rank returns the whole y. The bias is replicated and added once, after the reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 parallel: ParallelState | None = None) -> None:
        super().__init__(input_size // _tp_size(parallel), output_size, bias, parallel)

    def rank_parts(self, loaded, shard_id=None):
        if loaded.dim() != 2:  # the bias: whole on every rank
            return [(None, loaded)]
        return [(None, _rank_slice(loaded, 1, self.tp_rank, self.tp_size))]

    def lora_parts(self, a, b, shard_id):
        return [(sid, part, b) for sid, part in self.rank_parts(a, shard_id)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        # NOTE: the bias must be added once, after the all-reduce (not on every rank).
        out = self._product(x, None)  # a native_bias holds zeros here (_fused_bias)
        if self.lora is not None and self.lora.batch.active:
            self.lora.apply(x, out)  # this rank's columns' share of the delta
        all_reduce(out, self.parallel)
        return out if self.bias is None else out + self.bias

    def _fused_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp_size == 1 else None


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one matrix (e.g. gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 parallel: ParallelState | None = None) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, parallel)

    def _shard_ids(self) -> list[str | int | None]:
        return list(range(len(self.output_sizes)))

    def rank_parts(self, loaded, shard_id=None):
        if shard_id is None:  # checkpoint already fused: rows [shard 0 | shard 1 | ...]
            if self.tp_size == 1:
                return [(None, loaded)]
            return [part for j, whole in enumerate(loaded.split(self.output_sizes, dim=0))
                    for part in self.rank_parts(whole, j)]
        return [(shard_id, _rank_slice(loaded, 0, self.tp_rank, self.tp_size))]

    def output_range(self, shard_id: str | int | None) -> tuple[int, int]:
        if shard_id is None:
            return super().output_range(None)
        sizes = [s // self.tp_size for s in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix: rows [q | k | v] of this rank's heads."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, parallel: ParallelState | None = None) -> None:
        tp_size = _tp_size(parallel)
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        # Rank r runs q heads [r * H / tp, (r + 1) * H / tp).
        self.num_heads = num_heads // tp_size
        # MQA/GQA with fewer KV heads than ranks replicates KV heads: each rank keeps the
        # one KV head its q heads read (q head h reads KV head h * KVH // H).
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        # Ranks sharing one KV head when KV heads are replicated (1 otherwise).
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        total = (self.q_size + 2 * self.kv_size) * tp_size
        super().__init__(hidden_size, total, bias, parallel)

    def _shard_ids(self) -> list[str | int | None]:
        return ["q", "k", "v"]

    def rank_parts(self, loaded, shard_id=None):
        if shard_id is None:  # checkpoint already fused: rows [q | k | v] of all heads
            if self.tp_size == 1:
                return [(None, loaded)]
            q_rows = self.total_num_heads * self.head_size
            kv_rows = self.total_num_kv_heads * self.head_size
            return [part for whole, sid in zip(
                loaded.split([q_rows, kv_rows, kv_rows], dim=0), "qkv")
                for part in self.rank_parts(whole, sid)]
        _, size = self.output_range(shard_id)
        # This rank's slice index: its q heads, or the KV head group it reads.
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        return [(shard_id, loaded if self.tp_size == 1 else loaded.narrow(0, rank * size,
                                                                          size))]

    def output_range(self, shard_id: str | int | None) -> tuple[int, int]:
        if shard_id is None:
            return super().output_range(None)
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]
