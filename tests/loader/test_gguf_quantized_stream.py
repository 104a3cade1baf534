"""The quantized GGUF stream (quantization="gguf"): Q8_0 / Q4_0 / Q4_1 2-D weights come as
`QuantizedWeight`s holding the file's blocks (q/k rows un-permuted as bytes), everything
else dequantized as before; the stream is cached and read back without parsing the file.
Uses test_gguf.py's tiny llama / qwen2 files (every block type, F16, BF16, Q5_*), and
K-quant blocks."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagedllm.kernels.cpu.quant import NATIVE_QTYPES, QuantizedWeight
from pagedllm.loader import gguf_cache, iter_weights
from tests.loader.test_gguf import (_forbid_conversion, cache_dir,  # noqa: F401 (fixtures)
                                    random_k_blocks, storage_type, tiny_gguf)


def _quantized(path) -> dict[str, torch.Tensor | QuantizedWeight]:
    return dict(iter_weights(str(path), None, torch.float32, quantization="gguf"))


def test_stream_keeps_native_blocks(tiny_gguf):
    path, state, expected = tiny_gguf
    got = _quantized(path)
    assert set(got) == set(expected)
    for name, value in got.items():
        kind = storage_type(name, state[name].numpy()) if name in state else None
        if isinstance(value, QuantizedWeight):
            assert value.qtype == kind.name and value.qtype in NATIVE_QTYPES
            # The blocks decode to the loader's dequantized, un-permuted tensor.
            assert torch.equal(value.dequantize(torch.float32), expected[name]), name
        else:
            assert kind is None or kind.name not in NATIVE_QTYPES or value.dim() == 1
            assert torch.equal(value, expected[name]), name
    native = [n for n, t in state.items()
              if t.dim() == 2 and storage_type(n, t.numpy()).name in NATIVE_QTYPES]
    assert len(native) >= 7
    assert sorted(n for n, v in got.items() if isinstance(v, QuantizedWeight)) == sorted(native)


def test_quantized_stream_is_cached(tiny_gguf, cache_dir, monkeypatch):  # noqa: F811
    path, _, _ = tiny_gguf
    first = _quantized(path)
    entry = gguf_cache.entry_dir(str(path))
    assert (entry / "weights-gguf-float32.safetensors").is_file()
    _forbid_conversion(monkeypatch)
    second = _quantized(path)
    assert set(second) == set(first)
    for name, a in first.items():
        b = second[name]
        if isinstance(a, QuantizedWeight):
            assert isinstance(b, QuantizedWeight) and (a.qtype, a.shape) == (b.qtype, b.shape)
            assert torch.equal(a.raw, b.raw), name
        else:
            assert torch.equal(a, b), name


def test_dequantized_stream_unchanged_by_default(tiny_gguf):
    path, _, expected = tiny_gguf
    got = dict(iter_weights(str(path), None, torch.float32))
    assert not any(isinstance(v, QuantizedWeight) for v in got.values())
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert gguf.GGMLQuantizationType  # gguf-py present (the files above need it)


def test_q4_k_weights_stream_as_blocks(tmp_path):
    """Q4_K projections come as blocks too (gguf-py cannot quantize K-types: random blocks);
    other K-types are dequantized."""
    rng = np.random.default_rng(0)
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    raws = {"attn_output.weight": (gguf.GGMLQuantizationType.Q4_K, (256, 256)),
            "ffn_gate.weight": (gguf.GGMLQuantizationType.Q6_K, (96, 256))}
    expected = {}
    for name, (qtype, shape) in raws.items():
        raw = random_k_blocks(rng, shape, qtype)
        writer.add_tensor(f"blk.0.{name}", raw, raw_dtype=qtype)
        expected[name] = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype),
                                                    np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = _quantized(path)
    o_proj = got["model.layers.0.self_attn.o_proj.weight"]
    gate = got["model.layers.0.mlp.gate_proj.weight"]
    assert isinstance(o_proj, QuantizedWeight) and o_proj.qtype == "Q4_K"
    assert torch.equal(o_proj.dequantize(torch.float32), expected["attn_output.weight"])
    assert isinstance(gate, torch.Tensor) and torch.equal(gate, expected["ffn_gate.weight"])
