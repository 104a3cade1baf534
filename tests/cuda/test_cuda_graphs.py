"""Decode-step CUDA graphs (worker/cuda_graphs.py) on a real GPU: a tiny Llama's greedy
tokens with graphs (the default on CUDA) equal its tokens with enforce_eager=True, in
float32 and bfloat16, for 1, 3 and 9 requests (9 rows replay in the 16-row bucket, 7 of
them padding), and with chunked prefill and prefix-cache hits forced as in
tests/engine/test_triton_engine.py. float32 also equals transformers on the same GPU.

bfloat16: a padded bucket may pick other GEMM tiles and the captured attention never
splits the KV (md.static_shapes), so rounding may differ from the eager step's. Tokens
must still be equal, except where the eager run's own top-2 logprobs were a tie within
bfloat16 rounding at the first differing token (after which the two continuations are
unrelated); at most one such request per batch.
"""

from __future__ import annotations

import pytest

from tests.cuda.helpers import (CUDA_MARKS, TINY_ENGINE_KW, free_cuda, hf_greedy_no_eos_cuda,
                                hf_model_cuda, runner_of)
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

pytestmark = CUDA_MARKS

VOCAB = 256
MAX_NEW = 16
# bfloat16 has 8 significant bits: logprobs this close are a tie its rounding can flip.
BF16_TIE = 0.05


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama_graphs"),
                           tiny_llama_config(vocab_size=VOCAB))


class Run:
    """One engine's outputs for a list of prompt lists (each list one generate call)."""

    def __init__(self, path, dtype: str, batches: list[list[list[int]]], logprobs: bool,
                 **engine_kw) -> None:
        from pagedllm import LLM, SamplingParams

        llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True,
                  **{**TINY_ENGINE_KW, **engine_kw})
        runner, run = runner_of(llm), None
        self.graphs_on = getattr(runner, "graphs", None) is not None
        self.buckets_replayed: list[int] = []
        if self.graphs_on:
            run = runner.graphs.replay

            def counting_replay(bucket, num_reqs):
                self.buckets_replayed.append(bucket)
                return run(bucket, num_reqs)

            runner.graphs.replay = counting_replay
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                logprobs=2 if logprobs else None)
        self.tokens, self.logprobs, self.num_cached = [], [], []
        try:
            for prompts in batches:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
                self.tokens.append([o.outputs[0].token_ids for o in outs])
                self.logprobs.append([o.outputs[0].logprobs for o in outs])
                self.num_cached.append([o.num_cached_tokens for o in outs])
        finally:
            del llm, runner, run
            free_cuda()


def _assert_same_tokens(graph: Run, eager: Run, dtype: str) -> None:
    for b, (g_batch, e_batch) in enumerate(zip(graph.tokens, eager.tokens)):
        if dtype == "float32":
            assert g_batch == e_batch, f"batch {b}"
            continue
        ties = 0
        for r, (g, e) in enumerate(zip(g_batch, e_batch)):
            if g == e:
                continue
            j = next(i for i, (x, y) in enumerate(zip(g, e)) if x != y)
            step = eager.logprobs[b][r][j]  # the eager run's chosen token + top-2
            gap = step[e[j]].logprob - step[g[j]].logprob if g[j] in step else float("inf")
            assert gap <= BF16_TIE, (f"batch {b} request {r}: tokens differ at {j} "
                                     f"({g[j]} vs eager {e[j]}), logprob gap {gap:.3f}")
            ties += 1
        assert ties <= 1, f"batch {b}: {ties} requests differ"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_tokens_equal_eager_tokens(tiny_llama, dtype):
    # 1, 3 and 9 requests of mixed lengths: buckets 1, 4 and 16 (9 > 8: padded to 16).
    batches = [random_prompts(n, VOCAB, 3, 40, seed=n) for n in (1, 3, 9)]
    logprobs = dtype != "float32"
    graph = Run(tiny_llama, dtype, batches, logprobs)
    eager = Run(tiny_llama, dtype, batches, logprobs, enforce_eager=True)
    assert graph.graphs_on and not eager.graphs_on
    assert {1, 4, 16} <= set(graph.buckets_replayed), graph.buckets_replayed
    assert not eager.buckets_replayed
    _assert_same_tokens(graph, eager, dtype)
    assert all(len(t) == MAX_NEW for batch in graph.tokens for t in batch)
    if dtype == "float32":
        hf = hf_model_cuda(tiny_llama)
        try:
            reference = [[hf_greedy_no_eos_cuda(hf, p, MAX_NEW) for p in prompts]
                         for prompts in batches]
        finally:
            del hf
            free_cuda()
        assert graph.tokens == reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_with_chunked_prefill_and_prefix_hits(tiny_llama, dtype):
    """tests/engine/test_triton_engine.py's regime: prompts share a 32-token prefix that
    one earlier request cached; 12-token steps split every prompt into chunks over the
    cached blocks; the decode steps after them replay graphs."""
    shared = random_prompts(1, VOCAB, 32, 32, seed=7)[0]
    prompts = [shared + p for p in random_prompts(3, VOCAB, 1, 21, seed=1)]
    batches = [[shared + [1]], prompts]
    kw = dict(max_num_batched_tokens=12, num_kv_blocks=48)
    graph = Run(tiny_llama, dtype, batches, dtype != "float32", **kw)
    eager = Run(tiny_llama, dtype, batches, dtype != "float32", enforce_eager=True, **kw)
    assert graph.num_cached[1] == eager.num_cached[1] == [32, 32, 32]
    assert graph.graphs_on and graph.buckets_replayed
    _assert_same_tokens(graph, eager, dtype)
    if dtype == "float32":
        torch_ref = Run(tiny_llama, dtype, batches, False, attention_backend="torch_ref",
                        enforce_eager=True, **kw)
        assert graph.tokens == torch_ref.tokens


def test_async_scheduling_equals_sync_scheduling(tiny_llama):
    """Async scheduling, the default on CUDA (each step launched while the one before
    runs, its placeholders filled on the device from that step's sampled ids, in the
    replayed graphs' static buffers), against async_scheduling=False: the same tokens,
    finish reasons and logprobs in float32, for 9 requests of different lengths, with
    a stop id that ends some of them early (each then wastes one launched token)."""
    from pagedllm import LLM, SamplingParams

    prompts = random_prompts(9, VOCAB, 3, 40, seed=11)

    def run(async_scheduling, stop_token_ids=()):
        llm = LLM(str(tiny_llama), dtype="float32", skip_tokenizer_init=True,
                  async_scheduling=async_scheduling, **TINY_ENGINE_KW)
        try:
            core = llm.llm_engine.engine_core
            assert core.async_scheduling is (async_scheduling is not False)
            assert runner_of(llm).graphs is not None
            params = [SamplingParams(temperature=0, max_tokens=4 + i, logprobs=2,
                                     stop_token_ids=list(stop_token_ids))
                      for i in range(len(prompts))]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            return ([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs],
                    [[{t: lp.logprob for t, lp in step.items()}
                      for step in o.outputs[0].logprobs] for o in outs])
        finally:
            del llm
            free_cuda()

    plain, _ = run(False)
    stop = plain[-1][0][2]  # a token the longest request produces third
    expected, expected_lp = run(False, [stop])
    assert any(reason == "stop" for _, reason in expected)
    actual, actual_lp = run(None, [stop])
    assert actual == expected
    for a_req, e_req in zip(actual_lp, expected_lp):
        for a, e in zip(a_req, e_req, strict=True):
            assert a.keys() == e.keys()
            assert all(abs(a[t] - e[t]) <= 1e-4 for t in a)
