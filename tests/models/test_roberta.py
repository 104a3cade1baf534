"""RoBERTa-family encoders (XLM-RoBERTa: bge-m3, multilingual-e5, bge-reranker-v2-m3)
against transformers on tiny random models (float32): embeddings at every position up
to the last learned one (positions counted from padding_idx + 1), cross-encoder scores
(also against sentence-transformers' CrossEncoder) and classifier probabilities."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.errors import InvalidRequestError
from tests.utils import ROBERTA_CORPUS, save_tiny_roberta


def test_embeddings_match_transformers(tmp_path):
    from transformers import AutoTokenizer, XLMRobertaModel

    path = save_tiny_roberta(tmp_path, "XLMRobertaModel")
    tokenizer = AutoTokenizer.from_pretrained(path)
    long = " ".join(ROBERTA_CORPUS * 3)
    ids = tokenizer(long)["input_ids"][:63] + [tokenizer.eos_token_id]  # 64: every row
    prompts = ROBERTA_CORPUS + [{"prompt_token_ids": ids}]
    llm = LLM(str(path), dtype="float32")
    assert llm.llm_engine.config.model.max_model_len == 64  # 66 rows - (pad 1 + 1)
    outs = llm.embed(prompts, use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        llm.embed([{"prompt_token_ids": ids + [5]}], use_tqdm=False)
    llm.shutdown()
    model = XLMRobertaModel.from_pretrained(path).eval()
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            x = (torch.tensor([prompt["prompt_token_ids"]]) if isinstance(prompt, dict)
                 else tokenizer(prompt, return_tensors="pt").input_ids)
            assert out.prompt_token_ids == x[0].tolist()
            want = torch.nn.functional.normalize(model(x).last_hidden_state[0].mean(0), dim=0)
            assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-5)


def test_cross_encoder_matches_transformers_and_sentence_transformers(tmp_path):
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, XLMRobertaForSequenceClassification

    path = save_tiny_roberta(tmp_path, "XLMRobertaForSequenceClassification")
    query = "the cat sat"
    llm = LLM(str(path), dtype="float32")
    got = [o.outputs.score for o in llm.score(query, ROBERTA_CORPUS, use_tqdm=False)]
    llm.shutdown()
    model = XLMRobertaForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        want = [float(torch.sigmoid(model(**tokenizer(query, d, return_tensors="pt"))
                                    .logits[0, 0])) for d in ROBERTA_CORPUS]
    assert got == pytest.approx(want, abs=1e-5)
    assert len({round(s, 4) for s in got}) == len(got)
    st = CrossEncoder(str(path), device="cpu").predict([(query, d) for d in ROBERTA_CORPUS])
    assert got == pytest.approx(st.tolist(), abs=1e-5)


def test_classifier_matches_transformers(tmp_path):
    from transformers import AutoTokenizer, XLMRobertaForSequenceClassification

    path = save_tiny_roberta(tmp_path, "XLMRobertaForSequenceClassification", num_labels=4)
    llm = LLM(str(path), dtype="float32")
    outs = llm.classify(ROBERTA_CORPUS, use_tqdm=False)
    llm.shutdown()
    model = XLMRobertaForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        for text, out in zip(ROBERTA_CORPUS, outs):
            want = torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits[0], -1)
            assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)
