"""GGUF weights as a stream of `(hf_name, tensor)` pairs.

A GGUF file (llama.cpp's format) stores tensors under llama.cpp names (`blk.3.attn_q.weight`),
in ggml's dimension order, often block-quantized. `GGUFWeights` memory-maps the file with
`gguf.GGUFReader`, checks every tensor up front (known name, supported type), and then
dequantizes one tensor at a time with `gguf.quants.dequantize`, renamed to the Hugging Face
checkpoint name and converted to the requested dtype. For llama it also undoes the q/k row
permutation that llama.cpp's converter applies (see `_unpermute_rows`); for GPT-2 it
transposes the projections back to the checkpoint's `Conv1D` layout.

With `quantized` (ModelConfig.quantization "gguf"), 2-D weights of the types the native
quantized GEMM runs on (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q4_K, Q5_K, Q6_K) are yielded as
`QuantizedWeight`s instead: the file's block rows, q/k rows un-permuted as bytes
(kernels/cpu/quant.py); Q3_K rows come converted into Q6_K's (the same weights).

Architectures are a per-architecture table (`_ARCHS`): tensor names, the transforms llama.cpp's
converter applied, and the config attributes transformers' GGUF config parsing leaves out
(`complete_hf_config`). Adding an architecture means adding a table entry, not control flow.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import torch

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu.quant import (CONVERTED_QTYPES, NATIVE_QTYPES, QuantizedWeight,
                                         block_elems, raw_row_bytes)

_QT = gguf.GGMLQuantizationType

SUPPORTED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset({
    _QT.F32, _QT.F16, _QT.BF16,
    _QT.Q4_0, _QT.Q4_1, _QT.Q5_0, _QT.Q5_1, _QT.Q8_0,
    _QT.Q2_K, _QT.Q3_K, _QT.Q4_K, _QT.Q5_K, _QT.Q6_K,
})
"""ggml tensor types this loader dequantizes (others raise ModelLoadError up front)."""


@dataclass(frozen=True)
class _ArchSpec:
    """How one GGUF architecture's tensor names map onto its HF checkpoint names."""

    hf_model_type: str
    """`model_type` of the matching transformers config (documentation and sanity checks)."""
    global_names: Mapping[str, str]
    """Full GGUF name -> full HF name, for tensors outside the decoder layers."""
    layer_names: Mapping[str, str]
    """GGUF name after `blk.N.` -> HF name after `model.layers.N.`."""
    permute_qk: bool = False
    """True when llama.cpp's converter interleaved the q/k rows for its rope kernel."""
    ignored: frozenset[str] = field(default_factory=frozenset)
    """GGUF tensors with no HF counterpart (derived from the config on the HF side)."""
    layer_prefix: str = "model.layers."
    """HF name prefix of decoder layer N, before `N.`."""
    transposed: frozenset[str] = field(default_factory=frozenset)
    """Layer tensors (names after `blk.N.`) stored as the transpose of the HF checkpoint's."""
    complete_config: Callable[[gguf.GGUFReader, dict[str, Any]], None] | None = None
    """Fills, in a config dict parsed by transformers, what its GGUF table leaves out."""
    native_quant: bool = True
    """Whether the models of this architecture take `QuantizedWeight`s (they load their
    tensors through `load_stacked_weights` unchanged)."""
    expert_names: Mapping[str, str] = field(default_factory=dict)
    """3-D expert tensors: GGUF name after `blk.N.` -> HF name after `model.layers.N.`
    with `{e}` for the expert (one HF tensor per expert)."""


