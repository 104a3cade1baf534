"""The reasoning formats (pagedllm/reasoning.py): the text reader splits any chunking of
an output the same way, the token gate agrees with it, the prompt decides where an
output starts, and a tokenizer without the tags is refused."""

from __future__ import annotations

import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.entrypoints.openai.protocol import ChatResponseMessage, DeltaMessage
from pagedllm.reasoning import (REASONING_FORMATS, Phase, ReasoningGate, ReasoningReader,
                                ReasoningTokens, get_reasoning_format, tokens_of)

R1 = REASONING_FORMATS["deepseek_r1"]
QWEN3 = REASONING_FORMATS["qwen3"]


def read_chunked(fmt, phase: Phase, text: str, size: int) -> tuple[str, str]:
    reader = ReasoningReader(fmt, phase)
    reasoning, content = "", ""
    for i in range(0, len(text), size):
        r, c = reader.feed(text[i:i + size])
        reasoning, content = reasoning + r, content + c
    r, c = reader.finish()
    return reasoning + r, content + c


# (initial phase, output text) -> (reasoning, content); the same for both formats, whose
# difference is only the phase an output starts in (ReasoningTokens.initial_phase).
CASES = [
    (Phase.OPENING, "<think>\nweigh it\n</think>\n\nYes.", ("\nweigh it\n", "\n\nYes.")),
    (Phase.OPENING, "Yes. </think> and <think>", ("", "Yes. </think> and <think>")),
    (Phase.OPENING, "<think>cut off", ("cut off", "")),
    (Phase.OPENING, "<thi", ("", "<thi")),  # a partial tag at the end is plain text
    (Phase.OPENING, "", ("", "")),
    (Phase.OPENING, "<think></think>", ("", "")),
    (Phase.OPENING, " \n<think>x</think>y", ("x", "y")),  # a detokenizer's spaces first
    (Phase.OPENING, "  ", ("", "  ")),
    (Phase.REASONING, "weigh it</think>Yes.", ("weigh it", "Yes.")),
    (Phase.REASONING, "<think>weigh it</think>Yes.", ("weigh it", "Yes.")),  # R1-0528
    (Phase.REASONING, "never closed </thi", ("never closed </thi", "")),
    (Phase.REASONING, "a</think>b</think>c", ("a", "b</think>c")),
    (Phase.REASONING, "</think>", ("", "")),
    (Phase.CONTENT, "<think>x</think>y", ("", "<think>x</think>y")),
]


@pytest.mark.parametrize("fmt", [R1, QWEN3], ids=lambda f: f.name)
@pytest.mark.parametrize("phase,text,expected", CASES)
def test_reader_splits_any_chunking_alike(fmt, phase, text, expected):
    for size in range(1, max(len(text), 1) + 1):
        assert read_chunked(fmt, phase, text, size) == expected, size


def test_initial_phase_from_the_prompt():
    r1, qwen3 = ReasoningTokens(R1, 7, 8), ReasoningTokens(QWEN3, 7, 8)
    assert r1.initial_phase([1, 2]) is Phase.REASONING  # R1: reasoning without a tag
    assert qwen3.initial_phase([1, 2]) is Phase.OPENING  # Qwen3: only if it opens one
    for tokens in (r1, qwen3):
        # enable_thinking false: an empty reasoning closed in the prompt.
        assert tokens.initial_phase([1, 7, 3, 8, 3]) is Phase.CONTENT
        # A template that opens the reasoning for the model.
        assert tokens.initial_phase([1, 7, 3, 8, 4, 7, 3]) is Phase.REASONING


def test_gate_agrees_with_the_reader():
    """Token by token, the gate marks as answer exactly the tokens the text reader puts
    in the content (tags as single tokens)."""
    words = {7: "<think>", 8: "</think>", 1: "a", 2: "b", 3: "c"}
    for fmt in (R1, QWEN3):
        tokens = ReasoningTokens(fmt, 7, 8)
        for phase in Phase:
            for output in ([7, 1, 2, 8, 3, 1], [1, 8, 2], [1, 2], [7, 1], [8, 7, 8, 1]):
                gate = ReasoningGate(tokens, phase)
                answer = [t for t in output if gate.accept(t)]
                _, content = read_chunked(fmt, phase, "".join(words[t] for t in output), 3)
                assert "".join(words[t] for t in answer) == content, (fmt.name, phase, output)


def test_gate_phases():
    tokens = ReasoningTokens(QWEN3, 7, 8)
    gate = ReasoningGate(tokens, Phase.OPENING)
    assert gate.accept(7) is False and gate.phase is Phase.REASONING
    assert gate.accept(1) is False and gate.accept(8) is False
    assert gate.phase is Phase.CONTENT and gate.accept(7) is True
    gate = ReasoningGate(tokens, Phase.OPENING)
    assert gate.accept(1) is True and gate.phase is Phase.CONTENT


class _Tokenizer:
    def __init__(self, vocab: dict[str, list[int]]) -> None:
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.vocab[text]


def test_tags_must_be_single_tokens():
    assert tokens_of(QWEN3, _Tokenizer({"<think>": [5], "</think>": [6]})) == (
        ReasoningTokens(QWEN3, 5, 6))
    with pytest.raises(ValueError, match="'</think>' is not a single token"):
        tokens_of(R1, _Tokenizer({"<think>": [5], "</think>": [1, 2, 3]}))


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_format("granite")
    with pytest.raises(ValueError, match="unknown reasoning parser 'x'"):
        StructuredOutputsConfig(reasoning_parser="x")


def test_messages_without_reasoning_send_openai_fields_only():
    assert "reasoning" not in ChatResponseMessage(content="hi").model_dump()
    assert "reasoning_content" not in DeltaMessage(content="hi").model_dump()
    both = ChatResponseMessage(content=None, reasoning="r", reasoning_content="r")
    assert both.model_dump()["reasoning"] == both.model_dump()["reasoning_content"] == "r"
