"""PoolingParams: how one embedding request turns hidden states into a vector.

Pure Python (core/ imports it and must not pull in torch). A request created with
PoolingParams instead of SamplingParams is prefill only: the runner pools the final
(normed) hidden states of its whole prompt, computed in one step, and the request
finishes without sampling a token. Field names follow vLLM's `PoolingParams`.
`pooling_type` None takes the model's default (`ModelConfig.default_pooling_type`), which
the input processor fills in before the request reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import check_truncate_prompt_tokens

POOLING_TYPES = ("last", "mean", "cls")
POOLING_TASKS = ("embed", "score", "classify")


@dataclass
class PoolingParams:
    """Pooling of one embedding request, validated on construction."""

    pooling_type: str | None = None
    """"last": the hidden state of the last prompt token (vLLM's default for decoder
    models, which see the whole prompt only there); "mean": the average over every
    prompt token; "cls": the first prompt token's (BERT's [CLS]); None: the model's
    default ("last" for decoders, the sentence-transformers Pooling config or "mean"
    for encoders)."""
    normalize: bool | None = None
    """Embeddings: L2-normalize the pooled vector (vLLM's older name of use_activation;
    None: use_activation decides). Scores and classifications: None or False."""
    use_activation: bool | None = None
    """Embeddings: L2-normalize; scores and classifications: the head's activation (a
    sigmoid or softmax; off: the raw logits). None: the model's default (its
    pooler_config's use_activation, else on). The input processor resolves it."""
    dimensions: int | None = None
    """Embeddings: keep the vector's first `dimensions` values (before normalizing), for
    models trained so (Matryoshka: hf_config `is_matryoshka` or `matryoshka_dimensions`,
    e.g. set by hf_overrides); None: the model's default (pooler_config), else all."""
    truncate_prompt_tokens: int | None = None
    """Embed only the prompt's last k tokens; -1: its last max_model_len; None: all."""
    task: str = "embed"
    """"embed": a vector of the prompt (embedding models); "score": a cross-encoder's
    score of the pair the prompt holds (LLM.score sets it, with token_type_start);
    "classify": a classifier's label probabilities (LLM.classify sets it)."""
    token_type_start: int | None = None
    """Score requests: the prompt position where the pair's second text (token type 1)
    starts; None: the whole prompt is type 0."""

    def __post_init__(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {POOLING_TASKS}, got "
                                      f"{self.task!r}")
        if self.token_type_start is not None and (
                isinstance(self.token_type_start, bool)
                or not isinstance(self.token_type_start, int) or self.token_type_start < 1):
            raise InvalidRequestError(f"token_type_start must be a position >= 1, got "
                                      f"{self.token_type_start!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(f"pooling_type must be one of {POOLING_TYPES}, got "
                                      f"{self.pooling_type!r}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be a bool, got "
                                          f"{type(value).__name__}")
        if self.task == "embed" and None not in (self.normalize, self.use_activation) \
                and self.normalize != self.use_activation:
            raise InvalidRequestError(f"normalize={self.normalize} and use_activation="
                                      f"{self.use_activation} disagree (normalize is the "
                                      f"older name of use_activation)")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not
                                            isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be an integer >= 1, got "
                                      f"{self.dimensions!r}")
        if self.dimensions is not None and self.task != "embed":
            raise InvalidRequestError(f"dimensions applies to embeddings, not to a "
                                      f"{self.task} request")

    @property
    def needs_all_positions(self) -> bool:
        """Whether the pooling step must compute the prompt from position 0 (no
        prefix-cache hits): mean pooling reads each position's hidden state, cls the
        first one's."""
        return self.pooling_type in ("mean", "cls")
