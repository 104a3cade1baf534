"""AsyncLLM: the asyncio front end of the server.

    API process (event loop)                          engine-core process
    generate() -> LLMEngine.add_request -> EngineCoreClient --ZMQ--> EngineCore loop
    per-request collector <- LLMEngine.step() <- output loop <--ZMQ--/

Tokenization, detokenization and stop strings run here, in the LLMEngine's input and
output processors; the engine process only schedules and runs the model, so the event
loop stays free to answer HTTP while a batch runs. One output-loop task receives the
core's batches, records metrics, and routes each RequestOutput to its request's
collector (one output waits per request, however slowly its reader reads:
output_collector.py).
If the core process dies, every waiting request gets EngineDeadError within
`POLL_INTERVAL_S` and new requests are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import EngineProcess
from pagedllm.engine.core_proc import EngineCoreOutputs
from pagedllm.engine.dp_client import make_core_client
from pagedllm.engine.engine_core import (check_pause_mode, check_sleep_level,
                                         check_wake_tags)
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.output_collector import RequestOutputCollector
from pagedllm.errors import EngineDeadError, EngineSleepingError, InvalidRequestError
from pagedllm.inputs import PromptType
from pagedllm.lora_request import LoRARequest
from pagedllm.metrics import EngineMetrics
from pagedllm.multimodal.processor import ImageProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.reasoning import ReasoningTokens
from pagedllm.sample.constraint_check import ConstraintChecker
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# How often the output loop checks that the core process is alive while it is silent.
POLL_INTERVAL_S = 0.2
UTILITY_TIMEOUT_S = 10.0
# Seconds between a waiting pause's checks that no request runs any more.
PAUSE_POLL_S = 0.02


class EngineGenerateError(RuntimeError):
    """The engine failed one request for a reason that is not the client's fault."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting to be scheduled (the server answers 503)."""


