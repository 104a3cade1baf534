"""ServeConfig: the HTTP server's limits and policies (`pagedllm serve` flags).

One flag per field, derived like the engine's (entrypoints/cli.py), so the limits a
request can hit are documented in `pagedllm serve --help` and in one place here.
Every limit protects the process from one request: beyond it the request gets a 400
(413 for the body) naming the limit and the flag that raises it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def _flag(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class ServeConfig:
    """Limits on what one request may ask for, and the server's admission policies."""

    max_n: int = _flag(128, "most sequences one request generates: n (and best_of), "
                            "times the number of prompts of a completions request")
    max_logprobs: int = _flag(20, "most logprobs / top_logprobs / prompt_logprobs per "
                                  "position (vLLM's max_logprobs)")
    max_stop: int = _flag(64, "most entries in each of stop, stop_token_ids and bad_words")
    max_prompt_bytes: int = _flag(1 << 20, "most UTF-8 bytes of one prompt text, or of all "
                                           "message contents of a chat together")
    max_body_bytes: int = _flag(2 << 20, "most bytes of a request body (413 beyond)")
    render_timeout: float = _flag(5.0, "seconds that tokenizing a prompt or rendering a chat "
                                       "template may take (400 beyond)")
    trust_request_chat_template: bool = _flag(
        False, "accept `chat_template` in request bodies (templates are code: a hostile "
               "one can loop; it is still cut off after --render-timeout)")
    request_timeout: float | None = _flag(None, "default deadline in seconds of a request "
                                                "that gives no `timeout` (default: none)")
    max_queued_requests: int | None = _flag(None, "most requests waiting to be scheduled; "
                                                  "beyond, 503 with Retry-After (default: "
                                                  "unbounded)")
    metrics_without_key: bool = _flag(False, "serve /metrics without the API key")

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop", "max_prompt_bytes", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        for name in ("render_timeout", "request_timeout"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got "
                             f"{self.max_queued_requests}")
