"""The `transformers` config of a model directory or GGUF file."""

from __future__ import annotations

from typing import Any

from pagedllm.errors import ModelLoadError


def load_hf_config(path: str) -> Any:
    """The `transformers` config of an HF directory or a GGUF file (from its metadata)."""
    from transformers import AutoConfig

    try:
        if path.endswith(".gguf"):
            # Cached next to the converted weights: transformers' GGUF parsing is slow.
            from pagedllm.loader.gguf_cache import load_gguf_config

            cfg = load_gguf_config(path)
        else:
            cfg = AutoConfig.from_pretrained(path)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the model config at {path!r}: {e}") from e
    if not getattr(cfg, "architectures", None):
        # GGUF-derived configs carry model_type but no architectures list.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type)
        cfg.architectures = [arch] if arch else []
    return cfg
