"""Which of a step's token rows are prompt rows, for the quantized GEMM's split.

On a CPU with AMX bfloat16 tiles the quantized GEMM runs a model's prompt rows on those
tiles (the GGUF weights dequantized per call: ~1.8x the int8 kernels' speed at prefill
sizes) and its other rows on the int8 kernels (which stream the blocks as stored: the
fast ones for decodes). The two give different bits, so a row's kernels follow from what
the row is, never from the batch: a token is a prompt row when it is one of its
request's prompt tokens, whichever step computes it (a prefill chunk, the recompute
after a preemption). The prefix cache keeps K/V of prompt rows and generated rows of the
same tokens apart (core/block_hash.py `prompt_rows`). kernels/cpu/ops.py gemm_quant;
the native decoder stack takes the step's marks from its metadata
(models/native_layers.py), the Python layers' quantized linears from the model's
StepRows (models/layers/linear.py).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.kernels.cpu.ops import cpu_ops_available, quant_splits_prompt_rows
from pagedllm.models.layers.linear import LinearBase, StepRows


def attach_step_rows(model: nn.Module, dtype: torch.dtype, device: torch.device,
                     compiled: bool) -> StepRows | None:
    """Where `model`, run eagerly on the CPU in `dtype`, computes prompt rows on other
    kernels than generated ones (GGUF blocks through the quantized GEMM with bfloat16
    activations, where the kernels split: `quant_splits_prompt_rows`): a StepRows given
    to each of its linears holding GGUF blocks. None elsewhere."""
    if (device.type != "cpu" or compiled or dtype != torch.bfloat16
            or not cpu_ops_available(torch.empty(0))):
        return None
    linears = _quantized_linears(model)
    if not linears or not quant_splits_prompt_rows():
        return None
    rows = StepRows()
    for linear in linears:
        linear.step_rows = rows
    return rows


def _quantized_linears(model: nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase) and (
        m.native_shards or (m.native_weight is not None and m.native_weight.dtype == torch.uint8))]


def prompt_rows(positions: np.ndarray, num_prompt_tokens: np.ndarray) -> torch.Tensor | None:
    """bool [T]: token t (at `positions[t]` of a request with `num_prompt_tokens[t]` prompt
    tokens) is a prompt token; None when none is (every row takes the default kernels)."""
    rows = positions < num_prompt_tokens
    return torch.from_numpy(rows) if rows.any() else None
