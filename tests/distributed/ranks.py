"""Run tensor-parallel ranks as threads of the test process (no process start-up cost).

Each thread joins its own gloo group through a TCPStore the test hosts; gloo and torch's
kernels release the GIL, so the ranks really run side by side.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import ParallelState, init_tensor_parallel

_group_ids = itertools.count()


def run_ranks(tp_size: int, fn: Callable[[ParallelState], Any],
              timeout_s: float = 60.0) -> list[Any]:
    """fn(parallel_state) on tp_size ranks at once; their results in rank order. A rank
    that raises fails the call (the others then fail their collectives at the timeout,
    short here)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    prefix = f"test{next(_group_ids)}"
    results: list[Any] = [None] * tp_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            ps = init_tensor_parallel("127.0.0.1", store.port, rank, tp_size,
                                      timeout_s=timeout_s, prefix=prefix)
            with torch.inference_mode():
                results[rank] = fn(ps)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 2)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results
