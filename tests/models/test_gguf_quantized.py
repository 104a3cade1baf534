"""GGUF weights run natively (quantization="gguf": the quantized GEMM on the file's blocks)
against the same file dequantized (quantization="none"), both in float32, on a tiny
Llama written here as llama.cpp would (q/k rows permuted, Q8_0 / Q4_0 / Q4_1 blocks,
fused projections mixing block types (run shard by shard, as Q4_K_M files need: v in more
bits than q and k), F16 tensors that fall back to dequantizing, the Q8_0 embedding tied as
the LM head); and a wider one whose projections are all Q2_K.

The native path quantizes activations to int8 blocks (as llama.cpp), so the two differ
by ~1% of each GEMM. Measured here: the teacher-forced logprobs of the same sequences
differ by at most 0.047 (over the whole vocabulary); the greedy tokens are identical for
5 of the 6 prompts x 16 tokens, and the sixth parts at a near-tie (the dequantized
model's top two logprobs 0.001 apart). The test allows a parting only at such a tie.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu.quant import packed_qtype
from tests.engine.partings import greedy_dists
from tests.loader.test_gguf import (NUM_HEADS, NUM_KV_HEADS, hf_name_to_gguf,
                                    llamacpp_row_order, random_k_blocks)
from tests.models.test_native_layers import run_both_ways
from tests.utils import pagedllm_sequence_logprobs, random_prompts

QT = gguf.GGMLQuantizationType
VOCAB, MAX_NEW = 256, 16
LOGPROB_ATOL = 0.1
# Greedy runs may part only where the reference's top two logprobs are this close.
NEAR_TIE = 0.02
# Types gguf-py cannot quantize: written as random blocks (finite scales), not the model's
# weights (tests/loader/test_gguf.py random_k_blocks).
RANDOM_K_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
# Per layer: the storage type of each projection. Layer 0's qkv runs in two shards (q and
# k stacked as one Q4_1 weight, v Q8_0), layer 1's gate_up in two (Q4_0, Q4_1); layer 1
# dequantizes its qkv (an F16 shard among Q8_0 ones) and down (F16).
LAYER_TYPES = [
    {"q_proj": QT.Q4_1, "k_proj": QT.Q4_1, "v_proj": QT.Q8_0, "o_proj": QT.Q4_0,
     "gate_proj": QT.Q4_1, "up_proj": QT.Q4_1, "down_proj": QT.Q8_0},
    {"q_proj": QT.Q8_0, "k_proj": QT.F16, "v_proj": QT.Q8_0, "o_proj": QT.Q4_1,
     "gate_proj": QT.Q4_0, "up_proj": QT.Q4_1, "down_proj": QT.F16},
]


def _storage_type(name: str, w: np.ndarray) -> QT:
    if w.ndim == 1:
        return QT.F32
    if name == "model.embed_tokens.weight":
        return QT.Q8_0
    return LAYER_TYPES[int(name.split(".")[2])][name.split(".")[-2]]


def write_tiny_llama(path: Path, hidden: int = 64, inter: int = 160, scale: float = 4,
                     storage_type: Callable[[str, np.ndarray], QT] = _storage_type) -> None:
    """A 2-layer Llama as llama.cpp writes it, its weights `scale` times the init's
    (sharper: greedy choices are not near-ties), each tensor stored as `storage_type`
    says."""
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                      num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                      vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    state = {k: v.detach().float() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for k in state:
        state[k] = 1 + 0.1 * torch.randn_like(state[k]) if "norm" in k else state[k] * scale
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 2), ("context_length", 256), ("embedding_length", hidden),
                       ("feed_forward_length", inter), ("head_count", NUM_HEADS),
                       ("head_count_kv", NUM_KV_HEADS), ("layer_norm_rms_eps", 1e-6),
                       ("rope_freq_base", 10000.0), ("vocab_size", VOCAB)):
        getattr(writer, f"add_{key}")(value)
    for name, tensor in state.items():
        w = tensor.numpy()
        heads = NUM_HEADS if ".q_proj." in name else NUM_KV_HEADS if ".k_proj." in name else None
        if heads is not None:
            w = w[llamacpp_row_order(w.shape[0], heads)]
        qtype = storage_type(name, w)
        if qtype in (QT.F32, QT.F16):
            writer.add_tensor(hf_name_to_gguf(name), w.astype(np.float32 if qtype == QT.F32
                                                              else np.float16))
        else:
            raw = (quantize_q2_k(w) if qtype == QT.Q2_K
                   else random_k_blocks(np.random.default_rng(zlib.crc32(name.encode())),
                                        w.shape, qtype) if qtype in RANDOM_K_TYPES
                   else gguf.quants.quantize(w, qtype))
            writer.add_tensor(hf_name_to_gguf(name), raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("quant") / "tiny-llama.gguf"
    write_tiny_llama(path)
    return path


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _model(llm: LLM):
    return llm.llm_engine.engine_core.executor.runner.model


def _assert_close(native: LLM, plain: LLM, prompts: list[list[int]],
                  got: list[list[int]], expected: list[list[int]]) -> None:
    """The native run's teacher-forced logprobs within LOGPROB_ATOL of the dequantized
    run's on the dequantized greedy sequences; its greedy tokens the same but for at most
    one prompt, and that one parting only at a near-tie of the reference."""
    num_identical = 0
    for prompt, ours_out, out in zip(prompts, got, expected):
        ours = pagedllm_sequence_logprobs(native, prompt + out)
        theirs = pagedllm_sequence_logprobs(plain, prompt + out)
        assert (ours - theirs).abs().max() <= LOGPROB_ATOL
        parted = next((i for i, (a, b) in enumerate(zip(ours_out, out)) if a != b), None)
        if parted is None:
            num_identical += 1
            continue
        top2 = theirs[len(prompt) - 1 + parted].topk(2).values
        assert top2[0] - top2[1] < NEAR_TIE, (prompt, parted)
    assert num_identical >= len(prompts) - 1


def test_native_matches_dequantized(tiny_path):
    prompts = random_prompts(6, VOCAB, 3, 41, seed=1)
    native = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
                 quantization="gguf", num_kv_blocks=64)
    model = _model(native)
    layers = model.model.layers
    # Which weights run on blocks, whole or in shards of one type each; the Q8_0 table.
    def kind(lin) -> str:
        if lin.native_shards is not None:
            assert lin.weight.numel() == 0  # not dequantized as well
            return "/".join(packed_qtype(blocks) for blocks, _ in lin.native_shards)
        blocks = lin.native_weight
        return packed_qtype(blocks) if getattr(blocks, "dtype", None) == torch.uint8 else "plain"

    kinds = [[kind(lin) for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
             for layer in layers]
    assert kinds == [["Q4_1/Q8_0", "Q4_0", "Q4_1", "Q8_0"],
                     ["plain", "Q4_1", "Q4_0/Q4_1", "plain"]]
    qkv_rows = [bias.numel() for _, bias in layers[0].self_attn.qkv_proj.native_shards]
    assert qkv_rows == [(NUM_HEADS + NUM_KV_HEADS) * 16, NUM_KV_HEADS * 16]  # [q | k], v
    assert model.model.embed_tokens.quant_weight is not None
    assert model.lm_head.native_weight is model.model.embed_tokens.quant_weight
    got = _generate(native, prompts)
    assert model.model._native is not None  # the fused decoder stack ran them

    plain = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
                quantization="none", num_kv_blocks=64)
    assert _model(plain).model.embed_tokens.quant_weight is None
    expected = _generate(plain, prompts)
    _assert_close(native, plain, prompts, got, expected)


def _generate_logprobs(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("native_layers", [True, False], ids=["stack", "python-layers"])
def test_quantized_batch_invariance(tiny_path, native_layers):
    """A request's tokens and logprobs are the same alone, in a batch and in 7-token
    chunks beside other requests' decodes (DESIGN.md §10), through the native stack and
    through the Python layers: where prompt rows take the bfloat16 tiles
    (worker/prompt_rows.py), a row's kernels follow from the row alone."""
    prompts = random_prompts(5, VOCAB, 3, 41, seed=7)
    results = []
    for kwargs in (dict(num_kv_blocks=128), dict(max_num_batched_tokens=7, max_num_seqs=3)):
        llm = LLM(str(tiny_path), dtype="bfloat16", skip_tokenizer_init=True,
                  quantization="gguf", enable_prefix_caching=False, **kwargs)
        _model(llm).model.use_native_layers = native_layers
        if not results:
            results.append([_generate_logprobs(llm, [p])[0] for p in prompts])
        results.append(_generate_logprobs(llm, prompts))
        assert (_model(llm).model._native is not None) == native_layers
        llm.shutdown()
    assert results[1] == results[0] and results[2] == results[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_stack_equals_python_layers(tiny_path, dtype):
    """The fused decoder stack runs the blocks, the mixed-type shards among them, bit for
    bit as the Python layers do (prefill chunks next to decodes, one-token steps)."""
    llm = LLM(str(tiny_path), dtype=dtype, skip_tokenizer_init=True, quantization="gguf",
              num_kv_blocks=64, max_num_batched_tokens=24, enable_prefix_caching=False)
    steps = run_both_ways(llm)
    prompts = random_prompts(3, VOCAB, 5, 40, seed=1)
    _generate(llm, prompts)
    _generate(llm, prompts[:1])
    assert 1 in steps and 24 in steps
    assert _model(llm).model._native is not None


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """A plain Q2_K quantizer (gguf-py has none): w [rows, cols] (cols a multiple of 256)
    -> ggml's blocks [rows, cols / 256 * 84]: per sub-block of 16 the range from min(w, 0)
    in 3 steps, step and -min stored as 4-bit multiples of the block's float16 d and dmin;
    q in [0, 3]. Layout: scales [16] (sc | m << 4), qs [64] (element 128h + 32s + l at
    bits 2s of byte 32h + l), d, dmin."""
    rows, cols = w.shape
    nb = cols // 256
    x = w.reshape(rows, nb, 16, 16).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)  # [rows, nb, 16]
    step = (x.max(-1) - lo) / 3
    d = (step.max(-1, keepdims=True) / 15).astype(np.float16)
    dmin = (-lo.min(-1, keepdims=True) / 15).astype(np.float16)
    sc = np.rint(step / np.maximum(d.astype(np.float32), 1e-30)).clip(0, 15)
    m = np.rint(-lo / np.maximum(dmin.astype(np.float32), 1e-30)).clip(0, 15)
    step, low = d.astype(np.float32) * sc, dmin.astype(np.float32) * m
    q = np.rint((x + low[..., None]) / np.where(step == 0, 1, step)[..., None]).clip(0, 3)
    q = q.astype(np.uint8).reshape(rows, nb, 2, 4, 32)  # element 128h + 32s + l
    qs = (q << np.array([0, 2, 4, 6], np.uint8)[:, None]).sum(-2, dtype=np.uint8)
    scales = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4))
    return np.concatenate([scales, qs.reshape(rows, nb, 64), d.view(np.uint8),
                           dmin.view(np.uint8)], axis=-1).reshape(rows, nb * 84)