class AsyncLLM:
    """`async for out in llm.generate(prompt, params, request_id)`, over an engine process.

    Build with `await AsyncLLM.from_engine_args(args)` (waits for the model to load) and
    stop with `shutdown()`. Must be used from one event loop.
    """

    def __init__(self, config: EngineConfig, model_name: str = "",
                 log_stats_interval_s: float = 10.0,
                 constraints: ConstraintChecker | None = None,
                 core_process: EngineProcess | None = None,
                 skip_tokenizer_init: bool = False) -> None:
        """`constraints`: the structured-output checks (the server's parse in a child
        process under limits; default: in the caller's thread), shut down with this.
        `core_process`: the engine-core process when it was started already (the
        server's, during its start-up). `skip_tokenizer_init`: no tokenizer (token-id
        prompts, no text out)."""
        self.config = config
        # The core starts loading the model while this process loads the tokenizer.
        # One engine core, or data parallel replicas behind the same interface.
        self.core_client = make_core_client(config, core_process)
        try:
            self.engine = LLMEngine(config, skip_tokenizer_init,
                                    engine_core=self.core_client, constraints=constraints)
        except BaseException:
            self.core_client.shutdown()
            raise
        self.tokenizer = self.engine.tokenizer
        observe = config.observability
        self.metrics = EngineMetrics(model_name or config.model.path,
                                     observe.histogram_buckets,
                                     kv_cache_metrics=observe.kv_cache_metrics_sample > 0,
                                     mfu_metrics=observe.enable_mfu_metrics)
        self.log_stats_interval_s = log_stats_interval_s
        self._collectors: dict[str, RequestOutputCollector] = {}
        # (engine_index, call_id) -> the utility call's result, to come.
        self._utility_futures: dict[tuple[int, int], asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        # Sleep mode: True from a sleep call until the core says all is awake again.
        self._sleeping = False

    @classmethod
    async def from_engine_args(cls, args: EngineArgs, model_name: str = "",
                               log_stats_interval_s: float = 10.0) -> AsyncLLM:
        llm = cls(args.create_engine_config(), model_name, log_stats_interval_s)
        try:
            await llm.start()
        except BaseException:
            llm.shutdown()
            raise
        return llm

    async def start(self) -> None:
        await self.core_client.wait_ready()
        self._tasks.append(asyncio.create_task(self._output_loop(), name="engine-outputs"))
        if self.log_stats_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._log_loop(), name="engine-stats"))

    # ------------------------------------------------------------------ state

    @property
    def is_dead(self) -> bool:
        return self.core_client.is_dead

    @property
    def dead_reason(self) -> str | None:
        return self.core_client.dead_reason

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine process is gone."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        if not self.core_client.check_alive():
            self._fail_all()
            raise EngineDeadError(self.dead_reason)

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def num_queued(self) -> int:
        """Requests sent to the core and not yet scheduled (the waiting queue, as far as
        this process knows; preempted requests are not counted again)."""
        return self.core_client.num_unscheduled

    @property
    def num_in_flight(self) -> int:
        """Requests added and not finished (their streams still open)."""
        return len(self._collectors)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens of the requests in the core without a first token yet."""
        return self.core_client.num_prefill_tokens

    @property
    def num_kv_cache_tokens(self) -> int:
        """Tokens the whole KV cache holds (block 0 is the null block)."""
        return (self.core_client.num_blocks - 1) * self.core_client.block_size

    @property
    def reasoning_tokens(self) -> ReasoningTokens | None:
        """The reasoning parser's format and tag ids (None without one)."""
        return self.engine.input_processor.reasoning

    @property
    def constraints(self) -> ConstraintChecker:
        """What checks a request's structured-output constraint (the server runs it off
        the event loop before add_request, which then finds the outcome remembered)."""
        return self.engine.input_processor.constraints

    @property
    def image_processor(self) -> ImageProcessor | None:
        """The model's image processor (None: a model without images)."""
        return self.engine.input_processor.images

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    priority: int = 0, timeout: float | None = None,
                    lora_request: LoRARequest | None = None,
                    ) -> AsyncIterator[RequestOutput]:
        """Submit a request now; return the stream of its outputs (the last `finished`).

        `priority` (lower first) needs the "priority" scheduling policy; past `timeout`
        seconds the core aborts the request (finish_reason "timeout"); `lora_request`
        runs it with that LoRA adapter.
        Raises InvalidRequestError for a bad prompt or parameters and EngineDeadError
        when the engine process is gone. Closing the stream early aborts the request
        (its KV blocks are freed), which is what a client disconnect does; a stream
        never iterated must be aborted with `abort(request_id)`.
        """
        self.check_health()
        if self._sleeping:
            raise EngineSleepingError("the engine is asleep: wake it up first (POST /wake_up)")
        if request_id in self._collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        # Embedding requests (PoolingParams) have one output, their last.
        collector = RequestOutputCollector(
            getattr(params, "output_kind", RequestOutputKind.FINAL_ONLY),
            self.config.scheduler.stream_interval)
        self._collectors[request_id] = collector
        try:
            self.engine.add_request(request_id, prompt, params, priority=priority,
                                    timeout=timeout, lora_request=lora_request)
        except BaseException:
            self._collectors.pop(request_id, None)
            raise
        return self._stream(request_id, collector)

    async def _stream(self, request_id: str,
                      collector: RequestOutputCollector) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                try:
                    item = await collector.get()
                except BaseException as e:
                    # An error from the engine: it has already dropped the request.
                    finished = not isinstance(e, asyncio.CancelledError)
                    raise
                finished = item.finished
                yield item
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str, lora_request: LoRARequest | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """`add_request` and iterate its stream (closing this closes the stream)."""
        stream = self.add_request(request_id, prompt, params, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Abort a live request (no-op when it is finished or unknown). A stream still
        read gets its last output, finish_reason "abort" (an abort by id from another
        route, such as /inference/v1/abort_requests, must end it)."""
        try:
            outputs = self.engine.abort_request([request_id])
        except EngineDeadError:
            outputs = []
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        self._drain_local_finishes()

    async def call_utility(self, method: str, *args: Any,
                           timeout: float | None = UTILITY_TIMEOUT_S) -> Any:
        """Run a utility on the core ("get_stats", "reset_prefix_cache", "ping",
        "kv_snapshot", "sleep", "wake_up", "is_sleeping")."""
        self.check_health()
        # One call per data parallel replica (one key), their results combined.
        keys = self.core_client.call_utility(method, *args)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in keys]
        self._utility_futures.update(zip(keys, futures))
        try:
            results = await asyncio.wait_for(asyncio.gather(*futures), timeout)
        finally:
            for key in keys:
                self._utility_futures.pop(key, None)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return self.core_client.combine_utility(method, results)

    # ------------------------------------------------------------------ sleep mode

    async def collective_rpc(self, method: Any, timeout: float | None = None,
                             args: tuple = (), kwargs: dict[str, Any] | None = None,
                             ) -> list:
        """LLM.collective_rpc through the core (every data parallel replica's ranks,
        in replica order); `timeout`: seconds to wait for the answer (the call itself
        still runs to its end)."""
        from pagedllm.worker.rpc import encode_call

        payload = encode_call(method, args, kwargs)
        return await self.call_utility("collective_rpc", payload, timeout=timeout)

    async def sleep(self, level: int = 1) -> None:
        """EngineCore.sleep in the core (every replica). New requests are refused from
        the call on (EngineSleepingError), so none slips in while it goes to sleep; if
        it cannot (busy, a bad level), whatever slept is woken and requests flow again."""
        check_sleep_level(level)  # here too: a huge int would not even reach the core
        self._sleeping = True
        try:
            await self.call_utility("sleep", level)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.call_utility("wake_up", None)
            self._sleeping = False
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """EngineCore.wake_up (every replica); requests flow again once all is awake."""
        await self.call_utility("wake_up", check_wake_tags(tags))
        self._sleeping = await self.call_utility("is_sleeping")

    async def is_sleeping(self) -> bool:
        return bool(await self.call_utility("is_sleeping"))

    # ------------------------------------------------------------------ pause

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's: stop generating (to update weights, say) until resume_generation().
        "abort": the requests in flight end now (finish_reason "abort"); "wait": they
        run to their end first (this returns then); "keep": they stay where they are
        and go on at resume. Requests that arrive meanwhile are taken and wait. With
        `clear_cache` ("abort", "wait") the prefix cache is reset once none runs."""
        check_pause_mode(mode)
        # The requests in flight now (no await before the core holds the rest).
        in_flight = list(self._collectors)
        await self.call_utility("pause", mode)
        if mode == "abort":
            for request_id in in_flight:
                self.abort(request_id)
        if mode == "keep":
            return
        while await self.call_utility("num_unheld"):
            await asyncio.sleep(PAUSE_POLL_S)
        if clear_cache:
            await self.call_utility("reset_prefix_cache")

    async def resume_generation(self) -> None:
        await self.call_utility("resume")

    async def is_paused(self) -> bool:
        return bool(await self.call_utility("is_paused"))

    async def start_profile(self) -> None:
        await self.call_utility("start_profile")

    async def stop_profile(self) -> list[str]:
        return await self.call_utility("stop_profile")

    # ------------------------------------------------------------------ output loop

    async def _output_loop(self) -> None:
        try:
            while True:
                batch = await self.core_client.get_output(POLL_INTERVAL_S)
                if batch is not None:
                    self._process_batch(batch)
        except EngineDeadError:
            self._fail_all()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a front-end bug: fail loudly rather than hang requests
            logger.exception("output loop failed")
            self.core_client.mark_dead(f"output processing failed: {e!r}")
            self._fail_all()

    def _process_batch(self, batch: EngineCoreOutputs) -> None:
        self.metrics.observe_scheduler_stats(self.core_client.scheduler_stats(batch))
        self.metrics.observe_outputs(batch, self.core_client.requests)
        for result in batch.utility_results:
            future = self._utility_futures.get((batch.engine_index, result.call_id))
            if future is not None and not future.done():
                future.set_result(pickle.loads(result.result))
        for err in batch.errors:
            # The core rejected the request (at admission, or its grammar did not
            # compile): drop the front end's state of the whole user request too.
            request_id = self.engine.output_processor.parent_id(err.req_id)
            self.engine.abort_request([request_id])
            collector = self._collectors.get(request_id)
            if collector is not None:
                collector.put(InvalidRequestError(err.message) if err.is_invalid
                              else EngineGenerateError(err.message))
        self.core_client.push_outputs(batch)
        # Applies the batch; also hands held-back n > 1 siblings to the core once their
        # leader has its first token.
        outputs = self.engine.step()
        for out in outputs:
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        self._drain_local_finishes()

    def _drain_local_finishes(self) -> None:
        """Metrics of requests finished in this process (aborts, stop strings)."""
        for req in self.core_client.take_finished_locally():
            self.metrics.observe_finished(req)

    def _fail_all(self) -> None:
        self.metrics.mark_engine_dead()
        error = EngineDeadError(self.dead_reason or "engine core is dead")
        for collector in self._collectors.values():
            collector.put(error)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)

    async def _log_loop(self) -> None:
        # A dead engine has no stats to report: the line stops with it.
        while not self.is_dead:
            await asyncio.sleep(self.log_stats_interval_s)
            if not self.is_dead:
                self.metrics.stats_log.log()

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self.core_client.shutdown()
        self.constraints.shutdown()
