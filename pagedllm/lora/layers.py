"""LoRA on a linear layer, per token row: y[rows of adapter a] += scale_a (x A_a^T) B_a^T.

One `LoRABatch` per model says which adapter each token row of the running step uses
(the runner sets it around a forward); every adapted linear holds a `LinearLoRA` with
the loaded adapters' weights for it and reads that batch. Rows without an adapter, and
whole steps without any, are left exactly as the base layer computed them.

A fused linear (qkv_proj, gate_up_proj) takes each shard's adapter at once: A of the
shards stacked [R, K] and B placed block-diagonally [N, R] (zeros elsewhere, which add
exact zeros), so one pass serves all its shards. The delta is computed in float32 and
added to the output with one rounding. On CPU the native `lora_apply` computes it (the
native decoder stack calls the same op, so both paths give the same bits): row by row,
in an order fixed by the shapes alone, so a row's result does not depend on which other
rows share the step (DESIGN.md §10). Elsewhere (CUDA) torch's matmuls do.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.ops import cpu_ops_available


class LoRABatch:
    """The running step's adapters: (lora_int_id, token rows as an int64 tensor, or None
    for every row) per adapter in the step; () outside a forward or without adapters."""

    def __init__(self) -> None:
        self.segments: tuple[tuple[int, torch.Tensor | None], ...] = ()

    @property
    def active(self) -> bool:
        return bool(self.segments)


class LinearLoRA:
    """The loaded adapters of one linear layer [output_size, input_size]."""

    def __init__(self, batch: LoRABatch, input_size: int, output_size: int,
                 device: torch.device) -> None:
        self.batch = batch
        self.input_size, self.output_size = input_size, output_size
        self.device = device
        self.native = device.type == "cpu" and cpu_ops_available(torch.empty(0))
        # lora_int_id -> (A^T [K, R], B^T [R, N] with the scale folded in), float32.
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, lora_id: int,
            shards: list[tuple[int, torch.Tensor, torch.Tensor, float]]) -> None:
        """Adapter `lora_id`'s weights for this layer: per shard (first output row,
        A [r, K], B [rows, r], scale)."""
        rank = sum(a.shape[0] for _, a, _, _ in shards)
        a_all = torch.cat([a for _, a, _, _ in shards]).float()
        b_all = torch.zeros(self.output_size, rank)
        col = 0
        for start, a, b, scale in shards:
            r = a.shape[0]
            b_all[start:start + b.shape[0], col:col + r] = b.float() * scale
            col += r
        self.adapters[lora_id] = (a_all.T.contiguous().to(self.device),
                                  b_all.T.contiguous().to(self.device))

    def remove(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (this layer's base output for x) += each row's adapter delta, in place."""
        x2, y2 = x.reshape(-1, self.input_size), y.view(-1, self.output_size)
        for lora_id, rows in self.batch.segments:
            weights = self.adapters.get(lora_id)
            if weights is None:
                continue  # the adapter leaves this layer alone
            if self.native:
                cpu_ops.lora_apply(y2, x2.contiguous(), *weights, rows)
                continue
            xs = x2 if rows is None else x2.index_select(0, rows)
            ys = y2 if rows is None else y2.index_select(0, rows)
            new = (ys.float() + (xs.float() @ weights[0]) @ weights[1]).to(y2.dtype)
            if rows is None:
                y2.copy_(new)
            else:
                y2.index_copy_(0, rows, new)
