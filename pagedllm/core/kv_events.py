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

from dataclasses import dataclass

from pagedllm.core.block_hash import BlockHash


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


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (their memory went to other tokens)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (a reset, sleep, new weights)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def coalesce(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """Merge runs of BlockRemoved (the pool records one per evicted block) into one
    event each; the order of everything else is kept."""
    out: list[KVCacheEvent] = []
    for event in events:
        if isinstance(event, BlockRemoved) and out and isinstance(out[-1], BlockRemoved):
            out[-1] = BlockRemoved(out[-1].block_hashes + event.block_hashes)
        else:
            out.append(event)
    return out
