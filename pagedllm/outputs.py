"""What the engine returns: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.lora_request import LoRARequest


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the chosen token and the top-k, by token id.
SampleLogprobs = list[dict[int, Logprob]]
# One dict per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    """Which of the request's n samples this is."""
    text: str
    """Generated text (detokenized output_token_ids, cut at a stop string)."""
    token_ids: list[int]
    """Generated token ids."""
    cumulative_logprob: float | None = None
    """Sum of the chosen tokens' logprobs (when logprobs were requested)."""
    logprobs: SampleLogprobs | None = None
    """Per generated token: the chosen token and the top-k alternatives."""
    finish_reason: str | None = None
    """"stop", "length", "abort", "timeout" (past its deadline), or None while running."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended generation, if any."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    """Per prompt token (first entry None), when prompt_logprobs was requested."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Timestamps (arrival, first token, finish) for latency reporting."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter it ran with (None: the base model)."""


@dataclass
class BeamSearchSequence:
    """One beam: prompt plus generated tokens, and its score inputs (vLLM's shape)."""

    tokens: list[int]
    """Prompt token ids followed by the generated ones."""
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    """Per generated token, the logprobs the step returned."""
    cum_logprob: float = 0.0
    """Sum of the generated tokens' logprobs."""
    text: str | None = None
    """Decoded generated tokens (EOS left out)."""
    finish_reason: str | None = None
    """"stop" when the beam ended with EOS, else "length"."""


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class EmbeddingOutput:
    """The embedding of one prompt."""

    embedding: list[float]
    """The pooled (and, by default, L2-normalized) final hidden states, float32 values;
    [] when the request ended without one (aborted, timed out)."""

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of one embedding request (vLLM's name and fields)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    finish_reason: str = "stop"
    """"stop" once pooled; "abort" or "timeout" when it ended without an embedding."""


@dataclass
class ScoringOutput:
    """The score of one pair of texts."""

    score: float
    """A cross-encoder's score (its head's output, through its activation), or the
    cosine similarity of the two texts' embeddings for an embedding model."""


@dataclass
class ScoringRequestOutput:
    """The result of scoring one pair (vLLM's name and fields)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    """The pair's prompt (a cross-encoder's); the two texts' prompts one after the
    other for an embedding model."""
    finished: bool = True


@dataclass
class ClassificationOutput:
    """The label probabilities of one prompt."""

    probs: list[float]
    """One per label, in the model's label order (its config's id2label)."""

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """The result of classifying one prompt (vLLM's name and fields)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
