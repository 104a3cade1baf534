"""DPEngineCoreClient: data parallel replicas behind the one engine-core interface.

`data_parallel_size` engine-core processes, each a whole engine (scheduler, KV cache,
its own tp x pp workers) on its own cores or GPU (dp_placement.py), each reached by an
EngineCoreClient. The front end above (LLMEngine, AsyncLLM) sees one engine:
- a request goes to the replica with the fewest live requests (a waiting one counts
  twice: it still needs its prefill), or to one not much busier that recently took a
  prompt beginning the same way (dp_routing.py: its prefix cache has those blocks); the
  siblings of an n > 1 fan-out follow their leader, whose prompt blocks they share
  through that replica's prefix cache;
- aborts and stops go to the replica that holds the request;
- output batches from every replica are received in arrival order, each applied to the
  mirrors of its own client (EngineCoreOutputs.engine_index);
- utility calls go to every replica and their results are combined (stats summed, the
  KV block grids laid side by side);
- one replica's death fails the whole engine, as a dead worker does.

Outputs never depend on the replica: every replica runs the same model with the same
batch-invariant kernels (DESIGN.md section 10), so a request's tokens and logprobs are
the same wherever it runs.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import EngineCoreClient, EngineProcess
from pagedllm.engine.core_proc import EngineCoreOutputs, EngineDead, SchedulerStats
from pagedllm.engine.dp_placement import replica_configs
from pagedllm.engine.dp_routing import ReplicaRouter, affinity_key
from pagedllm.errors import EngineDeadError
from pagedllm.request import Request


class DPEngineCoreClient:
    """One EngineCoreClient per replica, offered as one (EngineCoreClient's interface).
    `process`: replica 0's engine process when it was spawned already (the server's)."""

    def __init__(self, config: EngineConfig, process: EngineProcess | None = None) -> None:
        self.clients: list[EngineCoreClient] = []
        self._dead_reason: str | None = None
        try:
            for rank, replica in enumerate(replica_configs(config)):
                self.clients.append(EngineCoreClient(replica, process if rank == 0 else None))
        except BaseException:
            self.shutdown()
            raise
        self.block_size = config.cache.block_size
        # Every replica's live requests, by req_id (a view: each client keeps its own).
        self.requests = collections.ChainMap(*(c.requests for c in self.clients))
        # req_id -> the replica it was sent to, while it is live.
        self._owner: dict[str, int] = {}
        self._router = ReplicaRouter()
        self._poller = zmq.asyncio.Poller()
        for client in self.clients:
            self._poller.register(client.output_socket, zmq.POLLIN)
        # Batches received (from any replica) and not yet returned by get_output.
        self._received: collections.deque[EngineCoreOutputs] = collections.deque()
        # Each replica's latest scheduler state.
        self._stats: list[SchedulerStats | None] = [None] * len(self.clients)

    # ------------------------------------------------------------------ lifecycle

    async def wait_ready(self, timeout_s: float = 1800.0) -> None:
        tasks = [asyncio.ensure_future(c.wait_ready(timeout_s)) for c in self.clients]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # the first failure ends the start-up: stop waiting
                task.cancel()

    @property
    def num_blocks(self) -> int:
        """One replica's KV blocks (a request runs on one; they are alike)."""
        return min(c.num_blocks for c in self.clients)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        if self._dead_reason is None:
            # A replica found dead by its own client fails the others too.
            for rank, client in enumerate(self.clients):
                if client.dead_reason is not None:
                    self.mark_dead(f"data parallel replica {rank}: {client.dead_reason}")
                    break
        return self._dead_reason

    def check_alive(self) -> bool:
        for client in self.clients:
            client.check_alive()
        return not self.is_dead

    def mark_dead(self, reason: str) -> None:
        """Fail the whole engine (the first reason wins): no replica takes requests."""
        if self._dead_reason is None:
            self._dead_reason = reason
            for client in self.clients:
                client.mark_dead(reason)

    def kill(self) -> None:
        for client in self.clients:
            client.kill()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        for client in self.clients:
            client.shutdown(timeout_s)

    # ------------------------------------------------------------------ EngineCore interface

    @property
    def num_unscheduled(self) -> int:
        return sum(c.num_unscheduled for c in self.clients)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_prefill_tokens for c in self.clients)

    def add_request(self, request: Request, sibling_of: str | None = None) -> None:
        rank = self._owner.get(sibling_of) if sibling_of is not None else None
        if rank is None:
            rank = self._router.route(affinity_key(request, self.block_size),
                                      [len(c.requests) + c.num_unscheduled
                                       for c in self.clients])
        self.clients[rank].add_request(request)
        self._owner[request.req_id] = rank

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self._finish(req_ids, EngineCoreClient.abort_requests)

    def stop_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self._finish(req_ids, EngineCoreClient.stop_requests)

    def _finish(self, req_ids: Iterable[str], finish: Any) -> list[Request]:
        by_rank: dict[int, list[str]] = collections.defaultdict(list)
        for req_id in ([req_ids] if isinstance(req_ids, str) else req_ids):
            rank = self._owner.pop(req_id, None)
            if rank is not None:
                by_rank[rank].append(req_id)
        return [req for rank, ids in by_rank.items()
                for req in finish(self.clients[rank], ids)]

    def has_unfinished_requests(self) -> bool:
        return any(c.has_unfinished_requests() for c in self.clients)

    def step(self) -> list[Request]:
        updated = [req for client in self.clients for req in client.step()]
        for req in updated:
            if req.is_finished:
                self._owner.pop(req.req_id, None)
        return updated

    def take_finished_locally(self) -> list[Request]:
        return [req for client in self.clients for req in client.take_finished_locally()]

    # ------------------------------------------------------------------ transport

    def push_outputs(self, batch: EngineCoreOutputs) -> None:
        self.clients[batch.engine_index].push_outputs(batch)

    async def get_output(self, timeout_s: float) -> EngineCoreOutputs | None:
        """The next batch from any replica, or None after timeout_s; EngineDeadError
        once any replica is gone."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        if not self._received:
            ready = dict(await self._poller.poll(timeout=int(timeout_s * 1000)))
            # Each ready socket gives one message per call, so a busy replica cannot
            # starve the others.
            for client in self.clients:
                if ready.get(client.output_socket):
                    msg = client.decode(await client.output_socket.recv(copy=False))
                    if isinstance(msg, EngineDead):
                        client.mark_dead(msg.message)
                        raise EngineDeadError(self.dead_reason)
                    if isinstance(msg, EngineCoreOutputs):
                        self._received.append(msg)
            if not ready and not self.check_alive():
                raise EngineDeadError(self.dead_reason)
        return self._received.popleft() if self._received else None

    def call_utility(self, method: str, *args: Any) -> list[tuple[int, int]]:
        return [key for client in self.clients for key in client.call_utility(method, *args)]

    def scheduler_stats(self, batch: EngineCoreOutputs) -> SchedulerStats:
        """The replicas' latest states summed (KV usage: of all their blocks)."""
        self._stats[batch.engine_index] = batch.scheduler_stats
        return sum_scheduler_stats([s for s in self._stats if s is not None])

    @staticmethod
    def combine_utility(method: str, results: list[Any]) -> Any:
        return combine_utility(method, results)


