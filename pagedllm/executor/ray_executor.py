"""RayExecutor: one Ray actor per rank (tp x pp), on any node of a Ray cluster.

The multiprocess executor's design (multiproc.py) with Ray doing the transport: every
step the engine pickles the SchedulerOutput once and sends the bytes to each rank's
actor; every rank runs the step, their layers talking over gloo as under "mp"; only the
driver (TP rank 0 of the last stage) returns the ModelRunnerOutput, the others return
None. Each actor wraps a `Worker` built from a `WorkerInit`, exactly as an mp worker
process does.

The bytes travel inside each call's message while they are small (a decode step of 64
requests pickles to ~2.5 KB): the object store costs more than copying them (on a 2-core
machine, a round trip to two no-op actors took 4.4 ms through `ray.put` and an ObjectRef
against 1.5 ms by value). A large step (many new prompts) goes into the object store
once (`ray.put`) and every actor reads that one copy; passed by value, Ray would store
it once per call.

Cluster: when this process is not connected to Ray yet, the executor calls `ray.init()`,
which joins the cluster named by RAY_ADDRESS (or the one `ray start` left on this
machine) and otherwise starts a local one. Shutdown undoes only what the executor did:
`ray.shutdown()` when it called `ray.init()` (which stops a cluster it started and merely
disconnects from an existing one); with Ray already initialized by the caller, it only
kills its actors and frees its placement group.

Placement: one placement-group bundle per rank, rank i in bundle i, with Ray's PACK
strategy (the bundles go on as few nodes as hold them, so a stage's TP ranks share a
node when they can; ranks spill to further nodes only when one node lacks resources).
On CUDA each bundle is one GPU. On CPU each is a small fraction of a CPU: Ray's CPU count
is a scheduling token, not a limit, so any node can host several ranks, and the threads
are split among the ranks by `worker_config` as under "mp".

Ordering: the actors are synchronous (max_concurrency 1) and Ray runs the calls of one
caller to such an actor in submission order, so pipeline parallelism can keep
`pipeline_parallel_size` steps in flight (`execute_model(..., non_block=True)`) and every
rank still runs them in the same order.

Failure: a call that raises or an actor that dies fails the step: the executor gets
every rank's result of a step (non-drivers' None too), and `ray.get` of several results
raises as soon as one of them is an error, so any rank's failure ends the wait within
seconds, even while the other ranks are blocked in a collective with it. The executor
then kills every actor and raises EngineDeadError (a worker's own exception, with its
type, during start-up). Shutdown (explicit, on garbage collection or at interpreter exit,
through a weakref finalizer) releases everything.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, NoReturn

from pagedllm.config import EngineConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import driver_rank
from pagedllm.errors import EngineDeadError
from pagedllm.executor.step_future import StepFuture, StepsInFlight
from pagedllm.executor.worker_group import WorkerGroupExecutor
from pagedllm.loader.hf_config import import_remote_code_modules
from pagedllm.worker.worker import EXECUTE, Worker, WorkerInit, worker_config

logger = logging.getLogger(__name__)

# Ray placement strategy of the ranks' bundles (see the module docstring); the env var
# PAGEDLLM_RAY_PLACEMENT_STRATEGY overrides it (SPREAD puts CPU workers on separate nodes).
PLACEMENT_STRATEGY = "PACK"
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Ray CPUs a rank reserves on a CPU device: a token (see the module docstring).
CPU_PER_RANK = 0.01
# How long the placement group may take to be placed before start-up fails (a cluster
# without room for it would otherwise wait forever).
PLACEMENT_TIMEOUT_S = 120.0
# A step's pickled SchedulerOutput up to this size goes inside each call's message, a
# larger one through the object store (below Ray's 100 KiB limit for inline arguments).
INLINE_MAX_BYTES = 64 * 1024


class RayWorker:
    """The body of one rank's Ray actor: a `Worker`, built by `init`.

    Built in two calls (an empty actor, then `init`) so that an error while loading comes
    back as that call's exception, with its type, rather than as an actor that died while
    being created.
    """

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def location(self) -> tuple[str, int]:
        """(node IP, pid): for the logs, and for tests that kill a worker."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def init(self, data: bytes) -> None:
        """Build the Worker from the pickled WorkerInit (pickled here rather than by
        Ray: a config of a model directory's own code unpickles only with its module
        importable, from this node's HF_MODULES_CACHE)."""
        import_remote_code_modules()
        self.worker = Worker(pickle.loads(data))

    def execute(self, method: str, *args: Any) -> Any:
        """The Worker's `method` (determine_num_blocks, initialize_kv_cache, ...)."""
        assert self.worker is not None, "init first"
        return self.worker.execute(method, *args)

    def execute_step(self, data: bytes) -> ModelRunnerOutput | None:
        """One step from the pickled SchedulerOutput; None for a non-driver (nobody
        reads it)."""
        assert self.worker is not None, "init first"
        result = self.worker.execute(EXECUTE, pickle.loads(data))
        return result if self.worker.is_driver else None


