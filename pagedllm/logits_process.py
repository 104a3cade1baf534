"""Custom logits processors: your code changes a request's logits before it samples.

Name a subclass of `LogitsProcessor` when building the engine, as a class or by its
qualified name ("package.module.Class" or "package.module:Class"):

    LLM(model=..., logits_processors=[BanTokens])
    pagedllm serve MODEL --logits-processors mypkg.procs:BanTokens

The engine builds one instance per worker. For each request, `new_request` says whether
and how it changes that request's logits: it returns a function of (the request's
output token ids so far, its logits row: float32 [vocab_size]) -> the row (changed in
place or a new one), or None to leave the request alone. Requests choose through their
`SamplingParams.extra_args` (the server's `vllm_xargs` request field, as vLLM's);
`validate_params` checks them when the request arrives, so a bad value is that
request's 400 (a ValueError offline), never an error inside a running batch.

Where it runs: after the masks (allowed ids, bad words, min_tokens, the grammar) and
logit_bias, before penalties, temperature and top-k/p; logprobs stay those of the
model's raw logits, as vLLM's. Each function sees one request's row alone, so a
request's output does not depend on what else is in the batch. Not with speculative
decoding or async scheduling (a function reads the latest token on the host).

A processor that raises (in `new_request` or in a request's function) fails that request
alone: the server answers it with a 500 naming the processor and the exception (offline:
it finishes as "abort", logged), and the batch's other requests go on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.errors import ConfigError
from pagedllm.qualname import import_by_name
from pagedllm.sampling_params import SamplingParams

# (output token ids so far, logits row float32 [vocab_size]) -> the row.
RequestLogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


def processor_failure(processor: object, e: BaseException) -> str:
    """What a failed request's client reads: which processor, what it raised."""
    name = f"{type(processor).__module__}.{type(processor).__qualname__}"
    return f"logits processor {name} failed on this request: {type(e).__name__}: {e}"


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor is built with."""

    model_path: str
    """The model's directory or file (e.g. to load its tokenizer)."""
    vocab_size: int
    """Length of a logits row."""
    device: torch.device
    """Where the logits are."""


class LogitsProcessor:
    """Base of custom logits processors (see the module's docstring)."""

    def __init__(self, context: ProcessorContext) -> None:
        self.context = context

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a request's parameters (its
        `extra_args`) for this processor; called where the request arrives."""

    def new_request(self, params: SamplingParams, prompt_token_ids: list[int],
                    ) -> RequestLogitsProcessor | None:
        """The function that changes this request's logits each step, or None."""
        raise NotImplementedError


def resolve_logits_processors(specs: Iterable[Any] | None,
                              ) -> tuple[type[LogitsProcessor], ...]:
    """The classes `specs` name (classes, or "module.Class" / "module:Class" strings);
    ConfigError for one that cannot be imported or is not a LogitsProcessor."""
    classes = []
    for spec in specs or ():
        cls = _import_class(spec) if isinstance(spec, str) else spec
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ConfigError(f"logits_processors: {spec!r} is not a subclass of "
                              f"pagedllm.logits_process.LogitsProcessor")
        classes.append(cls)
    return tuple(classes)


def _import_class(name: str) -> Any:
    try:
        return import_by_name(name)
    except ValueError as e:
        raise ConfigError(f"logits_processors: {e}") from e
