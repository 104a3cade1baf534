"""Build a model from its config and fill it from a weight stream."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import itertools
import logging
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.errors import ModelLoadError
from pagedllm.loader import iter_weights
from pagedllm.models.layers.linear import finalize_quantized_weights
from pagedllm.models.layers.rotary import RotaryEmbedding
from pagedllm.models.registry import get_model_class

logger = logging.getLogger(__name__)

GiB = 1 << 30


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Scoped default dtype so parameters are created directly in the compute dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _trimming(weights: Iterator[tuple[str, object]], every: int = 4 << 20
              ) -> Iterator[tuple[str, object]]:
    """`weights`, returning freed heap memory to the OS every `every` bytes loaded.

    Layers repack GGUF blocks as they arrive (models/layers/linear.py) and free the raw
    rows: holes of mixed sizes below glibc's mmap threshold, which the heap keeps. On
    SmolLM2 Q4_1 (93.8 MiB file) that took the load's RSS to +153 MiB, +114 with this.
    """
    since = 0
    for name, tensor in weights:
        yield name, tensor
        raw = getattr(tensor, "raw", tensor)  # a QuantizedWeight's bytes
        since += raw.numel() * raw.element_size()
        if since >= every:
            _return_freed_memory()
            since = 0


def load_model(model_config: ModelConfig, attn_backend: str, device: torch.device,
               dtype: torch.dtype, parallel: ParallelState = SINGLE_RANK,
               updates: Sequence[tuple[str, torch.Tensor]] = ()) -> nn.Module:
    """Model on `device` in `dtype`, weights loaded (streamed, one copy in memory), then
    `updates` ((hf_name, tensor) pairs, e.g. a trainer's new weights) over them.

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
    if model_config.language_model_only and getattr(cls, "is_multimodal", False):
        kwargs["language_model_only"] = True
    start = time.perf_counter()
    model = None
    try:
        model = _build_and_load(cls, kwargs, model_config, attn_backend, device, dtype,
                                updates)
    except torch.cuda.OutOfMemoryError:
        if device.type != "cuda":
            raise
        # Reported below, once the partly built model (held by the traceback) is gone.
    if model is None:
        raise _weights_do_not_fit(cls, kwargs, model_config, attn_backend, device, dtype)
    model.eval()
    # Every position the engine may run has its rotary angles (max_model_len may exceed
    # the model's max_position_embeddings, as llama.cpp allows a larger context).
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cover(model_config.max_model_len)
    logger.info("loaded %s in %.1f s", cls.__name__, time.perf_counter() - start)
    return model


def _build_and_load(cls: type, kwargs: dict, model_config: ModelConfig, attn_backend: str,
                    device: torch.device, dtype: torch.dtype,
                    updates: Sequence[tuple[str, torch.Tensor]] = ()) -> nn.Module:
    with torch.device(device), _default_dtype(dtype):
        model = cls(model_config.hf_config, attn_backend, **kwargs)
    if model_config.load_format == "dummy":
        _fill_dummy_weights(model, model_config.seed)  # no updates: the engine refuses them
        return model
    weights = iter_weights(model_config.path, model_config.hf_config, dtype,
                           load_format=model_config.load_format,
                           quantization=model_config.quantization)
    if model_config.quantization is None:
        # A later pair of the same name overwrites the earlier one (its shard, for a
        # fused projection): the updates win.
        model.load_weights(itertools.chain(weights, updates))
    else:
        model.load_weights(_trimming(weights))
        finalize_quantized_weights(model)  # blocks of projections some shards of which came plain
        _return_freed_memory()
    return model


def _fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """--load-format dummy, as vLLM's: every floating-point parameter uniform in
    [-1e-3, 1e-3], drawn from `seed` (the same model on every run and every worker)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                values = torch.empty(param.shape).uniform_(-1e-3, 1e-3, generator=generator)
                param.copy_(values)


def _weights_do_not_fit(cls: type, kwargs: dict, model_config: ModelConfig,
                        attn_backend: str, device: torch.device, dtype: torch.dtype,
                        ) -> ModelLoadError:
    """The error of a load that ran out of GPU memory, with the weights' size (of a
    model built again on the meta device: no memory) and the device's free memory."""
    gc.collect()  # the traceback's frames held the partly built model
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    size = "of unknown size"
    try:
        with torch.device("meta"), _default_dtype(dtype):
            meta = cls(model_config.hf_config, attn_backend, **kwargs)
        size = f"{module_bytes(meta) / GiB:.2f} GiB"
    except Exception:  # noqa: BLE001 (a model whose __init__ needs real tensors)
        pass
    return ModelLoadError(
        f"the model's weights ({size} in {str(dtype).removeprefix('torch.')}) do not fit "
        f"in the GPU's free memory ({free / GiB:.2f} GiB free of {total / GiB:.2f} GiB): "
        f"free the GPU (other processes?), or use a smaller model or dtype")


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size()
               for t in itertools.chain(module.parameters(), module.buffers()))
