"""Decode-step CUDA graphs (worker/cuda_graphs.py) without a GPU: `eager_capture` stands
in for capture and re-runs the forward on the static buffers at each "replay", so the
bucketing, the padding rows and the static metadata (views of the buffers, per KV cache
group) are checked end to end on the triton backend under Triton's interpreter. That a
real capture replays the same thing is tests/cuda/'s job, on a GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import transformers as tf  # noqa: E402

pytest.importorskip("triton", reason="the triton backend needs the `triton` package")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.worker.cuda_graphs import DecodeGraphs, eager_capture, graph_buckets  # noqa: E402
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config  # noqa: E402

VOCAB = 256
MAX_NUM_SEQS = 8


def test_buckets_are_powers_of_two_then_steps_of_eight():
    assert graph_buckets(256) == [1, 2, 4, *range(8, 257, 8)]
    assert graph_buckets(12) == [1, 2, 4, 8, 12]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(1) == [1]


def test_vllms_capture_sizes_choose_the_buckets():
    """compilation_config's cudagraph_capture_sizes / max_cudagraph_capture_size
    (engine/compilation.py): sizes past max_num_seqs come down to it; a batch past the
    largest bucket runs eagerly."""
    assert graph_buckets(64, sizes=(3, 16, 100)) == [3, 16, 64]
    assert graph_buckets(256, max_size=20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(8, max_size=20) == [1, 2, 4, 8]
    graphs = DecodeGraphs(lambda ids, pos, md: ids.float()[:, None], max_num_seqs=32,
                          max_blocks_per_req=4, num_groups=1, max_model_len=64,
                          device=torch.device("cpu"), capture=eager_capture, sizes=(2, 6))
    assert graphs.buckets == [2, 6]
    assert [graphs.bucket_for(n, 1) for n in (1, 2, 3, 6, 7)] == [2, 2, 6, 6, None]


def test_staging_pads_to_the_bucket_with_null_block_rows():
    """3 decode requests in the 4-row bucket, two KV cache groups: the step's values in
    its rows, padding rows on the null block, the step's own sizes in its metadata."""
    seen = []

    def forward(input_ids, positions, md):
        seen.append(md)
        return (input_ids * 1000 + positions).float()[:, None]

    graphs = DecodeGraphs(forward, max_num_seqs=8, max_blocks_per_req=4, num_groups=2,
                          max_model_len=64, device=torch.device("cpu"),
                          capture=eager_capture)
    # One capture per bucket, largest first, on metadata marked static.
    assert [md.num_reqs for md in seen] == [8, 4, 2, 1]
    assert all(md.static_shapes and len(md.groups) == 2 for md in seen)
    # Requests 0..2: contexts 5, 17, 33 (their last token decodes now).
    seq_lens = np.array([5, 17, 33])
    tables = [(np.array([[3, 0, 0], [4, 5, 0], [6, 7, 8]], dtype=np.int32),
               np.array([3 * 16 + 4, 5 * 16 + 0, 8 * 16 + 0])),
              (np.array([[9, 0, 0], [0, 10, 0], [0, 0, 11]], dtype=np.int32),
               np.array([9 * 16 + 4, 10 * 16 + 0, 11 * 16 + 0]))]
    bucket = graphs.bucket_for(num_reqs=3, max_query_len=1)
    assert bucket == 4 and graphs.bucket_for(3, 2) is None and graphs.bucket_for(9, 1) is None
    ids, pos, md = graphs.stage(bucket, np.array([7, 8, 9]), seq_lens - 1,
                                np.arange(4), seq_lens, tables)
    assert ids.tolist() == [7, 8, 9] and pos.tolist() == [4, 16, 32]
    assert (md.num_reqs, md.max_query_len, md.max_seq_len) == (3, 1, 33)
    assert md.groups[1].block_table.tolist() == tables[1][0].tolist()
    dev = graphs.dev
    assert dev["seq_lens"][:4].tolist() == [5, 17, 33, 1]
    assert dev["input_ids"][:4].tolist() == [7, 8, 9, 0]
    assert dev["slot_mappings"][:, 3].tolist() == [0, 0]  # padding: the null block
    assert dev["block_tables"][:, 3].abs().sum() == 0
    assert graphs.replay(bucket, 3)[:, 0].tolist() == [7004, 8016, 9032]


MODELS = {
    "llama": lambda: tiny_llama_config(vocab_size=VOCAB),
    # Alternating full and 12-token window layers: two KV cache groups, each with its
    # own block table and slots in the static buffers.
    "gemma2": lambda: tf.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, max_position_embeddings=256, sliding_window=12,
        bos_token_id=None, eos_token_id=None, pad_token_id=None),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_path(request, tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp(request.param), MODELS[request.param]())


def _engine(path, async_scheduling: bool = False) -> LLM:
    from pagedllm.attention.triton.ops import kernels_interpreted

    if not torch.cuda.is_available() and not kernels_interpreted():
        pytest.skip("pagedllm.attention.triton was imported before TRITON_INTERPRET=1")
    # num_kv_blocks: the interpreter copies every tensor argument, so keep the cache small.
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True,
               attention_backend="triton", block_size=16, num_kv_blocks=64,
               max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=32, enforce_eager=True,
               async_scheduling=async_scheduling)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_replayed_decode_steps_equal_eager_ones(model_path, async_scheduling):
    # 5 requests of mixed lengths under a 32-token budget: the first steps mix prefill
    # chunks and decodes (eager), later ones are decode-only: 5 rows replayed in the
    # 8-row bucket (3 padding rows). Async scheduling: the placeholders of each replayed
    # step are filled in the static input buffer from the step before's sampled ids.
    prompts = random_prompts(5, VOCAB, 3, 24, seed=5)
    expected = _generate(_engine(model_path), prompts)

    llm = _engine(model_path, async_scheduling)
    runner = llm.llm_engine.engine_core.executor.runner
    assert runner.graphs is None  # enforce_eager
    graphs = DecodeGraphs(runner._forward, MAX_NUM_SEQS, runner.input_batch.block_tables.shape[2],
                          runner.kv_layout.num_groups, runner.max_model_len, runner.device,
                          eager_capture)
    buckets_run = []
    replay = graphs.replay

    def counting_replay(bucket, num_reqs):
        buckets_run.append(bucket)
        return replay(bucket, num_reqs)

    graphs.replay = counting_replay
    runner.graphs = graphs
    assert _generate(llm, prompts) == expected
    assert 8 in buckets_run  # the padded batch replayed
    # A lone request: the 1-row bucket.
    assert _generate(llm, prompts[:1]) == expected[:1]
    assert buckets_run[-1] == 1
