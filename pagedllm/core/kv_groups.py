"""KV cache groups: which layers share a block table, and what a sliding window frees.

Layers whose attention sees every earlier token (full attention) need a request's whole
context; layers with a sliding window W only need the last W keys. Keeping one block
table for both would make the window layers hold blocks they never read again, so the
layers are split into groups, each with its own block table drawn from ONE block pool:

- Every group holds the same number of layers, `group_size` (the last group of a kind may
  be short), so a block is the same number of bytes whatever group holds it: the cache
  is `group_size` tensors ("slots"), and layer j of every group stores its K/V in slot
  j's tensor. A block id is owned by one group at a time, so layers sharing a slot never
  collide. This is vLLM's hybrid allocator (seed 001's KV cache groups).
- group_size is the layer count of the smallest kind (Gemma 2: half of the layers in
  each of 2 groups; Gemma 3's 5:1 pattern: one full group and five window groups).
- A model with one kind (every full-attention model, or Mistral with a window on every
  layer) has one group holding every layer: the layout of a cache without groups.

A window group frees the blocks that fall wholly out of the window of every query still
to come, putting the null block in their place, so a window-W layer holds at most
cdiv(W, block_size) + 1 blocks per decoding request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheLayout:
    """Groups of layers with their windows, and each layer's group and slot."""

    # Per group: the sliding window of its layers (None: full attention).
    group_windows: tuple[int | None, ...]
    # Per attention layer (model order, all pipeline stages): its group and its slot,
    # the index of its K/V tensor (its position within the group).
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slot, default=-1) + 1


def build_kv_cache_layout(windows: Sequence[int | None], max_model_len: int,
                          ) -> KVCacheLayout:
    """Group layers by window (a window that covers max_model_len is full attention:
    it never frees anything). `windows[i]` is attention layer i's sliding window."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        if window is not None and window >= max_model_len:
            window = None
        kinds.setdefault(window, []).append(layer)
    if len(kinds) <= 1:
        window = next(iter(kinds), None)
        return KVCacheLayout((window,), (0,) * len(windows), tuple(range(len(windows))))
    group_size = min(len(layers) for layers in kinds.values())
    group_windows: list[int | None] = []
    layer_group = [0] * len(windows)
    layer_slot = [0] * len(windows)
    # Full attention first (group 0), then windows in increasing size.
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        layers = kinds[window]
        for start in range(0, len(layers), group_size):
            for slot, layer in enumerate(layers[start:start + group_size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVCacheLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot))


def num_skipped_blocks(num_computed_tokens: int, window: int | None, block_size: int) -> int:
    """Leading blocks a window layer never reads again once `num_computed_tokens` tokens
    are in the cache: the next query (position num_computed_tokens) sees keys from
    position num_computed_tokens - window + 1 on, and so do all later ones."""
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


def max_blocks_per_request(window: int | None, num_tokens: int, block_size: int) -> int:
    """Blocks a request of `num_tokens` tokens holds in one group at most while it
    decodes (a window group: the window's blocks, one more when it straddles a block)."""
    num_blocks = cdiv(num_tokens, block_size)
    if window is None:
        return num_blocks
    return min(num_blocks, cdiv(window, block_size) + 1)
