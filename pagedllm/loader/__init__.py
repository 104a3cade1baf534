"""Weight and tokenizer loading.

Loaders yield `(hf_name, tensor)` pairs under Hugging Face checkpoint names, one tensor at
a time, converted to the requested dtype; models own the mapping onto their parameters
(fusing, sharding, tying). Weight formats are a name registry with lazy imports so that
`gguf` is imported only for GGUF models.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from pagedllm.errors import ModelLoadError


class WeightFormat(Protocol):
    """A weight format module: one streaming entry point."""

    def iter_weights(self, model_path: str, hf_config: Any, dtype: torch.dtype
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, tensor)` for every tensor, one at a time, in `dtype`."""
        ...


_FORMATS: dict[str, str] = {
    "safetensors": "pagedllm.loader.safetensors",  # HF directories (also .bin fallback)
    "gguf": "pagedllm.loader.gguf_cache",  # GGUF through the conversion cache
}


def detect_format(model_path: str) -> str:
    """Name of the weight format of `model_path`: a directory -> safetensors, .gguf -> gguf."""
    if os.path.isdir(model_path) or model_path.endswith(".safetensors"):
        return "safetensors"
    if model_path.endswith(".gguf"):
        return "gguf"
    raise ModelLoadError(f"cannot tell the weight format of {model_path!r}: pass an HF model "
                         f"directory or a .gguf file")


def get_format(name: str) -> WeightFormat:
    """The format module registered under `name`, imported on first use."""
    if name not in _FORMATS:
        raise ModelLoadError(f"unknown weight format {name!r} (known: {', '.join(_FORMATS)})")
    return importlib.import_module(_FORMATS[name])  # type: ignore[return-value]


def iter_weights(model_path: str, hf_config: Any, dtype: torch.dtype,
                 load_format: str | None = None, quantization: str | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(hf_name, tensor)` pairs of a model, converted to `dtype`.

    `load_format`: None / "auto" detects the format from the path; "safetensors" and
    "pt" read only those files of an HF directory, "gguf" a .gguf file (a path of
    another kind is an error naming it). With quantization "gguf"
    (GGUF files only) weights the quantized GEMM runs on come as
    `kernels.cpu.quant.QuantizedWeight`s instead (models dequantize those they cannot
    use: models/utils.py). Path and format errors raise here; errors inside the files
    raise when the stream is consumed.
    """
    if not os.path.exists(model_path):
        raise ModelLoadError(f"model path does not exist: {model_path!r}")
    name = detect_format(model_path)
    if load_format not in (None, "auto", name, *(("pt",) if name == "safetensors" else ())):
        raise ModelLoadError(f"--load-format {load_format} cannot read {model_path!r}, a "
                             f"{'GGUF file' if name == 'gguf' else 'Hugging Face directory'}")
    fmt = get_format(name)
    if load_format in ("safetensors", "pt"):
        return fmt.iter_weights(model_path, hf_config, dtype,  # type: ignore[call-arg]
                                kinds=(load_format,))
    if quantization is None:
        return fmt.iter_weights(model_path, hf_config, dtype)
    if quantization != "gguf" or not name.startswith("gguf"):
        raise ModelLoadError(f"quantization {quantization!r} applies to GGUF files only "
                             f"({model_path!r} is {name})")
    return fmt.iter_weights(model_path, hf_config, dtype, quantized=True)  # type: ignore[call-arg]


def load_tokenizer(model_path: str, tokenizer_path: str | None = None,
                   trust_remote_code: bool = False) -> Any:
    """The transformers tokenizer of a model, with its chat template when it has one.

    `tokenizer_path` (a directory or a .gguf file) overrides the model's own. GGUF tokenizers
    come from the file's metadata through the conversion cache. `trust_remote_code` lets
    transformers run the directory's own tokenizer class (tokenizer_config.json's
    `auto_map`); without it such a tokenizer is refused.
    """
    source = tokenizer_path or model_path
    if source.endswith(".gguf"):
        from pagedllm.loader.gguf_cache import load_gguf_tokenizer

        return load_gguf_tokenizer(source)
    from transformers import AutoTokenizer

    from pagedllm.loader.hf_config import needs_remote_code, remote_code_refused

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        if needs_remote_code(e):
            raise remote_code_refused("tokenizer", source, "tokenizer_config.json") from e
        raise ModelLoadError(f"cannot load a tokenizer from {source!r}: {e}") from e
