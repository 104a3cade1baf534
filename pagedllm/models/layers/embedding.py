"""Token embedding and the LM head (optionally tied to it), vocab-parallel under TP.

With tp_size > 1 the vocabulary is split into tp equal slices of ceil(V / tp) rows (the
last padded with zero rows): rank r holds ids [r * per, (r + 1) * per). The embedding
looks up the ids in its slice (zeros for the others) and all-reduces; the LM head computes
its slice of the logits and gathers them on rank 0, the rank that samples. A tied head
shares the embedding's slice, so the two always split the vocabulary the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.comm import all_reduce, gather
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.quant import QuantizedWeight, dequantize_rows, repack
from pagedllm.models.layers.linear import cpu_linear, native_bias, pack_for_cpu
from pagedllm.nn import Module


class VocabShard:
    """This rank's rows of a vocabulary of `vocab_size`: [start, start + per_rank)."""

    def __init__(self, vocab_size: int, parallel: ParallelState) -> None:
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // parallel.tp_size)
        self.start = parallel.tp_rank * self.per_rank
        # Real (unpadded) rows of this slice; the rest are zero padding.
        self.num_real = max(0, min(vocab_size - self.start, self.per_rank))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        """Copy this slice's rows of the full [V, ...] tensor; zero the padding rows."""
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"weight shape mismatch: expected ({self.vocab_size}, "
                             f"{', '.join(map(str, param.shape[1:]))}), "
                             f"got {tuple(loaded.shape)}")
        param.data[:self.num_real].copy_(loaded.narrow(0, self.start, self.num_real))
        param.data[self.num_real:].zero_()

    def quantized_rows(self, param: nn.Parameter, loaded: QuantizedWeight,
                       ) -> QuantizedWeight:
        """This slice's rows of the full table's GGUF blocks, padded with zero rows."""
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"weight shape mismatch: expected ({self.vocab_size}, "
                             f"{param.shape[1]}), got {loaded.shape}")
        return loaded.narrow(0, self.start, self.num_real).padded(self.per_rank)


class VocabEmbedding(Module):
    def __init__(self, vocab_size: int, hidden_size: int,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.parallel = parallel or SINGLE_RANK
        self.shard = VocabShard(vocab_size, self.parallel)
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(self.shard.per_rank, hidden_size),
                                   requires_grad=False)
        if self.parallel.tp_size > 1:
            self.weight.weight_loader = self.shard.weight_loader
        self.weight.quant_loader = self._load_quantized

    # GGUF blocks of the table, repacked (kernels/cpu/quant.py), else None: lookups
    # dequantize the rows they read, and a tied LM head runs the quantized GEMM on them.
    quant_weight: torch.Tensor | None = None
    _quant: QuantizedWeight | None = None

    def _load_quantized(self, param: nn.Parameter, loaded: QuantizedWeight,
                        shard_id: object = None) -> None:
        self._quant = self.shard.quantized_rows(param, loaded)
        self.finalize_quantized()  # now: the raw rows are freed as the load goes

    def finalize_quantized(self) -> None:
        """Keep the GGUF blocks (repacked) instead of a dense table."""
        if self._quant is not None:
            self.quant_weight, self._quant = repack(self._quant), None
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self._lookup(input_ids)
        # Ids outside this rank's slice look up row 0 and are zeroed; the all-reduce
        # then sums exactly one non-zero row per token (exact in every dtype).
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.per_rank)
        out = self._lookup(local.masked_fill(outside, 0))  # [T, hidden]
        out.masked_fill_(outside[:, None], 0)
        return all_reduce(out, self.parallel)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's table."""
        if self.quant_weight is None:
            return F.embedding(ids, self.weight)
        # The same values as F.embedding of the dequantized table (both ways).
        if not cpu_ops.cpu_ops_available(ids):
            return dequantize_rows(self.quant_weight, ids).to(self.weight.dtype)
        flat = ids.reshape(-1).long().contiguous()
        out = torch.empty(flat.numel(), self.hidden_size, dtype=self.weight.dtype)
        cpu_ops.quant_rows(out, self.quant_weight, flat, self.shard.per_rank)
        return out.view(*ids.shape, -1)


class LMHead(Module):
    """hidden [N, hidden] -> logits [N, vocab] in the model's dtype (the sampler converts
    to float32 only when it needs more than the argmax). Under TP the full logits exist
    on rank 0 only: the other ranks take part in the gather and get None."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.parallel = parallel or SINGLE_RANK
        self.shard = VocabShard(vocab_size, self.parallel)
        rows = self.shard.per_rank
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None
        if self.parallel.tp_size > 1:
            for param in (self.weight, self.bias):
                if param is not None:
                    param.weight_loader = self.shard.weight_loader
        self.weight.quant_loader = self._load_quantized
        # The embedding this head is tied to, in a tuple (not a submodule).
        self._tied: tuple[VocabEmbedding, ...] = ()

    # Packed copies of `weight` for eager CPU runs (pack_for_cpu; see LinearBase), else
    # None. The plain weight stays: it may be the (tied) embedding table.
    packed_weight: torch.Tensor | None = None
    native_weight: torch.Tensor | None = None
    native_bias: torch.Tensor | None = None

    # GGUF blocks of an untied head until finalize_quantized.
    _quant: QuantizedWeight | None = None

    def tie(self, embedding: VocabEmbedding) -> None:
        assert embedding.shard.per_rank == self.shard.per_rank, "tied slices must agree"
        self.weight = embedding.weight
        self._tied = (embedding,)

    def _load_quantized(self, param: nn.Parameter, loaded: QuantizedWeight,
                        shard_id: object = None) -> None:
        self._quant = self.shard.quantized_rows(param, loaded)
        self.finalize_quantized()

    def finalize_quantized(self) -> None:
        """After loading: the quantized GEMM on the head's GGUF blocks, or on those of the
        embedding it is tied to (one copy for both)."""
        packed = None
        if self._quant is not None:
            packed, self._quant = repack(self._quant), None
            self.weight.data = self.weight.data.new_empty(0)
        elif self._tied:
            self._tied[0].finalize_quantized()
            packed = self._tied[0].quant_weight
        if packed is not None:
            self.native_weight = packed
            self.native_bias = native_bias(self.bias, self.shard.per_rank)

    def pack_for_cpu(self) -> None:
        if self.native_weight is not None and self.native_weight.dtype == torch.uint8:
            return  # GGUF blocks (finalize_quantized)
        self.packed_weight, self.native_weight, self.native_bias = pack_for_cpu(self.weight,
                                                                                self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = cpu_linear(hidden, self.weight, self.bias, self.packed_weight,
                            self.native_weight, self.native_bias)  # [N, V / tp]
        if self.parallel.tp_size == 1:
            return logits
        full = gather(logits, self.parallel, dim=-1)  # [N, tp * per_rank] on rank 0
        if full is None or full.shape[-1] == self.shard.vocab_size:
            return full
        return full[:, :self.shard.vocab_size].contiguous()  # drop the padding columns

