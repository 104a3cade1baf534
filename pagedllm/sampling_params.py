"""SamplingParams: how one request picks its tokens, validated on construction.

Pure Python (core/ imports it and must not pull in torch). Field names, defaults and
meanings follow vLLM's `SamplingParams`, so the OpenAI server can copy request fields
straight across.
"""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import InitVar, dataclass, field
from typing import Any

from pagedllm import json_limits
from pagedllm.errors import InvalidRequestError


class RequestOutputKind(enum.Enum):
    """What each streamed `RequestOutput` carries."""

    CUMULATIVE = 0
    """Everything generated so far (text, token ids, logprobs)."""
    DELTA = 1
    """Only what is new since the previous output."""
    FINAL_ONLY = 2
    """Nothing until the request finishes, then everything."""


@dataclass
class StructuredOutputsParams:
    """Constrain generation to a grammar; exactly one of the constraint fields is set.

    Compiled by xgrammar in the engine core, off its loop (cached per constraint).
    """

    json: str | dict | None = None
    """A JSON schema (dict or JSON text): the output is a JSON value matching it."""
    regex: str | None = None
    """The output matches this regular expression."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF dialect, start rule `root`)."""
    json_object: bool | None = None
    """The output is any JSON object (OpenAI's response_format json_object)."""
    structural_tag: str | dict | None = None
    """An xgrammar structural tag (dict or JSON text): {"type": "structural_tag",
    "format": {...}}, or vLLM's older {"structures": [{"begin", "schema", "end"}],
    "triggers": [...]} (free text, where a trigger starts one of the tagged JSON
    blocks)."""
    disable_any_whitespace: bool = False
    """JSON without free whitespace between tokens (compact; small models loop less)."""
    _key: tuple | None = field(default=None, init=False, repr=False, compare=False)
    """cache_key(), once taken (pickled with the params: the engine core need not take
    it again)."""

    def __post_init__(self) -> None:
        for name, types in _FIELD_TYPES.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, types):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be {_TYPE_NAMES[types]}, got "
                    f"{type(value).__name__}")
        kinds = [name for name in _CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object or structural_tag, got {kinds or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(
                    f"structured_outputs.choice must be a non-empty list of strings, "
                    f"got {self.choice!r}")
            self.choice = list(self.choice)
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                json_limits.loads(value, f"structured_outputs.{name}")
            elif value is not None:
                json_limits.check_depth(value, f"structured_outputs.{name}")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar, json_object or
        structural_tag."""
        for name in _CONSTRAINT_KINDS:
            if getattr(self, name) not in (None, False):
                return name
        raise AssertionError("validated on construction")

    def cache_key(self) -> tuple:
        """Hashable identity of the constraint (compiled grammars are cached by it).
        Taken once: a large schema's canonical text is tens of milliseconds of one C call
        (~60 ms for 60,000 properties), and the server's check, the input processor and
        the engine core each ask for it; the constraint is not to change after."""
        if self._key is None:
            value: Any = getattr(self, self.kind)
            if isinstance(value, dict):
                value = json.dumps(value, sort_keys=True)
            elif isinstance(value, list):
                value = tuple(value)
            self._key = (self.kind, value, self.disable_any_whitespace)
        return self._key


# vLLM's name of StructuredOutputsParams before its 0.11 (SamplingParams.guided_decoding).
GuidedDecodingParams = StructuredOutputsParams

_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# What each field may hold (None aside): a list where a string belongs was an unhashable
# cache key (a 500), a string where a flag belongs read as true.
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "json": (str, dict), "regex": str, "choice": (list, tuple), "grammar": str,
    "json_object": bool, "structural_tag": (str, dict), "disable_any_whitespace": bool}
_TYPE_NAMES = {(str, dict): "a JSON text or object", str: "a string",
               (list, tuple): "a list of strings", bool: "true or false"}


def check_truncate_prompt_tokens(value: int | None) -> None:
    """None, -1 (max_model_len) or a count >= 1 (vLLM's truncate_prompt_tokens)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or (value < 1 and value != -1)):
        raise InvalidRequestError(f"truncate_prompt_tokens must be an integer >= 1, or -1 "
                                  f"for max_model_len, got {value!r}.")


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not (isinstance(value, (int, float)) and low <= value <= high):
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}.")


# Beyond this temperature every token is equally likely for practical logits (and
# 1e300 overflows float32): a larger value is a mistake, not a wish.
MAX_TEMPERATURE = 100.0
# Integer fields are kept in int64 / int32 arrays by the runner; bigger is meaningless.
_MAX_INT32 = 2**31 - 1
MAX_LOGPROB_TOKEN_IDS = 128
"""Most token ids one request's logprob_token_ids may name (vLLM's bound)."""


@dataclass
class SamplingParams:
    """Per-request sampling options, with vLLM's meanings.

    Invalid values raise `InvalidRequestError` (a ValueError) naming the field.
    Sampling order (as vLLM): allowed_token_ids, bad_words, min_tokens, logit_bias,
    structured output mask -> penalties -> greedy or temperature -> min_p -> top_k ->
    top_p -> draw. Logprobs are computed from the raw logits before all of it.
    """

    n: int = 1
    """Completions to return for the prompt (they share its KV through the prefix cache)."""
    best_of: int | None = None
    """Completions to generate; the n with the highest cumulative logprob are returned."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of a token in the output (in [-2, 2])."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens in prompt or output (> 0)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's."""
    seed: int | None = None
    """Per-request seed: the output is reproducible whatever else is in the batch."""
    stop: str | list[str] | None = None
    """Strings that end generation; the text is cut before them."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (finish_reason "stop", stop_reason the id)."""
    bad_words: list[str] | None = None
    """Words never to generate (their last token is masked after the others)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string at the end of the text."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use this for exact output lengths)."""
    max_tokens: int | None = 16
    """Most tokens to generate (None: up to max_model_len)."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens were generated."""
    logprobs: int | None = None
    """Return the logprobs of this many most likely tokens per step, plus the chosen one."""
    prompt_logprobs: int | None = None
    """Return the logprobs of this many most likely tokens per prompt position."""
    logprob_token_ids: list[int] | None = None
    """Return the logprobs of exactly these tokens (at most 128, each once, in this
    order) at every generated position, besides the chosen token's, in place of the
    most likely ones (vLLM's; logprobs, when given, must be their count)."""
    detokenize: bool = True
    """Produce text (stop strings need it)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """Slow tokenizers only: separate special tokens by spaces in the text."""
    logit_bias: dict[int, float] | None = None
    """token id -> value added to its logit before sampling (JSON string keys accepted)."""
    allowed_token_ids: list[int] | None = None
    """Sample only among these token ids."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What streamed outputs carry (LLM.generate always returns final outputs)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Grammar constraint (JSON schema, regex, choice, EBNF, any JSON object)."""
    thinking_token_budget: int | None = None
    """Most reasoning tokens (vLLM's; needs a reasoning parser): once the reasoning holds
    this many, its end tag is the next token. -1 or None: no limit."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (left truncation); -1: its last
    max_model_len; None: the whole prompt."""
    extra_args: dict[str, Any] | None = None
    """Arguments for the engine's custom logits processors (pagedllm.logits_process;
    vLLM's extra_args; the server's vllm_xargs)."""
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    """Set by the input processor: bad_words tokenized (with and without leading space)."""
    guided_decoding: InitVar[StructuredOutputsParams | dict | None] = None
    """vLLM's older name of structured_outputs (taken as it; not both)."""

    def __post_init__(self, guided_decoding: StructuredOutputsParams | dict | None = None,
                      ) -> None:
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidRequestError("give structured_outputs or guided_decoding (its "
                                          "older name), not both")
            self.structured_outputs = guided_decoding
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias is not None:
            self.logit_bias = self._parse_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.logprob_token_ids, list | tuple):
            self.logprob_token_ids = list(self.logprob_token_ids)
            if self.logprobs is None:
                self.logprobs = len(self.logprob_token_ids)
        if self.thinking_token_budget == -1 and not isinstance(self.thinking_token_budget,
                                                                bool):
            self.thinking_token_budget = None  # vLLM's "unlimited"
        self._verify()

    # ------------------------------------------------------------------ checks

    @staticmethod
    def _parse_logit_bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise InvalidRequestError(f"logit_bias must be a dict of token id -> bias, "
                                      f"got {type(bias).__name__}")
        parsed: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token_id, bias_value = int(key), float(value)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(
                    f"logit_bias must map token ids to numbers, got {key!r}: {value!r}") from e
            if token_id < 0 or not math.isfinite(bias_value):
                raise InvalidRequestError(
                    f"logit_bias entries need a token id >= 0 and a finite bias, "
                    f"got {key!r}: {value!r}")
            parsed[token_id] = bias_value
        return parsed

    def _verify(self) -> None:
        self._verify_counts()
        self._verify_sampling()
        self._verify_stops()
        if self.output_kind not in RequestOutputKind:
            raise InvalidRequestError(f"output_kind must be a RequestOutputKind, "
                                      f"got {self.output_kind!r}")
        if self.extra_args is not None and not (
                isinstance(self.extra_args, dict)
                and all(isinstance(k, str) for k in self.extra_args)):
            raise InvalidRequestError(f"extra_args must be a dict with string keys, got "
                                      f"{self.extra_args!r:.200}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError(f"structured_outputs must be StructuredOutputsParams, "
                                      f"got {type(self.structured_outputs).__name__}")

    def _verify_logprob_token_ids(self) -> None:
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise InvalidRequestError(f"logprob_token_ids must be a list of 1 to "
                                      f"{MAX_LOGPROB_TOKEN_IDS} token ids, got {ids!r:.200}")
        if len(set(ids)) != len(ids):
            raise InvalidRequestError("logprob_token_ids must not repeat a token id")
        if self.logprobs != len(ids):
            raise InvalidRequestError(f"with logprob_token_ids, logprobs must be their count "
                                      f"({len(ids)}) or unset, got {self.logprobs}")

    def _verify_counts(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}.")
        if self.best_of is not None and (not isinstance(self.best_of, int)
                                         or self.best_of < self.n):
            raise InvalidRequestError(f"best_of must be greater than or equal to n, got "
                                      f"n={self.n} and best_of={self.best_of}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= _MAX_INT32:
            raise InvalidRequestError(f"min_tokens must be in [0, {_MAX_INT32}], got "
                                      f"{self.min_tokens}.")
        if self.max_tokens is not None and not isinstance(self.max_tokens, int):
            raise InvalidRequestError(f"max_tokens must be an integer, got {self.max_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be less than or equal to max_tokens="
                                      f"{self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int)
                                      or not 0 <= value <= _MAX_INT32):
                raise InvalidRequestError(f"{name} must be a non-negative integer, "
                                          f"got {value}.")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        self._verify_logprob_token_ids()
        budget = self.thinking_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or not 0 <= budget <= _MAX_INT32):
            raise InvalidRequestError(f"thinking_token_budget must be an integer in [0, "
                                      f"{_MAX_INT32}] or -1 (no limit), got {budget!r}.")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be a 64-bit integer, got {self.seed!r}.")

    def _verify_sampling(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not (
                0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidRequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                                      f"{self.temperature}.")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}.")
        if (not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0
                or self.top_k > _MAX_INT32):
            raise InvalidRequestError(
                f"top_k must be -1 (disable) or in [1, {_MAX_INT32}], got {self.top_k}.")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not isinstance(self.repetition_penalty, (int, float)) or not (
                0.0 < self.repetition_penalty < math.inf):
            raise InvalidRequestError(f"repetition_penalty must be greater than zero, got "
                                      f"{self.repetition_penalty}.")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise InvalidRequestError(f"allowed_token_ids must be a non-empty list of "
                                      f"non-negative integers, got {self.allowed_token_ids}.")

    def _verify_stops(self) -> None:
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, "
                                      f"got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings are only supported when detokenize is "
                                      "True. Set detokenize=True to use stop.")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise InvalidRequestError(f"bad_words must be non-empty strings, "
                                      f"got {self.bad_words!r}")

    # ------------------------------------------------------------------ derived

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back while streaming, so a stop string is never half-sent."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    @property
    def num_samples(self) -> int:
        """Sequences generated for the prompt: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    def clone(self) -> SamplingParams:
        """A deep copy that skips re-validation (the fields were checked already)."""
        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """Options of `LLM.beam_search` (vLLM's BeamSearchParams)."""

    beam_width: int
    """Beams kept after each step."""
    max_tokens: int
    """Steps to run (tokens per beam at most)."""
    ignore_eos: bool = False
    """When False, a beam that emits EOS is complete and leaves the search."""
    temperature: float = 0.0
    """Temperature of the per-step requests (the scores always use raw logprobs)."""
    length_penalty: float = 1.0
    """Score = cum_logprob / len(tokens) ** length_penalty (prompt included, as vLLM)."""
    include_stop_str_in_output: bool = False
    """Keep the EOS text in the decoded beams."""

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be at least 1, got {self.beam_width}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be non-negative, got "
                                      f"{self.temperature}.")
