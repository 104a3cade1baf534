"""LLM.embed: pooled final hidden states of a tiny random Llama against transformers',
batching invariance, prefix-cache hits under mean pooling, and bad pooling params."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, EmbeddingRequestOutput, InvalidRequestError, PoolingParams
from pagedllm import SamplingParams
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    cfg = tiny_llama_config(vocab_size=VOCAB)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama_embed"), cfg)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, VOCAB, 3, 41, seed=7)


@pytest.fixture(scope="module")
def hf_hidden(tiny_llama, prompts):
    """transformers' last hidden state (after the final norm) of each prompt, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            hs = model(torch.tensor([p]), output_hidden_states=True).hidden_states
            # hidden_states[-1] is the final norm's output (LlamaModel applies the norm
            # before appending it), the same tensor lm_head reads.
            out.append(hs[-1][0].float())  # [L, H]
    return out


def _pool(hidden: torch.Tensor, pooling_type: str, normalize: bool) -> torch.Tensor:
    vec = {"last": lambda: hidden[-1], "mean": lambda: hidden.mean(dim=0),
           "cls": lambda: hidden[0]}[pooling_type]()
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def _llm(path, **kw):
    kw.setdefault("dtype", "float32")
    return LLM(str(path), skip_tokenizer_init=True, **kw)


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("backend", ["torch_ref", "cpu"])
@pytest.mark.parametrize("pooling_type,normalize",
                         [("last", True), ("mean", True), ("cls", True), ("last", False)])
def test_embed_matches_transformers(tiny_llama, prompts, hf_hidden, backend, pooling_type,
                                    normalize):
    llm = _llm(tiny_llama, attention_backend=backend)
    outs = llm.embed(_ids(prompts), PoolingParams(pooling_type=pooling_type,
                                                  normalize=normalize), use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts
    for out, hidden in zip(outs, hf_hidden):
        got = torch.tensor(out.outputs.embedding)
        want = _pool(hidden, pooling_type, normalize)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        if normalize:
            assert abs(got.norm().item() - 1.0) < 1e-5


def test_embed_does_not_depend_on_batching(tiny_llama, prompts):
    """Bit-identical in float32 whether a prompt runs alone, with other embeddings, or
    beside generate requests (decodes and prefills in the same steps)."""
    llm = _llm(tiny_llama)
    for pooling_type in ("last", "mean"):
        params = PoolingParams(pooling_type=pooling_type)
        alone = [llm.embed(_ids([p]), params, use_tqdm=False)[0].outputs.embedding
                 for p in prompts]
        together = [o.outputs.embedding
                    for o in llm.embed(_ids(prompts), params, use_tqdm=False)]
        assert together == alone
        # Mixed: generate requests already decoding when the embeddings arrive.
        engine = llm.llm_engine
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for i, p in enumerate(prompts[:3]):
            engine.add_request(f"gen-{pooling_type}-{i}", {"prompt_token_ids": p[::-1]}, sp)
        engine.step()
        for i, p in enumerate(prompts):
            engine.add_request(f"emb-{pooling_type}-{i}", {"prompt_token_ids": p}, params)
        mixed: dict[str, list[float]] = {}
        kinds = set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                kinds.add(type(out).__name__)
                if isinstance(out, EmbeddingRequestOutput):
                    mixed[out.request_id] = out.outputs.embedding
        assert kinds == {"RequestOutput", "EmbeddingRequestOutput"}
        assert [mixed[f"emb-{pooling_type}-{i}"] for i in range(len(prompts))] == alone


def test_mean_pooling_with_cached_prefix(tiny_llama, hf_hidden, prompts):
    """A prefix cached by an earlier request is recomputed for a mean- or cls-pooled
    request (every position, or the first, is pooled); last pooling may use the hits."""
    llm = _llm(tiny_llama, block_size=4)
    long_prompt = max(prompts, key=len)
    hidden = hf_hidden[prompts.index(long_prompt)]
    llm.generate(_ids([long_prompt]), SamplingParams(max_tokens=1), use_tqdm=False)
    for pooling_type in ("mean", "cls", "last"):
        out = llm.embed(_ids([long_prompt]), PoolingParams(pooling_type=pooling_type),
                        use_tqdm=False)[0]
        if pooling_type != "last":
            assert out.num_cached_tokens == 0
        else:
            assert out.num_cached_tokens > 0
        torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                                   _pool(hidden, pooling_type, True), atol=TOL, rtol=0)
    assert not llm.llm_engine.has_unfinished_requests()


