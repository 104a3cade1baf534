"""Build a model from its config and fill it from a weight stream."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.errors import ModelLoadError
from pagedllm.loader import iter_weights
from pagedllm.models.registry import get_model_class


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Scoped default dtype so parameters are created directly in the compute dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model_config: ModelConfig, attn_backend: str, device: torch.device,
               dtype: torch.dtype, parallel: ParallelState = SINGLE_RANK) -> nn.Module:
    """Model on `device` in `dtype`, weights loaded (streamed, one copy in memory).

    Layers allocate their parameters with torch.empty (no random init), so building on
    the target device costs only the allocation. Under tensor parallelism the model is
    this rank's shard: every rank streams the whole checkpoint and keeps its slices;
    under pipeline parallelism only its stage's layers (models/pipeline.py).
    """
    cls = get_model_class(model_config.architecture)
    kwargs = {}
    if parallel.tp_size > 1:
        # A family is TP-aware when its constructor takes the worker's ParallelState.
        if "parallel" not in inspect.signature(cls).parameters:
            raise ModelLoadError(f"tensor parallelism is not supported for "
                                 f"{model_config.architecture} yet")
        kwargs["parallel"] = parallel
    if parallel.pp_size > 1:
        if not getattr(cls, "supports_pp", False):
            raise ModelLoadError(f"pipeline parallelism is not supported for "
                                 f"{model_config.architecture} yet")
        kwargs["parallel"] = parallel
    start = time.perf_counter()
    with torch.device(device), _default_dtype(dtype):
        model = cls(model_config.hf_config, attn_backend, **kwargs)
    model.load_weights(iter_weights(model_config.path, model_config.hf_config, dtype))
    model.eval()
    model.load_time_s = time.perf_counter() - start
    return model
