"""GGUF weights kept as blocks under tensor parallelism: each rank holds its rows of the
column-parallel projections (q / k / v heads, gate / up), its columns of the row-parallel
ones where they fall on whole blocks (else that weight runs dense), and its vocabulary
slice of the quantized embedding tied as the LM head; the sharded model's logits match
the one-rank quantized model's, and LLM with two worker processes its greedy tokens
(two pipeline stages: the very same tokens).

The tiny Llama of tests/models/test_gguf_quantized.py (hidden 64, MLP 160, Q8_0 / Q4_0 /
Q4_1 blocks, mixed-type qkv, F16 shards): with two ranks o_proj's 32 columns are one
block of 32, down_proj's 80 are not whole blocks.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.distributed.parallel_state import SINGLE_RANK
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kernels.cpu.quant import packed_qtype
from tests.distributed.helpers import worker_processes
from tests.distributed.ranks import run_ranks
from tests.distributed.test_tp_models import _LOAD_LOCK, _sequence_logits
from tests.models.test_gguf_quantized import VOCAB, _generate, write_tiny_llama
from tests.utils import pagedllm_sequence_logprobs, random_prompts

# Logprobs of the sharded and the whole quantized model: the row-parallel sums split in
# two and their activations quantized per rank's columns (measured over 4 prompts of 30
# tokens: 0.027-0.039 at most; the native model against its dequantized self: 0.047).
LOGPROB_ATOL = 0.1


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_gguf") / "tiny-llama.gguf"
    write_tiny_llama(path)
    return path


def _kind(linear) -> str:
    if linear.native_shards is not None:
        return "/".join(packed_qtype(blocks) for blocks, _ in linear.native_shards)
    blocks = linear.native_weight
    return packed_qtype(blocks) if getattr(blocks, "dtype", None) == torch.uint8 else "plain"


def test_ranks_keep_their_blocks_and_match_the_whole_model(gguf_path):
    model_config = EngineArgs(model=str(gguf_path), dtype="float32").create_engine_config().model
    assert model_config.quantization == "gguf"
    ids = random_prompts(1, VOCAB, 21, 21, seed=5)[0]
    whole = _sequence_logits(model_config, SINGLE_RANK, ids, chunk=13)

    def shard(ps):
        from pagedllm.models.layers.linear import pack_linear_weights
        from pagedllm.worker.model_loader import load_model

        with _LOAD_LOCK:
            model = load_model(model_config, "cpu", torch.device("cpu"), torch.float32, ps)
            pack_linear_weights(model)
        layers = model.model.layers
        kinds = [[_kind(lin) for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
                 for layer in layers]
        qkv_rows = [b.numel() for _, b in layers[0].self_attn.qkv_proj.native_shards]
        table = model.model.embed_tokens.quant_weight
        tied = model.lm_head.native_weight is table
        return kinds, qkv_rows, table is not None and tied, _sequence_logits(
            model_config, ps, ids, chunk=13)

    results = run_ranks(2, shard)
    for kinds, qkv_rows, table_tied, _ in results:
        # Layer 1's qkv has an F16 shard and its down_proj is F16: dense, as on one rank.
        # down_proj of layer 0 (Q8_0) runs dense: its rank's 80 columns cut blocks.
        assert kinds == [["Q4_1/Q8_0", "Q4_0", "Q4_1", "plain"],
                         ["plain", "Q4_1", "Q4_0/Q4_1", "plain"]]
        assert qkv_rows == [(2 + 1) * 16, 1 * 16]  # this rank's 2 q heads + 1 k | 1 v
        assert table_tied
    logits = results[0][3]
    assert results[1][3] is None
    diff = (torch.log_softmax(logits, -1) - torch.log_softmax(whole, -1)).abs().max()
    assert diff <= LOGPROB_ATOL


def test_llm_with_two_workers_keeps_the_blocks(gguf_path):
    prompts = random_prompts(4, VOCAB, 3, 30, seed=1)
    one = LLM(str(gguf_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    expected = _generate(one, prompts)
    llm = LLM(str(gguf_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              tensor_parallel_size=2)
    try:
        assert llm.llm_engine.config.model.quantization == "gguf"
        assert len(worker_processes()) == 2
        got = _generate(llm, prompts)
        # Greedy tokens may part only where one rank's model is at a near-tie: compare
        # the one-rank model's teacher-forced logprobs on the two-rank sequences.
        for prompt, ours, theirs in zip(prompts, got, expected):
            if ours == theirs:
                continue
            parted = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            lp = pagedllm_sequence_logprobs(one, prompt + theirs)
            top2 = lp[len(prompt) - 1 + parted].topk(2).values
            assert top2[0] - top2[1] < LOGPROB_ATOL, (prompt, parted)
        assert sum(a == b for a, b in zip(got, expected)) >= len(prompts) - 1
    finally:
        llm.shutdown()
    # Pipeline stages keep whole layers: the same blocks, the same tokens.
    staged = LLM(str(gguf_path), dtype="float32", skip_tokenizer_init=True,
                 num_kv_blocks=64, pipeline_parallel_size=2)
    try:
        assert staged.llm_engine.config.model.quantization == "gguf"
        assert _generate(staged, prompts) == expected
    finally:
        staged.shutdown()
        one.shutdown()


def test_experts_stay_blocks_under_expert_parallelism(tmp_path):
    """A GGUF Mixtral under two ranks: with expert parallelism each rank's whole experts
    run their blocks; sliced among the ranks, the experts run dense."""
    import dataclasses

    from pagedllm.models.mixtral import ExpertLinear
    from pagedllm.worker.model_loader import load_model
    from tests.loader.test_gguf_families import write_family_gguf

    path = tmp_path / "tiny-mixtral.gguf"
    write_family_gguf(path, tmp_path / "hf", "llama")
    model_config = EngineArgs(model=str(path), dtype="float32").create_engine_config().model

    def experts(ps):
        with _LOAD_LOCK:
            model = load_model(model_config, "cpu", torch.device("cpu"), torch.float32, ps)
        return [(m.expert_ids, m.quantized is not None and all(
                    q is not None for q in m.quantized), m.weight.numel() == 0)
                for m in model.modules() if isinstance(m, ExpertLinear)]

    held = run_ranks(2, lambda ps: experts(dataclasses.replace(ps, expert_parallel=True)))
    # 2 layers' w13 and w2 per rank, each its 2 of the 4 experts as blocks only.
    assert held == [[([0, 1], True, True)] * 4, [([2, 3], True, True)] * 4]
    sliced = run_ranks(2, experts)
    assert all(not quantized and not empty for rank in sliced
               for _, quantized, empty in rank)
