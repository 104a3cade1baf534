"""Sequence classifiers (BertForSequenceClassification): with one label a cross-encoder,
LLM.score's pair scores against transformers and sentence-transformers' CrossEncoder
(float32), the pair's token types, truncation, the pairing rules and what it refuses;
with several labels LLM.classify's probabilities against transformers' softmax; an
embedding model's scores are the cosine similarities of LLM.embed's vectors."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.errors import InvalidRequestError
from tests.utils import save_tiny_bert, save_tiny_cross_encoder

QUERIES = ["the cat sat on the mat", "paris is the capital of france", "hello"]
DOCS = ["a dog is playing guitar", "hello world", "the man is on the mat, the cat sat"]


@pytest.fixture(scope="module")
def sigmoid_dir(tmp_path_factory):
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("ce_sigmoid"))


@pytest.fixture(scope="module")
def identity_dir(tmp_path_factory):
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("ce_identity"), seed=1,
                                   activation="torch.nn.modules.linear.Identity")


def hf_scores(model_dir, pairs, activation, **tokenizer_kwargs) -> list[float]:
    from transformers import AutoTokenizer, BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scores = []
    with torch.no_grad():
        for a, b in pairs:  # one at a time: no padding
            logits = model(**tokenizer(a, b, return_tensors="pt", **tokenizer_kwargs)).logits
            scores.append(float(activation(logits[0, 0])))
    return scores


def test_scores_match_transformers(sigmoid_dir, identity_dir):
    pairs = list(zip(QUERIES, DOCS))
    for model_dir, activation in ((sigmoid_dir, torch.sigmoid), (identity_dir, lambda x: x)):
        llm = LLM(str(model_dir), dtype="float32")
        want = hf_scores(model_dir, pairs, activation)
        got = [o.outputs.score for o in llm.score(QUERIES, DOCS, use_tqdm=False)]
        assert got == pytest.approx(want, abs=1e-5)
        # One query against every document (1 -> N), batched with different lengths.
        one = llm.score(QUERIES[0], DOCS, use_tqdm=False)
        assert [o.outputs.score for o in one] == pytest.approx(
            hf_scores(model_dir, [(QUERIES[0], d) for d in DOCS], activation), abs=1e-5)
        assert len(set(round(s, 4) for s in got)) == len(got)  # not a constant
        llm.shutdown()


def test_scores_match_sentence_transformers(sigmoid_dir, identity_dir):
    from sentence_transformers import CrossEncoder

    pairs = list(zip(QUERIES, DOCS))
    for model_dir in (sigmoid_dir, identity_dir):
        want = CrossEncoder(str(model_dir), device="cpu").predict(pairs).tolist()
        llm = LLM(str(model_dir), dtype="float32")
        got = [o.outputs.score for o in llm.score(QUERIES, DOCS, use_tqdm=False)]
        assert got == pytest.approx(want, abs=1e-5)
        llm.shutdown()


def test_the_second_text_is_token_type_1(identity_dir):
    """The pair's prompt is the tokenizer's, and its token types matter: the score with
    every token of type 0 (a pair read as one text) is another."""
    llm = LLM(str(identity_dir), dtype="float32")
    out = llm.score(QUERIES[1], DOCS[1], use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    assert out.prompt_token_ids == tokenizer(QUERIES[1], DOCS[1])["input_ids"]
    flat = llm.embed([{"prompt_token_ids": out.prompt_token_ids}],
                     PoolingParams(task="score", pooling_type="cls", normalize=False),
                     use_tqdm=False)[0].outputs.embedding[0]
    assert abs(flat - out.outputs.score) > 1e-3
    llm.shutdown()


def test_truncation_cuts_the_longer_text_first(identity_dir):
    long = " ".join(["the cat sat on the mat"] * 20)  # past the 64 positions
    llm = LLM(str(identity_dir), dtype="float32")
    with pytest.raises(InvalidRequestError, match="maximum context length|max_model_len"):
        llm.score("hello", long, use_tqdm=False)
    got = llm.score("hello", long, truncate_prompt_tokens=32, use_tqdm=False)[0]
    assert len(got.prompt_token_ids) == 32
    want = hf_scores(identity_dir, [("hello", long)], lambda x: x,
                     truncation="longest_first", max_length=32)
    assert got.outputs.score == pytest.approx(want[0], abs=1e-5)
    llm.shutdown()


def test_pairing_rules_and_refusals(identity_dir, tmp_path):
    llm = LLM(str(identity_dir), dtype="float32")
    with pytest.raises(InvalidRequestError, match="give one text_1, or as many as text_2"):
        llm.score(QUERIES[:2], DOCS, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="text_2 must not be empty"):
        llm.score("hello", [], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="is a cross-encoder"):
        llm.embed(["hello"], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="does not support generation|embedding"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    # One label classifies a single text too (its one score: a reward model's use).
    single = llm.classify(["hello"], use_tqdm=False)[0].outputs.probs
    pair = llm.score("hello", ["world"], use_tqdm=False)[0].outputs.score
    assert len(single) == 1 and single[0] != pair
    llm.shutdown()


def test_embedding_models_score_by_cosine(tmp_path):
    llm = LLM(str(save_tiny_bert(tmp_path / "bert")), dtype="float32")
    scores = [o.outputs.score for o in llm.score(QUERIES[0], DOCS, use_tqdm=False)]
    vectors = [torch.tensor(o.outputs.embedding)
               for o in llm.embed([QUERIES[0], *DOCS], use_tqdm=False)]
    want = [float(torch.nn.functional.cosine_similarity(vectors[0], v, dim=0))
            for v in vectors[1:]]
    assert scores == pytest.approx(want, abs=1e-6)
    with pytest.raises(InvalidRequestError, match="task 'score' is not this model's"):
        llm.embed(["hello"], PoolingParams(task="score", pooling_type="cls",
                                           normalize=False), use_tqdm=False)
    llm.shutdown()


def test_classifiers_give_label_probabilities(tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification

    model_dir = save_tiny_cross_encoder(tmp_path / "three", num_labels=3)
    texts = QUERIES + DOCS
    llm = LLM(str(model_dir), dtype="float32")
    outs = llm.classify(texts, use_tqdm=False)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        for text, out in zip(texts, outs):
            want = torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits[0], -1)
            assert out.outputs.num_classes == 3
            assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)
    assert len({tuple(round(p, 4) for p in o.outputs.probs) for o in outs}) == len(texts)
    with pytest.raises(InvalidRequestError, match="is a classifier"):
        llm.embed(["hello"], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="is a classifier"):
        llm.score("a", "b", use_tqdm=False)
    llm.shutdown()
