"""Every model family sharded over 2 ranks computes the logits of the whole model.

Ranks run as threads (tests/distributed/ranks.py); each loads its shard of a tiny random
checkpoint with packed CPU weights, as the model runner does, binds its own KV cache (its
share of the KV heads) and runs a sequence in two chunks, the second attending to the
first through the cache. Rank 0's gathered logits must match the one-rank model's.
The end-to-end path (worker processes, LLM) is tests/distributed/test_tensor_parallel.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import transformers as tf

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.layers.linear import pack_linear_weights
from pagedllm.worker.memory import allocate_kv_cache, attention_layers
from pagedllm.worker.model_loader import load_model
from tests.distributed.ranks import run_ranks
from tests.models.test_decoder_parity import SPECS
from tests.utils import random_prompts, save_tiny_model, scale_saved_weights

BLOCK_SIZE = 4
# load_model sets torch's default dtype, which is process-wide: rank threads load in turn.
_LOAD_LOCK = threading.Lock()
# An odd vocabulary: the last rank's slice is padded (ceil(251 / 2) = 126 rows each).
ODD_VOCAB = dict(vocab_size=251, bos_token_id=None, eos_token_id=None, pad_token_id=None)

OTHER_FAMILIES = {
    "gpt2_odd_vocab": lambda: tf.GPT2Config(**ODD_VOCAB, n_embd=64, n_layer=2, n_head=4,
                                            n_positions=64),
    # ALiBi: each rank keeps the slopes of its heads.
    "bloom": lambda: tf.BloomConfig(**ODD_VOCAB, hidden_size=64, n_layer=2, n_head=4),
    # word_embed_proj_dim != hidden: project_in / project_out stay replicated.
    "opt_projected": lambda: tf.OPTConfig(**ODD_VOCAB, hidden_size=64, num_hidden_layers=2,
                                          ffn_dim=128, num_attention_heads=4,
                                          max_position_embeddings=64,
                                          word_embed_proj_dim=32),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**ODD_VOCAB, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=128,
                                         max_position_embeddings=64, rotary_pct=0.5),
}
ROTARY_FAMILIES = ["llama_tied_bias", "mistral_sliding_window", "qwen2_bias_window",
                   "qwen3_qk_norm_mqa", "gemma2", "gemma3", "phi3_partial_longrope",
                   "mixtral_4x_top2", "qwen3_moe_4x_top2"]


@pytest.fixture(scope="module", params=list(OTHER_FAMILIES) + ROTARY_FAMILIES)
def model_config(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param in OTHER_FAMILIES:
        save_tiny_model(path, OTHER_FAMILIES[request.param]())
    else:
        spec = SPECS[request.param]
        save_tiny_model(path, spec.make_config())
        scale_saved_weights(path, spec.scales)
    return EngineArgs(model=str(path), dtype="float32").create_engine_config().model


def _sequence_logits(model_config, parallel: ParallelState, token_ids: list[int],
                     chunk: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Logits [len, vocab] of every position of one sequence (None off rank 0)."""
    with _LOAD_LOCK:
        model = load_model(model_config, "cpu", torch.device("cpu"), dtype, parallel)
        pack_linear_weights(model)
    num_blocks = -(-len(token_ids) // BLOCK_SIZE) + 1  # + the null block
    allocate_kv_cache(model, num_blocks, BLOCK_SIZE, dtype, torch.device("cpu"))
    # The sequence owns blocks 1..n in order: position p lives in slot p + BLOCK_SIZE.
    block_table = torch.arange(1, num_blocks, dtype=torch.int32)[None]
    ids = torch.tensor(token_ids)
    logits = []
    for start in range(0, len(token_ids), chunk):
        end = min(len(token_ids), start + chunk)
        positions = torch.arange(start, end)
        qsl, seq_lens = np.array([0, end - start]), np.array([end])
        md = AttentionMetadata(
            num_reqs=1, num_actual_tokens=end - start,
            query_start_loc=torch.from_numpy(qsl).to(torch.int32),
            seq_lens=torch.from_numpy(seq_lens).to(torch.int32), block_table=block_table,
            slot_mapping=positions + BLOCK_SIZE, max_query_len=end - start,
            max_seq_len=end, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        logits.append(model.compute_logits(model(ids[start:end], positions, md)))
    return None if logits[0] is None else torch.cat(logits)


def test_sharded_model_matches_whole(model_config):
    cfg = model_config.hf_config
    token_ids = random_prompts(1, cfg.vocab_size, 21, 21, seed=5)[0]
    with torch.inference_mode():
        whole = _sequence_logits(model_config, SINGLE_RANK, token_ids, chunk=13)
    shards = run_ranks(2, lambda ps: _sequence_logits(model_config, ps, token_ids, chunk=13))
    assert shards[1] is None
    assert shards[0].shape == (len(token_ids), cfg.vocab_size)
    torch.testing.assert_close(shards[0], whole, rtol=1e-4, atol=1e-4)


def test_kv_heads_per_rank_and_replication(model_config):
    """Each rank's attention layers hold H / tp query heads and max(1, KVH / tp) KV
    heads (a KV head is replicated when there are fewer than ranks)."""
    cfg = model_config.hf_config
    num_heads = cfg.num_attention_heads
    num_kv = getattr(cfg, "num_key_value_heads", None) or num_heads

    def specs(ps):
        model = load_model(model_config, "cpu", torch.device("cpu"), torch.float32, ps)
        return {(layer.spec.num_heads, layer.spec.num_kv_heads)
                for layer in attention_layers(model)}

    for got in run_ranks(2, specs):
        assert got == {(num_heads // 2, max(1, num_kv // 2))}


def test_bfloat16_column_parallel_bias(tmp_path):
    """bfloat16 runs the native GEMM where the CPU has AVX512-BF16, whose packed bias
    every column-parallel rank must keep (only a row-parallel bias is added once)."""
    from safetensors.torch import load_file, save_file

    cfg = tf.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=None, eos_token_id=None)
    save_tiny_model(tmp_path, cfg)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    torch.manual_seed(0)
    for name in [n for n in tensors if n.endswith(".bias")]:  # large q/k/v biases
        tensors[name] = torch.randn_like(tensors[name]) * 2
    save_file(tensors, file, metadata={"format": "pt"})
    args = EngineArgs(model=str(tmp_path), dtype="bfloat16")
    model_config = args.create_engine_config().model
    token_ids = random_prompts(1, 256, 21, 21, seed=5)[0]
    with torch.inference_mode():
        whole = _sequence_logits(model_config, SINGLE_RANK, token_ids, 13, torch.bfloat16)
    shards = run_ranks(2, lambda ps: _sequence_logits(model_config, ps, token_ids, 13,
                                                      torch.bfloat16))
    # bfloat16 rounding differs between one GEMM and two halves plus a sum (~0.01 here);
    # a bias dropped on rank 1 moves logits by ~0.6.
    torch.testing.assert_close(shards[0].float(), whole.float(), rtol=0, atol=0.05)
