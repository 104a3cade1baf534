"""PoolingParams: how one embedding request turns hidden states into a vector.

Pure Python (core/ imports it and must not pull in torch). A request created with
PoolingParams instead of SamplingParams is prefill only: the runner pools the final
(normed) hidden states of its whole prompt, computed in one step, and the request
finishes without sampling a token. Field names follow vLLM's `PoolingParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import InvalidRequestError

POOLING_TYPES = ("last", "mean")


@dataclass
class PoolingParams:
    """Pooling of one embedding request, validated on construction."""

    pooling_type: str = "last"
    """"last": the hidden state of the last prompt token (vLLM's default for decoder
    models, which see the whole prompt only there); "mean": the average over every
    prompt token."""
    normalize: bool = True
    """L2-normalize the pooled vector."""
    dimensions: int | None = None
    """Matryoshka truncation: not supported (a model must declare it), so only None."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling_type must be one of {POOLING_TYPES}, got "
                                      f"{self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be a bool, got "
                                      f"{type(self.normalize).__name__}")
        if self.dimensions is not None:
            raise InvalidRequestError(
                "dimensions is not supported: this model does not support matryoshka "
                "representation, so the embedding size cannot be changed")

    @property
    def needs_all_positions(self) -> bool:
        """Whether every prompt position must be computed in the pooling step (no
        prefix-cache hits): mean pooling reads each position's hidden state."""
        return self.pooling_type == "mean"
