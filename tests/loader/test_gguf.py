"""GGUF loading on tiny files written here with `gguf.GGUFWriter`.

The files mimic llama.cpp's converter: HF tensors renamed, llama q/k rows permuted for
ggml's interleaved rope, many tensors block-quantized. The loader must give back exactly
the dequantized, un-permuted data, and the HF weights within quantization error.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pagedllm.errors import ModelLoadError
from pagedllm.loader import gguf_cache, iter_weights
from pagedllm.loader import gguf as gguf_loader
from pagedllm.loader.gguf import GGUFWeights

QT = gguf.GGMLQuantizationType
NUM_HEADS, NUM_KV_HEADS = 4, 2

# HF suffix (after model.layers.N.) -> GGUF suffix (after blk.N.)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}

# Storage type per HF tensor (layer suffixes per layer index); 1-D tensors stay F32.
LAYER_TYPES = [
    {"q_proj": QT.Q4_0, "k_proj": QT.Q4_1, "v_proj": QT.Q5_0, "o_proj": QT.Q5_1,
     "gate_proj": QT.F16, "up_proj": QT.BF16, "down_proj": QT.Q8_0},
    {"q_proj": QT.Q8_0, "k_proj": QT.F16, "v_proj": QT.BF16, "o_proj": QT.Q4_0,
     "gate_proj": QT.Q5_1, "up_proj": QT.Q5_0, "down_proj": QT.Q4_1},
]
GLOBAL_TYPES = {"model.embed_tokens.weight": QT.Q8_0, "lm_head.weight": QT.Q4_1}

# Worst-case error relative to the tensor's max |w|. Min/max types (Q4_1, Q5_1) err by half
# a step of range/(2^bits - 1); symmetric ones (Q4_0, Q5_0: d = amax / -2^(bits-1)) by up to a
# full step on the side opposite the block's extreme, where the top code is clipped.
TOLERANCE = {QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 4e-3, QT.Q8_0: 0.01,
             QT.Q5_0: 0.07, QT.Q5_1: 0.04, QT.Q4_0: 0.13, QT.Q4_1: 0.07}


def llamacpp_row_order(num_rows: int, num_heads: int) -> np.ndarray:
    """Source row of each GGUF row under llama.cpp's q/k permutation.

    Within a head of `hd` rows (half = hd / 2) HF pairs rows j and j + half for rotation;
    llama.cpp stores them adjacent: GGUF row 2*j + t of a head is HF row t*half + j.
    """
    hd = num_rows // num_heads
    half = hd // 2
    return np.array([h * hd + t * half + j
                     for h in range(num_heads) for j in range(half) for t in range(2)])


def hf_name_to_gguf(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def storage_type(hf_name: str, tensor: np.ndarray) -> gguf.GGMLQuantizationType:
    if tensor.ndim == 1:
        return QT.F32
    if hf_name in GLOBAL_TYPES:
        return GLOBAL_TYPES[hf_name]
    layer = int(hf_name.split(".")[2])
    return LAYER_TYPES[layer][hf_name.split(".")[-2]]


def permute_heads(hf_name: str, arch: str) -> int | None:
    if arch != "llama":
        return None
    if ".q_proj." in hf_name:
        return NUM_HEADS
    return NUM_KV_HEADS if ".k_proj." in hf_name else None


def add_decoder_hparams(writer: gguf.GGUFWriter, cfg) -> None:
    """A Llama-shaped decoder's sizes as llama.cpp's converter writes them."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(cfg.vocab_size)


