"""What the engine returns: RequestOutput holding one CompletionOutput per sample."""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedllm.lora_request import LoRARequest


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(Sequence[dict[int, Logprob]]):
    """The logprobs of generated positions: `[i]` is position i's {token_id: Logprob}
    (the chosen token first, then the top-k), as a list of dicts would give.

    Stored flat, because a list of dicts costs ~220 bytes an entry (a dict slot, a
    Logprob, a float and two ints): one request of 128 samples of 8,000 tokens at 20
    logprobs is 21 million entries, 4.6 GB in the server before it writes a byte of the
    response. Here an entry is 24 bytes: token id, logprob, rank and a reference to the
    token's text (shared by every entry of that token). Dicts are built when indexed.
    Append-only, so `head()` (a view of the positions so far) shares the arrays.
    """

    __slots__ = ("_starts", "_ids", "_logprobs", "_ranks", "_texts", "_len")

    def __init__(self) -> None:
        self._starts = array("q", [0])  # position i's entries are [_starts[i], _starts[i+1])
        self._ids = array("i")
        self._logprobs = array("d")
        self._ranks = array("i")
        self._texts: list[str | None] = []
        self._len = 0

    def append(self, token_ids: Iterable[int], logprobs: Iterable[float],
               ranks: Iterable[int], texts: Iterable[str | None] | None = None) -> None:
        """Add a position; a token id seen before in it (the chosen token is often also
        one of the top-k) keeps its first entry, as a dict would."""
        assert self._len == len(self._starts) - 1, "append to a head() view"
        seen: set[int] = set()
        texts = texts if texts is not None else itertools.repeat(None)
        for token_id, logprob, rank, text in zip(token_ids, logprobs, ranks, texts):
            if token_id not in seen:
                seen.add(token_id)
                self._ids.append(token_id)
                self._logprobs.append(logprob)
                self._ranks.append(rank)
                self._texts.append(text)
        self._starts.append(len(self._ids))
        self._len += 1

    def head(self) -> FlatLogprobs:
        """The positions so far, unchanged by later appends (shares the storage)."""
        view = FlatLogprobs.__new__(FlatLogprobs)
        view._starts, view._ids, view._logprobs = self._starts, self._ids, self._logprobs
        view._ranks, view._texts, view._len = self._ranks, self._texts, self._len
        return view

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):  # int -> dict; slice -> list of dicts
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("position out of range")
        return {self._ids[j]: Logprob(self._logprobs[j], self._ranks[j], self._texts[j])
                for j in range(self._starts[index], self._starts[index + 1])}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


# One dict per generated token: the chosen token and the top-k, by token id (the engine
# gives a FlatLogprobs; a list of dicts is the same to a reader).
SampleLogprobs = Sequence[dict[int, Logprob]]
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
    prompt_token_ids: list[int] | None
    """None for a prompt given as embeddings (EmbedsPrompt)."""
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    """Per prompt token (first entry None), when prompt_logprobs was requested."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: dict[str, float] = field(default_factory=dict)
    """time.monotonic() timestamps for latency reporting: arrival_time,
    first_scheduled_time, first_token_time, last_token_time, finished_time (each once
    it happened)."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter it ran with (None: the base model)."""
    num_prompt_tokens: int | None = None
    """Prompt positions: len(prompt_token_ids), or an embeddings prompt's rows."""

    def __post_init__(self) -> None:
        if self.num_prompt_tokens is None:
            self.num_prompt_tokens = len(self.prompt_token_ids or ())


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
class PoolingOutput:
    """The raw pooled output of one prompt (LLM.encode)."""

    data: Any
    """A float32 torch.Tensor: the embedding, the label probabilities or the one score,
    as the pooling task gives it."""


@dataclass
class PoolingRequestOutput:
    """The result of one LLM.encode prompt (vLLM's name and fields)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
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
