"""Mixtral: Mistral's attention with a sparse mixture-of-experts feed-forward.

Each token's router logits pick the top-k experts; their softmax probabilities, taken over
all experts and renormalized over the chosen k (HF's MixtralTopKRouter), weight the
experts' SiLU-gated MLP outputs. Expert weights are stacked into [num_experts, ...]
parameters, filled from HF's per-expert `experts.{e}.w1/w2/w3` tensors on load.

Tensor parallel: every rank holds every expert, sliced along the intermediate dim (w1/w3
rows, w2 columns), as a dense MLP is; the router is replicated, so all ranks route alike,
and the block's partial outputs are all-reduced once. With expert parallelism
(ParallelState.expert_parallel) each rank holds whole experts, its share of them: it
runs the rows routed to its experts, and the same all-reduce adds the ranks' partial
sums (every rank has every token, after the attention's all-reduce, so no all-to-all).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.comm import all_reduce
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.kernels.cpu.quant import QuantizedWeight
from pagedllm.models.layers.linear import (LinearBase, cpu_linear, native_bias, pack_for_cpu,
                                           pack_quantized, quantized_shards_linear)
from pagedllm.models.llama import LlamaForCausalLM, LlamaVariant
from pagedllm.models.utils import LLAMA_STACKED_PARAMS


class ExpertLinear(nn.Module):
    """One linear map per expert this rank holds: weight [local experts,
    sum(output_sizes), input_size].

    Shard (e, j) of a checkpoint is expert e's j-th output block (w13: w1 = gate rows,
    then w3 = up rows), as MergedColumnParallelLinear stacks them for a dense MLP.
    Sizes are this rank's; `tp_dim` is the checkpoint tensor's dim this rank takes a
    1/tp_size slice of (0: output rows, w13; 1: input columns, w2) when experts are
    sliced; under expert parallelism the rank holds whole experts
    (`parallel.local_experts`) and skips the others' tensors.
    """

    def __init__(self, num_experts: int, output_sizes: list[int], input_size: int,
                 tp_dim: int = 0, parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.output_sizes, self.tp_dim = output_sizes, tp_dim
        self.parallel = parallel or SINGLE_RANK
        # Global ids of the experts held here; expert_ids[i] is stored at index i.
        self.expert_ids = self.parallel.local_experts(num_experts)
        self._index = {e: i for i, e in enumerate(self.expert_ids)}
        # Ranks each expert's width is sliced among (1: whole experts).
        self.slices = 1 if self.parallel.expert_parallel else self.parallel.tp_size
        self.num_experts, self.input_size = len(self.expert_ids), input_size
        self.weight = nn.Parameter(
            torch.empty(self.num_experts, sum(output_sizes), input_size),
            requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if self.slices == 1:  # GGUF blocks run whole experts only
            self.weight.quant_loader = self._load_quantized

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, int] | None = None) -> None:
        slices = self.slices
        if shard_id is None and (slices > 1 or self.parallel.ep_size > 1):
            # Stacked [E, sum(full sizes), in]: per expert and shard.
            full = [s * slices if self.tp_dim == 0 else s for s in self.output_sizes]
            for expert, per_expert in enumerate(loaded):
                for j, part in enumerate(per_expert.split(full, dim=0)):
                    self.weight_loader(param, part, (expert, j))
            return
        if shard_id is None:  # all experts at once, already stacked
            dst = param.data
        else:
            expert, j = shard_id
            if expert not in self._index:
                return  # another rank's expert
            offset = sum(self.output_sizes[:j])
            dst = param.data[self._index[expert]].narrow(0, offset, self.output_sizes[j])
            if slices > 1:  # this rank's 1/tp of the expert's rows (w13) or columns (w2)
                part = loaded.shape[self.tp_dim] // slices
                loaded = loaded.narrow(self.tp_dim, self.parallel.tp_rank * part, part)
        if dst.shape != loaded.shape:
            raise ValueError(f"weight shape mismatch: expected {tuple(dst.shape)}, "
                             f"got {tuple(loaded.shape)}")
        dst.copy_(loaded)

    # Per expert: (oneDNN-packed weight, native-packed weight, native bias), once packed.
    packed: list[tuple[torch.Tensor | None, ...]] | None = None
    # GGUF (quantization "gguf"): per expert its blocks as the quantized GEMM runs them
    # (None for an expert that came as plain tensors), and the blocks of experts whose
    # shards are still arriving.
    quantized: list[tuple[tuple[torch.Tensor, torch.Tensor], ...] | None] | None = None
    _quant_parts: dict[int, dict[int, QuantizedWeight]] | None = None

    def _load_quantized(self, param: nn.Parameter, loaded: QuantizedWeight,
                        shard_id: tuple[int, int]) -> None:
        expert, j = shard_id
        if expert not in self._index:
            return  # another rank's expert
        if self._quant_parts is None:
            self._quant_parts = {}
        parts = self._quant_parts.setdefault(expert, {})
        parts[j] = loaded
        if len(parts) == len(self.output_sizes):
            self._finalize_expert(expert)  # repack now: the raw rows are freed as we go

    def _finalize_expert(self, expert: int) -> None:
        """An expert's GGUF blocks run through the quantized GEMM when they cover its
        weight, else are dequantized into it (some shards came plain)."""
        parts = self._quant_parts.pop(expert)
        ordered = [parts.get(j) for j in range(len(self.output_sizes))]
        if None in ordered or [p.shape for p in ordered] != [
                (rows, self.input_size) for rows in self.output_sizes]:
            for j, part in parts.items():
                self.weight_loader(self.weight, part.dequantize(self.weight.dtype),
                                   (expert, j))
            return
        if self.quantized is None:
            self.quantized = [None] * self.num_experts
        self.quantized[self._index[expert]] = pack_quantized(
            ordered, native_bias(None, sum(self.output_sizes)))

    def finalize_quantized(self) -> None:
        """After loading (finalize_quantized_weights): experts left with some shards
        plain are dequantized; the plain weight is dropped when every expert runs
        blocks."""
        for expert in list(self._quant_parts or {}):
            self._finalize_expert(expert)
        self._quant_parts = None
        if self.quantized is not None and all(q is not None for q in self.quantized):
            self.weight.data = self.weight.data.new_empty(0)

    def pack_for_cpu(self) -> None:
        """Pack each expert's weight as a linear layer's (pack_linear_weights calls this
        on CPU): the native GEMM sums each output row in one chain whatever the number
        of rows, so an expert's output for a token does not depend on how many tokens
        it got. The plain weight is dropped when every expert is packed. Experts that
        run GGUF blocks are not packed."""
        if self.packed is not None or not self.weight.numel():
            return
        quantized = self.quantized or [None] * self.num_experts
        self.packed = [pack_for_cpu(w, None) if q is None else (None, None, None)
                       for w, q in zip(self.weight.data, quantized)]
        if all(p[0] is not None or p[1] is not None or q is not None
               for p, q in zip(self.packed, quantized)):
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] through the linear map of the expert stored at index `expert`
        (global id expert_ids[expert]) -> [rows, sum(output_sizes)]."""
        if self.quantized is not None and self.quantized[expert] is not None:
            return quantized_shards_linear(x, self.quantized[expert])
        if self.packed is None:
            return F.linear(x, self.weight[expert])
        packed, native, bias = self.packed[expert]
        weight = self.weight[expert] if self.weight.numel() else self.weight
        return cpu_linear(x, weight, None, packed, native, bias)