@dataclass
class _Cluster:
    """What the executor holds in Ray: what the finalizer releases (it must not hold the
    executor itself)."""

    ray: Any
    did_init: bool = False
    """The executor called ray.init (so it calls ray.shutdown)."""
    placement_group: Any = None
    actors: list[Any] = field(default_factory=list)
    """Actor handles, by rank."""


class RayExecutor(WorkerGroupExecutor):
    """tp x pp Ray actors, each with one ModelRunner (its shard)."""

    def __init__(self, config: EngineConfig, placement_strategy: str | None = None) -> None:
        placement_strategy = placement_strategy or os.environ.get(
            "PAGEDLLM_RAY_PLACEMENT_STRATEGY", PLACEMENT_STRATEGY)
        if placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"PAGEDLLM_RAY_PLACEMENT_STRATEGY must be one of "
                             f"{PLACEMENT_STRATEGIES}, got {placement_strategy!r}")
        self._ray = _import_ray()
        self.tp_size = config.parallel.tensor_parallel_size
        self.pp_size = config.parallel.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        self.driver = driver_rank(self.tp_size, self.pp_size)
        # Steps in flight: one per pipeline stage keeps every stage busy.
        self.max_concurrent_batches = self.pp_size
        # A step's handle: its call (ObjectRef) on every rank, all waited for, so any
        # rank's failure fails the step.
        self._pending = StepsInFlight(
            lambda refs: self._wait(refs, during="execute_model")[self.driver])
        self._failed: str | None = None
        self.worker_locations: list[tuple[str, int]] = []
        """(node IP, pid) of each rank's actor."""
        self._cluster = _Cluster(self._ray)
        self._finalizer = weakref.finalize(self, _release, self._cluster)
        try:
            self._connect()
            self._place(config.device.device, placement_strategy)
            self._start_workers(worker_config(config, self.world_size))
        except BaseException:
            self.shutdown()
            raise

    def _connect(self) -> None:
        """Join Ray unless this process already has (then the connection is the
        caller's, and left as it is on shutdown).

        NOTE: a second RayExecutor in this process shares the first one's connection;
        shutting the first down (when it called ray.init) stops the second's workers.
        """
        if self._ray.is_initialized():
            return
        # ray.init replaces the SIGTERM handler (with sys.exit); the process hosting the
        # engine decides how it exits, so its own handler is put back.
        on_sigterm = signal.getsignal(signal.SIGTERM)
        # No arguments: ray.init's own resolution (RAY_ADDRESS, else the cluster `ray
        # start` left on this machine, else a new local one).
        self._ray.init()
        self._cluster.did_init = True
        if threading.current_thread() is threading.main_thread() and on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)

    def _place(self, device: str, strategy: str) -> None:
        """Reserve one bundle per rank; fail clearly if the cluster cannot hold them."""
        ray = self._ray
        bundle = {"GPU": 1.0} if device == "cuda" else {"CPU": CPU_PER_RANK}
        pg = ray.util.placement_group([dict(bundle) for _ in range(self.world_size)],
                                      strategy=strategy)
        self._cluster.placement_group = pg
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray could not place {self.world_size} workers ({bundle} each, strategy "
                f"{strategy}) within {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
                f"{ray.available_resources()} available") from None

    def _start_workers(self, config: EngineConfig) -> None:
        import torch.distributed as dist
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        gpus = 1 if config.device.device == "cuda" else 0
        actor_class = ray.remote(RayWorker)
        for rank in range(self.world_size):
            placement = PlacementGroupSchedulingStrategy(
                placement_group=self._cluster.placement_group,
                placement_group_bundle_index=rank)
            # max_concurrency 1: the calls run one at a time, in the order sent.
            self._cluster.actors.append(actor_class.options(
                num_cpus=0 if gpus else CPU_PER_RANK, num_gpus=gpus, max_concurrency=1,
                scheduling_strategy=placement).remote())
        # The rendezvous, hosted here: workers on other nodes reach it at this node's
        # address as Ray knows it; port 0 lets the OS pick one.
        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, None, True, wait_for_workers=False)
        refs = [actor.init.remote(pickle.dumps(WorkerInit(rank, self.tp_size, self.pp_size,
                                                          host, self._store.port, config)))
                for rank, actor in enumerate(self._cluster.actors)]
        # Loading errors (an unsupported model, a bad checkpoint) keep their type.
        self._wait(refs, during="start-up", reraise=True)
        self.worker_locations = self._wait(self._submit("location"), during="start-up")
        logger.info("started %d Ray workers (tp=%d, pp=%d; node IP, pid: %s)",
                    self.world_size, self.tp_size, self.pp_size, self.worker_locations)

    # ------------------------------------------------------------------ executor API

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> ModelRunnerOutput | StepFuture:
        """Send the step to every actor; its output, or (non_block) a future of it."""
        self._check_alive()
        data = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        # Small: copied into each call's message; large: stored once (module docstring).
        payload = data if len(data) <= INLINE_MAX_BYTES else self._ray.put(data)
        future = self._pending.add(self._submit("execute_step", payload))
        return future if non_block else future.result()

    def shutdown(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ calls

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        assert not self._pending, "a call to every worker while steps are in flight"
        self._check_alive()
        return self._wait(self._submit("execute", method, *args), during=method)

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise EngineDeadError(self._failed)

    def _submit(self, actor_method: str, *args: Any) -> list[Any]:
        """Call `actor_method` on every actor; the calls' ObjectRefs, by rank."""
        return [getattr(actor, actor_method).remote(*args)
                for actor in self._cluster.actors]

    def _wait(self, refs: list[Any], during: str, reraise: bool = False) -> list[Any]:
        """The results of `refs` (one call per rank), in order. Raises as soon as one of
        them fails, without waiting for the others."""
        ray = self._ray
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as e:
            rank, error = self._first_failure(refs, e)
            self._fail_call(rank, error, during, reraise)

    def _first_failure(self, refs: list[Any], error: Exception,
                       ) -> tuple[int | None, Exception]:
        """(rank, error) of a failed call of `refs` (`error`, with no rank, if none is
        found: it came from one of them). A dead actor is the cause when there is one:
        the others' calls then fail too, in a collective with it, often first, so the
        calls get a moment to settle."""
        ray = self._ray
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
        failures: list[tuple[int, Exception]] = []
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    failures.append((rank, e))
        for rank, e in failures:
            if isinstance(e, ray.exceptions.RayActorError):
                return rank, e
        return failures[0] if failures else (None, error)

    def _fail_call(self, rank: int | None, error: Exception, during: str,
                   reraise: bool) -> NoReturn:
        """A call that raised (RayTaskError, carrying the worker's exception) or whose
        actor died (RayActorError and kin): fail the executor."""
        who = "a worker" if rank is None else f"worker {rank}"
        cause = getattr(error, "cause", None)
        if isinstance(error, self._ray.exceptions.RayTaskError) and cause is not None:
            cause.add_note(f"(raised in {who})")
            self._fail(f"{who} failed during {during}: "
                       f"{type(cause).__name__}: {cause}\n{error}",
                       cause if reraise else None)
        self._fail(f"{who} died during {during}: {type(error).__name__}: {error}")

    def _fail(self, message: str, exc: BaseException | None = None) -> NoReturn:
        """Kill every actor (the group cannot go on without one) and raise."""
        self._failed = message
        logger.error("%s", message)
        # No graceful exit: the others may be blocked in a collective with the failed one.
        self.shutdown()
        if exc is not None:
            raise exc
        raise EngineDeadError(message)


def _import_ray() -> Any:
    try:
        import ray
        import ray.util  # noqa: F401 - placement groups, node address
    except ImportError as e:
        raise ImportError("distributed_executor_backend='ray' needs Ray: "
                          "pip install pagedllm[ray]") from e
    return ray


def _release(cluster: _Cluster) -> None:
    """Kill the actors, free the placement group, and ray.shutdown() if the executor
    called ray.init.

    A weakref finalizer (never a method): it runs at shutdown(), when the executor is
    collected, or at interpreter exit, and must not keep the executor alive.
    """
    ray = cluster.ray
    if not ray.is_initialized():
        # Ray's own exit hook ran first: the actors, owned by this driver, went with it.
        return
    for actor in cluster.actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already dead, or Ray is going down
            pass
    if cluster.placement_group is not None:
        try:
            ray.util.remove_placement_group(cluster.placement_group)
        except Exception:  # noqa: BLE001 - as above
            pass
    if cluster.did_init:
        ray.shutdown()
