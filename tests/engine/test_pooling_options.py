"""vLLM's pooling options: Matryoshka `dimensions`, `use_activation` per request,
--pooler-config's defaults (pooling type, activation, dimensions, score calibration)
and --convert (a causal LM served for embeddings only, or read as a classifier), with
their refusals."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, InvalidRequestError, PoolingParams, SamplingParams
from pagedllm.errors import ConfigError
from tests.utils import (TINY_WORDS, random_prompts, save_tiny_decoder_classifier,
                         save_tiny_model, tiny_llama_config, word_tokenizer)

VOCAB = 256
TOL = 1e-6


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama_pool"),
                           tiny_llama_config(vocab_size=VOCAB))


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(3, VOCAB, 3, 20, seed=7)]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, **kw)


def _vectors(llm, prompts, params=None) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding)
            for o in llm.embed(prompts, params, use_tqdm=False)]


def test_matryoshka_dimensions_cut_before_normalizing(tiny_llama, prompts):
    llm = _llm(tiny_llama, hf_overrides={"matryoshka_dimensions": [16, 32]})
    raw = _vectors(llm, prompts, PoolingParams(use_activation=False))
    for dims in (16, 32):
        cut = _vectors(llm, prompts, PoolingParams(dimensions=dims))
        for got, full in zip(cut, raw):
            assert got.shape == (dims,)
            torch.testing.assert_close(got, torch.nn.functional.normalize(full[:dims], dim=0),
                                       rtol=0, atol=TOL)
    # Normalized by default, as the older name `normalize` says too.
    for params in (None, PoolingParams(normalize=True), PoolingParams(use_activation=True)):
        for got, full in zip(_vectors(llm, prompts, params), raw):
            torch.testing.assert_close(got, torch.nn.functional.normalize(full, dim=0),
                                       rtol=0, atol=TOL)
    assert torch.equal(_vectors(llm, prompts, PoolingParams(normalize=False))[0], raw[0])
    with pytest.raises(InvalidRequestError, match=r"Matryoshka dimensions \[16, 32\], got 20"):
        llm.embed(prompts, PoolingParams(dimensions=20), use_tqdm=False)
    llm.shutdown()
    # is_matryoshka: any size up to the hidden size (64).
    llm = _llm(tiny_llama, hf_overrides={"is_matryoshka": True})
    assert _vectors(llm, prompts[:1], PoolingParams(dimensions=7))[0].shape == (7,)
    with pytest.raises(InvalidRequestError, match=r"dimensions must be in \[1, 64\]"):
        llm.embed(prompts, PoolingParams(dimensions=65), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.shutdown()


def test_pooler_config_sets_the_defaults(tiny_llama, prompts):
    plain = _llm(tiny_llama, hf_overrides={"is_matryoshka": True})
    explicit = _vectors(plain, prompts, PoolingParams(pooling_type="mean",
                                                      use_activation=False, dimensions=24))
    plain.shutdown()
    llm = _llm(tiny_llama, hf_overrides={"is_matryoshka": True}, pooler_config={
        "pooling_type": "MEAN", "use_activation": False, "dimensions": 24})
    assert llm.llm_engine.config.model.default_pooling_type == "mean"
    for got, want in zip(_vectors(llm, prompts), explicit):
        assert torch.equal(got, want)
    # A request's own fields still win.
    full = _vectors(llm, prompts[:1], PoolingParams(pooling_type="last", use_activation=True,
                                                    dimensions=64))[0]
    assert full.shape == (64,) and abs(full.norm().item() - 1) < 1e-5
    llm.shutdown()


def test_classifier_activation_and_calibration(tmp_path):
    path = save_tiny_decoder_classifier(tmp_path, "llama", num_labels=3)
    texts = ["w1 w2 w3", "w7"]
    llm = LLM(str(path), dtype="float32")
    probs = [o.outputs.probs for o in llm.classify(texts, use_tqdm=False)]
    logits = [torch.tensor(o.outputs.data.tolist()) for o in llm.encode(
        texts, PoolingParams(task="classify", use_activation=False), use_tqdm=False)]
    for p, z in zip(probs, logits):
        assert p == pytest.approx(torch.softmax(z, dim=-1).tolist(), abs=1e-6)
    unactivated = llm.classify(texts, pooling_params=PoolingParams(use_activation=False),
                               use_tqdm=False)
    assert [o.outputs.probs for o in unactivated] == [z.tolist() for z in logits]
    llm.shutdown()
    calibrated = LLM(str(path), dtype="float32",
                     pooler_config={"logit_mean": 0.5, "logit_sigma": 2.0})
    for out, z in zip(calibrated.classify(texts, use_tqdm=False), logits):
        assert out.outputs.probs == pytest.approx(
            torch.softmax((z - 0.5) / 2.0, dim=-1).tolist(), abs=1e-6)
    raw = calibrated.encode(texts, PoolingParams(task="classify", use_activation=False),
                            use_tqdm=False)
    for out, z in zip(raw, logits):
        assert out.outputs.data.tolist() == pytest.approx(((z - 0.5) / 2.0).tolist(),
                                                          abs=1e-6)
    calibrated.shutdown()


def test_convert(tiny_llama, prompts, tmp_path):
    embed_only = _llm(tiny_llama, convert="embed")
    assert embed_only.llm_engine.config.model.runner == "pooling"
    assert len(_vectors(embed_only, prompts[:1])[0]) == 64
    with pytest.raises(InvalidRequestError, match="pooling"):
        embed_only.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    embed_only.shutdown()
    with pytest.raises(ConfigError, match="runner 'generate' disagrees"):
        _llm(tiny_llama, convert="embed", runner="generate")
    # classify: a causal Qwen3 read as Qwen3ForSequenceClassification, its head the LM
    # head's rows of two tokens (vLLM's Qwen3-Reranker recipe, without naming the
    # architecture).
    from transformers import Qwen3Config

    path = save_tiny_model(tmp_path, Qwen3Config(
        vocab_size=len(TINY_WORDS) + 2, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        bos_token_id=None, eos_token_id=None, pad_token_id=None))
    word_tokenizer(TINY_WORDS + ["no", "yes"]).save_pretrained(path)
    reranker = LLM(str(path), dtype="float32", convert="classify",
                   hf_overrides={"classifier_from_token": ["no", "yes"]})
    assert reranker.llm_engine.config.model.architecture == "Qwen3ForSequenceClassification"
    named = LLM(str(path), dtype="float32", hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes"]})
    pair = ("w1 w2 w3", "w4 w5")
    score = reranker.score(*pair, use_tqdm=False)[0].outputs.score
    assert score == named.score(*pair, use_tqdm=False)[0].outputs.score
    logit = reranker.score(*pair, use_tqdm=False, pooling_params=PoolingParams(
        use_activation=False))[0].outputs.score
    assert torch.sigmoid(torch.tensor(logit)).item() == pytest.approx(score, abs=1e-6)
    reranker.shutdown()
    named.shutdown()
    # A causal LM's checkpoint has no classification head of its own.
    with pytest.raises(ConfigError, match="classifier_from_token"):
        LLM(str(path), dtype="float32", convert="classify")


@pytest.mark.parametrize("pooler_config, match", [
    ({"normalize": True}, "use_activation instead"),
    ({"tok_pooling_type": "ALL"}, "token-wise pooling"),
    ({"enable_chunked_processing": True}, "chunked processing"),
    ({"step_tag_id": 3}, "process reward"),
    ({"pooling_type": "MAX"}, "pooling_type must be one of"),
    ({"pooling_type": "MEAN", "seq_pooling_type": "CLS"}, "not both"),
    ({"task": "classify"}, "does 'embed'"),
    ({"use_activation": "yes"}, "use_activation must be a bool"),
    ({"dimensions": 16}, "does not support Matryoshka"),
    ({"logit_sigma": 0}, "logit_sigma must not be 0"),
    ({"frobnicate": 1}, "unknown key 'frobnicate'"),
])
def test_pooler_config_refusals(tiny_llama, pooler_config, match):
    with pytest.raises(ConfigError, match=match):
        _llm(tiny_llama, pooler_config=pooler_config)


def test_convert_refusals(tmp_path, tiny_llama):
    import transformers as tf

    gpt2 = save_tiny_model(tmp_path, tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1,
                                                   n_head=4, n_positions=64))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no sequence classification"):
        _llm(gpt2, convert="classify")
    with pytest.raises(ConfigError, match="convert must be one of"):
        _llm(tiny_llama, convert="reward")


def test_the_flags():
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.cli import build_parser, engine_args_from
    from pagedllm.entrypoints.dotted_flags import expand_dotted_flags, json_object_flags

    argv = expand_dotted_flags(["serve", "m", "--pooler-config.pooling_type=MEAN",
                                "--pooler-config.use_activation", "false",
                                "--convert", "embed"], json_object_flags(EngineArgs))
    args = engine_args_from(build_parser().parse_args(argv))
    assert args.pooler_config == {"pooling_type": "MEAN", "use_activation": False}
    assert args.convert == "embed"
