"""The scoped forward context of compiled model runs (DESIGN.md §6's one exception).

A compiled graph cannot take the step's AttentionMetadata (numpy arrays, per-step ints)
as an input without recompiling every step, so inside a compiled model attention is an
opaque custom op, `pagedllm::attention(q, k, v, layer_index)`, which finds its layer and
the step's metadata in the context the model runner binds around each compiled forward.
Eager runs pass metadata as an argument and never touch this module's state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    """What compiled attention ops read during one forward pass."""

    # The model's Attention layers; layer i has layer_index i.
    layers: list[Any] = field(default_factory=list)
    # Metadata of the step being run (None outside a forward pass).
    attn_metadata: AttentionMetadata | None = None


_current: ForwardContext | None = None


@contextlib.contextmanager
def bind_forward_context(ctx: ForwardContext, attn_metadata: AttentionMetadata,
                         ) -> Iterator[None]:
    """Make `ctx` (with this step's metadata) visible to attention ops for one forward."""
    global _current
    previous = _current
    ctx.attn_metadata, _current = attn_metadata, ctx
    try:
        yield
    finally:
        ctx.attn_metadata, _current = None, previous


@torch.library.custom_op("pagedllm::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 layer_index: int) -> torch.Tensor:
    """q [T, H*D], k/v [T, KVH*D] -> [T, H*D]; writes K/V into the layer's cache (a side
    effect the graph does not see: each layer's cache is touched only by its own op)."""
    ctx = _current
    assert ctx is not None and ctx.attn_metadata is not None, \
        "pagedllm::attention runs only inside bind_forward_context"
    return ctx.layers[layer_index].attend(q, k, v, ctx.attn_metadata)


@attention_op.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    layer_index: int) -> torch.Tensor:
    return q.new_empty(q.shape)