class MixtralMoE(nn.Module):
    """x [T, hidden] -> sum over its top-k experts of weight * expert_mlp(x) [T, hidden].

    `intermediate_size` is each expert's (default: the config's intermediate_size);
    `renormalize` divides the top-k probabilities by their sum (Mixtral; Qwen3-MoE's
    norm_topk_prob), else they weight the experts as the softmax gave them."""

    def __init__(self, cfg: Any, parallel: ParallelState | None = None, layer: int = 0,
                 intermediate_size: int | None = None, renormalize: bool = True) -> None:
        super().__init__()
        self.parallel = parallel or SINGLE_RANK
        self.num_experts, self.top_k = cfg.num_local_experts, cfg.num_experts_per_tok
        self.renormalize = renormalize
        hidden = cfg.hidden_size
        slices = 1 if self.parallel.expert_parallel else self.parallel.tp_size
        inter = (intermediate_size or cfg.intermediate_size) // slices
        self.gate = LinearBase(hidden, self.num_experts, bias=False)  # the router
        self.experts = nn.Module()
        self.experts.w13 = ExpertLinear(self.num_experts, [inter, inter], hidden, 0,
                                        self.parallel)
        self.experts.w2 = ExpertLinear(self.num_experts, [hidden], inter, 1, self.parallel)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] float32, topk_ids [T, k]) as HF computes them."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.route(x)
        # Each (token, slot) pair is one row of work; group the rows by expert so every
        # expert runs one matmul over all of its tokens (no loop over tokens).
        flat_ids = topk_ids.flatten()  # [T*k]: row r is token r // k, slot r % k
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // self.top_k  # [T*k] token of each sorted row
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # host sync
        rows = x[token_of]  # [T*k, hidden]
        w13, w2 = self.experts.w13, self.experts.w2
        # Under expert parallelism the rows of other ranks' experts stay zero here: a
        # token's sum then gains their outputs in the all-reduce.
        partial = w13.num_experts < self.num_experts
        out = (torch.zeros_like if partial else torch.empty_like)(rows)
        starts = [0, *itertools.accumulate(counts)]
        for index, expert in enumerate(w13.expert_ids):
            start, end = starts[expert], starts[expert + 1]
            if start == end:
                continue
            gate, up = w13(index, rows[start:end]).chunk(2, dim=-1)
            out[start:end] = w2(index, F.silu(gate) * up)
        # As HF: the float32 routing weight scales the expert output before the sum.
        out = (out * topk_weights.flatten()[order, None]).to(x.dtype)
        return all_reduce(torch.zeros_like(x).index_add_(0, token_of, out), self.parallel)


