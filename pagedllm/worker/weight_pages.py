"""The packed CPU weights moved into one arena on transparent huge pages.

A decode step streams every packed weight from memory once (~66 MB of SmolLM2's Q4_1
blocks, ~270 MB in bfloat16), and on 4 KiB pages that stream takes a TLB miss every
4 KiB. torch's allocations are plain pages where the kernel gives huge pages only on
request (transparent_hugepage=madvise, a common default); `lazy_zeros` asks for them.
One arena for all weights, not one mapping each, because a partly used huge page at the
end of every mapping would cost up to 2 MiB of memory per weight. Each weight's old
memory is freed (and the heap trimmed) as the copies go, so the weights are never held
twice: peak RSS of the bundled model 1490 -> 1425 MB in bfloat16, 1223 -> 1211-1223 MB on its
Q4_1 blocks (the trim also returns what packing freed).

Measured on Zen 4 (2 threads; the two placements swapped within one process, rounds
interleaved): a single decode step of the bundled model in bfloat16 9.22 -> 8.34,
10.35 -> 8.95 and 9.37 -> 8.07 ms, on its Q4_1 blocks 5.47 -> 5.30 and 6.66 -> 6.21 ms;
every layer's decode GEMVs alone (weights cold) Q4_1 2.79 -> 2.64 ms, bfloat16 7.58 ->
7.25 ms. Batched steps (64 rows, compute-bound) and prefills: unchanged.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from pagedllm.worker.memory import lazy_zeros

# What the native kernels stream: packed weights (linear layers, LM heads), GGUF blocks
# (quantized linears and embeddings), the shards of a mixed-type projection.
_WEIGHT_ATTRS = ("native_weight", "quant_weight")
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ALIGN = 64  # a cache line: what torch's CPU allocator aligns to
# Bytes copied between two heap trims (see trim_heap): bounds the memory held twice.
_TRIM_EVERY = 32 << 20


def huge_pages_available() -> bool:
    """Whether the kernel may back a madvise'd mapping with huge pages."""
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def _weight_refs(model: nn.Module) -> dict[tuple, list[tuple[nn.Module, str, int]]]:
    """Where each distinct packed / GGUF-block weight the native kernels read is held
    (a tied weight: several places): (module, attribute, shard index or -1) per
    reference, keyed by the tensor's memory and layout."""
    refs: dict[tuple, list[tuple[nn.Module, str, int]]] = {}

    def add(t: object, module: nn.Module, name: str, index: int) -> None:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            refs.setdefault(key, []).append((module, name, index))

    for module in model.modules():
        for name in _WEIGHT_ATTRS:
            add(getattr(module, name, None), module, name, -1)
        for i, (blocks, _) in enumerate(getattr(module, "native_shards", None) or ()):
            add(blocks, module, "native_shards", i)
    return refs


def _get(module: nn.Module, name: str, index: int) -> torch.Tensor:
    value = getattr(module, name)
    return value if index < 0 else value[index][0]


def _set(module: nn.Module, name: str, index: int, t: torch.Tensor) -> None:
    if index < 0:
        setattr(module, name, t)
    else:
        shards = list(module.native_shards)
        shards[index] = (t, shards[index][1])
        module.native_shards = tuple(shards)


def native_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every distinct packed / GGUF-block weight of `model` the native kernels read."""
    return [_get(*where[0]) for where in _weight_refs(model).values()]


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy the native weights of `model` into one huge-page arena and point the modules
    at the copies (same values). Each old tensor goes with its last reference as soon
    as it is copied, so memory peaks ~32 MB above the weights (_TRIM_EVERY). Call before
    the first forward pass: the native decoder stack binds the weights it finds then.
    Returns the bytes moved (0 when the kernel gives no huge pages)."""
    # The references only, not the tensors: each old weight must go as soon as its
    # modules point at the copy (its memory is returned at the next trim).
    refs = [where for where in _weight_refs(model).values() if _get(*where[0]).is_contiguous()]
    if not refs or not huge_pages_available():
        return 0
    sizes = [_get(*where[0]).nbytes for where in refs]
    slots = [-(-size // _ALIGN) * _ALIGN for size in sizes]  # each on a cache line
    arena = lazy_zeros((sum(slots),), torch.uint8)
    offset = untrimmed = 0
    for where, size, slot in zip(refs, sizes, slots):
        old = _get(*where[0])
        copy = arena[offset:offset + size].view(old.dtype).view(old.shape)
        copy.copy_(old)
        del old
        for module, name, index in where:
            _set(module, name, index, copy)
        offset += slot
        untrimmed += size
        if untrimmed >= _TRIM_EVERY:
            trim_heap()
            untrimmed = 0
    trim_heap()
    return sum(sizes)


def trim_heap() -> None:
    """Return freed heap memory to the OS. glibc serves allocations below its (adaptive,
    up to 32 MiB) mmap threshold from the heap and keeps them there once freed, so
    without this the replaced weights stayed resident: measured +350 MB RSS for the
    bundled model in bfloat16 (270 MB of weights), +52 MB from its Q4_1 blocks."""
    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: libc's
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim this way
