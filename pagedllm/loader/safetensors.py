"""Weights of a Hugging Face checkpoint directory as a stream of `(hf_name, tensor)` pairs.

Looks for, in order: a sharded safetensors index, a single `model.safetensors`, a sharded
`pytorch_model.bin` index, a single `pytorch_model.bin`. Safetensors files are read with
`safe_open`, one tensor at a time, so peak memory is one tensor (plus the page cache);
`.bin` files are memory-mapped (`torch.load(mmap=True)`) so their tensors are paged in on
use rather than read up front.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedllm.errors import ModelLoadError

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


def convert(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype` when it is floating point; integer buffers keep their type."""
    if tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


def _shards_of_index(index_path: Path) -> list[Path]:
    """Shard files named by an HF index's weight_map, in first-mention order."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read the shard index {str(index_path)!r}: {e}") from e
    shards = [index_path.parent / name for name in dict.fromkeys(weight_map.values())]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise ModelLoadError(f"{str(index_path)!r} names shard files that are missing: "
                             f"{', '.join(missing)}")
    return shards


def find_weight_files(model_path: str, kinds: tuple[str, ...] = ("safetensors", "pt"),
                      ) -> list[Path]:
    """The weight files of an HF directory (or a lone `.safetensors` file), in load order:
    of the first of `kinds` (safetensors, pt: `.bin`) the directory has."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".safetensors" and "safetensors" in kinds:
        return [path]
    if not path.is_dir():
        raise ModelLoadError(f"not a model directory: {model_path!r}")
    names = {"safetensors": (SAFE_INDEX, SAFE_SINGLE), "pt": (BIN_INDEX, BIN_SINGLE)}
    for kind in kinds:
        index, single = names[kind]
        if (path / index).is_file():
            return _shards_of_index(path / index)
        if (path / single).is_file():
            return [path / single]
    expected = [name for kind in kinds for name in reversed(names[kind])]
    raise ModelLoadError(f"no weights found in {model_path!r}: expected "
                         f"{', '.join(expected[:-1])} or {expected[-1]}")


def iter_safetensors_file(path: Path | str, dtype: torch.dtype
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream one safetensors file tensor by tensor, converted to `dtype`."""
    try:
        f = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError besides OSError
        raise ModelLoadError(f"cannot open safetensors file {str(path)!r}: {e}") from e
    with f:
        for name in f.keys():
            yield name, convert(f.get_tensor(name), dtype)


def _torch_load(path: Path) -> Any:
    """`torch.load` a checkpoint memory-mapped; weights_only refuses pickled code."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            # Files from torch < 1.6 (legacy, non-zip format) cannot be memory-mapped.
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and weights_only errors have no common base
        raise ModelLoadError(f"cannot load {str(path)!r}: {e}") from e


def _iter_torch_bin(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a `torch.save`d state dict tensor by tensor, converted to `dtype`."""
    state = _torch_load(path)
    if not isinstance(state, dict):
        raise ModelLoadError(f"{str(path)!r} does not hold a state dict")
    for name in list(state):
        tensor = state.pop(name)  # drop our reference as we go
        if isinstance(tensor, torch.Tensor):
            yield name, convert(tensor, dtype)


def iter_weights(model_path: str, hf_config: Any, dtype: torch.dtype,
                 kinds: tuple[str, ...] = ("safetensors", "pt"),
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor of an HF checkpoint directory (its
    files of the first of `kinds` it has)."""
    del hf_config  # names are the checkpoint's own; nothing to map here
    for file in find_weight_files(model_path, kinds):
        if file.suffix == ".safetensors":
            yield from iter_safetensors_file(file, dtype)
        else:
            yield from _iter_torch_bin(file, dtype)
