"""LLMEngine: text in, RequestOutputs out, one step at a time (offline, in-process)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import DeferredSiblings, fan_out
from pagedllm.errors import EngineBusyError, InvalidRequestError
from pagedllm.inputs import PromptType
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sample.constraint_check import ConstraintChecker
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """add_request / step / abort_request over an EngineCore.

    A request that fails validation raises InvalidRequestError from add_request and
    leaves every other request untouched. `engine_core` defaults to an in-process
    EngineCore; the server passes an EngineCoreClient (same interface, the core runs in
    another process and step() returns what arrived from it). `constraints` checks
    structured-output constraints (InputProcessor's default: in the caller's thread).
    """

    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False,
                 engine_core: Any = None, constraints: ConstraintChecker | None = None,
                 ) -> None:
        self.config = config
        self.tokenizer = None
        if not skip_tokenizer_init:
            from pagedllm.loader import load_tokenizer

            self.tokenizer = load_tokenizer(config.model.path, config.model.tokenizer,
                                            config.model.trust_remote_code)
        self.input_processor = InputProcessor(
            config.model, self.tokenizer, config.lora,
            reasoning_parser=config.structured_outputs.reasoning_parser,
            constraints=constraints, logits_processors=config.logits_processors,
            disable_any_whitespace=config.structured_outputs.disable_any_whitespace,
            reasoning_end_str=config.structured_outputs.reasoning_end_str)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Samples 2..n of n > 1 requests, waiting for sample 1 to fill the prefix cache.
        self.deferred = DeferredSiblings()
        if engine_core is None and config.parallel.data_parallel_size > 1:
            from pagedllm.engine.dp_offline import OfflineDPCore

            engine_core = OfflineDPCore(config)  # a process per replica
        self.engine_core = engine_core if engine_core is not None else EngineCore(config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, skip_tokenizer_init: bool = False,
                         ) -> LLMEngine:
        return cls(args.create_engine_config(), skip_tokenizer_init)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    timeout: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; n > 1 / best_of fan out into child requests
        "{request_id}_{i}" that share the prompt's KV blocks (see parallel_sampling).

        `priority` (lower runs first) needs scheduling_policy "priority". `timeout`
        (seconds after `arrival_time`, a `time.monotonic()` time, default now) sets a
        deadline: a request still unfinished then ends with finish_reason "timeout".
        PoolingParams make an embedding request: its one output is an
        EmbeddingRequestOutput. `lora_request` runs it with that LoRA adapter (needs
        enable_lora).
        """
        if self.output_processor.has_request(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self._validate_priority(priority)
        if arrival_time is None:
            arrival_time = time.monotonic()
        deadline = None if timeout is None else arrival_time + _check_timeout(timeout)
        request, text = self.input_processor.process(
            request_id, prompt,
            params or SamplingParams(**self.config.model.sampling_defaults), arrival_time,
            priority=priority,
            deadline=deadline, lora_request=lora_request)
        requests = fan_out(request)
        if len(requests) > 1:
            taken = [r.req_id for r in requests if self.output_processor.has_request(r.req_id)]
            if taken:
                raise InvalidRequestError(f"request id {taken[0]!r} is already in use")
        self.engine_core.add_request(requests[0])
        if self.config.cache.enable_prefix_caching:
            self.deferred.add(requests[0], requests[1:])
        else:
            for child in requests[1:]:
                self.engine_core.add_request(child, sibling_of=requests[0].req_id)
        self.output_processor.add_request(requests, text, request.sampling_params,
                                          request_id)

    def check_request(self, prompt: PromptType, params: SamplingParams,
                      priority: int = 0, timeout: float | None = None,
                      lora_request: LoRARequest | None = None) -> None:
        """add_request's checks of a request, without queueing it (InvalidRequestError
        for what add_request would refuse)."""
        self._validate_priority(priority)
        if timeout is not None:
            _check_timeout(timeout)
        self.input_processor.process("check", prompt, params, time.monotonic(),
                                     priority=priority, lora_request=lora_request)

    def _validate_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an int, got "
                                      f"{type(priority).__name__}")
        if priority != 0 and self.config.scheduler.policy != "priority":
            # vLLM's message.
            raise InvalidRequestError(
                f"Got priority {priority} but Priority scheduling is not enabled.")

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort user requests (all their samples); unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = [c for r in ids for c in (self.output_processor.child_req_ids(r) or [r])]
        aborted = self.deferred.abort(set(child_ids))
        aborted += self.engine_core.abort_requests(child_ids)
        return self.output_processor.process(aborted)

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One engine step; requests ended by a stop string are finished in the core."""
        outputs = self.output_processor.process(self.engine_core.step())
        to_stop = self.output_processor.take_reqs_to_stop()
        if to_stop:
            self.engine_core.stop_requests(to_stop)
        # After the outputs: a leader that got its first token (or finished) this step
        # releases its siblings now, so the core never idles with siblings held back.
        for child, leader_id in self.deferred.release():
            self.engine_core.add_request(child, sibling_of=leader_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests() or len(self.deferred) > 0

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """Forget every cached prefix block (True), unless a request still holds blocks
        (False); `reset_external`: and this engine's blocks in the KV store."""
        return self.engine_core.reset_prefix_cache(reset_external)

    def sleep(self, level: int = 1) -> None:
        """EngineCore.sleep: release the KV cache (and at level 2 the weights)."""
        if len(self.deferred):
            raise EngineBusyError(f"{len(self.deferred)} requests are unfinished: the "
                                  f"engine sleeps only when idle")
        self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def update_weights(self, weights: Any) -> None:
        if len(self.deferred):
            raise EngineBusyError(f"{len(self.deferred)} requests are unfinished: weights "
                                  f"change only when the engine is idle")
        self.engine_core.update_weights(weights)

    def collective_rpc(self, method: Any, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        from pagedllm.worker.rpc import encode_call

        return self.engine_core.collective_rpc(encode_call(method, args, kwargs))

    def start_profile(self) -> None:
        self.engine_core.start_profile()

    def stop_profile(self) -> list[str]:
        return self.engine_core.stop_profile()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine core (and its worker processes, if any)."""
        self.engine_core.shutdown()


def _check_timeout(timeout: float) -> float:
    """`timeout` as a float; InvalidRequestError unless it is a finite number > 0."""
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout) or timeout <= 0):
        raise InvalidRequestError(f"timeout must be a finite number of seconds > 0, "
                                  f"got {timeout!r}")
    return float(timeout)
