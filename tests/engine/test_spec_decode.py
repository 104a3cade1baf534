"""Speculative decoding (prompt lookup) emits exactly the tokens of plain decoding:
greedy and seeded sampling, with logprobs, under chunked prefill, prefix-cache hits and
preemption; proposals are really made and accepted (the counters say so)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import save_tiny_model, tiny_llama_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}


def _repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat phrases, so prompt lookup finds matches (and random models
    tend to continue repeating)."""
    phrase = [17, 42, 99, 7, 150, 3]
    return [phrase * 4 + [5], [11, 12] + phrase * 3, [200, 201, 202, 203] * 5,
            phrase * 2 + [77, 78, 79] + phrase, [9, 8, 7, 6, 5] * 4 + [9, 8]]


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
             [sorted((t, lp.logprob, lp.rank) for t, lp in d.items())
              for d in (o.outputs[0].logprobs or [])]) for o in outs]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True,
                   logprobs=1),
    # Not speculated (a penalty sees the tokens before each position): must still match.
    SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("spec_llama"), tiny_llama_config())


@pytest.mark.parametrize("engine_kw", [
    dict(),
    # Chunked prefill (5-token steps) and prefix hits (every prompt is run twice).
    dict(max_num_batched_tokens=5, max_num_seqs=3),
    # A small pool: requests are preempted and recomputed mid-speculation.
    dict(block_size=4, num_kv_blocks=20),
    dict(block_size=4, num_kv_blocks=20, preemption_mode="swap"),
    # Tensor parallelism: rank 0 samples every position, every rank accepts the same.
    dict(tensor_parallel_size=2),
])
def test_ngram_matches_plain_decoding_tiny_llama(tiny_llama, engine_kw):
    sched = _assert_matches_plain_decoding(tiny_llama, NGRAM, engine_kw)
    assert 0 < sched.num_accepted_tokens <= sched.num_draft_tokens


def _assert_matches_plain_decoding(model, spec, engine_kw):
    """Every PARAMS run of the repetitive prompts (twice: the second run hits the prefix
    cache) equals plain decoding; returns the speculating engine's scheduler."""
    prompts = _repetitive_prompts()
    plain = LLM(str(model), dtype="float32", skip_tokenizer_init=True, **engine_kw)
    try:
        expected = [_run(plain, prompts, p) for p in PARAMS]
    finally:
        plain.shutdown()
    llm = LLM(str(model), dtype="float32", skip_tokenizer_init=True,
              speculative_config=spec, **engine_kw)
    try:
        for _ in range(2):
            assert [_run(llm, prompts, p) for p in PARAMS] == expected
        sched = llm.llm_engine.engine_core.scheduler
        assert sched.num_draft_tokens > 0
        if "num_kv_blocks" in engine_kw:
            assert sched.num_preemptions > 0
        return sched
    finally:
        llm.shutdown()


def test_ngram_matches_plain_decoding_smollm2(default_llm):
    """The bundled model in its default dtype: copying text is where lookup pays."""
    tok = default_llm.get_tokenizer()
    text = ("def area(r):\n    return 3.14159 * r * r\n\n"
            "def perimeter(r):\n    return 2 * 3.14159 * r\n\n")
    prompts = [tok.encode("Repeat this code exactly:\n" + text + "Here it is again:\n"),
               tok.encode("The capital of France is"),
               tok.encode("one two three four five one two three four five one two")]
    params = [SamplingParams(temperature=0, max_tokens=40, logprobs=1),
              SamplingParams(temperature=0.7, seed=11, max_tokens=40)]
    expected = [_run(default_llm, prompts, p) for p in params]
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5},
              max_num_batched_tokens=16, num_kv_blocks=8, block_size=16)
    try:
        assert [_run(llm, prompts, p) for p in params] == expected
        sched = llm.llm_engine.engine_core.scheduler
        assert sched.num_accepted_tokens > 10
        assert sched.num_preemptions > 0
    finally:
        llm.shutdown()