def expert_stacked_params(num_experts: int, names: tuple[str, str, str] = ("w1", "w3", "w2"),
                          ) -> tuple[tuple[str, str, Any], ...]:
    """HF's per-expert gate / up / down tensors (Mixtral's `experts.{e}.w1/w3/w2`;
    `names` for other families) -> rows of w13[e] and w2[e]. Listed before a dense
    MLP's own entries: `.gate_proj.` would otherwise match inside `.experts.0.gate_proj.`."""
    gate, up, down = names
    return tuple(entry for e in range(num_experts) for entry in (
        ("experts.w13", f"experts.{e}.{gate}", (e, 0)),
        ("experts.w13", f"experts.{e}.{up}", (e, 1)),
        ("experts.w2", f"experts.{e}.{down}", (e, 0))))


class MixtralForCausalLM(LlamaForCausalLM):
    # The MoE block groups tokens by expert on the host (a sync, counts that change
    # every step): a CUDA graph cannot hold it, so every step runs eagerly.
    supports_cuda_graphs = False

    def __init__(self, cfg: Any, attn_backend: str,
                 parallel: ParallelState | None = None) -> None:
        variant = LlamaVariant(make_mlp=MixtralMoE, stacked_params=(
            expert_stacked_params(cfg.num_local_experts) + LLAMA_STACKED_PARAMS))
        super().__init__(cfg, attn_backend, variant, parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            # The MoE block sits where Llama's MLP does: HF calls it block_sparse_moe.
            for name, tensor in weights:
                yield name.replace(".block_sparse_moe.", ".mlp."), tensor

        return super().load_weights(renamed())
