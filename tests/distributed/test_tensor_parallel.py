"""Tensor parallelism through `LLM`: tp=2 worker processes (gloo on CPU) against tp=1.

Greedy outputs must be token-for-token those of one worker in float32, for GQA with
more ranks than KV heads (replicated KV heads), GQA with KV heads split, and Qwen2's q/k/v
bias; also under chunked prefill with prefix-cache hits, with logprobs and prompt
logprobs. A worker that dies or fails makes generate raise promptly, and shutting down
(or dropping the LLM) leaves no worker process behind.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.contracts import CachedRequestData, SchedulerOutput
from pagedllm.errors import EngineDeadError
from tests.distributed.helpers import (MAX_NEW, assert_logprobs_close, generate, token_ids,
                                       worker_processes)
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


MODELS = {
    # 4 q heads, 1 KV head: with tp=2 each rank keeps a copy of the KV head.
    "llama_kv_replicated": lambda: tiny_llama_config(num_key_value_heads=1),
    # 4 q heads, 2 KV heads: one KV head per rank.
    "llama_kv_split": lambda: tiny_llama_config(num_key_value_heads=2),
    # q/k/v bias (column-parallel bias slices) and a tied, vocab-parallel head.
    "qwen2": _qwen2_config,
}


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    return {name: save_tiny_model(tmp_path_factory.mktemp(name), make())
            for name, make in MODELS.items()}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, VOCAB, 3, 30, seed=3)


def _make_llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, **kw)





@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_parity(model_paths, prompts, name):
    with_one = token_ids(generate(_make_llm(model_paths[name]), prompts))
    llm = _make_llm(model_paths[name], tensor_parallel_size=2)
    assert llm.llm_engine.config.parallel.distributed_executor_backend == "mp"
    assert len(worker_processes()) == 2
    try:
        assert token_ids(generate(llm, prompts)) == with_one
    finally:
        if name == "qwen2":
            # Dropping the LLM (no shutdown call) stops the workers too.
            del llm
            gc.collect()
        else:
            llm.shutdown()
    assert worker_processes() == []


def test_chunked_prefill_prefix_hits_and_logprobs(model_paths, prompts):
    # 7 tokens per step: prompts are prefilled in chunks; 4-token blocks: the shared
    # 16-token prefix is 4 full blocks that later requests take from the prefix cache.
    shared = random_prompts(1, VOCAB, 16, 16, seed=11)[0]
    suffixed = [shared + p[:5] for p in prompts[:4]]
    kw = dict(block_size=4, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=2)
    # Prompt logprobs bypass the prefix cache; asked for separately.
    prompt_params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    path = model_paths["llama_kv_replicated"]
    results = []
    for tp in (1, 2):
        llm = _make_llm(path, tensor_parallel_size=tp, **kw)
        try:
            results.append((generate(llm, [shared + [1]], params),
                            generate(llm, suffixed, params),
                            generate(llm, prompts[:3], prompt_params)))
        finally:
            llm.shutdown()
    (ref_first, ref, ref_prompt), (first, outs, prompt_outs) = results
    assert token_ids(first) == token_ids(ref_first)
    assert token_ids(outs) == token_ids(ref)
    assert [o.num_cached_tokens for o in outs] == [16] * 4
    for ours, theirs in zip(first + outs, ref_first + ref):
        assert_logprobs_close(ours.outputs[0].logprobs, theirs.outputs[0].logprobs)
    for ours, theirs in zip(prompt_outs, ref_prompt):
        assert ours.prompt_logprobs[0] is None
        assert_logprobs_close(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:])



def test_killed_worker_failsgenerate(model_paths, prompts):
    llm = _make_llm(model_paths["llama_kv_split"], tensor_parallel_size=2)
    try:
        generate(llm, prompts[:2])
        workers = worker_processes()
        assert len(workers) == 2
        os.kill(workers[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker"):
            generate(llm, prompts)
        assert time.monotonic() - start < 30
        # The executor stays dead: a new call fails at once instead of hanging.
        with pytest.raises(EngineDeadError):
            generate(llm, prompts[:1])
    finally:
        llm.shutdown()
    assert worker_processes() == []


def test_failing_worker_raises(model_paths, prompts):
    llm = _make_llm(model_paths["llama_kv_split"], tensor_parallel_size=2)
    generate(llm, prompts[:2])
    # A step naming a request the workers never saw: every rank raises KeyError.
    bad = SchedulerOutput(scheduled_new_reqs=[], num_scheduled_tokens={"nope": 1},
                          scheduled_cached_reqs=[CachedRequestData("nope", [], 0)],
                          total_num_scheduled_tokens=1)
    with pytest.raises(EngineDeadError, match="KeyError"):
        llm.llm_engine.engine_core.executor.execute_model(bad)
    assert worker_processes() == []
    llm.shutdown()  # after a failure: a no-op that must not raise


@pytest.mark.parametrize("kw, match", [
    (dict(tensor_parallel_size=3), r"attention heads \(4\) must be divisible by tensor "
                                   r"parallel size \(3\)"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be >= 1"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "use 'mp' or 'ray'"),
    (dict(distributed_executor_backend="slurm"), "must be one of"),
])
def test_invalid_parallel_configs(model_paths, kw, match):
    with pytest.raises(ValueError, match=match):
        _make_llm(model_paths["llama_kv_split"], **kw)
    assert worker_processes() == []