def test_stop_and_max_tokens_inside_accepted_run(tiny_llama):
    """A stop token or max_tokens reached among the accepted tokens ends the request
    there, as plain decoding does."""
    prompts = _repetitive_prompts()
    plain = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True)
    free = _run(plain, prompts, SamplingParams(temperature=0, max_tokens=20,
                                                ignore_eos=True))
    # Stop at a token each output emits after a few steps.
    stops = [toks[7] for toks, _, _ in free]
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5)]
    cases += [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[s])
              for s in stops]
    expected = [_run(plain, prompts, p) for p in cases]
    plain.shutdown()
    llm = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True,
              speculative_config=NGRAM)
    try:
        assert [_run(llm, prompts, p) for p in cases] == expected
    finally:
        llm.shutdown()


def test_speculative_config_is_validated(tiny_llama, tiny_draft, tmp_path):
    def make(spec, **kw):
        return LLM(str(tiny_llama), skip_tokenizer_init=True, speculative_config=spec, **kw)

    with pytest.raises(ValueError, match="speculative method"):
        make({"method": "medusa"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make({"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        make({"prompt_lookup": 3})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        make({"prompt_lookup_min": 5, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="needs one"):
        make({"method": "draft_model"})
    with pytest.raises(ValueError, match="pipeline parallelism"):
        make(NGRAM, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="tensor parallelism"):
        make({"model": str(tiny_draft)}, tensor_parallel_size=2)
    other_vocab = save_tiny_model(tmp_path / "v", tiny_llama_config(vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary"):
        make({"model": str(other_vocab)})


def test_vllm_shortcut_flags(tiny_llama, tiny_draft):
    """--spec-method / --spec-model / --spec-tokens fill in speculative_config and win
    over its fields (vLLM's); --num-gpu-blocks-override is --num-kv-blocks."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    def spec_of(*flags):
        ns = build_parser().parse_args(["serve", str(tiny_llama), *flags])
        return engine_args_from(ns).create_engine_config().speculative

    spec = spec_of("--spec-method", "ngram", "--spec-tokens", "3")
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    spec = spec_of("--speculative-config", '{"num_speculative_tokens": 5, '
                   '"prompt_lookup_max": 6}', "--spec-tokens", "2")
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max) == (2, 6)
    spec = spec_of("--spec-model", str(tiny_draft))
    assert spec.method == "draft_model" and spec.model == str(tiny_draft)
    assert spec_of() is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec_of("--spec-tokens", "0")
    ns = build_parser().parse_args(["serve", "--num-gpu-blocks-override", "30"])
    assert engine_args_from(ns).num_kv_blocks == 30
    assert EngineArgs(model=str(tiny_llama), spec_tokens=4).create_engine_config() \
        .speculative.num_speculative_tokens == 4


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A smaller random Llama of the same vocabulary: one layer, narrower."""
    return save_tiny_model(tmp_path_factory.mktemp("spec_draft"),
                           tiny_llama_config(num_hidden_layers=1, hidden_size=32,
                                             intermediate_size=64), seed=1)


@pytest.mark.parametrize("engine_kw", [
    dict(),
    dict(max_num_batched_tokens=5, max_num_seqs=3),
    dict(block_size=4, num_kv_blocks=24),
    dict(block_size=4, num_kv_blocks=24, preemption_mode="swap"),
])
def test_draft_model_matches_plain_decoding(tiny_llama, tiny_draft, engine_kw):
    _assert_matches_plain_decoding(
        tiny_llama, {"model": str(tiny_draft), "num_speculative_tokens": 3}, engine_kw)


def test_draft_model_of_itself_accepts_every_greedy_proposal(tiny_llama):
    """The target as its own draft: in float32 every greedy proposal is the target's
    argmax, so all are accepted (the draft's K/V is kept exactly in step)."""
    prompts = _repetitive_prompts()
    spec = {"model": str(tiny_llama), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True,
              speculative_config=spec, max_num_batched_tokens=7)
    try:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        _run(llm, prompts, params)
        sched = llm.llm_engine.engine_core.scheduler
        assert sched.num_draft_tokens > 50
        assert sched.num_accepted_tokens == sched.num_draft_tokens
    finally:
        llm.shutdown()