def test_q2k_native_matches_dequantized(tmp_path):
    """Q2_K projections (sub-blocks of 16 with a 4-bit scale and min each, run natively,
    not dequantized) against the same file dequantized, as test_native_matches_dequantized
    does for the 32-weight types: a Llama of hidden size 256 (Q2_K needs K a multiple of
    256), every projection Q2_K and the Q8_0 table. Weights at twice the init scale (four
    times, as above, makes logits of this wider model twice as sensitive to the int8
    activations: max logprob gaps 0.14-0.21 for Q8_0 and Q4_1 projections alike). Measured
    at 2x: teacher-forced logprobs within 0.039-0.043 (the same model in Q8_0: 0.032-0.043),
    greedy tokens identical for all 6 prompts."""
    path = tmp_path / "q2k.gguf"
    write_tiny_llama(path, hidden=256, inter=512, scale=2, storage_type=lambda name, w: (
        QT.F32 if w.ndim == 1 else QT.Q8_0 if name == "model.embed_tokens.weight" else QT.Q2_K))

    prompts = random_prompts(6, VOCAB, 3, 41, seed=1)
    native = LLM(str(path), dtype="float32", skip_tokenizer_init=True, quantization="gguf",
                 num_kv_blocks=64)
    layers = _model(native).model.layers
    assert all(packed_qtype(lin.native_weight) == "Q2_K"
               for layer in layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                               layer.mlp.gate_up_proj, layer.mlp.down_proj))
    got = _generate(native, prompts)
    plain = LLM(str(path), dtype="float32", skip_tokenizer_init=True, quantization="none",
                num_kv_blocks=64)
    expected = _generate(plain, prompts)
    _assert_close(native, plain, prompts, got, expected)


