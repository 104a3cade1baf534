"""An offline engine with data parallel replicas (`LLM(data_parallel_size=2)`): two
engine-core processes, each pinned to its core, both taking prompts; tokens and
logprobs those of one in-process engine; n > 1 samples, embeddings, utilities (prefix
cache reset, sleep, collective_rpc) over both; nothing left running after shutdown or
after the LLM is dropped."""

from __future__ import annotations

import gc
import os

import psutil
import pytest

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.engine.dp_placement import physical_cores
from pagedllm.errors import ConfigError
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

pytestmark = pytest.mark.skipif(
    len(physical_cores(os.sched_getaffinity(0))) < 2,
    reason="two replicas need two physical cores")

VOCAB = 256


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("dp_offline"),
                           tiny_llama_config(vocab_size=VOCAB))


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(8, VOCAB, 20, 60, seed=4)]


def _replica_processes(llm) -> list[psutil.Process]:
    return [psutil.Process(c.proc.pid) for c in llm.llm_engine.engine_core.client.clients]


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _worker_pid(worker) -> int:
    return os.getpid()


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
               **kw)


def test_replicas_give_the_one_engine_outputs(model_path, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    sampled = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7)
    one = _llm(model_path)
    want = one.generate(prompts, greedy, use_tqdm=False)
    want_n = one.generate(prompts[:2], sampled, use_tqdm=False)
    want_vec = one.embed(prompts[:3], PoolingParams(pooling_type="mean"), use_tqdm=False)
    one.shutdown()

    llm = _llm(model_path, data_parallel_size=2)
    core = llm.llm_engine.engine_core
    procs = _replica_processes(llm)
    try:
        # Each replica on its own core.
        assert sorted(len(p.cpu_affinity()) for p in procs) == [1, 1]
        assert procs[0].cpu_affinity() != procs[1].cpu_affinity()
        got = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids
                                                         for o in want]
        for ours, theirs in zip(got, want):
            for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
        # Both replicas took prompts.
        replicas = core._call("get_stats")["replicas"]
        assert all(r["prefix_cache_queries"] > 0 for r in replicas)
        got_n = llm.generate(prompts[:2], sampled, use_tqdm=False)
        assert ([[c.token_ids for c in o.outputs] for o in got_n]
                == [[c.token_ids for c in o.outputs] for o in want_n])
        vecs = llm.embed(prompts[:3], PoolingParams(pooling_type="mean"), use_tqdm=False)
        for a, b in zip(vecs, want_vec):
            assert a.outputs.embedding == pytest.approx(b.outputs.embedding, abs=1e-6)
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.reset_prefix_cache() is True
        # collective_rpc reaches every replica's worker.
        pids = llm.collective_rpc(_worker_pid)
        assert sorted(pids) == sorted(p.pid for p in procs)
        with pytest.raises(ConfigError, match="profiling is off"):
            llm.start_profile()
        with pytest.raises(ConfigError, match="data parallel"):
            llm.llm_engine.update_weights({})
        # The engine serves on after the refusals.
        again = llm.generate(prompts[:2], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids
                                                           for o in want[:2]]
    finally:
        llm.shutdown()
    assert _alive(procs) == []


def test_sleep_and_dropping_the_llm(model_path, prompts):
    llm = _llm(model_path, data_parallel_size=2, enable_sleep_mode=True)
    before = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)
    llm.sleep(level=1)
    assert llm.llm_engine.is_sleeping()
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping()
    after = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=6),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids
                                                       for o in before]
    procs = _replica_processes(llm)
    del llm
    gc.collect()
    gone, alive = psutil.wait_procs(procs, timeout=30)
    assert alive == []