def write_gguf(path: Path, arch: str, cfg, state: dict[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    """Write `state` as llama.cpp would; return the expected loader output (float32)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    add_decoder_hparams(writer, cfg)
    expected = {}
    for hf_name, tensor in state.items():
        w = tensor.float().numpy()
        heads = permute_heads(hf_name, arch)
        order = None if heads is None else llamacpp_row_order(w.shape[0], heads)
        stored = w if order is None else w[order]
        qtype = storage_type(hf_name, w)
        if qtype == QT.F32:
            data = stored.astype(np.float32)
        elif qtype == QT.F16:
            data = stored.astype(np.float16)
        else:
            data = gguf.quants.quantize(stored, qtype)
        writer.add_tensor(hf_name_to_gguf(hf_name), data,
                          raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
        deq = gguf.quants.dequantize(data, qtype).reshape(w.shape)
        if order is not None:  # un-permute: HF row order[i] was written at row i
            deq = deq[np.argsort(order)]
        expected[hf_name] = torch.from_numpy(np.array(deq, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def tiny_state(arch: str) -> tuple[object, dict[str, torch.Tensor]]:
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, vocab_size=128,
              max_position_embeddings=256)
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(**kw, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**kw, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if arch == "qwen2":
        state.pop("lm_head.weight")  # tied: llama.cpp writes no output.weight
        for k in state:  # HF initializes biases to zero; make the mapping observable
            if k.endswith(".bias"):
                state[k] = torch.randn_like(state[k])
    for k in state:  # norms are all ones at init; perturb so a mix-up would show
        if "norm" in k:
            state[k] = 1 + 0.1 * torch.randn_like(state[k])
    return cfg, state


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory):
    """(path, HF state dict, expected loader output) of a tiny GGUF model."""
    arch = request.param
    cfg, state = tiny_state(arch)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    expected = write_gguf(path, arch, cfg, state)
    return path, state, expected


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_uncached_stream_equals_dequantized_reference(tiny_gguf):
    path, state, expected = tiny_gguf
    got = dict(GGUFWeights(str(path)).iter_weights(torch.float32))
    assert list(got) == list(expected)  # file order, HF names
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def test_stream_matches_hf_weights_within_quantization_error(tiny_gguf):
    path, state, _ = tiny_gguf
    got = dict(iter_weights(str(path), None, torch.float32))
    assert set(got) == set(state)
    for name, tensor in got.items():
        ref = state[name].float()
        tol = TOLERANCE[storage_type(name, ref.numpy())]
        err = (tensor - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item() + 1e-7, (name, err)


def test_dtype_conversion(tiny_gguf):
    path, _, expected = tiny_gguf
    got = dict(iter_weights(str(path), None, torch.bfloat16))
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def _forbid_conversion(monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("GGUF parsed or dequantized although the cache should serve")

    # Every header parse, ours and transformers' (through gguf-py's class or our subclass of
    # it, which transformers_parse_fast swaps in), runs this __init__.
    monkeypatch.setattr(gguf.GGUFReader, "__init__", boom)
    monkeypatch.setattr(gguf.quants, "dequantize", boom)


def test_second_load_reads_cache(tiny_gguf, cache_dir, monkeypatch):
    path, _, expected = tiny_gguf
    first = dict(iter_weights(str(path), None, torch.float32))
    entries = list((cache_dir / "gguf").iterdir())
    assert len(entries) == 1
    assert (entries[0] / "weights-float32.safetensors").is_file()
    assert not [p for p in entries[0].iterdir() if p.name.startswith(".tmp")]
    _forbid_conversion(monkeypatch)
    second = dict(iter_weights(str(path), None, torch.float32))
    assert set(second) == set(first)
    for name in first:
        assert torch.equal(second[name], first[name]) and torch.equal(first[name], expected[name])


def test_cache_is_per_dtype(tiny_gguf, cache_dir, monkeypatch):
    path, _, expected = tiny_gguf
    list(iter_weights(str(path), None, torch.bfloat16))
    _forbid_conversion(monkeypatch)
    got = dict(iter_weights(str(path), None, torch.bfloat16))
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert all(torch.equal(got[n], expected[n].to(torch.bfloat16)) for n in expected)
    with pytest.raises(AssertionError, match="cache should serve"):
        list(iter_weights(str(path), None, torch.float32))  # no float32 entry yet


def test_changed_file_invalidates_cache(tiny_gguf, cache_dir, monkeypatch):
    path, _, expected = tiny_gguf
    list(iter_weights(str(path), None, torch.float32))
    st = os.stat(path)
    try:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        calls = []
        real = gguf_loader.open_reader
        monkeypatch.setattr(gguf_loader, "open_reader", lambda *a: calls.append(a) or real(*a))
        got = dict(iter_weights(str(path), None, torch.float32))
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the file is module-shared
    assert len(calls) == 1
    assert len(list((cache_dir / "gguf").iterdir())) == 2
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_abandoned_stream_leaves_no_cache(tiny_gguf, cache_dir):
    path, _, _ = tiny_gguf
    stream = iter_weights(str(path), None, torch.float32)
    next(stream)
    stream.close()
    (entry,) = (cache_dir / "gguf").iterdir()
    assert [p.name for p in entry.iterdir()] == ["source.json"]


def test_corrupt_cache_file_is_rebuilt(tiny_gguf, cache_dir):
    path, _, expected = tiny_gguf
    list(iter_weights(str(path), None, torch.float32))
    (entry,) = (cache_dir / "gguf").iterdir()
    cached = entry / "weights-float32.safetensors"
    size = cached.stat().st_size
    cached.write_bytes(cached.read_bytes()[:-100])  # header intact, data cut short
    got = dict(iter_weights(str(path), None, torch.float32))
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert cached.stat().st_size == size


def test_unwritable_cache_falls_back(tiny_gguf, tmp_path, monkeypatch):
    path, _, expected = tiny_gguf
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocker / "cache"))
    got = dict(iter_weights(str(path), None, torch.float32))
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_config_is_cached(tiny_gguf, cache_dir, monkeypatch):
    path, _, _ = tiny_gguf
    first = gguf_cache.load_gguf_config(str(path))
    assert first.num_hidden_layers == 2 and first.num_key_value_heads == NUM_KV_HEADS
    assert first.architectures[0].endswith("ForCausalLM")

    def boom(path):
        raise AssertionError("GGUF config parsed again")

    monkeypatch.setattr(gguf_cache, "_parse_config", boom)
    second = gguf_cache.load_gguf_config(str(path))
    assert second.to_dict() == first.to_dict()


def test_transformers_parse_fast_swaps_the_reader_only_within(tiny_gguf):
    path, _, _ = tiny_gguf
    original = gguf.GGUFReader
    assert isinstance(original(str(path)).data, np.memmap)
    with gguf_loader.transformers_parse_fast() as built:
        # What transformers' load_gguf_checkpoint builds: the plain-ndarray reader, kept
        # for the caller (load_gguf_tokenizer reads more of the header from it).
        reader = gguf.GGUFReader(str(path))
        assert isinstance(reader, original) and not isinstance(reader.data, np.memmap)
        assert built == [reader]
    assert gguf.GGUFReader is original
    with pytest.raises(RuntimeError, match="inside"):
        with gguf_loader.transformers_parse_fast():
            raise RuntimeError("inside")
    assert gguf.GGUFReader is original


def test_a_first_config_load_parses_through_the_fast_reader(tiny_gguf, memmapped_readers):
    """Every header parse of a first config load, transformers' own included, builds the
    plain-ndarray reader (`open_reader`'s), not gguf-py's np.memmap one."""
    path, _, _ = tiny_gguf
    gguf_cache.load_gguf_config(str(path))
    assert memmapped_readers and not any(memmapped_readers), memmapped_readers


def _write_minimal(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_head_count(NUM_HEADS)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_tensor_name_is_reported(tmp_path):
    path = tmp_path / "bad.gguf"
    _write_minimal(path, "llama", {"token_embd.weight": np.zeros((8, 32), np.float32),
                                   "blk.0.mystery.weight": np.zeros(32, np.float32)})
    with pytest.raises(ModelLoadError, match="blk.0.mystery.weight"):
        GGUFWeights(str(path))


def test_unsupported_type_and_arch_are_reported(tmp_path):
    path = tmp_path / "f64.gguf"
    _write_minimal(path, "llama", {"output_norm.weight": np.zeros(32, np.float64)})
    with pytest.raises(ModelLoadError, match=r"output_norm.weight \(F64\)"):
        GGUFWeights(str(path))
    path = tmp_path / "mamba.gguf"
    _write_minimal(path, "mamba", {"output_norm.weight": np.zeros(32, np.float32)})
    with pytest.raises(ModelLoadError, match="'mamba'"):
        list(iter_weights(str(path), None, torch.float32))


K_TYPES = {"attn_q.weight": QT.Q2_K, "attn_k.weight": QT.Q3_K, "attn_v.weight": QT.Q4_K,
           "attn_output.weight": QT.Q5_K, "ffn_gate.weight": QT.Q6_K}
# Byte offsets of the float16 scale fields (`d`, and `dmin` where the type has one) in one
# 256-value block, from ggml's block structs (the order gguf.quants splits them in).
K_SCALE_OFFSETS = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2),
                   QT.Q6_K: (208,)}


def random_k_blocks(rng: np.random.Generator, shape: tuple[int, int],
                    qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Raw K-quant data for a [rows, cols] tensor (cols a multiple of 256): every byte random
    (all quant and sub-block scale bits exercised), except the float16 super-block scales,
    set to small finite values so the dequantized tensor is finite."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scale = (rng.uniform(0.001, 0.05, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2]))
        raw[..., offset:offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, cols // block_size * type_size)


def test_k_quants_dequantize(tmp_path):
    """gguf-py cannot quantize K-types: write random blocks and check that the loader, uncached
    and through the conversion cache (filling it, then reading it), returns their
    dequantization by gguf.quants, un-permuted."""
    rng = np.random.default_rng(0)
    dim, heads, kv_heads = 256, 4, 2
    shapes = {"attn_q.weight": (dim, dim), "attn_k.weight": (dim // 2, dim),
              "attn_v.weight": (dim // 2, 2 * dim), "attn_output.weight": (dim, dim),
              "ffn_gate.weight": (3 * dim // 4, dim)}
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    expected = {}
    for name, qtype in K_TYPES.items():
        raw = random_k_blocks(rng, shapes[name], qtype)
        writer.add_tensor(f"blk.0.{name}", raw, raw_dtype=qtype)
        deq = gguf.quants.dequantize(raw, qtype)
        assert deq.shape == shapes[name] and np.isfinite(deq).all()
        assert np.abs(deq).max() > 0.1  # the random bytes really decode to a spread of values
        n = {"attn_q.weight": heads, "attn_k.weight": kv_heads}.get(name)
        if n is not None:
            deq = deq[np.argsort(llamacpp_row_order(deq.shape[0], n))]
        hf_name = f"model.layers.0.{next(k for k, v in LAYER_NAMES.items() if v == name)}"
        expected[hf_name] = torch.from_numpy(np.array(deq, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for got in (dict(GGUFWeights(str(path)).iter_weights(torch.float32)),
                dict(iter_weights(str(path), None, torch.float32)),  # converts, fills cache
                dict(iter_weights(str(path), None, torch.float32))):  # reads the cache
        assert set(got) == set(expected)
        for name, ref in expected.items():
            assert torch.equal(got[name], ref), name
