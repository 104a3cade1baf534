"""thinking_token_budget (vLLM's): once a request's reasoning holds that many tokens, the
next token is the end tag, and the answer follows. On a scripted model whose greedy
output is known word for word (tests/utils.py:save_scripted_llama)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams
from tests.utils import save_scripted_llama

# go -> <think> hmm well ok fine </think> maybe so; ponder -> hmm well ok ...; plain -> text.
SCRIPT = {"go": "<think>", "<think>": "hmm", "hmm": "well", "well": "ok", "ok": "fine",
          "fine": "</think>", "</think>": "maybe", "maybe": "so", "ponder": "hmm",
          "plain": "text", "text": "yes", "yes": "no"}
FULL = ["<think>", "hmm", "well", "ok", "fine", "</think>", "maybe", "so"]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return save_scripted_llama(tmp_path_factory.mktemp("scripted"), SCRIPT)


@pytest.fixture(scope="module")
def r1(scripted):
    return LLM(model=str(scripted), dtype="float32", reasoning_parser="deepseek_r1",
               num_kv_blocks=64, max_model_len=64)


def words(llm, prompts, **kw):
    params = SamplingParams(**{"max_tokens": 8, "temperature": 0} | kw)
    return [o.outputs[0].text.split() for o in llm.generate(prompts, params, use_tqdm=False)]


def test_the_budget_ends_the_reasoning(r1):
    assert words(r1, ["go"]) == [FULL]
    # deepseek_r1 reads the output as reasoning from its first token: a budget of 0 ends
    # it before the model could write the start tag.
    assert words(r1, ["go"], thinking_token_budget=0) == [["</think>", "maybe", "so"]]
    for budget, reasoning in ((1, ["hmm"]), (2, ["hmm", "well"]),
                              (4, ["hmm", "well", "ok", "fine"]),
                              (9, ["hmm", "well", "ok", "fine"])):
        expected = ["<think>", *reasoning, "</think>", "maybe", "so"]
        assert words(r1, ["go"], thinking_token_budget=budget) == [expected[:8]], budget
    # -1 is vLLM's "no limit".
    assert words(r1, ["go"], thinking_token_budget=-1) == [FULL]


def test_qwen3_bounds_a_reasoning_the_output_opens(scripted):
    llm = LLM(model=str(scripted), dtype="float32", reasoning_parser="qwen3",
              num_kv_blocks=64, max_model_len=64)
    # Under qwen3 only an output that opens with the start tag reasons.
    assert words(llm, ["go", "plain"], thinking_token_budget=0) == [
        ["<think>", "</think>", "maybe", "so"], ["text", "yes", "no"]]


def test_reasoning_in_the_prompt_counts(r1):
    # The prompt opened the reasoning and holds one token of it ("hmm"): one more fits.
    assert words(r1, ["go <think> hmm"], max_tokens=4, thinking_token_budget=2) == [
        ["well", "</think>", "maybe", "so"]]
    # One holding more than the budget: the end tag comes first.
    assert words(r1, ["go <think> hmm well ok"], max_tokens=3, thinking_token_budget=1) == [
        ["</think>", "maybe", "so"]]
    # A reasoning the prompt closed is not bounded.
    assert words(r1, ["go <think> </think>"], max_tokens=2, thinking_token_budget=0) == [
        ["maybe", "so"]]
    # deepseek_r1 reads an output without the start tag as reasoning too.
    assert words(r1, ["ponder"], max_tokens=4, thinking_token_budget=1) == [
        ["hmm", "</think>", "maybe", "so"]]


def test_batched_children_and_grammar(r1):
    prompts = ["go", "ponder", "plain", "go"]
    budgets = [1, 2, None, 3]
    params = [SamplingParams(max_tokens=8, temperature=0, thinking_token_budget=b)
              for b in budgets]
    together = [o.outputs[0].text.split()
                for o in r1.generate(prompts, params, use_tqdm=False)]
    alone = [words(r1, [p], thinking_token_budget=b)[0] for p, b in zip(prompts, budgets)]
    assert together == alone
    assert together[0] == ["<think>", "hmm", "</think>", "maybe", "so"]
    assert together[2] == ["text", "yes", "no"]  # never closed: all reasoning, unbounded
    # Each of n samples counts its own reasoning.
    outs = r1.generate(["go"], SamplingParams(n=2, max_tokens=8, temperature=0,
                                              thinking_token_budget=1), use_tqdm=False)
    assert [o.text.split() for o in outs[0].outputs] == [together[0]] * 2
    # With a grammar, it constrains what follows the forced end tag.
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    assert words(r1, ["go"], thinking_token_budget=1, structured_outputs=yes_no) == [
        ["<think>", "hmm", "</think>", "yes"]]


def test_sampled_reasoning_keeps_to_the_budget(r1):
    # Hot enough to stray from the script: however the reasoning goes, it ends by the
    # budget (the end tag is at most the budget + 1 tokens after the start).
    for seed in range(8):
        out = r1.generate(["go"], SamplingParams(max_tokens=12, temperature=20.0, seed=seed,
                                                 thinking_token_budget=3, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
        ids = list(out.token_ids)
        end_id = r1.get_tokenizer().convert_tokens_to_ids("</think>")
        start_id = r1.get_tokenizer().convert_tokens_to_ids("<think>")
        assert end_id in ids, out.text
        reasoning = [t for t in ids[:ids.index(end_id)] if t != start_id]
        assert len(reasoning) <= 3, out.text


@pytest.mark.parametrize("engine_kw", [
    {"async_scheduling": True},
    # (A budgeted request is not speculated on: its row may be masked.)
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1}}], ids=["async", "ngram"])
def test_with_async_scheduling_speculation_and_prefix_caching(scripted, r1, engine_kw):
    llm = LLM(model=str(scripted), dtype="float32", reasoning_parser="deepseek_r1",
              num_kv_blocks=64, max_model_len=64, **engine_kw)
    prompts = ["go", "ponder", "go hmm well ok"]
    expected = words(r1, prompts, thinking_token_budget=2)
    assert words(llm, prompts, thinking_token_budget=2) == expected
    assert words(llm, prompts, thinking_token_budget=2) == expected  # cached


def test_what_it_refuses(scripted, r1):
    plain = LLM(model=str(scripted), dtype="float32", num_kv_blocks=64, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="reasoning parser"):
        words(plain, ["go"], thinking_token_budget=2)
    for bad in (-2, 1.5, True, "3", 2 ** 31):
        with pytest.raises(InvalidRequestError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None


def test_reasoning_config_forces_a_phrase(scripted, r1):
    """vLLM's reasoning_config reasoning_end_str: a spent budget forces the phrase token
    by token, the end tag last (the phrase is part of the reasoning)."""
    llm = LLM(model=str(scripted), dtype="float32", num_kv_blocks=64, max_model_len=64,
              reasoning_config={"reasoning_parser": "deepseek_r1",
                                "reasoning_start_str": "<think>",
                                "reasoning_end_str": "plain text </think>"})
    assert words(llm, ["go"], thinking_token_budget=1) == [
        ["<think>", "hmm", "plain", "text", "</think>", "maybe", "so"]]
    # A reasoning that ends before the budget is not touched; without a budget neither.
    assert words(llm, ["go"], thinking_token_budget=9) == words(llm, ["go"]) == [FULL]
    outs = llm.generate(["go"], SamplingParams(max_tokens=8, temperature=0,
                                               thinking_token_budget=0), use_tqdm=False)
    assert outs[0].outputs[0].text.split()[:3] == ["plain", "text", "</think>"]
    # A prompt past the budget gets the whole phrase.
    assert words(llm, ["go <think> hmm well ok"], max_tokens=4, thinking_token_budget=1) == [
        ["plain", "text", "</think>", "maybe"]]


@pytest.mark.parametrize("config, match", [
    ({"reasoning_parser": "deepseek_r1", "reasoning_end_str": "time is up"}, "end tag"),
    ({"reasoning_parser": "deepseek_r1", "reasoning_start_str": "<t>"}, "start tag"),
    ({"reasoning_end_str": "</think>"}, "needs a reasoning parser"),
    ({"reasoning_parser": "qwen3", "other": 1}, "unknown reasoning_config keys"),
    ({"reasoning_parser": 3}, "must be a string")])
def test_reasoning_config_is_checked(scripted, config, match):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=str(scripted), reasoning_config=config).create_engine_config()
