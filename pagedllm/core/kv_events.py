"""KV cache events: what the prefix cache gained and lost, step by step.

A router in front of many engines (vLLM's `--kv-events-config` consumers: NVIDIA Dynamo,
llm-d) keeps a map of which engine holds which prefix blocks from these events, and
sends a request where most of its prompt is cached. The pool records them as they
happen; the engine drains them once per step and publishes them
(engine/kv_events.py). Only blocks registered in the prefix cache are events: a block
stored once and removed once, so a consumer that applies them in order holds exactly
the engine's set of cached hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.core.block_hash import BlockHash
from pagedllm.request import Request


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one sequence entered the prefix cache."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    """The hash of the block before the first one (None: it starts the sequence)."""
    token_ids: tuple[int, ...]
    """The blocks' tokens, block_size each, in order."""
    block_size: int
    lora_id: int | None
    lora_name: str | None
    medium: str = "GPU"
    """Which tier: "GPU", vLLM's name for the engine's own KV cache whatever the device,
    or "CPU", the prefix cache's host tier (core/kv_offload.py)."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (their memory went to other tokens)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (a reset, sleep, new weights)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored_runs(request: Request, block_hashes: Sequence[BlockHash],
                stored: Sequence[int], block_size: int,
                medium: str = "GPU") -> list[BlockStored]:
    """One BlockStored per run of consecutive block indices in `stored` (ascending) of
    `request`'s blocks that entered a tier."""
    lora = request.lora_request
    events, start = [], 0
    for k in range(1, len(stored) + 1):
        if k < len(stored) and stored[k] == stored[k - 1] + 1:
            continue
        first, last = stored[start], stored[k - 1]
        events.append(BlockStored(
            block_hashes=tuple(block_hashes[first:last + 1]),
            parent_block_hash=block_hashes[first - 1] if first else None,
            token_ids=tuple(request.all_token_ids[first * block_size:
                                                  (last + 1) * block_size]),
            block_size=block_size, lora_id=lora.lora_int_id if lora is not None else None,
            lora_name=lora.lora_name if lora is not None else None, medium=medium))
        start = k
    return events


def coalesce(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """Merge runs of BlockRemoved of one medium (the pool records one per evicted
    block) into one event each; the order of everything else is kept."""
    out: list[KVCacheEvent] = []
    for event in events:
        if (isinstance(event, BlockRemoved) and out and isinstance(out[-1], BlockRemoved)
                and out[-1].medium == event.medium):
            out[-1] = BlockRemoved(out[-1].block_hashes + event.block_hashes, event.medium)
        else:
            out.append(event)
    return out


def drain(events: list[KVCacheEvent] | None) -> list[KVCacheEvent]:
    """The recorded `events`, removals merged (`coalesce`); `events` is emptied (None:
    none recorded)."""
    if not events:
        return []
    out = coalesce(events)
    events.clear()
    return out
