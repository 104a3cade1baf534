"""BertModel (encoder-only embeddings) against transformers on a tiny random BERT, fp32:
mean / cls / last pooling of several texts in one batch, batch invariance, a `bert.`
prefixed checkpoint, the sentence-transformers pooling default, and the encoder rules
(no generation, no KV cache, no prefix hits, learned-position length limit)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm import LLM, InvalidRequestError, PoolingParams
from tests.utils import save_tiny_bert

MAX_POSITIONS = 64
TEXTS = ["The cat sat on the mat.", "Hello world", "Paris is the capital of France!",
         "a", "The man is playing guitar, the dog sat on a mat. Hello, hello world!"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"),
                          max_position_embeddings=MAX_POSITIONS)


@pytest.fixture(scope="module")
def llm(tiny_bert):
    return LLM(str(tiny_bert), dtype="float32")


def _hf_hidden(model_dir, texts, cls_name="BertModel"):
    """(token ids, transformers' last_hidden_state [L, H]) of each text, alone."""
    import transformers
    from transformers import AutoTokenizer

    model = getattr(transformers, cls_name).from_pretrained(model_dir,
                                                            dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            out.append((ids[0].tolist(), model(ids).last_hidden_state[0]))
    return out


@pytest.fixture(scope="module")
def hf_hidden(tiny_bert):
    return _hf_hidden(tiny_bert, TEXTS)


def _pool(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    vec = {"mean": lambda: hidden.mean(dim=0), "cls": lambda: hidden[0],
           "last": lambda: hidden[-1]}[pooling_type]()
    return torch.nn.functional.normalize(vec, dim=0)


def _assert_matches(outs, hf_hidden, pooling_type):
    for out, (ids, hidden) in zip(outs, hf_hidden, strict=True):
        # The tokenizer adds [CLS] ... [SEP] (ids 2 and 3 of the tiny vocabulary).
        assert out.prompt_token_ids == ids and ids[0] == 2 and ids[-1] == 3
        got, want = torch.tensor(out.outputs.embedding), _pool(hidden, pooling_type)
        assert got.shape == want.shape == (64,)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.9999
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling_type", ["mean", "cls", "last", None])
def test_embed_matches_transformers(llm, hf_hidden, pooling_type):
    """Every text in one batch (one step); None is BERT's default, mean."""
    outs = llm.embed(TEXTS, PoolingParams(pooling_type=pooling_type), use_tqdm=False)
    assert len({len(o.prompt_token_ids) for o in outs}) > 3  # lengths differ
    _assert_matches(outs, hf_hidden, pooling_type or "mean")


def test_embed_does_not_depend_on_batching(llm):
    """Each request attends within its own tokens: bit-identical alone, in a batch, and
    in a batch of another order and other neighbours."""
    for pooling_type in ("mean", "cls"):
        params = PoolingParams(pooling_type=pooling_type)
        alone = [llm.embed([t], params, use_tqdm=False)[0].outputs.embedding for t in TEXTS]
        together = [o.outputs.embedding for o in llm.embed(TEXTS, params, use_tqdm=False)]
        others = ["the dog", *TEXTS[::-1], "hello hello hello hello"]
        reordered = [o.outputs.embedding
                     for o in llm.embed(others, params, use_tqdm=False)][1:-1][::-1]
        assert together == alone
        assert reordered == alone


def test_bert_prefixed_checkpoint(tmp_path):
    """A task checkpoint (BertForMaskedLM: `bert.` names, a `cls.` head, no pooler)
    declared as BertModel loads its encoder and ignores the head."""
    from transformers import BertForMaskedLM

    src = save_tiny_bert(tmp_path / "base", seed=1)
    torch.manual_seed(1)
    mlm = BertForMaskedLM.from_pretrained(src)
    mlm.save_pretrained(tmp_path / "mlm")
    shutil.copy(src / "tokenizer.json", tmp_path / "mlm")
    shutil.copy(src / "tokenizer_config.json", tmp_path / "mlm")
    config = json.loads((tmp_path / "mlm" / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (tmp_path / "mlm" / "config.json").write_text(json.dumps(config))
    outs = LLM(str(tmp_path / "mlm"), dtype="float32").embed(TEXTS[:3], use_tqdm=False)
    _assert_matches(outs, _hf_hidden(tmp_path / "mlm", TEXTS[:3], "BertModel"), "mean")


def test_sentence_transformers_pooling_config(tiny_bert, hf_hidden, tmp_path):
    """modules.json + 1_Pooling/config.json choose the default pooling (here cls)."""
    model_dir = shutil.copytree(tiny_bert, tmp_path / "st_bert")
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": True,
         "pooling_mode_mean_tokens": False}))
    llm = LLM(str(model_dir), dtype="float32")
    assert llm.llm_engine.config.model.default_pooling_type == "cls"
    _assert_matches(llm.embed(TEXTS, use_tqdm=False), hf_hidden, "cls")


def test_encoder_keeps_no_kv_cache_and_takes_no_prefix_hits(llm):
    engine = llm.llm_engine
    assert engine.config.model.is_encoder_only
    assert not engine.config.cache.enable_prefix_caching
    assert engine.engine_core.executor.runner.kv_caches == []
    long_text = TEXTS[-1]
    first, again = (llm.embed([long_text], use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens == 0
    assert again.outputs.embedding == first.outputs.embedding
    kv = engine.engine_core.scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == engine.engine_core.num_blocks - 1


def test_encoder_rejects_generation_and_long_inputs(llm, tiny_bert):
    from pagedllm import SamplingParams

    with pytest.raises(ValueError, match="does not support generation"):
        llm.generate(["The cat"], SamplingParams(max_tokens=4), use_tqdm=False)
    # [CLS] + 63 words + [SEP] = 65 tokens > 64 learned positions.
    with pytest.raises(InvalidRequestError, match="maximum model length of 64"):
        llm.embed(["cat " * (MAX_POSITIONS - 1)], use_tqdm=False)
    with pytest.raises(ValueError, match="learned position"):
        LLM(str(tiny_bert), dtype="float32", max_model_len=MAX_POSITIONS + 1)
    with pytest.raises(ValueError, match="compile is not supported"):
        LLM(str(tiny_bert), dtype="float32", compile=True)
    # Still serving after the rejections; [CLS] + 62 + [SEP] = 64 fits.
    out = llm.embed(["cat " * (MAX_POSITIONS - 2)], use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == MAX_POSITIONS
    assert not llm.llm_engine.has_unfinished_requests()