def test_amx_bf16_tiles_give_the_dequantized_model_for_every_type(tmp_path, monkeypatch):
    """On a CPU with AMX-BF16, PAGEDLLM_CPU_QUANT_GEMM=amx_bf16 runs every row's Q5_0 / Q5_1
    / Q4_K / Q5_K / Q6_K (and Q8_0) blocks dequantized to bfloat16 inside the GEMM
    (csrc/quant_amx_bf16.h): the tokens and logprobs of the same file dequantized on load,
    exactly, with the fused qkv and gate_up run shard by shard (three and two types). The
    K-type projections are random blocks (gguf-py cannot quantize them)."""
    from pagedllm.kernels.cpu import ops as cpu_ops

    if not (cpu_ops.load_cpu_kernels() and cpu_ops.quant_amx_bf16_usable()):
        pytest.skip("no AMX-BF16 tiles here")
    types = {"q_proj": QT.Q5_0, "k_proj": QT.Q5_1, "v_proj": QT.Q6_K, "o_proj": QT.Q4_K,
             "gate_proj": QT.Q5_K, "up_proj": QT.Q4_K, "down_proj": QT.Q6_K}
    path = tmp_path / "mixed.gguf"
    write_tiny_llama(path, hidden=256, inter=512, scale=2, storage_type=lambda name, w: (
        QT.F32 if w.ndim == 1 else QT.Q8_0 if name == "model.embed_tokens.weight"
        else types[name.split(".")[-2]]))
    monkeypatch.setenv("PAGEDLLM_CPU_QUANT_GEMM", "amx_bf16")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, VOCAB, 3, 41, seed=2)]
    native = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, quantization="gguf",
                 num_kv_blocks=64)
    attn = _model(native).model.layers[0].self_attn
    assert [packed_qtype(w) for w, _ in attn.qkv_proj.native_shards] == ["Q5_0", "Q5_1",
                                                                         "Q6_K"]
    got = greedy_dists(native, prompts, MAX_NEW)
    native.shutdown()
    plain = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, quantization="none",
                num_kv_blocks=64)
    assert greedy_dists(plain, prompts, MAX_NEW) == got
