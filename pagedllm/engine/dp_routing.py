"""Which data parallel replica takes a new request.

The least loaded one, unless a replica recently took a prompt that begins the same way
(the same first blocks, under the same LoRA adapter) and is not much busier: its prefix
cache then holds those blocks, which another replica would compute again. Many users of
one system prompt so land on one replica while it keeps up, and spread when it does not.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

from pagedllm.request import Request

# Blocks of a prompt's beginning that make its affinity key.
AFFINITY_BLOCKS = 4
# Most prompt beginnings remembered (least recently used forgotten first).
MAX_ENTRIES = 4096


def affinity_key(request: Request, block_size: int) -> Hashable | None:
    """What prompts sharing cached blocks have in common: their first blocks' tokens and
    adapter; None for a prompt too short to hold them (beyond its last token), or one
    whose K/V is not its tokens' alone (images, embeddings)."""
    length = AFFINITY_BLOCKS * block_size
    if request.mm_inputs or request.num_prompt_tokens <= length:
        return None
    return request.lora_int_id, tuple(request.prompt_token_ids[:length])


class ReplicaRouter:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        # Prompt beginning -> the replica that last took it.
        self._owner: collections.OrderedDict[Hashable, int] = collections.OrderedDict()

    def route(self, key: Hashable | None, loads: list[int]) -> int:
        """The replica for a request with affinity `key`, given each replica's load."""
        least = min(range(len(loads)), key=lambda r: (loads[r], r))
        if key is None:
            return least
        rank = self._owner.get(key)
        # A quarter more than the least loaded (at least 2 requests) is close enough:
        # prefill saved there beats a slightly shorter queue elsewhere.
        if rank is None or loads[rank] > loads[least] + max(2, loads[least] // 4):
            rank = least
        self._owner[key] = rank
        self._owner.move_to_end(key)
        if len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return rank
