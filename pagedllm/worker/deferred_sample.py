"""Sampled ids left on the device when a step is launched, read back later.

Async scheduling (engine/engine_core.py) launches step N + 1 before reading step N's
sampled ids: N + 1's placeholders take N's ids on the device (`DeferredSample.sampled`),
and the host reads them (`HostCopy`) only when the engine asks for N's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sample.logprobs import LogprobsTensors


class HostCopy:
    """A device tensor's copy to the host, started now and waited for in `numpy()`.

    On CUDA into pinned memory with a non-blocking copy and an event after it: the wait
    is for this copy (and what the stream ran before it), not for later work.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def numpy(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()


@dataclass
class DeferredSample:
    """One step's sampled ids, still to be read and recorded in the input batch."""

    sampled: torch.Tensor  # [N] int64 on the device, one per sampling row
    copy: HostCopy  # of `sampled`
    rows: np.ndarray  # [N] the input-batch rows that sampled
    # [N] the rows' generations at launch: a row freed (or taken by another request)
    # since then no longer holds the request that sampled.
    generations: np.ndarray
    positions: np.ndarray  # [N] each row's request position in the step's output
    logprobs: LogprobsTensors | None
    num_logprobs: np.ndarray  # [N] the rows' logprobs counts at launch (-1: none)