def sum_scheduler_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """One engine's view of several replicas' states: counts and cumulative counters
    add up; kv_cache_usage is the share of all their usable blocks in use."""
    # Counts add up; lists (events) are laid end to end.
    fields = {f: sum((getattr(s, f) for s in stats),
                     [] if isinstance(getattr(stats[0], f), list) else 0)
              for f in SchedulerStats.__struct_fields__}
    fields["kv_cache_usage"] = _usage([(s.kv_cache_usage, s.num_blocks) for s in stats])
    return SchedulerStats(**fields)


def _usage(replicas: list[tuple[float, int]]) -> float:
    """The share of all replicas' usable blocks in use, from each one's (usage, blocks)
    (block 0, the null block, is not usable)."""
    usable = sum(blocks - 1 for _, blocks in replicas)
    return sum(usage * (blocks - 1) for usage, blocks in replicas) / max(1, usable)


def combine_utility(method: str, results: list[Any]) -> Any:
    """A utility call's result over every replica, from theirs (in replica order)."""
    if method == "get_stats":
        out = {k: sum(r[k] for r in results) for k, v in results[0].items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out["kv_cache_usage"] = _usage([(r["kv_cache_usage"], r["num_blocks"])
                                        for r in results])
        out["engine_pid"] = results[0]["engine_pid"]
        return out | {"replicas": results}
    if method == "reset_prefix_cache":
        return all(results)
    if method in ("is_sleeping", "is_paused"):
        return any(results)
    if method == "num_unheld":
        return sum(results)
    if method in ("stop_profile", "collective_rpc"):  # per replica, per rank
        return [item for items in results for item in items]
    if method == "kv_snapshot":
        from pagedllm.core.kv_snapshot import concat_snapshots

        return {"snapshot": concat_snapshots([r["snapshot"] for r in results]),
                "build_s": max(r["build_s"] for r in results),
                "progress": {k: v for r in results for k, v in r["progress"].items()}}
    return results[0]


def make_core_client(config: EngineConfig, process: EngineProcess | None = None,
                     ) -> EngineCoreClient | DPEngineCoreClient:
    """The client of `config`'s engine: an EngineCoreClient, or with data_parallel_size
    > 1 a DPEngineCoreClient over one per replica (`process`: the first replica's)."""
    if config.parallel.data_parallel_size == 1:
        return EngineCoreClient(config, process)
    return DPEngineCoreClient(config, process)
