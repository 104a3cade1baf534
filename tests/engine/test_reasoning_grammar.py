"""Structured outputs with a reasoning parser: the grammar constrains the answer after
the reasoning, not the reasoning (vLLM's behaviour), on a scripted model whose greedy
output is known word for word (tests/utils.py:save_scripted_llama)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.utils import save_scripted_llama

# go -> <think> hmm well </think> maybe so; ponder -> hmm well </think> ...; plain -> text.
SCRIPT = {"go": "<think>", "<think>": "hmm", "hmm": "well", "well": "</think>",
          "</think>": "maybe", "maybe": "so", "ponder": "hmm", "plain": "text",
          "text": "yes", "yes": "no"}
YES_NO = StructuredOutputsParams(choice=["yes", "no"])


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return save_scripted_llama(tmp_path_factory.mktemp("scripted"), SCRIPT)


def make_llm(path, parser):
    return LLM(model=str(path), dtype="float32", reasoning_parser=parser,
               num_kv_blocks=64, max_model_len=64)


def words(llm, prompts, grammar=True, **kw):
    params = SamplingParams(**{"max_tokens": 12, "temperature": 0,
                               "structured_outputs": YES_NO if grammar else None} | kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].text.split() for o in outs]


def test_without_a_parser_the_grammar_starts_at_once(scripted):
    llm = make_llm(scripted, None)
    assert words(llm, ["go"], grammar=False) == [
        ["<think>", "hmm", "well", "</think>", "maybe", "so"]]
    assert words(llm, ["go", "ponder", "plain"]) == [["yes"]] * 3


def test_deepseek_r1_constrains_the_answer_only(scripted):
    llm = make_llm(scripted, "deepseek_r1")
    prompts = ["go", "ponder", "go <think> </think>", "go <think>", "plain"]
    expected = [["<think>", "hmm", "well", "</think>", "yes"],  # opens the reasoning
                ["hmm", "well", "</think>", "yes"],  # reasoning without a start tag
                ["yes"],  # the prompt closed the reasoning: the grammar from the start
                ["hmm", "well", "</think>", "yes"],  # the prompt opened it
                ["text", "yes", "no"]]  # never closed: all reasoning, unconstrained
    assert words(llm, prompts) == expected
    # Alone or batched, the same.
    assert [words(llm, [p])[0] for p in prompts] == expected
    # Each of n samples reads its own reasoning.
    outs = llm.generate(["go"], SamplingParams(n=2, max_tokens=12, temperature=0,
                                               structured_outputs=YES_NO), use_tqdm=False)
    assert [o.text.split() for o in outs[0].outputs] == [expected[0]] * 2
    # Sampled requests (hot enough to stray from the script): whatever the reasoning,
    # what follows its end keeps to the grammar.
    closed = []
    for seed in range(10):
        out = words(llm, ["go"], temperature=20.0, seed=seed)[0]
        if "</think>" in out:
            end = out.index("</think>")
            assert out[end + 1:] in (["yes"], ["no"]), out
            closed.append(out[:end])
    assert len(closed) >= 3 and any(r != ["<think>", "hmm", "well"] for r in closed)


def test_qwen3_grammar_may_open_a_reasoning(scripted):
    """Under qwen3 an output is reasoning only if it opens with <think>: the first token
    may be the grammar's or the start tag, and after a reasoning the grammar holds."""
    llm = make_llm(scripted, "qwen3")
    go, plain, closed = words(llm, ["go", "plain", "go <think> </think>"])
    assert go == ["<think>", "hmm", "well", "</think>", "yes"]
    assert closed == ["yes"]
    # "plain" wants "text": not allowed, so the first token is "yes", "no" or the tag.
    assert plain in (["yes"], ["no"]) or (plain[0] == "<think>" and plain[-2:] in (
        ["</think>", "yes"], ["</think>", "no"]))


def test_parser_needs_the_tags_and_a_tokenizer(scripted):
    # The bundled SmolLM2 has no <think> token.
    with pytest.raises(ValueError, match="'<think>' is not a single token"):
        LLM(reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="needs the tokenizer"):
        LLM(model=str(scripted), reasoning_parser="qwen3", skip_tokenizer_init=True)
