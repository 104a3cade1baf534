"""On-disk conversion cache for GGUF models: weights, config and tokenizer.

Parsing a GGUF header (tens of thousands of vocabulary strings) and dequantizing its
tensors takes seconds; transformers' GGUF config and tokenizer parsing takes seconds more.
The first load of a file therefore writes what it produced under

    cache_root()/gguf/<key>/
        weights-<dtype>.safetensors   HF-named tensors in the requested dtype
        weights-gguf-<dtype>.safetensors  the same with quantized weights kept as blocks
                                      (`quantization="gguf"`: raw uint8 rows, their type
                                      in the header's metadata; the rest in the dtype)
        config/                       `PretrainedConfig.save_pretrained`
        tokenizer-v2/                 `tokenizer.save_pretrained` (chat template included),
                                      split as llama.cpp splits (gguf_vocab.py; the
                                      `tokenizer/` of older entries is not read)
        source.json                   which file the entry was made from (for humans)

and later loads read only these. `<key>` hashes the format version, the file's size and
mtime_ns, and sha256 of its first and last MiB: a rewritten or touched file gets a new
entry, without hashing gigabytes on every start.

Weights are stored in the requested dtype, one file per dtype: the cache then yields
bit-for-bit what the uncached path yields (the dequantize-then-cast happens once, before
writing), reads half the bytes in the common bfloat16 case, and stores half the bytes of a
float32 copy. A dtype switch costs one more conversion, which is rare.

Every entry part is written under a temporary name in the entry directory and published
with `os.replace`, so a crash leaves either the old state or a complete part, never half
of one. The weights file is written while the tensors stream to the caller (its header is
computed from the GGUF tensor shapes before any data), and published only once the stream
was consumed to the end. A cache that cannot be written (read-only disk, disk full) only
costs speed: loading falls back to converting without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from pagedllm.config import cache_root
from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu.quant import QuantizedWeight
from pagedllm.loader.gguf import (GGUFWeights, complete_hf_config, open_reader,
                                  transformers_parse_fast)
from pagedllm.loader.gguf_vocab import match_llama_cpp
from pagedllm.loader.safetensors import iter_safetensors_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 5
# The entry's tokenizer directory: renamed, not FORMAT_VERSION bumped, when only the
# tokenizer's conversion changes, so that the weights converted before stay in use.
TOKENIZER_DIR = "tokenizer-v2"
"""Bump when the cached layout or the conversion changes; old entries are then ignored.
(3: Q5_0 / Q5_1 / Q5_K / Q6_K weights kept as blocks in the quantized stream; 4: Q3_K
weights as Q6_K blocks; 5: Q2_K weights kept as blocks.)"""
_HASH_BYTES = 1 << 20
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float64: "F64", torch.uint8: "U8"}
# (name, shape, dtype) of one tensor of a cached weights file.
_Spec = tuple[str, tuple[int, ...], torch.dtype]


def cache_key(path: str) -> str:
    """Key of a GGUF file's cache entry (see the module docstring)."""
    try:
        st = os.stat(path)
        h = hashlib.sha256(f"pagedllm-gguf-v{FORMAT_VERSION}:{st.st_size}:{st.st_mtime_ns}:"
                           .encode())
        with open(path, "rb") as f:
            h.update(f.read(_HASH_BYTES))
            if st.st_size > _HASH_BYTES:  # the last MiB, or the rest of a file under 2 MiB
                f.seek(max(_HASH_BYTES, st.st_size - _HASH_BYTES))
                h.update(f.read(_HASH_BYTES))
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {e}") from e
    return h.hexdigest()[:32]


def entry_dir(path: str) -> Path:
    """Cache directory of a GGUF file (it may not exist yet)."""
    return cache_root() / "gguf" / cache_key(path)


