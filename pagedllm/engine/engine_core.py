"""EngineCore: the schedule -> execute -> update loop over one scheduler and executor.

It owns no tokenizer and no text: it moves Requests. The offline LLMEngine calls it
in-process; the server's engine process wraps it behind a socket.

Pipeline parallelism keeps up to pipeline_parallel_size steps in flight (the executor's
`max_concurrent_batches`): `step()` schedules and sends a new step while there is room
and something to run, and otherwise waits for the oldest step's output, so every stage
has work while the others run theirs. The scheduler skips requests in flight.

Async scheduling (`SchedulerConfig.async_scheduling`, one worker) uses the same loop with
two steps: step N + 1 is scheduled and launched while step N runs on the device, its
requests continuing with placeholders for N's tokens (core/scheduler.py); N's output is
read only then, so the host's work for one step overlaps the device's for the step
before. While a live request needs its tokens on the host first (`can_overlap`), each
step's output is read before the next step is scheduled.

Structured output (engine/structured_output.py): a request with a grammar waits outside
the scheduler while a background thread compiles it, so a grammar that takes seconds to
compile holds back only its own request. Each step then carries the grammar requests'
token bitmask, and their matchers take the tokens that come back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.perf import ModelShape, PerfCounter
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.structured_output import StructuredOutputManager
from pagedllm.errors import (ConfigError, EngineBusyError, EngineSleepingError,
                             InvalidRequestError)
from pagedllm.executor.executor import create_executor
from pagedllm.request import Request, RequestStatus
from pagedllm.sample.structured_output import GrammarManager

logger = logging.getLogger(__name__)


# What sleep releases and wake_up takes back (vLLM's tags).
SLEEP_TAGS = ("weights", "kv_cache")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Sleep mode: the released parts (SLEEP_TAGS), empty while awake.
        self.asleep: set[str] = set()
        # pause(mode="keep"): the core's loop runs no step until resume().
        self.frozen = False
        # Whether the torch profiler records the steps (start_profile).
        self.profiling = False
        self.executor = create_executor(config)
        self.num_blocks = self.executor.determine_num_blocks()
        # Host blocks of swap preemption (0 unless preemption_mode is "swap").
        self.num_swap_blocks = self.executor.determine_num_swap_blocks()
        # Slots of the prefix cache's host tier (kv_offloading_size; 0: none).
        self.num_offload_blocks = 0
        if config.kv_transfer is not None and config.kv_transfer.is_offloading:
            from pagedllm.engine.kv_transfer import num_offload_blocks
            self.num_offload_blocks = num_offload_blocks(config,
                                                         self.executor.kv_bytes_per_block())
        self.executor.initialize_kv_cache(self.num_blocks, self.num_swap_blocks,
                                          self.num_offload_blocks)
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self.async_scheduling = config.scheduler.async_scheduling
        # Steps the loop keeps in flight: the pipeline's stages, or async scheduling's
        # one step ahead of the one whose output is read next.
        self.max_in_flight = 2 if self.async_scheduling else self.max_concurrent_batches
        group_windows = self.executor.kv_cache_group_windows()
        kv_store = None
        if config.kv_transfer is not None:
            from pagedllm.engine.kv_transfer import make_kv_store
            try:
                kv_store = make_kv_store(config, tuple(group_windows),
                                         self.executor.splits_prompt_rows(),
                                         self.num_offload_blocks)
            except BaseException:
                self.executor.shutdown()
                raise
        scheduler_cls = scheduler_class(config.scheduler.scheduler_cls)
        self.scheduler = scheduler_cls(config.scheduler, config.cache, self.num_blocks,
                                       num_swap_blocks=self.num_swap_blocks,
                                       pipeline_depth=self.max_concurrent_batches,
                                       group_windows=group_windows,
                                       num_lookahead_tokens=_num_lookahead_tokens(config),
                                       hash_prompt_rows=self.executor.splits_prompt_rows(),
                                       enable_kv_events=config.kv_events is not None,
                                       kv_store=kv_store,
                                       kv_load_failure_policy=(
                                           config.kv_transfer.kv_load_failure_policy
                                           if config.kv_transfer is not None else "fail"),
                                       residency_sample_rate=(
                                           config.observability.kv_cache_metrics_sample))
        # KV cache events (engine/kv_events.py; imported only when asked for).
        self.kv_event_publisher = None
        if config.kv_events is not None:
            from pagedllm.engine.kv_events import make_publisher
            try:
                self.kv_event_publisher = make_publisher(
                    config.kv_events, config.parallel.data_parallel_rank)
            except BaseException:
                self.executor.shutdown()
                raise
        # Estimated FLOPs and bytes of the steps (enable_mfu_metrics).
        self.perf = (make_perf_counter(config) if config.observability.enable_mfu_metrics
                     else None)
        # enable_logging_iteration_details: id(SchedulerOutput) -> (step number, when
        # scheduled, prefill requests and tokens, decode requests and tokens).
        self.iteration_details = config.observability.enable_logging_iteration_details
        self._steps_in_flight: dict[int, tuple[int, float, int, int, int, int]] = {}
        self._num_steps = 0
        # (SchedulerOutput, future of its ModelRunnerOutput), oldest first.
        self.batch_queue: deque[tuple[Any, Any]] = deque()
        limits = config.structured_outputs
        self.structured_output = StructuredOutputManager(GrammarManager(
            lambda: _load_tokenizer(config), config.model.hf_config.vocab_size,
            compile_cpu_limit_s=limits.compile_timeout_s,
            compile_memory_limit_bytes=int(limits.compile_memory_gib * (1 << 30))))
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), %s", self.num_blocks,
                    config.cache.block_size, (self.num_blocks - 1) * config.cache.block_size,
                    config.kv_cache_dtype)
        if self.num_offload_blocks:
            logger.info("KV host tier: %d blocks (%d tokens)", self.num_offload_blocks,
                        self.num_offload_blocks * config.cache.block_size)
        elif kv_store is not None:
            logger.info("KV store (%s): %s/%s", config.kv_transfer.kv_role, kv_store.root,
                        kv_store.namespace)
        if group_windows != (None,):
            logger.info("KV cache groups (windows give blocks back): %s",
                        ", ".join(f"{w or 'full'}" for w in group_windows))
        if self.num_swap_blocks:
            logger.info("swap space: %d host blocks", self.num_swap_blocks - 1)
        if self.async_scheduling:
            logger.info("async scheduling: each step is launched while the one before runs")

    def add_request(self, request: Request, sibling_of: str | None = None) -> None:
        """Queue a validated request; raises InvalidRequestError if it can never fit.
        `sibling_of`: the first request of its n > 1 fan-out (data parallel replicas
        keep a fan-out together, for its shared prompt blocks; one engine has no use
        for it)."""
        if self.asleep:
            raise EngineSleepingError("the engine is asleep: wake it up first (LLM.wake_up(), "
                                      "or POST /wake_up on the server)")
        if request.req_id in self.structured_output:
            raise InvalidRequestError(f"request id {request.req_id!r} is already in use")
        self.scheduler.check_request(request)
        if request.sampling_params.structured_outputs is None:
            self.scheduler.add_request(request)
            if request.sampling_params.thinking_token_budget is not None:
                self.structured_output.track(request)  # its budget's end tag is masked
        else:
            self.structured_output.submit(request)  # to the scheduler once compiled

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self._finish(req_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Finish requests as "stop" (a stop string was found in their text)."""
        return self._finish(req_ids, RequestStatus.FINISHED_STOPPED)

    def _finish(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        req_ids = [req_ids] if isinstance(req_ids, str) else list(req_ids)
        finished = self.structured_output.pop(req_ids)
        for request in finished:
            request.status = status
        return finished + self.scheduler.finish_requests(req_ids, status)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to compile (not in the scheduler yet)."""
        return self.structured_output.num_pending

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self.batch_queue)
                or self.num_compiling > 0)

    def _admit_compiled(self) -> list[Request]:
        """Hand the requests whose grammar compiled to the scheduler; return the ones
        finished instead (compile failed: aborted; or their deadline passed)."""
        if not self.num_compiling:
            return []
        ready, finished = self.structured_output.pop_ready()
        for request in finished:  # failed to compile
            request.status = RequestStatus.FINISHED_ABORTED
        for request in ready:
            try:
                self.scheduler.add_request(request)  # checked by add_request already
            except InvalidRequestError as e:  # its id was taken meanwhile
                logger.warning("request %s dropped: %s", request.req_id, e)
                request.status = RequestStatus.FINISHED_ABORTED
                finished.append(request)
        now = self.scheduler.clock()  # the deadlines' time source
        expired = [r.req_id for r in self.structured_output.pending_requests()
                   if r.deadline is not None and r.deadline <= now]
        if expired:
            finished += self._finish(expired, RequestStatus.FINISHED_TIMEOUT)
        if not self.scheduler.has_unfinished_requests() and not self.batch_queue:
            # Only compiles are left: wait for one rather than spin.
            self.structured_output.wait(0.05)
        return finished

    def _schedule(self) -> SchedulerOutput:
        """scheduler.schedule(), with the grammar bitmask of the requests that sample."""
        scheduler_output = self.scheduler.schedule()
        self.structured_output.fill_bitmask(scheduler_output)
        if self.perf is not None:
            self.perf.observe(self._step_work(scheduler_output))
        if self.iteration_details and not scheduler_output.is_empty:
            self._num_steps += 1
            so = scheduler_output
            # A request whose tokens this step include prompt tokens is a prefill.
            prefill = [n for req_id, n in so.num_scheduled_tokens.items()
                       if (self.scheduler.requests[req_id].num_computed_tokens - n
                           < self.scheduler.requests[req_id].num_prompt_tokens)]
            self._steps_in_flight[id(so)] = (
                self._num_steps, time.perf_counter(), len(prefill), sum(prefill),
                len(so.num_scheduled_tokens) - len(prefill),
                so.total_num_scheduled_tokens - sum(prefill))
        return scheduler_output

    def _step_work(self, so: SchedulerOutput) -> list[tuple[int, int, int]]:
        """Per scheduled request: (context before the step, tokens computed, rows
        sampled), for the perf estimates. The scheduler has counted the step's tokens
        into num_computed_tokens already."""
        work = []
        for req_id, num in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            after = req.num_computed_tokens
            if req_id in so.scheduled_spec_decode_tokens:
                rows = num
            else:
                rows = int(after >= req.num_prompt_tokens and not req.is_pooling)
            work.append((after - num, num, rows))
        return work

    def _update(self, scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> list[Request]:
        # Requests the runner could not run as asked end here, with Request.error;
        # what they sampled is dropped (the updates below skip finished requests).
        failed = (self.scheduler.fail_requests(runner_output.failed_requests)
                  if runner_output.failed_requests else [])
        if runner_output.errored_requests:
            failed += self.scheduler.fail_requests(runner_output.errored_requests,
                                                   invalid=False)
        self.structured_output.accept_tokens(runner_output)
        details = self._steps_in_flight.pop(id(scheduler_output), None)
        if details is not None:
            step, start, num_prefill, prefill_tokens, num_decode, decode_tokens = details
            logger.info("Iteration %d: %d prefill requests (%d tokens), %d decode requests "
                        "(%d tokens), %.2f ms", step, num_prefill, prefill_tokens,
                        num_decode, decode_tokens, 1e3 * (time.perf_counter() - start))
        return failed + self.scheduler.update_from_output(scheduler_output, runner_output)

    def step(self) -> list[Request]:
        """Run one forward pass; return the requests that got tokens or finished
        (including those whose deadline passed: finished with FINISHED_TIMEOUT)."""
        try:
            return self._step()
        finally:
            self.publish_kv_events()

    def publish_kv_events(self) -> None:
        """Hand the KV cache events recorded since the last call to the publisher (none
        without kv_events_config)."""
        if self.kv_event_publisher is None:
            return
        events = self.scheduler.kv_cache_manager.take_events()
        if self.num_offload_blocks:  # (the host tier's, medium "CPU")
            events += self.scheduler.kv_store.take_events()
        if events:
            self.kv_event_publisher.publish(events)

    def _step(self) -> list[Request]:
        finished = self._admit_compiled()
        if self.max_in_flight > 1:
            return finished + self._step_pipelined()
        if not self.scheduler.has_unfinished_requests():
            return finished
        scheduler_output = self._schedule()
        # Timed out inside schedule(): no runner output will mention them.
        timed_out = finished + self.scheduler.pop_timed_out_requests()
        if scheduler_output.is_empty:
            # Every live request timed out: nothing to run. The runner still gets the
            # output so it drops their state (an empty step skips the forward pass).
            self.executor.execute_model(scheduler_output)
            return timed_out
        runner_output = self.executor.execute_model(scheduler_output)
        return timed_out + self._update(scheduler_output, runner_output)

    def _step_pipelined(self) -> list[Request]:
        """Send a new step if one fits in the pipeline and has work; otherwise (or when
        the pipeline is full) take the oldest step's output. Returns the requests updated
        (and timed out) by this call, possibly none."""
        timed_out: list[Request] = []
        if (len(self.batch_queue) < self.max_in_flight
                and self.scheduler.has_unfinished_requests()
                and (not self.batch_queue or not self.async_scheduling
                     or self.scheduler.can_overlap())):
            scheduler_output = self._schedule()
            timed_out = self.scheduler.pop_timed_out_requests()
            so = scheduler_output
            if (not so.is_empty or so.finished_req_ids or so.preempted_req_ids
                    or so.blocks_to_swap_out or so.blocks_to_swap_in):
                # Steps without tokens still carry ids the runners must drop (and
                # swaps); their empty outputs come back in order with the rest.
                future = self.executor.execute_model(scheduler_output, non_block=True)
                self.batch_queue.append((scheduler_output, future))
                if (not scheduler_output.is_empty
                        and len(self.batch_queue) < self.max_in_flight):
                    return timed_out  # room for another step before waiting
        if not self.batch_queue:
            return timed_out
        scheduler_output, future = self.batch_queue.popleft()
        runner_output = future.result()
        return timed_out + self._update(scheduler_output, runner_output)

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """Forget every cached prefix block; only when no request holds a block (False:
        nothing was reset). `reset_external` (vLLM's): then delete this engine's blocks
        from the KV store of kv_transfer_config too."""
        done = self.scheduler.kv_cache_manager.reset_prefix_cache()
        if done and reset_external and self.scheduler.kv_store is not None:
            self.scheduler.kv_store.clear()
        self.publish_kv_events()
        return done

    def collective_rpc(self, payload: bytes) -> list:
        """An encoded call (worker/rpc.py) on every rank's worker; results in rank
        order. Between steps only: the workers run one thing at a time."""
        if self.batch_queue:
            raise EngineBusyError(f"{len(self.batch_queue)} steps are in flight: "
                                  f"collective_rpc runs between steps; retry")
        return self.executor.collective_rpc(payload)

    def update_weights(self, weights: Any) -> None:
        """Load new weights ((hf_name, tensor) pairs or a dict, as the model's checkpoint
        names them; names not given keep the files' values) into an idle engine, e.g. a
        trainer's after each step. The prefix cache is reset (its K/V came from the old
        weights); a sleeping engine's weights wake up with them."""
        import torch

        pairs = list(weights.items() if isinstance(weights, dict) else weights)
        if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                   and isinstance(p[1], torch.Tensor) for p in pairs):
            raise InvalidRequestError("weights must be (name, tensor) pairs or a dict of "
                                      "name -> tensor")
        model = self.config.model
        if model.quantization is not None or model.load_format == "dummy":
            why = ("its GGUF blocks are not dense tensors: load it with dequantize=True"
                   if model.quantization is not None else "load_format 'dummy' has no files")
            raise ConfigError(f"update_weights needs a dense model read from files: {why}")
        if self.has_unfinished_requests():
            raise EngineBusyError("requests are unfinished: weights change only when the "
                                  "engine is idle")
        self.executor.update_weights(pairs)
        self.reset_prefix_cache()
        if self.scheduler.kv_store is not None:
            from pagedllm.engine.kv_transfer import new_weights_salt
            self.scheduler.kv_store.renew_namespace(new_weights_salt())
        self.asleep.discard("weights")

    # ------------------------------------------------------------------ profiling

    def start_profile(self) -> None:
        """Record the model's steps with torch's profiler until stop_profile (needs
        profiler_dir)."""
        if self.config.device.profiler_dir is None:
            raise ConfigError("profiling is off: give profiler_dir (--profiler-dir) or set "
                              "PAGEDLLM_TORCH_PROFILER_DIR")
        if self.profiling:
            raise InvalidRequestError("the profiler is already recording: stop_profile "
                                      "first")
        self.executor.start_profile()
        self.profiling = True

    def stop_profile(self) -> list[str]:
        """Stop recording; the traces' paths (Chrome trace JSON, one per worker)."""
        if not self.profiling:
            raise InvalidRequestError("the profiler is not recording: start_profile first")
        self.profiling = False
        # A worker that recorded no step (delay_iterations not reached) has no trace.
        paths = [path for path in self.executor.stop_profile() if path]
        logger.info("profiler traces: %s", ", ".join(paths) or "none (no step recorded)")
        return paths

    # ------------------------------------------------------------------ sleep mode

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1), and the weights too (level 2), until
        `wake_up`. Needs enable_sleep_mode and an idle engine; the prefix cache is reset
        (its blocks' contents are gone). Asleep, the engine refuses requests."""
        if not self.config.device.enable_sleep_mode:
            raise ConfigError("sleep mode is off: build the engine with "
                              "enable_sleep_mode=True (pagedllm serve --enable-sleep-mode)")
        check_sleep_level(level)
        if self.has_unfinished_requests():
            sched = self.scheduler
            num = (sched.num_running + sched.num_waiting + sched.num_swapped
                   + self.num_compiling)
            raise EngineBusyError(f"{num} requests are unfinished: the engine sleeps only "
                                  f"when idle")
        self.reset_prefix_cache()
        if self.num_offload_blocks:
            self.scheduler.kv_store.clear()  # (the tier is allocated anew on wake_up)
        self.executor.sleep(level)
        self.asleep |= {"kv_cache", "weights"} if level == 2 else {"kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what sleep released: `tags` of "weights" and "kv_cache" (default
        both; the KV cache needs the weights awake). Awake, it takes requests again."""
        tags = check_wake_tags(tags)
        if "kv_cache" in tags and "weights" in self.asleep and "weights" not in tags:
            raise InvalidRequestError("wake the weights up before the KV cache (the cache "
                                      "is laid out by the model's layers)")
        self.executor.wake_up(tags)
        self.asleep -= set(tags)
        if self.asleep:  # the weights awake, the cache not yet: still refusing requests
            logger.info("woke up %s; still asleep: %s", ", ".join(tags),
                        ", ".join(sorted(self.asleep)))

    def is_sleeping(self) -> bool:
        """Whether any part is asleep (requests are refused until all is awake)."""
        return bool(self.asleep)

    # ------------------------------------------------------------------ pause

    def pause(self, mode: str) -> None:
        """vLLM's pause_generation, the core's part. "keep": every request stays where
        it is, the loop runs no step until resume(). "abort" / "wait": the requests
        that have not run yet, and new ones, are held (the front end aborts the others,
        or waits for them: num_unheld()). Requests are taken all along."""
        check_pause_mode(mode)
        if mode == "keep":
            self.frozen = True
        else:
            self.scheduler.hold_new_requests()

    def resume(self) -> None:
        self.frozen = False
        self.scheduler.release_held()

    def is_paused(self) -> bool:
        return self.frozen or self.scheduler.held is not None

    def expire_idle(self) -> list[Request]:
        """The requests whose deadline passed while no step runs (held ones, or all of
        them while frozen), finished as FINISHED_TIMEOUT: the loop's step would have."""
        return self.scheduler.expire()

    def num_unheld(self) -> int:
        """Requests that may still run (not held), steps in flight included."""
        return (self.scheduler.get_num_unfinished_requests() + len(self.batch_queue)
                + self.num_compiling)

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()


PAUSE_MODES = ("abort", "wait", "keep")


def check_pause_mode(mode: Any) -> None:
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got "
                                  f"{str(mode)[:40]!r}")


