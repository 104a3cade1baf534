"""Reasoning ("thinking") in a model's output: `<think> ... </think>` before the answer.

A reasoning format (vLLM's `--reasoning-parser` names) says where the reasoning is:

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the output is reasoning until the
  end tag, whether or not it opens with the start tag (R1's chat template puts the start
  tag in the prompt, R1-0528 writes it itself); an output that never closes it is all
  reasoning.
- `qwen3` (Qwen3, which think unless `enable_thinking` is false): the output is
  reasoning only when it opens with the start tag, up to the end tag; an output that
  does not open with it is all content.

The prompt can decide it first: a prompt whose last tag is the end tag (Qwen3 with
`enable_thinking: false` renders an empty `<think>\\n\\n</think>`) leaves no reasoning to
the output, and one whose last tag is the start tag (templates that open the reasoning
for the model) leaves the output inside it, under both formats.

Two readers apply the same rule: `ReasoningGate` reads token ids (the engine core, so a
grammar constrains only the answer, as vLLM's structured outputs with a reasoning parser
do), `ReasoningReader` reads text (the server, which returns the reasoning in its own
field). They agree as long as each tag is generated as its own token, which is how these
models write them (both tags are single tokens of their vocabularies; `tokens_of`
refuses a tokenizer where they are not).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Phase(str, Enum):
    """Where an output stands."""

    OPENING = "opening"
    """Nothing read yet, and a start tag first would open reasoning (else: content)."""
    REASONING = "reasoning"
    """Inside the reasoning, until the end tag."""
    CONTENT = "content"
    """The answer: everything from here on."""


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    implicit_start: bool
    """The output starts inside the reasoning even without the start tag."""


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>", implicit_start=True),
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", implicit_start=False),
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format registered as `name`; ValueError naming the choices otherwise."""
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_FORMATS))}") from None


@dataclass(frozen=True)
class ReasoningTokens:
    """A format with its tags' token ids in one vocabulary."""

    format: ReasoningFormat
    start_id: int
    end_id: int
    forced_end: tuple[int, ...] = ()
    """What a spent thinking budget forces, token by token (it ends with end_id);
    empty: the end tag alone."""

    @property
    def forced_end_ids(self) -> tuple[int, ...]:
        return self.forced_end or (self.end_id,)

    def initial_phase(self, prompt_ids: list[int]) -> Phase:
        """The phase an output starts in after this prompt: its last tag decides (see
        the module docstring), else the format."""
        for token_id in reversed(prompt_ids):
            if token_id == self.end_id:
                return Phase.CONTENT
            if token_id == self.start_id:
                return Phase.REASONING
        return Phase.REASONING if self.format.implicit_start else Phase.OPENING

    def reasoning_in_prompt(self, prompt_ids: list[int]) -> int:
        """Tokens of reasoning the prompt already holds: those after its last tag when
        that is the start tag (a template that opens the reasoning, or a continued one);
        0 otherwise."""
        for i in range(len(prompt_ids) - 1, -1, -1):
            if prompt_ids[i] == self.end_id:
                return 0
            if prompt_ids[i] == self.start_id:
                return len(prompt_ids) - 1 - i
        return 0


def tokens_of(fmt: ReasoningFormat, tokenizer: Any,
              end_str: str | None = None) -> ReasoningTokens:
    """The tags' ids in `tokenizer` (a Hugging Face tokenizer), and `end_str`'s (the
    forced end; it must end with the end tag, written as that one token and holding no
    other tag); ValueError when either tag is not one token of it (a model without this
    reasoning format) or `end_str` is not so."""
    ids = []
    for tag in (fmt.start, fmt.end):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"reasoning parser {fmt.name!r}: {tag!r} is not a single token of this "
                f"model's tokenizer ({len(encoded)} tokens); this model does not write "
                f"its reasoning that way")
        ids.append(encoded[0])
    forced: tuple[int, ...] = ()
    if end_str is not None:
        forced = tuple(tokenizer.encode(end_str, add_special_tokens=False))
        if not forced or forced[-1] != ids[1] or set(forced[:-1]) & set(ids):
            raise ValueError(f"reasoning_end_str {end_str!r} must end with {fmt.end!r} "
                             f"(as its own token) and hold no other reasoning tag")
    return ReasoningTokens(fmt, ids[0], ids[1], forced)