def test_embedding_requests_free_their_blocks(tiny_llama, prompts):
    llm = _llm(tiny_llama, enable_prefix_caching=False)
    llm.embed(_ids(prompts), use_tqdm=False)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == llm.llm_engine.engine_core.num_blocks - 1


@pytest.mark.parametrize("kwargs,field", [
    ({"pooling_type": "max"}, "pooling_type"),
    ({"normalize": "yes"}, "normalize"),
    ({"dimensions": 0}, "dimensions"),
    ({"dimensions": True}, "dimensions"),
    ({"dimensions": 8, "task": "classify"}, "dimensions applies to embeddings"),
    ({"use_activation": 1}, "use_activation"),
    ({"normalize": True, "use_activation": False}, "disagree"),
])
def test_bad_pooling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PoolingParams(**kwargs)


def test_bad_embed_calls(tiny_llama):
    llm = _llm(tiny_llama, max_num_batched_tokens=32, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        llm.embed(_ids([list(range(40))]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="maximum model length"):
        llm.embed(_ids([[1] * 65]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed(_ids([[]]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="PoolingParams"):
        llm.embed(_ids([[1, 2]]), [SamplingParams()], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="does not support Matryoshka"):
        llm.embed(_ids([[1, 2]]), PoolingParams(dimensions=8), use_tqdm=False)
    # The engine still serves after the rejections.
    assert len(llm.embed(_ids([[1, 2, 3]]), use_tqdm=False)[0].outputs.embedding) == 64
    assert not llm.llm_engine.has_unfinished_requests()


def test_encode_is_vllms_pooling_call(tiny_llama, prompts, hf_hidden):
    """LLM.encode: the pooled output as a tensor; "embed" (this model's own task, the
    default) is LLM.embed's; other pooling tasks are refused by name."""
    llm = _llm(tiny_llama)
    outs = llm.encode(_ids(prompts[:3]), use_tqdm=False)
    embedded = llm.embed(_ids(prompts[:3]), use_tqdm=False)
    for out, emb, hidden in zip(outs, embedded, hf_hidden):
        assert isinstance(out.outputs.data, torch.Tensor)
        assert out.outputs.data.dtype == torch.float32
        assert out.outputs.data.tolist() == emb.outputs.embedding
        torch.testing.assert_close(out.outputs.data, _pool(hidden, "last", True),
                                   atol=TOL, rtol=0)
    raw = llm.encode(_ids(prompts[:1]), PoolingParams(pooling_type="mean", normalize=False),
                     pooling_task="embed", use_tqdm=False)[0]
    torch.testing.assert_close(raw.outputs.data, _pool(hf_hidden[0], "mean", False),
                               atol=TOL, rtol=0)
    with pytest.raises(InvalidRequestError, match="is not this model's"):
        llm.encode(_ids(prompts[:1]), pooling_task="classify", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="per-token tasks are not supported"):
        llm.encode(_ids(prompts[:1]), pooling_task="token_embed", use_tqdm=False)


@pytest.mark.parametrize("paraphrase_a,paraphrase_b,unrelated", [
    ("A man is playing a guitar.", "A person plays the guitar.",
     "The stock market fell sharply today."),
    ("How do I bake bread at home?", "What is a good recipe for homemade bread?",
     "The planet Jupiter has many moons."),
    ("The weather is sunny and warm today.", "It is a warm, sunny day.",
     "He forgot his password again."),
])
def test_smollm2_paraphrases_are_closer(default_llm, paraphrase_a, paraphrase_b, unrelated):
    """A sanity check, not a quality claim: with the default last-token pooling, the
    bundled SmolLM2 puts two paraphrases closer (cosine) than either is to an
    unrelated sentence (measured margins 0.1-0.2)."""
    outs = default_llm.embed([paraphrase_a, paraphrase_b, unrelated], use_tqdm=False)
    a, b, c = (torch.tensor(o.outputs.embedding) for o in outs)
    assert a @ b > max(a @ c, b @ c)
