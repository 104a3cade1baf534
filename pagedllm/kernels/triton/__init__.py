"""Triton kernels of the decoder layers' element-wise work on CUDA (`layer_ops.py`):
RMSNorm, SiLU-and-mul and rotary embedding, one launch each instead of the ~8, 2 and
~9 kernels per tensor their torch formulas launch. In a CUDA graph of a decode step
those small kernels were most of the GPU time (a 1B model on an H200: ~600 per step,
2.19 ms against a 0.59 ms weight-bandwidth floor).

The layers (models/layers/) take them through `layer_ops_for` for CUDA tensors only; on
CPU they have native ops (kernels/cpu). The same kernels run on CPU tensors under
`TRITON_INTERPRET=1` (set before triton is imported), which is how the tests check them
against the torch formulas without a GPU. Importing `layer_ops` imports triton; this
module does not.
"""

from __future__ import annotations

from types import ModuleType

import torch


def layer_ops_for(x: torch.Tensor) -> ModuleType | None:
    """`layer_ops` for a CUDA tensor, None otherwise and while torch.compile traces
    (inductor fuses the torch formulas itself)."""
    if x.device.type != "cuda" or torch.compiler.is_compiling():
        return None
    from pagedllm.kernels.triton import layer_ops

    return layer_ops
