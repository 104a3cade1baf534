"""Phi-3 and GPT-2 GGUF files, written here the way llama.cpp's converter writes them,
served by `LLM` with the same greedy tokens (and logprobs within 1e-3) as transformers
running the original tiny HF model.

The converter's layout changes are reproduced from the HF checkpoint: Phi-3 keeps its fused
`qkv_proj` / `gate_up_proj` as `attn_qkv` / `ffn_up`, and moves longrope factors into
`rope_factors_*` tensors; GPT-2 stores its Conv1D projections transposed (`attn_qkv`,
`attn_output`, `ffn_up`, `ffn_down`) and its learned positions as `position_embd`. No
tokenizer metadata is written, so the config sizes transformers' GGUF parsing would take
from the token list come from pagedllm's completion of the config.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from pagedllm.loader.gguf_cache import load_gguf_config
from tests.models.parity import MAX_NEW, VOCAB, TinyCase, assert_parity
from tests.utils import hf_greedy_no_eos, random_prompts, save_tiny_model, scale_saved_weights

QT = gguf.GGMLQuantizationType
NUM_PROMPTS = 4

_PHI3_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_PHI3_LAYER = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GPT2_GLOBAL = {"transformer.wte.weight": "token_embd.weight",
                "transformer.wpe.weight": "position_embd.weight",
                "transformer.ln_f.weight": "output_norm.weight",
                "transformer.ln_f.bias": "output_norm.bias"}
_GPT2_LAYER = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
               "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
# llama.cpp transposes GPT-2's Conv1D [in, out] weights to ggml's [out, in].
_GPT2_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def _phi3_config() -> tf.Phi3Config:
    """Fused qkv / gate_up, half the head dims rotated, longrope short factors, a sliding
    window shorter than most prompts, GQA."""
    return tf.Phi3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        original_max_position_embeddings=128, sliding_window=12, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0],
                         "long_factor": [2.0] * 8})


def _gpt2_config() -> tf.GPT2Config:
    # n_positions 128, not the GPT2Config default 1024: the config must come from the file.
    return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                         bos_token_id=None, eos_token_id=None)


def _gguf_name(hf_name: str, global_names: dict[str, str], layer_names: dict[str, str],
               layer_prefix: str) -> str:
    if hf_name in global_names:
        return global_names[hf_name]
    layer, rest = hf_name.removeprefix(layer_prefix).split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{layer_names[module]}.{kind}"


def _phi3_tensors(cfg, state):
    """(gguf name, tensor in the file's layout) pairs, as llama.cpp's Phi3MiniModel writes."""
    for name, t in state.items():
        yield _gguf_name(name, _PHI3_GLOBAL, _PHI3_LAYER, "model.layers."), t
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "longrope":
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"])
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"])


def _gpt2_tensors(cfg, state):
    for name, t in state.items():
        if name.endswith(_GPT2_CONV1D):
            t = t.t()
        yield _gguf_name(name, _GPT2_GLOBAL, _GPT2_LAYER, "transformer.h."), t


def _phi3_metadata(writer: gguf.GGUFWriter, cfg) -> None:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window or 0)
    scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
    writer.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))


def _gpt2_metadata(writer: gguf.GGUFWriter, cfg) -> None:
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)


ARCHS = {"phi3": (_phi3_config, _phi3_metadata, _phi3_tensors),
         "gpt2": (_gpt2_config, _gpt2_metadata, _gpt2_tensors)}


def write_gguf(path: Path, arch: str, cfg, state: dict[str, torch.Tensor], qtype: QT
               ) -> dict[str, np.ndarray]:
    """Write `state` as llama.cpp would, 2-D weights as `qtype` (1-D stay F32); return the
    data each GGUF tensor decodes to, in the file's layout."""
    _, add_metadata, tensors = ARCHS[arch]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    add_metadata(writer, cfg)
    decoded = {}
    for name, t in tensors(cfg, state):
        w = np.ascontiguousarray(t.float().numpy())
        if w.ndim == 1 or qtype == QT.F32:
            writer.add_tensor(name, w)
            decoded[name] = w
        else:
            data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
            decoded[name] = gguf.quants.dequantize(data, qtype).reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


def _back_to_hf(arch: str, cfg, state, decoded) -> dict[str, torch.Tensor]:
    """The HF state dict whose conversion gives `decoded` (quantization error included)."""
    # The converters yield the state's tensors first, in order (then Phi-3's rope factors).
    names = dict(zip((n for n, _ in ARCHS[arch][2](cfg, state)), state))
    out = {}
    for gguf_name, hf_name in names.items():
        w = torch.from_numpy(np.array(decoded[gguf_name], dtype=np.float32))
        out[hf_name] = w.t() if arch == "gpt2" and hf_name.endswith(_GPT2_CONV1D) else w
    return out


def _case(path: Path, hf_model) -> TinyCase:
    prompts = random_prompts(NUM_PROMPTS, VOCAB, 3, 41, seed=1)
    reference = [hf_greedy_no_eos(hf_model, p, MAX_NEW) for p in prompts]
    return TinyCase(path, hf_model, prompts, reference)


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    """(arch, HF config, saved HF state dict, directory) of a tiny model with sharp weights."""
    arch = request.param
    cfg = ARCHS[arch][0]()
    root = tmp_path_factory.mktemp(f"gguf_{arch}")
    save_tiny_model(root / "hf", cfg)
    if arch == "phi3":  # sharp attention and logits, so positions and the window matter
        scale_saved_weights(root / "hf", {"qkv_proj": 6.0, "lm_head": 10.0})
    state = load_file(root / "hf" / "model.safetensors")
    return arch, cfg, state, root


def test_f32_gguf_matches_transformers(tiny):
    arch, cfg, state, root = tiny
    path = root / f"tiny-{arch}-f32.gguf"
    write_gguf(path, arch, cfg, state, QT.F32)
    hf_model = tf.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    assert_parity(_case(path, hf_model), attention_backend="torch_ref", num_kv_blocks=64)


def test_q8_0_gguf_matches_transformers_on_dequantized_weights(tiny):
    arch, cfg, state, root = tiny
    path = root / f"tiny-{arch}-q8_0.gguf"
    decoded = write_gguf(path, arch, cfg, state, QT.Q8_0)
    hf_model = tf.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    dequantized = _back_to_hf(arch, cfg, state, decoded)
    assert any(not torch.equal(dequantized[n], state[n]) for n in state)  # really quantized
    hf_model.load_state_dict(dequantized, strict=False)
    # Dequantized as transformers does (quantization="gguf" quantizes activations too).
    assert_parity(_case(path, hf_model), logprob_chunk_size=7, attention_backend="torch_ref",
                  num_kv_blocks=64, quantization="none")


def test_config_completed_from_the_file(tiny):
    """What transformers' GGUF config parsing drops comes back from the metadata/tensors."""
    arch, cfg, state, root = tiny
    path = root / f"tiny-{arch}-f32.gguf"
    if not path.exists():
        write_gguf(path, arch, cfg, state, QT.F32)
    got = load_gguf_config(str(path))
    assert got.vocab_size == VOCAB and got.tie_word_embeddings == (arch == "gpt2")
    if arch == "gpt2":
        assert got.architectures == ["GPT2LMHeadModel"]
        assert (got.n_positions, got.n_inner or 4 * got.n_embd) == (128, 256)
    else:
        assert got.architectures == ["Phi3ForCausalLM"]
        assert got.sliding_window == 12 and got.original_max_position_embeddings == 128
        for key in ("rope_type", "partial_rotary_factor", "short_factor", "long_factor"):
            assert got.rope_parameters[key] == pytest.approx(cfg.rope_parameters[key]), key