def check_sleep_level(level: Any) -> None:
    if isinstance(level, bool) or level not in (1, 2):
        raise InvalidRequestError(f"sleep level must be 1 (release the KV cache) or 2 (the "
                                  f"weights too), got {str(level)[:40]}")


def check_wake_tags(tags: Any) -> list[str]:
    """wake_up's tags (None: all of SLEEP_TAGS), checked."""
    tags = list(SLEEP_TAGS if tags is None else tags)
    if not tags or any(t not in SLEEP_TAGS for t in tags):
        raise InvalidRequestError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got "
                                  f"{str(tags)[:80]}")
    return tags


def _load_tokenizer(config: EngineConfig) -> Any:
    """The grammar compiler's tokenizer, loaded with the first grammar (loader/ imports
    torch, which importing the engine does not)."""
    from pagedllm.loader import load_tokenizer

    return load_tokenizer(config.model.path, config.model.tokenizer,
                          config.model.trust_remote_code)


def _num_lookahead_tokens(config: EngineConfig) -> int:
    """KV slots a sampling step reserves past its tokens (a draft model's proposals)."""
    return config.speculative.num_lookahead_tokens if config.speculative else 0


def make_perf_counter(config: EngineConfig) -> PerfCounter:
    """The perf estimates' counter for this engine's model and layout."""
    import dataclasses
    import os

    model = config.model
    dtype_bytes = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}.get(str(model.dtype)
                                                                       .split(".")[-1], 2.0)
    shape = ModelShape.from_hf_config(model.hf_config, dtype_bytes,
                                      1.0 if config.cache.cache_dtype.startswith("fp8")
                                      else dtype_bytes, config.parallel.world_size)
    if model.quantization == "gguf" and os.path.isfile(model.path):
        # Blocks of several sizes: the file's bytes over its weights, on average.
        shape = dataclasses.replace(
            shape, weight_bytes_per_param=os.path.getsize(model.path) / shape.weight_params)
    return PerfCounter(shape)


# vLLM's own schedulers by the names its --scheduler-cls takes: pagedllm's here.
_VLLM_SCHEDULERS = frozenset({"vllm.v1.core.sched.scheduler.Scheduler",
                              "vllm.v1.core.sched.async_scheduler.AsyncScheduler"})


def scheduler_class(name: str) -> type[Scheduler]:
    """The scheduler class `name` names (ConfigError unless a Scheduler subclass)."""
    if not name or name in _VLLM_SCHEDULERS:
        return Scheduler
    from pagedllm.qualname import import_subclass

    try:
        return import_subclass(name, Scheduler, "scheduler_cls")
    except ValueError as e:
        raise ConfigError(str(e)) from None
