"""Stable chained block hashes for automatic prefix caching.

The hash of full block i is sha256(parent hash, token ids of block i, extra keys), so two
requests share a block hash exactly when their whole prefixes up to that block are equal
(and their extra keys, e.g. a LoRA id, agree). The encoding is canonical and independent
of the process (no `hash()`, no PYTHONHASHSEED), so equal prefixes collide on purpose in
every process, and sha256 makes accidental collisions negligible.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.request import Request

BlockHash = bytes
"""A 32-byte sha256 digest identifying a full block and its whole prefix."""

# Parent of the first block of every sequence. Fixed (not random) so hashes are stable
# across processes and runs.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pagedllm-kv-root").digest()

# Pickle protocol used for extra keys; fixed so the encoding never changes under us.
_PICKLE_PROTOCOL = 4


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block).

    Encoding: parent digest (32 bytes) | token count (u64) | token ids (u64 each, little
    endian) | pickled extra keys (or nothing). Every part has a fixed or stated length, so
    no two different inputs share an encoding.
    """
    h = hashlib.sha256(ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash)
    h.update(struct.pack(f"<Q{len(token_ids)}Q", len(token_ids), *token_ids))
    if extra_keys is not None:
        h.update(pickle.dumps(extra_keys, protocol=_PICKLE_PROTOCOL))
    return h.digest()


def update_block_hashes(request: Request, block_size: int,
                        extra_keys: tuple[Any, ...] | None = None,
                        prompt_rows: bool = False) -> list[BlockHash]:
    """Extend `request.block_hashes` with the hashes of its newly full blocks.

    Block i covers `request.all_token_ids[i * block_size : (i + 1) * block_size]`; only
    blocks whose every token is known are hashed (num_full_blocks = num_tokens //
    block_size). Tokens are only ever appended, so hashes already computed stay valid,
    including across preemption. Returns `request.block_hashes` (the same list).
    `extra_keys` default to the request's own (its LoRA adapter, if any); a block
    with image placeholders adds those images' hashes. `prompt_rows`: a block that
    holds generated tokens also adds how many of its tokens are prompt tokens, as the
    model computes prompt rows on other kernels (the quantized GEMM's bfloat16 tiles,
    kernels/cpu/ops.py gemm_quant): the same tokens as another request's prompt are
    not the same K/V.
    """
    if extra_keys is None:
        extra_keys = request.block_hash_extra_keys
    hashes = request.block_hashes
    token_ids = request.all_token_ids
    num_full_blocks = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full_blocks):
        start = i * block_size
        keys = extra_keys
        if request.mm_inputs:
            images = request.image_hashes(start, start + block_size)
            keys = (*(extra_keys or ()), *images) if images else extra_keys
        if prompt_rows and request.num_prompt_tokens < start + block_size:
            keys = (*(keys or ()), ("prompt_rows", max(request.num_prompt_tokens - start, 0)))
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], keys)
        hashes.append(parent)
    return hashes