def _ensure_entry(entry: Path, path: str) -> bool:
    """Create the entry directory (with its source.json); False when the cache is unusable."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        if not (entry / "source.json").exists():
            st = os.stat(path)
            info = {"path": os.path.abspath(path), "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns, "format_version": FORMAT_VERSION}
            tmp = entry / f".tmp-{uuid.uuid4().hex}-source.json"
            tmp.write_text(json.dumps(info, indent=1))
            os.replace(tmp, entry / "source.json")
        return True
    except OSError as e:
        logger.warning("GGUF cache disabled: cannot write %s (%s)", entry, e)
        return False


def _publish_dir(entry: Path, name: str, fill: Callable[[str], Any]) -> None:
    """Fill a temporary directory with `fill(dir)`, then rename it to `entry/name`.

    If a concurrent loader published first, the rename fails and our copy is dropped.
    """
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=entry)
        fill(tmp)
        os.replace(tmp, entry / name)
    except Exception as e:  # a cache that cannot be written costs speed, never the load
        if not (entry / name).is_dir():
            logger.warning("could not cache %s in %s: %s", name, entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class _StreamingSafetensorsWriter:
    """Writes a safetensors file whose header is known before its data arrives.

    Format: 8-byte little-endian header length, JSON header (name -> dtype, shape,
    data_offsets relative to the data start), then the tensors' bytes back to back in
    header order. Written to a temporary name; `commit` renames it into place.
    """

    def __init__(self, target: Path, specs: list[_Spec],
                 metadata: dict[str, str] | None = None) -> None:
        self.target = target
        self.tmp = target.with_name(f".tmp-{uuid.uuid4().hex}-{target.name}")
        self.expected = iter((name, shape) for name, shape, _ in specs)
        header = _header(specs, metadata or {})
        self.file: BinaryIO | None = open(self.tmp, "wb")
        try:
            self.file.write(struct.pack("<Q", len(header)))
            self.file.write(header)
        except OSError:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor's bytes (it must be the next one of the header)."""
        exp_name, exp_shape = next(self.expected)
        assert (name, tuple(tensor.shape)) == (exp_name, exp_shape), (name, exp_name)
        assert self.file is not None
        self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def commit(self) -> None:
        """Flush to disk and publish under the target name."""
        assert self.file is not None and next(self.expected, None) is None
        file, self.file = self.file, None
        try:
            with file:
                file.flush()
                os.fsync(file.fileno())
            os.replace(self.tmp, self.target)
        except OSError:
            self.tmp.unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        """Drop the partial file (no-op after commit)."""
        if self.file is not None:
            self.file.close()
            self.file = None
            self.tmp.unlink(missing_ok=True)


