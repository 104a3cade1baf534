"""Decoders with a classification head (transformers' <Family>ForSequenceClassification)
against transformers: one label scores pairs (LLM.score: rerankers) and single texts
(LLM.classify: reward models) through a sigmoid, several labels classify (softmax).
Generation and embeddings are refused; batching and prefix-cache hits change nothing."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.errors import InvalidRequestError
from tests.utils import save_tiny_decoder_classifier

PAIRS = [("w1 w2 w3", "w4 w5"), ("w1 w2 w3", "w9 w8 w7 w6"), ("w100", "w100 w3")]


def _hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0]


# (Qwen2 below: transformers loads a Qwen2 directory's tokenizer as Qwen2Tokenizer,
# which cannot read the test's word-level tokenizer.)
@pytest.fixture(scope="module", params=["llama", "mistral", "qwen3"])
def reranker(request, tmp_path_factory):
    path = save_tiny_decoder_classifier(tmp_path_factory.mktemp(request.param),
                                        request.param)
    return path, LLM(model=str(path), dtype="float32")


def test_pair_scores_match_transformers(reranker):
    path, llm = reranker
    outs = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for (a, b), out in zip(PAIRS, outs):
        ids = tokenizer(a, b)["input_ids"]
        assert out.prompt_token_ids == ids
        expect = torch.sigmoid(_hf_logits(path, ids))[0].item()
        assert out.outputs.score == pytest.approx(expect, abs=1e-5)


def test_single_texts_score_as_reward(reranker):
    path, llm = reranker
    outs = llm.classify(["w1 w2 w3", "w7"], use_tqdm=False)
    for text, out in zip(["w1 w2 w3", "w7"], outs):
        ids = llm.get_tokenizer().encode(text)
        expect = torch.sigmoid(_hf_logits(path, ids)).tolist()
        assert out.outputs.probs == pytest.approx(expect, abs=1e-5)
    # LLM.encode: the model's own task ("score": one text as the pair's first) or
    # "classify", as LLM.classify reads it.
    for task in (None, "classify"):
        encoded = llm.encode(["w1 w2 w3", "w7"], use_tqdm=False, pooling_task=task)
        assert [e.outputs.data.tolist() for e in encoded] == [o.outputs.probs for o in outs]


def test_batching_and_prefix_hits_do_not_change_scores(reranker):
    path, _ = reranker
    llm = LLM(model=str(path), block_size=2, max_num_batched_tokens=8)  # default dtype
    pairs = PAIRS * 2  # the second round hits the prefix cache
    batched = llm.score([a for a, _ in pairs], [b for _, b in pairs], use_tqdm=False)
    alone = [llm.score(a, b, use_tqdm=False)[0] for a, b in PAIRS]
    assert [o.outputs.score for o in batched] == [o.outputs.score for o in alone] * 2


def test_what_a_classifier_does_not_do(reranker):
    _, llm = reranker
    with pytest.raises(InvalidRequestError, match="classification head"):
        llm.generate(["w1"], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="is not this model's"):
        llm.embed(["w1"])
    with pytest.raises(InvalidRequestError, match="pooling_type 'last'"):
        llm.embed(["w1"], PoolingParams(task="classify", pooling_type="mean",
                                        normalize=False))


def test_several_labels_classify(tmp_path):
    path = save_tiny_decoder_classifier(tmp_path, "qwen2", num_labels=3, seed=4)
    llm = LLM(model=str(path), dtype="float32")
    ids = [5, 6, 7, 200]
    out = llm.classify([{"prompt_token_ids": ids}], use_tqdm=False)[0]
    expect = torch.softmax(_hf_logits(path, ids), dim=-1).tolist()
    assert out.outputs.probs == pytest.approx(expect, abs=1e-5)
    with pytest.raises(InvalidRequestError, match="is not this model's"):
        llm.embed([{"prompt_token_ids": ids}], PoolingParams(task="score", normalize=False))
    # LLM.encode (vLLM's pooling call) of a classifier: its label probabilities.
    encoded = llm.encode([{"prompt_token_ids": ids}], use_tqdm=False)[0]
    assert encoded.outputs.data.tolist() == out.outputs.probs



@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}])
def test_parallel(reranker, parallel):
    """Two workers: under TP the decoder sharded and the head whole on each rank, under
    PP the last stage pooling and running the head; the same scores (up to the TP
    all-reduce's summation order)."""
    path, llm = reranker
    if "mistral" not in str(path):
        pytest.skip("one family is enough for the worker processes")
    expect = llm.score("w1 w2", ["w3", "w4 w5"], use_tqdm=False)
    got = LLM(model=str(path), dtype="float32", **parallel).score(
        "w1 w2", ["w3", "w4 w5"], use_tqdm=False)
    assert [o.outputs.score for o in got] == pytest.approx(
        [o.outputs.score for o in expect], abs=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_causal_lm_as_reranker(tmp_path, tied):
    """Qwen3-Reranker's way, through vLLM's hf_overrides: a causal LM's logit of "yes"
    minus its logit of "no" at the pair's last token, through a sigmoid (the 2-way
    softmax's probability of "yes"); with three tokens, a softmax over their logits.
    The rows come from the LM head, or the embedding it is tied to."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tests.utils import TINY_WORDS, save_tiny_model, word_tokenizer

    path = save_tiny_model(tmp_path, Qwen3Config(
        vocab_size=len(TINY_WORDS) + 2, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    word_tokenizer(TINY_WORDS + ["no", "yes"]).save_pretrained(path)
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    llm = LLM(model=str(path), dtype="float32", hf_overrides=overrides)
    causal = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    outs = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)
    for (a, b), out in zip(PAIRS, outs):
        with torch.no_grad():
            logits = causal(torch.tensor([tokenizer(a, b)["input_ids"]])).logits[0, -1]
        assert out.outputs.score == pytest.approx(
            torch.sigmoid(logits[yes] - logits[no]).item(), abs=1e-5)
    three = LLM(model=str(path), dtype="float32", hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes", "w7"]})
    probs = three.classify(["w1 w2"], use_tqdm=False)[0].outputs.probs
    with torch.no_grad():
        logits = causal(torch.tensor([tokenizer.encode("w1 w2")])).logits[0, -1]
    ids = tokenizer.convert_tokens_to_ids(["no", "yes", "w7"])
    assert probs == pytest.approx(torch.softmax(logits[ids], dim=-1).tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="'maybe' is not one token"):
        LLM(model=str(path), hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                           "classifier_from_token": ["no", "maybe"]})