class ReasoningGate:
    """One request's phase read from its output tokens (the engine core's reader):
    which tokens belong to the answer, which a grammar then constrains; and, with a
    thinking budget, when the reasoning must end."""

    def __init__(self, tokens: ReasoningTokens, phase: Phase, budget: int | None = None,
                 num_reasoning: int = 0) -> None:
        self.start_id = tokens.start_id
        self.end_id = tokens.end_id
        self.forced = tokens.forced_end_ids
        self.phase = phase
        # SamplingParams.thinking_token_budget, and the reasoning's tokens so far (the
        # prompt's included, as vLLM counts; the tags not).
        self.budget = budget
        self.num_reasoning = num_reasoning

    @classmethod
    def for_prompt(cls, tokens: ReasoningTokens, prompt_ids: list[int],
                   budget: int | None = None) -> ReasoningGate:
        # A prompt holding more reasoning than the budget ends it at once: counted as
        # just spent, so the forced end starts from its first token.
        num = tokens.reasoning_in_prompt(prompt_ids)
        return cls(tokens, tokens.initial_phase(prompt_ids), budget,
                   num if budget is None else min(num, budget))

    def accept(self, token_id: int) -> bool:
        """Take the next output token; True if it is part of the answer."""
        if self.phase is Phase.CONTENT:
            return True
        if self.phase is Phase.OPENING:
            self.phase = Phase.REASONING if token_id == self.start_id else Phase.CONTENT
            return self.phase is Phase.CONTENT
        if token_id == self.end_id:
            self.phase = Phase.CONTENT
        elif token_id != self.start_id:  # (an implicit reasoning may still write it)
            self.num_reasoning += 1
        return False

    def forced_token(self) -> int | None:
        """The next token when the budget is spent inside the reasoning: the forced end's
        next one (the phrase before the end tag counts as reasoning, so how far past the
        budget the reasoning is says which); None otherwise."""
        if self.budget is None or self.phase is not Phase.REASONING:
            return None
        past = self.num_reasoning - self.budget
        if past < 0:
            return None
        return self.forced[min(past, len(self.forced) - 1)]  # (the end tag, at worst)


class ReasoningReader:
    """Splits an output's text into reasoning and content, piece by piece (a stream's
    deltas, or the whole text at once: the result does not depend on the pieces).

    Text that may still turn out to be a tag (a partial `</thi`) is held back until the
    next piece or `finish`. The tags themselves appear in neither part.
    """

    def __init__(self, fmt: ReasoningFormat, phase: Phase) -> None:
        self.start = fmt.start
        self.end = fmt.end
        self.phase = phase
        # A reasoning that starts implicitly may still open with the start tag (dropped).
        self._may_open = phase is Phase.REASONING
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) released by this piece."""
        reasoning, content = "", ""
        text = self._held + text
        self._held = ""
        if self.phase is Phase.OPENING or self._may_open:
            # Whitespace before the tag is the detokenizer's (a word-level tokenizer
            # joins words with spaces), not the model's: it opens the output all the same.
            stripped = text.lstrip()
            if len(stripped) < len(self.start) and self.start.startswith(stripped):
                self._held = text  # too short to tell
                return "", ""
            opens = stripped.startswith(self.start)
            if opens:
                text = stripped[len(self.start):]
            if self.phase is Phase.OPENING:
                self.phase = Phase.REASONING if opens else Phase.CONTENT
            self._may_open = False
        if self.phase is Phase.REASONING:
            before, tag, after = text.partition(self.end)
            if not tag:
                keep = _partial_tag_len(text, self.end)
                self._held = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
            reasoning, text = before, after
            self.phase = Phase.CONTENT
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The output ended: what is still held (an unfinished tag is plain text of the
        part it was in)."""
        held, self._held = self._held, ""
        return (held, "") if self.phase is Phase.REASONING else ("", held)


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
