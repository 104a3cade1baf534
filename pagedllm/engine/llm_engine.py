"""LLMEngine: text in, RequestOutputs out, one step at a time (offline, in-process)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """add_request / step / abort_request over an in-process EngineCore.

    A request that fails validation raises InvalidRequestError from add_request and
    leaves every other request untouched.
    """

    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False) -> None:
        self.config = config
        self.tokenizer = None
        if not skip_tokenizer_init:
            from pagedllm.loader import load_tokenizer

            self.tokenizer = load_tokenizer(config.model.path, config.model.tokenizer)
        self.input_processor = InputProcessor(config.model, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, skip_tokenizer_init: bool = False,
                         ) -> LLMEngine:
        return cls(args.create_engine_config(), skip_tokenizer_init)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        if self.output_processor.has_request(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request, text = self.input_processor.process(
            request_id, prompt, params or SamplingParams(), arrival_time)
        self.engine_core.add_request(request)
        self.output_processor.add_request(request, text)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self.output_processor.process(self.engine_core.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        return self.output_processor.process(self.engine_core.step())

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_tokenizer(self) -> Any:
        return self.tokenizer
