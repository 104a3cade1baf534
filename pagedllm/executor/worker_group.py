"""WorkerGroupExecutor: what the multiprocess and Ray executors share.

Both run one worker per rank and answer the engine's set-up calls by asking every rank;
they differ only in transport (`_call_all`).
"""

from __future__ import annotations

from typing import Any


class WorkerGroupExecutor:
    """The KV-cache set-up calls of an executor over a group of ranks."""

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every rank's runner; the results in rank order."""
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        # Every rank must fit the same block ids: the smallest budget wins.
        return min(self._call_all("determine_num_blocks"))

    def kv_cache_group_windows(self) -> tuple[int | None, ...]:
        # Computed from the same config on every rank.
        return self._call_all("kv_cache_group_windows")[0]

    def splits_prompt_rows(self) -> bool:
        # Any rank that does makes the blocks' hashes tell prompt rows apart.
        return any(self._call_all("splits_prompt_rows"))

    def determine_num_swap_blocks(self) -> int:
        # Every rank must hold the same host block ids too.
        return min(self._call_all("determine_num_swap_blocks"))

    def kv_bytes_per_block(self) -> int:
        # vLLM's kv_offloading_size is the host memory of every rank together.
        return sum(self._call_all("kv_bytes_per_block"))

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int = 0,
                            num_offload_blocks: int = 0) -> None:
        self._call_all("initialize_kv_cache", num_blocks, num_swap_blocks, num_offload_blocks)

    def sleep(self, level: int) -> None:
        self._call_all("sleep", level)

    def wake_up(self, tags: list[str]) -> None:
        self._call_all("wake_up", tags)

    def start_profile(self) -> None:
        self._call_all("start_profile")

    def stop_profile(self) -> list[str]:
        return self._call_all("stop_profile")

    def update_weights(self, weights: list) -> None:
        self._call_all("update_weights", weights)

    def collective_rpc(self, payload: bytes) -> list:
        return self._call_all("collective_rpc", payload)
