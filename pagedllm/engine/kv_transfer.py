"""Setting up the KV store of `kv_transfer_config` (core/kv_store.py) for an engine: the
checks, and the namespace folder that keeps engines whose blocks are not interchangeable
apart; or the host tier of kv_offloading_size (core/kv_offload.py): its size.

Two engines share blocks only when a block's K/V means the same to both: the same
weights (told apart by the model's file names and sizes and its config, not by reading
gigabytes), dtype, weight quantization, KV cache dtype and block size, the same tensor
parallel size (each rank stores its heads), the same hashing (prompt rows on their own
kernels) and the same pagedllm version (kernels change bits). The namespace is a digest
of all of it; anything else is left to whoever points two engines at one directory.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import uuid

from pagedllm.config import EngineConfig
from pagedllm.core.kv_offload import HostKVStore
from pagedllm.core.kv_store import KVStore, store_root
from pagedllm.errors import ConfigError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def make_kv_store(config: EngineConfig, group_windows: tuple[int | None, ...],
                  hash_prompt_rows: bool, num_offload_blocks: int = 0,
                  ) -> KVStore | HostKVStore:
    """The scheduler's store for `config.kv_transfer`: the directory's KVStore, or the
    host tier's HostKVStore of `num_offload_blocks` slots; ConfigError where the engine
    cannot keep blocks there."""
    kvt = config.kv_transfer
    assert kvt is not None
    if group_windows != (None,):
        what = "kv_offloading_size" if kvt.is_offloading else "kv_transfer_config"
        raise ConfigError(f"{what}: models with sliding-window layers (more than one KV "
                          f"cache group) are not supported")
    if kvt.is_offloading:
        return HostKVStore(num_offload_blocks, config.cache.block_size,
                           enable_events=config.kv_events is not None)
    root = store_root(kvt.storage_path)
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"kv_transfer_config: cannot create {root}: {e}") from e
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError(f"kv_transfer_config: {root} is not readable and writable")
    return KVStore(root, namespace(config, hash_prompt_rows),
                   num_ranks=config.parallel.tensor_parallel_size,
                   block_size=config.cache.block_size, load=kvt.is_consumer,
                   save=kvt.is_producer, min_free_bytes=kvt.min_free_disk_bytes)


def num_offload_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Slots of the host tier: its bytes over one block's K and V on every rank
    (vLLM's kv_offloading_size counts all ranks together); ConfigError for none."""
    size = config.kv_transfer.offload_bytes
    if not bytes_per_block:
        raise ConfigError("kv_offloading_size: the model keeps no KV cache")
    num = size // bytes_per_block
    if num < 1:
        raise ConfigError(f"kv_offloading_size: {size} bytes hold no KV block of "
                          f"{bytes_per_block} bytes")
    return num


def namespace(config: EngineConfig, hash_prompt_rows: bool) -> str:
    """The folder of this engine's blocks: a digest of what makes them interchangeable
    (the module docstring)."""
    model = config.model
    try:
        version = importlib.metadata.version("pagedllm")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    identity = {
        "weights": weight_files(model.path),
        # Not its "_name_or_path": the same model lies at other paths on other machines.
        "hf_config": {k: v for k, v in model.hf_config.to_dict().items()
                      if not k.startswith("_")},
        "dtype": model.dtype,
        "quantization": model.quantization,
        "kv_cache_dtype": config.kv_cache_dtype,
        "block_size": config.cache.block_size,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "hash_prompt_rows": hash_prompt_rows,
        "pagedllm": version,
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def weight_files(path: str) -> list[tuple[str, int]]:
    """(name, size) of the model's weight files: a GGUF file itself, or those of an HF
    directory."""
    if os.path.isfile(path):
        return [(os.path.basename(path), os.path.getsize(path))]
    if not os.path.isdir(path):
        return [(path, 0)]
    return sorted((name, os.path.getsize(os.path.join(path, name)))
                  for name in os.listdir(path) if name.endswith(WEIGHT_SUFFIXES))


def new_weights_salt() -> str:
    """A namespace suffix no other engine has: blocks computed with weights loaded at
    run time (update_weights) are this engine's alone."""
    return uuid.uuid4().hex[:16]