def _header(specs: list[_Spec], metadata: dict[str, str]) -> bytes:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt",
                                             "pagedllm_gguf_cache": str(FORMAT_VERSION),
                                             **metadata}}
    offset = 0
    for name, shape, dtype in specs:
        num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        meta[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                      "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned


def _convert_and_fill(weights: GGUFWeights, dtype: torch.dtype, target: Path
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the dequantized tensors, writing each to the cache file before it is yielded."""
    stream = ((spec.hf_name, weights.load(spec, dtype)) for spec in weights.specs)
    yield from _write_through(target, [(s.hf_name, s.shape, dtype) for s in weights.specs],
                              {}, stream)


def _write_through(target: Path, specs: list[_Spec], metadata: dict[str, str],
                   stream: Iterator[tuple[str, torch.Tensor | QuantizedWeight]],
                   ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield `stream`, writing each tensor (a quantized weight's raw blocks) to the cache
    file `target` before it is yielded.

    The file is published only when the caller consumed the whole stream; an abandoned or
    failed load removes it. A write error disables the cache for this load, not the load.
    """
    writer: _StreamingSafetensorsWriter | None = None
    try:
        writer = _StreamingSafetensorsWriter(target, specs, metadata)
    except OSError as e:
        logger.warning("not caching GGUF weights at %s: %s", target, e)
    try:
        for name, tensor in stream:
            if writer is not None:
                try:
                    writer.write(name, tensor.raw if isinstance(tensor, QuantizedWeight)
                                 else tensor)
                except OSError as e:
                    logger.warning("not caching GGUF weights at %s: %s", target, e)
                    writer.abort()
                    writer = None
            yield name, tensor
        if writer is not None:
            try:
                writer.commit()
            except OSError as e:
                logger.warning("not caching GGUF weights at %s: %s", target, e)
    finally:
        if writer is not None:
            writer.abort()


def _open_cached(target: Path) -> bool:
    """True when `target` is a readable safetensors file; a corrupt one is removed."""
    if not target.is_file():
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(target), framework="pt"):
            return True
    except Exception as e:  # SafetensorError: truncated or foreign file
        logger.warning("discarding unreadable GGUF cache file %s: %s", target, e)
        target.unlink(missing_ok=True)
        return False


def _quantized_specs(weights: GGUFWeights, dtype: torch.dtype
                     ) -> tuple[list[_Spec], dict[str, str]]:
    """The cached file's tensors with `quantized`: raw block rows where the quantized GEMM
    runs, `dtype` elsewhere; the metadata names each raw tensor's type and row length."""
    specs: list[_Spec] = []
    metadata: dict[str, str] = {}
    for s in weights.specs:
        if weights.is_quantizable(s):
            qtype, row_bytes = weights.native_layout(s)
            specs.append((s.hf_name, (s.shape[0], row_bytes), torch.uint8))
            metadata[f"qtype:{s.hf_name}"] = f"{qtype}:{s.shape[1]}"
        else:
            specs.append((s.hf_name, s.shape, dtype))
    return specs, metadata


def _convert_quantized(weights: GGUFWeights, dtype: torch.dtype, target: Path
                       ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The quantized stream, written to `target` on the way (as `_convert_and_fill`)."""
    yield from _write_through(target, *_quantized_specs(weights, dtype),
                              weights.iter_weights(dtype, quantized=True))


_TORCH_DTYPES = {name: dtype for dtype, name in _ST_DTYPES.items()}


def _read_quantized(target: Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A cached quantized stream, tensor by tensor, read into fresh tensors with plain
    reads (no memory map: mapped pages would count in the process' RSS on top of the
    copies, ~2x the weights at the peak of a load)."""
    with open(target, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        metadata = header.pop("__metadata__", {}) or {}
        start = 8 + header_len
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=_TORCH_DTYPES[info["dtype"]])
            f.seek(start + begin)
            if f.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != end - begin:
                raise ModelLoadError(f"truncated GGUF cache file {target}")
            qtype = metadata.get(f"qtype:{name}")
            if qtype is None:
                yield name, tensor
            else:
                kind, in_features = qtype.split(":")
                yield name, QuantizedWeight(kind, tensor, int(in_features))


def iter_weights(model_path: str, hf_config: Any, dtype: torch.dtype, quantized: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """GGUF weights as `(hf_name, tensor)`: from the cache when present, else converted
    (and cached on the way). With `quantized`, weights of the types the quantized GEMM
    runs on come as `QuantizedWeight`s (kernels/cpu/quant.py), the rest in `dtype`."""
    del hf_config  # the GGUF metadata is authoritative for its own layout
    entry = entry_dir(model_path)
    if quantized:
        target = entry / f"weights-gguf-{str(dtype).removeprefix('torch.')}.safetensors"
        if _open_cached(target):
            yield from _read_quantized(target)
            return
        weights = GGUFWeights(model_path)
        if not _ensure_entry(entry, model_path):
            yield from weights.iter_weights(dtype, quantized=True)
            return
        yield from _convert_quantized(weights, dtype, target)
        return
    target = entry / f"weights-{str(dtype).removeprefix('torch.')}.safetensors"
    if dtype in _ST_DTYPES and _open_cached(target):
        yield from iter_safetensors_file(target, dtype)
        return
    weights = GGUFWeights(model_path)
    if dtype not in _ST_DTYPES or not _ensure_entry(entry, model_path):
        yield from weights.iter_weights(dtype)
        return
    yield from _convert_and_fill(weights, dtype, target)


def _split(path: str) -> tuple[str, str]:
    p = Path(path)
    return str(p.parent), p.name


def _parse_config(path: str) -> Any:
    """The transformers config from the GGUF metadata (slow: parses the whole header)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    directory, name = _split(path)
    try:
        with transformers_parse_fast():
            cfg = AutoConfig.from_pretrained(directory, gguf_file=name)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the model config of {path!r}: {e}") from e
    as_dict = cfg.to_dict()
    completed = complete_hf_config(path, as_dict)
    if completed is not as_dict:
        # The completion may name another model type (a `llama` file with experts is
        # Mixtral's).
        cls = (type(cfg) if completed["model_type"] == cfg.model_type
               else CONFIG_MAPPING[completed["model_type"]])
        cfg = cls.from_dict(completed)
    if not getattr(cfg, "architectures", None):
        # GGUF-derived configs carry model_type but no architectures list.
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type)
        cfg.architectures = [arch] if arch else []
    return cfg


def load_gguf_config(path: str) -> Any:
    """The `transformers.PretrainedConfig` of a GGUF file, cached after the first parse.

    Equal to `AutoConfig.from_pretrained(dir, gguf_file=name)` plus `architectures` filled
    in from the model type (GGUF metadata carries none) and, for some architectures, the
    attributes transformers' GGUF parsing drops (`gguf.complete_hf_config`).
    """
    from transformers import AutoConfig

    entry = entry_dir(path)
    if (entry / "config" / "config.json").is_file():
        try:
            cfg = AutoConfig.from_pretrained(str(entry / "config"))
            cfg.name_or_path = _split(path)[0]  # as transformers' own GGUF load sets it
            return cfg
        except (OSError, ValueError) as e:
            logger.warning("ignoring unreadable cached config in %s: %s", entry, e)
    cfg = _parse_config(path)
    if _ensure_entry(entry, path):
        _publish_dir(entry, "config", cfg.save_pretrained)
    return cfg


def _read_cached_tokenizer(entry: Path) -> Any | None:
    """The cached tokenizer of an entry, None when absent or unreadable.

    NOTE: read with the generic `PreTrainedTokenizerFast`, not `AutoTokenizer`: the saved
    config names the class transformers picked for the architecture (e.g. `Qwen2Tokenizer`),
    whose `__init__` rebuilds the normalizer and pre-tokenizer from its own defaults instead
    of taking the GGUF-derived ones from tokenizer.json (a `qwen35` vocabulary came back
    with Qwen2's split regex and an NFC normalizer added).
    """
    from transformers import PreTrainedTokenizerFast

    if not (entry / TOKENIZER_DIR).is_dir():
        return None
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(entry / TOKENIZER_DIR))
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable cached tokenizer in %s: %s", entry, e)
        return None


def load_gguf_tokenizer(path: str) -> Any:
    """The tokenizer (with chat template) from a GGUF file's metadata, cached after the first
    parse as a regular transformers tokenizer directory.

    The first load also returns the tokenizer read back from the cache, so that it behaves
    like every later load: transformers' freshly converted object can differ from its own
    saved form (Phi-3's `</s>`, a plain token in the file, is still skipped as special).
    """
    from transformers import AutoTokenizer

    entry = entry_dir(path)
    cached = _read_cached_tokenizer(entry)
    if cached is not None:
        return cached
    directory, name = _split(path)
    try:
        with transformers_parse_fast() as readers:
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the tokenizer of {path!r}: {e}") from e
    match_llama_cpp(tokenizer, readers[-1] if readers else open_reader(path))
    if _ensure_entry(entry, path):
        _publish_dir(entry, TOKENIZER_DIR, tokenizer.save_pretrained)
        cached = _read_cached_tokenizer(entry)
    return tokenizer if cached is None else cached
