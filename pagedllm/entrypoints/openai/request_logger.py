"""Log lines of the server's requests (`--enable-log-requests`, `--enable-log-outputs`).

As vLLM's: one INFO line per engine request with its id, its parameters (the fields that
differ from their defaults, so a line stays readable) and its adapter; its prompt (text
and token ids, cut at --max-log-len) at DEBUG, since prompts are user data. With
outputs on, one INFO line per finished engine request with what it generated (cut the
same way) and why it stopped. Streams are not logged piece by piece: the line comes
with the engine's final output (a request whose client left first has none).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput

logger = logging.getLogger(__name__)

EngineOutput = RequestOutput | EmbeddingRequestOutput


class RequestLogger:
    """Writes the log lines of requests; `max_log_len` cuts prompt and output text (in
    characters), token id lists (in ids) and each parameter's value (its repr, in
    characters: a schema or a logit_bias can be megabytes); None: no cut."""

    def __init__(self, max_log_len: int | None, log_inputs: bool, log_outputs: bool) -> None:
        self.max_log_len = max_log_len
        self.log_inputs = log_inputs
        self.log_outputs = log_outputs
        self._defaults: dict[type, Any] = {}

    def wrap(self, request_id: str, text: str | None, ids: list[int], params: Any,
             lora: LoRARequest | None, stream: AsyncIterator[EngineOutput],
             ) -> AsyncIterator[EngineOutput]:
        """Log a submitted request as the flags ask; its stream (wrapped when its final
        output is to be logged)."""
        if self.log_inputs:
            self._log_received(request_id, text, ids, params, lora)
        return self._logged(stream) if self.log_outputs else stream

    def _cut(self, value: Any) -> Any:
        return value if value is None or self.max_log_len is None else value[:self.max_log_len]

    def changed_fields(self, params: Any) -> str:
        """`SamplingParams(max_tokens=8, temperature=0.0)`: the dataclass's fields that
        differ from a default-constructed one's."""
        default = self._defaults.get(type(params))
        if default is None:
            default = self._defaults[type(params)] = type(params)()
        changed = [f"{f.name}={self._cut(repr(getattr(params, f.name)))}"
                   for f in dataclasses.fields(params)
                   if f.init and getattr(params, f.name) != getattr(default, f.name)]
        return f"{type(params).__name__}({', '.join(changed)})"

    def _log_received(self, request_id: str, text: str | None, ids: list[int],
                      params: Any, lora: LoRARequest | None) -> None:
        logger.info("Received request %s: params: %s, lora_request: %s.", request_id,
                    self.changed_fields(params), lora.lora_name if lora else None)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Request %s prompt: %r, prompt_token_ids (%d): %s.", request_id,
                         self._cut(text), len(ids), self._cut(ids))

    async def _logged(self, stream: AsyncIterator[EngineOutput]
                      ) -> AsyncIterator[EngineOutput]:
        """`stream`, logging its final output when it comes (closing this closes
        `stream`, which aborts its request as closing it would)."""
        try:
            async for out in stream:
                if out.finished:
                    self._log_final(out)
                yield out
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _log_final(self, out: EngineOutput) -> None:
        if isinstance(out, EmbeddingRequestOutput):
            logger.info("Finished request %s: %d floats, finish_reason: %s.", out.request_id,
                        len(out.outputs.embedding), out.finish_reason)
            return
        for seq in out.outputs:
            logger.info("Generated response %s (sequence %d): output: %r, "
                        "output_token_ids (%d): %s, finish_reason: %s.", out.request_id,
                        seq.index, self._cut(seq.text), len(seq.token_ids),
                        self._cut(seq.token_ids), seq.finish_reason)