_LLAMA_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    # Absent when the embeddings are tied; the model then ties lm_head itself.
    "output.weight": "lm_head.weight",
}
_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Mixtral (llama.cpp writes it as `llama` with experts): the router and the experts'
# 3-D tensors, under HF's block_sparse_moe names.
_MIXTRAL_LAYER = {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
_MIXTRAL_EXPERTS = {
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight",
}
_QWEN2_LAYER = {
    **_LLAMA_LAYER,
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
# Qwen3: Llama's tensors plus an RMSNorm over each q and k head.
_QWEN3_LAYER = {
    **_LLAMA_LAYER,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Qwen3-MoE: Qwen3's attention; the router, and every expert's gate / up / down stored
# as one 3-D tensor each ([experts, rows, cols]), split here into HF's per-expert names.
_QWEN3MOE_LAYER = {
    **{k: v for k, v in _QWEN3_LAYER.items() if not k.startswith("ffn_")},
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
_QWEN3MOE_EXPERTS = {
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}
# Phi-3's checkpoint already stores q/k/v and gate/up fused, as llama.cpp does (`ffn_up`
# holds [gate | up] rows); no q/k permutation (llama.cpp runs its rope in NEOX mode).
_PHI3_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GPT2_GLOBAL = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",  # only when untied (GPT-2 itself ties)
}
_GPT2_LAYER = {
    f"{gguf_part}.{kind}": f"{hf_part}.{kind}"
    for gguf_part, hf_part in (("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"),
                               ("attn_output", "attn.c_proj"), ("ffn_norm", "ln_2"),
                               ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj"))
    for kind in ("weight", "bias")
}


def _tensor_rows(reader: gguf.GGUFReader, name: str) -> int | None:
    """First torch-order dimension of a tensor (ggml's last `ne`), None when absent."""
    t = next((t for t in reader.tensors if t.name == name), None)
    return None if t is None else int(t.shape[-1])


def _complete_phi3_config(reader: gguf.GGUFReader, cfg: dict[str, Any]) -> None:
    """Sliding window, partial rotary and longrope factors, which transformers drops."""
    window = read_field(reader, "phi3.attention.sliding_window")
    if window is not None:  # llama.cpp writes 0 for "no window" (Phi-4-mini)
        cfg["sliding_window"] = int(window) or None
    cfg["vocab_size"] = _tensor_rows(reader, "token_embd.weight") or cfg.get("vocab_size")
    rope = dict(cfg.get("rope_parameters") or {})
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # llama.cpp stores int(partial_rotary_factor * hidden_size) // num_heads rotated dims.
    rope_dims = read_field(reader, "phi3.rope.dimension_count", head_dim)
    rope["partial_rotary_factor"] = int(rope_dims) / head_dim
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:  # longrope (Phi-3 128k, Phi-3.5): HF keeps the factors in the config
        rope["rope_type"] = "longrope"
        rope["long_factor"] = np.asarray(factors["rope_factors_long.weight"].data).tolist()
        rope["short_factor"] = np.asarray(factors["rope_factors_short.weight"].data).tolist()
        orig = read_field(reader, "phi3.rope.scaling.original_context_length")
        if orig is None:
            raise ModelLoadError("phi3 GGUF with rope factors lacks "
                                 "phi3.rope.scaling.original_context_length")
        cfg["original_max_position_embeddings"] = int(orig)
    cfg["rope_parameters"] = rope


def _complete_llama_config(reader: gguf.GGUFReader, cfg: dict[str, Any]) -> None:
    """A `llama` file with experts is Mixtral (transformers' llama table has no expert
    fields): the model type and the expert counts."""
    num_experts = read_field(reader, "llama.expert_count")
    if num_experts:
        cfg["model_type"] = "mixtral"
        cfg["num_local_experts"] = int(num_experts)
        cfg["num_experts_per_tok"] = int(read_field(reader, "llama.expert_used_count", 2))


def _complete_qwen3_config(reader: gguf.GGUFReader, cfg: dict[str, Any]) -> None:
    """The head size (Qwen3's is its own, 128 in the released models, not hidden /
    heads: transformers' qwen3 table drops attention.key_length)."""
    head_dim = read_field(reader, "qwen3.attention.key_length")
    if head_dim is not None:
        cfg["head_dim"] = int(head_dim)


def _complete_qwen3moe_config(reader: gguf.GGUFReader, cfg: dict[str, Any]) -> None:
    """The experts' width (transformers' table maps only the dense one) and the top-k
    renormalization llama.cpp's qwen3moe graph applies (the released models' setting)."""
    width = read_field(reader, "qwen3moe.expert_feed_forward_length")
    if width is not None:
        cfg["moe_intermediate_size"] = int(width)
    cfg["norm_topk_prob"] = True


def _complete_gpt2_config(reader: gguf.GGUFReader, cfg: dict[str, Any]) -> None:
    """Sizes transformers' GPT-2 table misses (it maps context_length to an unused `n_ctx`
    and takes vocab_size from the token list only): read off the tensors themselves."""
    sizes = {"vocab_size": "token_embd.weight", "n_positions": "position_embd.weight",
             "n_inner": "blk.0.ffn_up.weight"}  # ffn_up is c_fc transposed: [n_inner, n_embd]
    for key, tensor_name in sizes.items():
        rows = _tensor_rows(reader, tensor_name)
        if rows is not None:
            cfg[key] = rows


_ARCHS: Mapping[str, _ArchSpec] = {
    # llama.cpp writes Llama 3.x rope scaling as a `rope_freqs` tensor; HF derives the same
    # frequencies from config.rope_scaling, so it is skipped rather than yielded.
    "llama": _ArchSpec("llama", _LLAMA_GLOBAL, {**_LLAMA_LAYER, **_MIXTRAL_LAYER},
                       permute_qk=True, ignored=frozenset({"rope_freqs.weight"}),
                       expert_names=_MIXTRAL_EXPERTS, complete_config=_complete_llama_config),
    # llama.cpp's Qwen2 converter does not permute q/k (its rope runs in NEOX mode, which
    # pairs rows like HF's rotate_half).
    "qwen2": _ArchSpec("qwen2", _LLAMA_GLOBAL, _QWEN2_LAYER),
    # Qwen3 / Qwen3-MoE: NEOX rope as Qwen2 (no permutation).
    "qwen3": _ArchSpec("qwen3", _LLAMA_GLOBAL, _QWEN3_LAYER,
                       complete_config=_complete_qwen3_config),
    "qwen3moe": _ArchSpec("qwen3_moe", _LLAMA_GLOBAL, _QWEN3MOE_LAYER,
                          expert_names=_QWEN3MOE_EXPERTS,
                          complete_config=_complete_qwen3moe_config),
    # Longrope factors live in the HF config (`complete_config` moves them there).
    "phi3": _ArchSpec("phi3", _LLAMA_GLOBAL, _PHI3_LAYER,
                      ignored=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
                      complete_config=_complete_phi3_config),
    # GPT-2's checkpoint keeps its projections as Conv1D [in, out]; llama.cpp transposes
    # them to ggml's [out, in] matmul layout, so they are transposed back here.
    "gpt2": _ArchSpec("gpt2", _GPT2_GLOBAL, _GPT2_LAYER, layer_prefix="transformer.h.",
                      transposed=frozenset({"attn_qkv.weight", "attn_output.weight",
                                            "ffn_up.weight", "ffn_down.weight"}),
                      complete_config=_complete_gpt2_config, native_quant=False),
}

_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the stream, known before any data is read."""

    hf_name: str
    """Hugging Face checkpoint name."""
    shape: tuple[int, ...]
    """Shape of the HF tensor (ggml's `ne` reversed, then transposed when `transpose`)."""
    gguf_index: int
    """Index into `GGUFReader.tensors`."""
    permute_heads: int | None = None
    """Number of heads whose rows llama.cpp interleaved (q: n_head, k: n_head_kv); None: none."""
    transpose: bool = False
    """True when the file stores the transpose of the HF tensor (2-D)."""
    expert: int | None = None
    """The expert this tensor is of a 3-D expert tensor (its slice [expert]); None: the
    whole GGUF tensor."""


class _Reader(gguf.GGUFReader):
    """gguf-py's reader over a plain ndarray view of its memory map instead of the
    `np.memmap` itself: the header parse slices that array once or more per value, and
    each memmap slice runs Python (`__getitem__`, `__array_finalize__`). The bundled
    model's header (a 49k-token vocabulary and its merges) parsed in 4.8 s, now 1.4 s:
    the same fields and tensors over the same mapping."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)  # its base, the memmap, keeps the mapping open


# Held while `gguf.GGUFReader` is swapped (transformers_parse_fast): one swap at a time, so
# each restores the class it found.
_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def transformers_parse_fast() -> Iterator[list[gguf.GGUFReader]]:
    """Within it, transformers' own GGUF parses (`AutoConfig` / `AutoTokenizer`
    `.from_pretrained(dir, gguf_file=name)`) go through `_Reader` too; yields the list
    of the readers built meanwhile, so that the caller can read more of the header
    without parsing it again (1.4 s for the bundled model's).

    transformers builds its reader from the path inside `load_gguf_checkpoint`, looking
    `gguf.GGUFReader` up at call time, and takes no reader from outside, so the class is
    swapped for the call. `_Reader` parses the same fields and tensors
    (tests/loader/test_gguf_real.py), so another thread that happens to build a reader
    meanwhile gets the same result, only sooner. A 151k-token vocabulary's tokenizer:
    17.4 -> 6.2 s on Zen 3.
    """
    built: list[gguf.GGUFReader] = []

    class Recorded(_Reader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    with _SWAP_LOCK:
        original = gguf.GGUFReader
        gguf.GGUFReader = Recorded
        try:
            yield built
        finally:
            gguf.GGUFReader = original


def open_reader(path: str) -> gguf.GGUFReader:
    """The parsed header of the GGUF file at `path` (tensor data stays mapped, unread);
    ModelLoadError when it is not a readable GGUF file."""
    try:
        return _Reader(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from e


def read_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of a metadata key, `default` when the file has none."""
    f = reader.get_field(key)
    return default if f is None else f.contents()


def _hf_name(spec: _ArchSpec, gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor under `spec`, or None when the name is unknown."""
    if gguf_name in spec.global_names:
        return spec.global_names[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in spec.layer_names:
        return f"{spec.layer_prefix}{m.group(1)}.{spec.layer_names[m.group(2)]}"
    return None


class GGUFWeights:
    """The tensors of one GGUF file, validated up front and dequantized on demand.

    Opening parses the header (memory-mapped; no tensor data is read). `specs` lists the
    stream's names and shapes before any dequantization, which lets the conversion cache
    write a safetensors header ahead of the data.
    """

    def __init__(self, path: str) -> None:
        self.reader = open_reader(path)
        self.path = path
        self.arch = str(read_field(self.reader, "general.architecture", ""))
        spec = _ARCHS.get(self.arch)
        if spec is None:
            raise ModelLoadError(f"GGUF architecture {self.arch!r} of {path!r} is not supported "
                                 f"(supported: {', '.join(sorted(_ARCHS))})")
        self.specs = self._plan(spec)
        self.native_quant = spec.native_quant

    def _head_counts(self) -> tuple[int, int]:
        num_heads = read_field(self.reader, f"{self.arch}.attention.head_count")
        if num_heads is None:
            raise ModelLoadError(f"GGUF {self.path!r} lacks {self.arch}.attention.head_count")
        num_kv_heads = read_field(self.reader, f"{self.arch}.attention.head_count_kv", num_heads)
        return int(num_heads), int(num_kv_heads)

    def _plan(self, spec: _ArchSpec) -> list[TensorSpec]:
        """Map every tensor to its HF name; fail on unknown names or types before reading data."""
        num_heads, num_kv_heads = self._head_counts() if spec.permute_qk else (0, 0)
        specs: list[TensorSpec] = []
        unknown: list[str] = []
        unsupported: list[str] = []
        for i, t in enumerate(self.reader.tensors):
            if t.name in spec.ignored:
                continue
            m = _LAYER_RE.fullmatch(t.name)
            if m is not None and m.group(2) in spec.expert_names:
                if t.tensor_type not in SUPPORTED_TYPES:
                    unsupported.append(f"{t.name} ({t.tensor_type.name})")
                num_experts, rows, cols = (int(d) for d in reversed(t.shape.tolist()))
                pattern = f"{spec.layer_prefix}{m.group(1)}.{spec.expert_names[m.group(2)]}"
                specs += [TensorSpec(pattern.format(e=e), (rows, cols), i, expert=e)
                          for e in range(num_experts)]
                continue
            hf_name = _hf_name(spec, t.name)
            if hf_name is None:
                unknown.append(t.name)
                continue
            if t.tensor_type not in SUPPORTED_TYPES:
                unsupported.append(f"{t.name} ({t.tensor_type.name})")
            heads = None
            if spec.permute_qk and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                heads = num_heads
            elif spec.permute_qk and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                heads = num_kv_heads
            # ggml lists dimensions fastest-varying first (ne[0] = row length): reversed,
            # they are torch's row-major shape.
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            m = _LAYER_RE.fullmatch(t.name)
            transpose = m is not None and m.group(2) in spec.transposed and len(shape) == 2
            if transpose:
                shape = shape[::-1]
            specs.append(TensorSpec(hf_name, shape, i, heads, transpose))
        if unknown:
            raise ModelLoadError(f"GGUF {self.path!r} ({self.arch}) has tensors with no known "
                                 f"Hugging Face name: {', '.join(unknown)}")
        if unsupported:
            raise ModelLoadError(f"GGUF {self.path!r} has tensor types this loader cannot "
                                 f"dequantize: {', '.join(unsupported)}")
        return specs

    def iter_weights(self, dtype: torch.dtype, quantized: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield `(hf_name, tensor)` one at a time, in file order, converted to `dtype`;
        with `quantized`, the tensors `is_quantizable` accepts as `QuantizedWeight`s."""
        for spec in self.specs:
            if quantized and self.is_quantizable(spec):
                yield spec.hf_name, self.load_quantized(spec)
            else:
                yield spec.hf_name, self.load(spec, dtype)

    def is_quantizable(self, spec: TensorSpec) -> bool:
        """A 2-D weight of a type the quantized GEMM runs on, kept in the file's layout."""
        t = self.reader.tensors[spec.gguf_index]
        name = t.tensor_type.name
        return (self.native_quant and (name in NATIVE_QTYPES or name in CONVERTED_QTYPES)
                and len(spec.shape) == 2 and not spec.transpose
                and spec.shape[1] % block_elems(t.tensor_type.name) == 0)

    def native_layout(self, spec: TensorSpec) -> tuple[str, int]:
        """The native type a quantizable tensor comes as (its own, or the one
        CONVERTED_QTYPES turns it into) and its bytes per row."""
        qtype = self.reader.tensors[spec.gguf_index].tensor_type.name
        if qtype in CONVERTED_QTYPES:
            qtype = CONVERTED_QTYPES[qtype][0]
        return qtype, raw_row_bytes(qtype, spec.shape[1])

    def load_quantized(self, spec: TensorSpec) -> QuantizedWeight:
        """One tensor's blocks as stored (q/k rows un-permuted: blocks never straddle rows),
        or converted exactly into a native type's (CONVERTED_QTYPES: Q3_K as Q6_K)."""
        t = self.reader.tensors[spec.gguf_index]
        raw = torch.from_numpy(np.array(_data(t, spec), dtype=np.uint8, copy=True))
        raw = raw.reshape(spec.shape[0], -1)
        qtype = t.tensor_type.name
        if qtype in CONVERTED_QTYPES:
            qtype, convert = CONVERTED_QTYPES[qtype]
            raw = convert(raw)
        if spec.permute_heads is not None:
            raw = _unpermute_rows(raw, spec.permute_heads, spec.hf_name).contiguous()
        return QuantizedWeight(qtype, raw, spec.shape[1])

    def load(self, spec: TensorSpec, dtype: torch.dtype) -> torch.Tensor:
        """Dequantize one tensor to its HF layout and `dtype`."""
        t = self.reader.tensors[spec.gguf_index]
        if spec.transpose:  # stored [out, in]; the HF checkpoint holds [in, out]
            w = _to_torch(t.tensor_type, _data(t, spec), spec.shape[::-1]).t()
        else:
            w = _to_torch(t.tensor_type, _data(t, spec), spec.shape)
        if spec.permute_heads is not None:
            w = _unpermute_rows(w, spec.permute_heads, spec.hf_name)
        return w.to(dtype).contiguous()


def _data(t: Any, spec: TensorSpec) -> np.ndarray:
    """The tensor's data view, or its expert's slice (the leading dimension of a 3-D
    tensor's data, typed or raw bytes alike)."""
    return t.data if spec.expert is None else t.data[spec.expert]


def _to_torch(qtype: gguf.GGMLQuantizationType, data: np.ndarray,
              shape: tuple[int, ...]) -> torch.Tensor:
    """GGUF tensor data as a torch tensor of `shape`: float32 when quantized, else
    loss-free.

    `data` is a read-only view into the memory map: F32/F16 as typed arrays already in
    torch order, everything else (BF16 included) as raw bytes shaped [rows, bytes_per_row].
    """
    if qtype in (_QT.F32, _QT.F16):
        # Copy: the map is read-only and the caller may keep the tensor past the reader.
        return torch.from_numpy(np.array(data, copy=True)).reshape(shape)
    if qtype == _QT.BF16:
        # Keep bf16 exact instead of widening through numpy: two bytes per element.
        raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).reshape(-1)
        return raw.view(torch.bfloat16).reshape(shape)
    deq = gguf.quants.dequantize(data, qtype)  # float32, torch-order shape
    return torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32)).reshape(shape)


def _unpermute_rows(w: torch.Tensor, num_heads: int, name: str) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of q/k rows, back to HF's rotate_half layout.

    HF rotates row j of a head (head_dim rows, half = head_dim / 2) together with row
    j + half. ggml's llama rope rotates adjacent rows (2j, 2j + 1) instead, so llama.cpp's
    converter reorders each head's rows: GGUF row `2*j + t` holds HF row `t*half + j`
    (t in {0, 1}, j < half). Viewing the GGUF rows of a head as [half, 2] (index j, t) and
    swapping to [2, half] (t, j) puts HF row `t*half + j` back at position `t*half + j`.
    Works for weights [rows, cols] and biases [rows] alike (trailing dims ride along).
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"{name}: {rows} rows do not split into {num_heads} heads of "
                             f"even size, cannot undo llama.cpp's rotary permutation")
    half = rows // num_heads // 2
    # [num_heads, half (j), 2 (t), ...] -> [num_heads, 2 (t), half (j), ...]
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def complete_hf_config(path: str, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a dict transformers parsed from the GGUF at `path`) completed with what its
    GGUF table leaves out for this architecture (GPT-2's sizes, Phi-3's sliding window,
    partial rotary and longrope factors).

    Only architectures with a `complete_config` re-read the header (seconds for a large
    vocabulary, once: the config is cached); the others return `config` unchanged.
    """
    spec = next((s for s in _ARCHS.values()
                 if s.hf_model_type == config.get("model_type") and s.complete_config), None)
    if spec is None:
        return config
    config = dict(config)
    spec.complete_config(open_reader(path), config)
    return config


def iter_weights(model_path: str, hf_config: Any, dtype: torch.dtype, quantized: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Uncached GGUF stream (the registry's `gguf` format goes through `gguf_cache`)."""
    del hf_config  # the GGUF metadata is authoritative for its own layout
    yield from GGUFWeights(model_path).iter_weights(dtype, quantized)
