"""Greedy parity with transformers on a tiny random Llama, under every scheduling regime
that must not change outputs: plain batching, chunked prefill, preemption, prefix hits."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import hf_greedy, random_prompts, save_tiny_model, tiny_llama_config

MAX_NEW = 16
VOCAB = 256


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    cfg = tiny_llama_config(vocab_size=VOCAB)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), cfg)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, VOCAB, 3, 41, seed=1)


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    return hf_greedy(tiny_llama, prompts, MAX_NEW)


def _generate(model_path, prompts, **engine_kw):
    llm = LLM(str(model_path), dtype="float32", skip_tokenizer_init=True, **engine_kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("backend", ["torch_ref", "cpu"])
def test_default_settings(tiny_llama, prompts, reference, backend):
    _, outs = _generate(tiny_llama, prompts, attention_backend=backend)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts


@pytest.mark.parametrize("backend", ["torch_ref", "cpu"])
def test_chunked_prefill(tiny_llama, prompts, reference, backend):
    # 10 tokens per step: every prompt longer than that is split across steps.
    _, outs = _generate(tiny_llama, prompts, max_num_batched_tokens=10,
                        attention_backend=backend)
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("backend", ["torch_ref", "cpu"])
def test_preemption(tiny_llama, prompts, reference, backend):
    # 4-token blocks, 24 usable: far fewer than 8 requests of up to 57 tokens need.
    llm, outs = _generate(tiny_llama, prompts, block_size=4, num_kv_blocks=25,
                          attention_backend=backend)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_prefix_cache_hits(tiny_llama, prompts, reference):
    shared = random_prompts(1, VOCAB, 32, 32, seed=7)[0]  # two full 16-token blocks
    suffixed = [shared + p[:5] for p in prompts[:4]]
    ref = hf_greedy(tiny_llama, suffixed, MAX_NEW)
    llm = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    first = llm.generate([{"prompt_token_ids": shared + [1]}], params, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in suffixed], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in outs] == [32] * 4
    # The same prompts again: all but the last (partial) block come from the cache.
    again = llm.generate([{"prompt_token_ids": p} for p in suffixed], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == ref
    # LLM.reset_prefix_cache (vLLM's): afterwards the first prompt is computed afresh
    # (the others share its blocks, cached as it is scheduled), the outputs the same.
    assert llm.reset_prefix_cache()
    fresh = llm.generate([{"prompt_token_ids": p} for p in suffixed], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in fresh] == [0, 32, 32, 32]
    assert [o.outputs[0].token_ids for o in fresh] == ref
