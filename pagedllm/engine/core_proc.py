"""The engine-core process: EngineCore's schedule -> execute -> update loop behind ZMQ.

The API process (front end) tokenizes, detokenizes and applies stop strings; this
process only moves token ids, like vLLM V1's EngineCoreProc. Two PUSH/PULL sockets:

    front end --(AddRequest | FinishRequests | UtilityCall | Shutdown)--> core
    front end <--(EngineCoreOutputs: per-step token deltas + scheduler stats)-- core

Messages are msgspec structs in msgpack. A `Request` and per-token extras (logprobs)
travel pickled inside them: both sides run the same code, the socket is local, and the
sampling fields keep growing, so an explicit schema would only lag behind.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any

import msgspec

from pagedllm.config import EngineConfig
from pagedllm.errors import ConfigError, EngineBusyError, InvalidRequestError, ModelLoadError
from pagedllm import log_config
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# Request list attributes that only grow (besides output_token_ids) and must reach the
# front end's mirror of the request: only their new entries travel each step. An
# embedding request's pooled vector goes from [] to the whole vector in its one step.
# The output tokens' logprobs travel too, and are dropped here once sent
# (Request.take_output_logprobs).
GROWING_ATTRS = ("prompt_logprobs", "pooler_output")

# Errors a user fixes in the model or the options, reported by name at start-up.
USER_ERRORS = (ModelLoadError, ConfigError)


# ------------------------------------------------------------------ front end -> core

class AddRequest(msgspec.Struct, tag="add"):
    request: bytes
    """The pickled, validated `Request` (built by the front end's InputProcessor)."""


class FinishRequests(msgspec.Struct, tag="finish"):
    req_ids: list[str]
    status: str
    """RequestStatus value: finished_aborted (client gone) or finished_stopped (stop string)."""


class UtilityCall(msgspec.Struct, tag="utility"):
    call_id: int
    method: str
    """One of EngineCoreProc.UTILITIES."""
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


CoreInput = AddRequest | FinishRequests | UtilityCall | Shutdown


# ------------------------------------------------------------------ core -> front end

class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step."""

    req_id: str
    new_token_ids: list[int]
    status: str
    """RequestStatus value after the step."""
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    """time.monotonic() of the step that first scheduled it (first output only)."""
    extras: bytes | None = None
    """Pickled {attr: new entries} of GROWING_ATTRS, when any grew."""


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of usable KV blocks held by requests."""
    prefix_cache_queries: int
    """Cumulative prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int
    """Cumulative prompt tokens served from it."""
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int
    num_swapped: int = 0
    """Requests swapped out to the host pool (preemption_mode "swap")."""
    num_swaps_out: int = 0
    """Cumulative swap-outs."""
    num_swaps_in: int = 0
    """Cumulative swap-ins."""
    num_swapped_blocks: int = 0
    num_draft_tokens: int = 0
    """Cumulative tokens proposed by speculative decoding."""
    num_accepted_tokens: int = 0
    """Cumulative proposed tokens accepted."""
    external_prefix_cache_queries: int = 0
    """Cumulative prompt tokens looked up in the KV store (kv_transfer_config)."""
    external_prefix_cache_hits: int = 0
    """Cumulative prompt tokens loaded from it."""
    estimated_flops: float = 0.0
    """Cumulative estimated FLOPs per worker (enable_mfu_metrics; core/perf.py)."""
    estimated_read_bytes: float = 0.0
    estimated_write_bytes: float = 0.0
    kv_block_residency: list[tuple[float, float, tuple[float, ...]]] = msgspec.field(
        default_factory=list)
    """kv_cache_metrics: the sampled blocks' stays that ended since the last stats
    (lifetime, idle seconds, reuse gaps; core/kv_residency.py)."""
    """Host blocks held by swapped requests."""


class RequestError(msgspec.Struct, array_like=True):
    req_id: str
    message: str
    is_invalid: bool
    """True for InvalidRequestError (a 400), False for an engine failure."""


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: bytes
    """Pickled return value."""


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    timestamp: float
    errors: list[RequestError] = []
    utility_results: list[UtilityResult] = []
    engine_index: int = 0
    """The data parallel replica that sent it (ParallelConfig.data_parallel_rank)."""


class EngineReady(msgspec.Struct, tag="ready"):
    num_blocks: int
    block_size: int
    pid: int


class EngineDead(msgspec.Struct, tag="dead"):
    message: str
    user_error: str | None = None
    """At start-up, "ModelLoadError" or "ConfigError" when the model or the options are
    what failed (the front end raises the same, `message` being the error's own)."""


CoreOutput = EngineCoreOutputs | EngineReady | EngineDead


class EngineCoreProc:
    """Runs an EngineCore and serves the sockets until Shutdown or the parent exits."""

    UTILITIES = ("get_stats", "reset_prefix_cache", "ping", "kv_snapshot", "sleep",
                 "wake_up", "is_sleeping", "start_profile", "stop_profile",
                 "collective_rpc", "pause", "resume", "is_paused", "num_unheld")

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str,
                 parent_pid: int) -> None:
        import zmq

        from pagedllm.engine.engine_core import EngineCore

        self.parent_pid = parent_pid
        self.engine_index = config.parallel.data_parallel_rank
        self.ctx = zmq.Context()
        self.input_sock = self.ctx.socket(zmq.PULL)
        self.input_sock.connect(input_addr)
        self.output_sock = self.ctx.socket(zmq.PUSH)
        self.output_sock.setsockopt(zmq.LINGER, 1000)
        self.output_sock.connect(output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(CoreInput)
        try:
            self.core = EngineCore(config)
        except USER_ERRORS as e:
            self._send(EngineDead(str(e), user_error=type(e).__name__))
            raise
        except BaseException as e:
            self._send(EngineDead(f"engine start-up failed: {e!r}"))
            raise
        # A server's first grammar request would otherwise wait seconds for xgrammar and
        # the compiler process to start (more on a busy machine: that process is niced).
        self.core.structured_output.warm_up()
        # req_id -> how many entries of each per-token list were already sent.
        self._num_sent: dict[str, dict[str, int]] = {}
        # req_id -> monotonic time of its first scheduling step (None once reported).
        self._first_scheduled: dict[str, float | None] = {}
        self._running = True
        self._send(EngineReady(num_blocks=self.core.num_blocks,
                               block_size=config.cache.block_size, pid=os.getpid()))

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        while self._running:
            busy = self.core.has_unfinished_requests() and not self.core.frozen
            # Idle: block on the socket, waking every second to notice an orphaned process
            # (and at the next deadline: held or frozen requests still time out).
            if self.input_sock.poll(0 if busy else self._idle_wait_ms()):
                errors, results = self._handle_inputs()
            elif not busy:
                if os.getppid() != self.parent_pid:
                    logger.warning("front end exited; engine core stops")
                    return
                self._send_expired()
                continue
            else:
                errors, results = [], []
            if not self._running:
                return
            runs = self.core.has_unfinished_requests() and not self.core.frozen
            outputs = self._step(errors) if runs else []
            self._send(EngineCoreOutputs(outputs=outputs, scheduler_stats=self._stats(),
                                         timestamp=time.monotonic(), errors=errors,
                                         utility_results=results,
                                         engine_index=self.engine_index))

    def _handle_inputs(self) -> tuple[list[RequestError], list[UtilityResult]]:
        import zmq

        errors: list[RequestError] = []
        results: list[UtilityResult] = []
        while True:
            try:
                frame = self.input_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return errors, results
            msg = self.decoder.decode(frame)
            if isinstance(msg, AddRequest):
                request: Request = pickle.loads(msg.request)
                try:
                    self.core.add_request(request)
                except InvalidRequestError as e:
                    errors.append(RequestError(request.req_id, str(e), True))
                except Exception as e:  # one bad request must not stop the engine
                    logger.exception("add_request %s failed", request.req_id)
                    errors.append(RequestError(request.req_id, repr(e), False))
            elif isinstance(msg, FinishRequests):
                status = RequestStatus(msg.status)
                if status == RequestStatus.FINISHED_STOPPED:
                    done = self.core.stop_requests(msg.req_ids)
                else:
                    done = self.core.abort_requests(msg.req_ids)
                for req in done:
                    self._forget(req.req_id)
            elif isinstance(msg, UtilityCall):
                results.append(UtilityResult(msg.call_id, pickle.dumps(self._utility(msg))))
            else:
                self._running = False
                return errors, results

    def _idle_wait_ms(self) -> int:
        deadline = self.core.scheduler.next_deadline()
        if deadline is None:
            return 1000
        return max(0, min(1000, math.ceil((deadline - time.monotonic()) * 1000)))

    def _send_expired(self) -> None:
        """Idle: the requests whose deadline passed, finished and sent."""
        expired = self.core.expire_idle()
        if not expired:
            return
        outputs = [self._make_output(req) for req in expired]
        for req in expired:
            self._forget(req.req_id)
        self._send(EngineCoreOutputs(outputs=outputs, scheduler_stats=self._stats(),
                                     timestamp=time.monotonic(), errors=[],
                                     utility_results=[], engine_index=self.engine_index))

    def _step(self, errors: list[RequestError]) -> list[EngineCoreOutput]:
        """The step's outputs; a request the engine failed goes to `errors` instead,
        answered as a bad request when it was at fault (its grammar did not compile),
        as a server error otherwise (a custom logits processor raised)."""
        step_start = time.monotonic()
        updated = []
        for req in self.core.step():
            if req.error is None:
                updated.append(req)
            else:
                errors.append(RequestError(req.req_id, req.error, req.error_is_invalid))
                self._forget(req.req_id)
        # Requests this step scheduled for the first time: their queue time ends at
        # step_start (reported with their first output, which may come steps later when
        # a long prompt is prefilled in chunks).
        for req in itertools.chain(self.core.scheduler.running, updated):
            self._first_scheduled.setdefault(req.req_id, step_start)
        outputs = [self._make_output(req) for req in updated]
        for req in updated:
            if req.is_finished:
                self._forget(req.req_id)
        # Requests scheduled for the first time without a token yet (a prefill chunk):
        # an empty output tells the front end they left the queue (--max-queued-requests).
        for req in self.core.scheduler.running:
            if self._first_scheduled.get(req.req_id) is not None:
                outputs.append(self._make_output(req))
        return outputs

    def _make_output(self, req: Request) -> EngineCoreOutput:
        sent = self._num_sent.setdefault(req.req_id, {})
        num_tokens = sent.get("output_token_ids", 0)
        sent["output_token_ids"] = req.num_output_tokens
        # None once reported: the key stays so setdefault above does not record it again.
        first_scheduled = self._first_scheduled.get(req.req_id)
        self._first_scheduled[req.req_id] = None
        extras: dict[str, Any] = {}
        if req.output_logprobs:
            extras["output_logprobs"] = req.take_output_logprobs()
        for attr in GROWING_ATTRS:
            values = getattr(req, attr, None)
            if values and len(values) > sent.get(attr, 0):
                extras[attr] = values[sent.get(attr, 0):]
                sent[attr] = len(values)
        return EngineCoreOutput(
            req_id=req.req_id, new_token_ids=req.output_token_ids[num_tokens:],
            status=req.status.value, stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_tokens, first_scheduled_time=first_scheduled,
            extras=pickle.dumps(extras) if extras else None)

    def _forget(self, req_id: str) -> None:
        self._num_sent.pop(req_id, None)
        self._first_scheduled.pop(req_id, None)

    # ------------------------------------------------------------------ helpers

    def _stats(self, drain: bool = True) -> SchedulerStats:
        """The scheduler's counters; `drain`: with the residency events since the last
        call (they go to the metrics once)."""
        sched = self.core.scheduler
        kv = sched.kv_cache_manager
        store = sched.kv_store
        perf = self.core.perf
        return SchedulerStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting + self.core.num_compiling,  # grammars compiling too
            kv_cache_usage=kv.usage, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, num_preemptions=sched.num_preemptions,
            num_free_blocks=kv.get_num_free_blocks(), num_blocks=self.core.num_blocks,
            num_swapped=sched.num_swapped, num_swaps_out=sched.num_swaps_out,
            num_swaps_in=sched.num_swaps_in, num_swapped_blocks=sched.num_swapped_blocks,
            num_draft_tokens=sched.num_draft_tokens,
            num_accepted_tokens=sched.num_accepted_tokens,
            external_prefix_cache_queries=store.queries if store is not None else 0,
            external_prefix_cache_hits=store.hits if store is not None else 0,
            estimated_flops=perf.flops if perf is not None else 0.0,
            estimated_read_bytes=perf.read_bytes if perf is not None else 0.0,
            estimated_write_bytes=perf.write_bytes if perf is not None else 0.0,
            kv_block_residency=kv.take_residency_events() if drain else [])

    def _utility(self, call: UtilityCall) -> Any:
        if call.method == "get_stats":
            stats = self._stats(drain=False)  # (the events are the metrics')
            import psutil

            return {f: getattr(stats, f) for f in stats.__struct_fields__} | {
                "engine_pid": os.getpid(),
                "engine_rss_bytes": psutil.Process().memory_info().rss}
        if call.method == "reset_prefix_cache":
            return self.core.reset_prefix_cache(*call.args)
        if call.method == "ping":
            return "pong"
        if call.method == "collective_rpc":
            try:
                return self.core.collective_rpc(*call.args)
            except Exception as e:  # noqa: BLE001 - the caller's call failed: its answer
                return e
        if call.method in ("sleep", "wake_up", "is_sleeping", "start_profile",
                           "stop_profile", "pause", "resume", "is_paused", "num_unheld"):
            try:
                return getattr(self.core, call.method)(*call.args)
            except (ValueError, EngineBusyError) as e:  # the caller's: answered, not fatal
                return e
        if call.method == "kv_snapshot":
            # The dashboard's block grid: built only when asked (the front end caches
            # it and asks a few times a second at most), never in the step loop.
            from pagedllm.core.kv_snapshot import snapshot_blocks

            sched = self.core.scheduler
            start = time.perf_counter()
            snapshot = snapshot_blocks(sched.kv_cache_manager)
            return {"snapshot": snapshot, "build_s": time.perf_counter() - start,
                    "progress": {r.req_id: (r.num_computed_tokens, r.num_prompt_tokens)
                                 for r in sched.running}}
        return RuntimeError(f"unknown utility {call.method!r}")

    def _send(self, msg: CoreOutput) -> None:
        self.output_sock.send(self.encoder.encode(msg), copy=False)

    def close(self) -> None:
        self.core.shutdown()
        self.input_sock.close(linger=0)
        self.output_sock.close()
        self.ctx.term()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pin_to(cpu_ids: tuple[int, ...]) -> None:
    """Pin every thread of this process to `cpu_ids` (a data parallel replica's cores):
    a thread started by the imports keeps its own mask, and threads started from now on
    (torch's intra-op pool, the workers' processes) inherit the caller's."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has just exited
            os.sched_setaffinity(int(tid), cpu_ids)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    parent_pid: int, log_level: int = logging.INFO) -> None:
    """Entry point of the spawned engine process."""
    # A data parallel replica's lines say which one wrote them.
    rank = config.parallel.data_parallel_rank
    replicas = config.parallel.data_parallel_size > 1
    # The front end's setting (the CLI puts it in the environment), else its level.
    logging_config = (log_config.LoggingConfig.from_env() if log_config.ENV in os.environ
                      else log_config.LoggingConfig(log_level=logging.getLevelName(log_level)))
    log_config.configure(logging_config,
                      process_name=f"engine_core_dp{rank}" if replicas else "engine_core",
                      prefix=f"[DP{rank}] " if replicas else "")
    _die_with_parent()
    if config.device.cpu_ids is not None:
        _pin_to(config.device.cpu_ids)
    # SIGTERM unwinds through `finally` so the sockets close cleanly.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which stops us
    proc = None
    code = 0
    try:
        proc = EngineCoreProc(config, input_addr, output_addr, parent_pid)
        proc.run()
    except SystemExit:
        pass
    except BaseException as e:
        if proc is None and isinstance(e, USER_ERRORS):
            # At start-up, the model or the options: the front end reports the message
            # (EngineDead.user_error; a traceback through the loader would bury it).
            logger.debug("engine start-up failed:\n%s", traceback.format_exc())
        else:
            logger.error("engine core failed:\n%s", traceback.format_exc())
        if proc is not None:
            proc._send(EngineDead(f"engine core failed: {e!r}"))
        code = 1
    finally:
        try:
            if proc is not None:
                proc.close()
        except BaseException:  # reported here: the exit below would drop it unseen
            logger.error("closing the engine core failed:\n%s", traceback.format_exc())
            code = code or 1
        _exit_without_teardown(code)


def run_engine_core_when_configured(conn: Any, parent_pid: int,
                                    log_level: int = logging.INFO) -> None:
    """Entry point of an engine process started before its config is known (the server
    starts it first: its imports, ~2.5 s, then overlap the front end's reading the
    model's config); then run_engine_core with the (config, input_addr, output_addr)
    that arrives on `conn`, or a quiet exit if the front end closes it instead."""
    import transformers.activations  # noqa: F401  (what a model config's import pulls in)

    import pagedllm.worker.model_runner  # noqa: F401
    try:
        blob = conn.recv_bytes()
    except (EOFError, OSError):  # the front end stopped first (an option it refused)
        os._exit(0)
    conn.close()
    # A config of a model directory's own code (trust_remote_code) unpickles only with
    # its module importable; the directory exists once the front end has read it.
    from pagedllm.loader.hf_config import import_remote_code_modules

    import_remote_code_modules()
    config, input_addr, output_addr = pickle.loads(blob)
    run_engine_core(config, input_addr, output_addr, parent_pid, log_level)


def _exit_without_teardown(code: int) -> None:
    """End the process now that it has closed what it owns (sockets, workers, the
    grammar compiler), skipping the interpreter's teardown: that teardown ends the
    daemon threads still running, and one inside native code aborts the process
    instead (the grammar warm-up's xgrammar call: a server stopped in its first
    seconds printed "terminate called without an active exception" and its core
    died of SIGABRT). multiprocessing's fork children leave the same way."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
