"""SamplingParams: how one request picks its tokens, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """Per-request sampling options, with vLLM's meanings.

    Invalid values raise `InvalidRequestError` (a ValueError) naming the field.
    """

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 disables."""
    seed: int | None = None
    """Per-request seed: the output is reproducible whatever else is in the batch."""
    max_tokens: int | None = 16
    """Most tokens to generate (None: up to max_model_len)."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens were generated."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (finish_reason "stop", stop_reason the id)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use this for exact output lengths)."""

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify()

    def _verify(self) -> None:
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise InvalidRequestError(
                f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                      f"({self.max_tokens})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
