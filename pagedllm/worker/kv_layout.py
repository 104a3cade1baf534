"""The KV cache groups of a model (core/kv_groups.py) from its config.

The scheduler (engine core) and every worker compute the same layout from the same
config, so block ids mean the same thing everywhere, whichever layers a pipeline stage
holds.
"""

from __future__ import annotations

from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.core.kv_groups import KVCacheLayout, build_kv_cache_layout
from pagedllm.models.registry import get_model_class
from pagedllm.worker.memory import attention_layers


def model_sliding_windows(config: EngineConfig) -> list[int | None]:
    """Each attention layer's sliding window (None: full attention), whole model.

    Families without windows (GPT-2, OPT, ...) have no `layer_sliding_windows`."""
    hf_config = config.model.hf_config
    windows = getattr(get_model_class(config.model.architecture),
                      "layer_sliding_windows", None)
    if windows is None:
        return [None] * hf_config.num_hidden_layers
    return windows(hf_config)


def kv_cache_layout(config: EngineConfig) -> KVCacheLayout:
    return build_kv_cache_layout(model_sliding_windows(config),
                                 config.scheduler.max_model_len)


def check_layer_windows(model: nn.Module, layout: KVCacheLayout, max_model_len: int) -> None:
    """A group never gives back blocks one of its layers still reads: a window group
    holds only layers of its window (a full-attention group may hold any layer: it keeps
    every block). Catches a model whose `layer_sliding_windows` disagrees with the
    windows its layers were built with."""
    for layer in attention_layers(model):
        window = layer.spec.sliding_window
        if window is not None and window >= max_model_len:
            window = None
        group_window = layout.group_windows[layer.kv_group]
        if group_window is not None and window != group_window:
            raise ValueError(f"attention layer {layer.layer_index} has sliding window "
                             f"{window} but its KV cache group {layer.kv_group} has "
                             f"{group_window}")
