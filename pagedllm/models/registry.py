"""HF architecture name -> model class, imported lazily when chosen."""

from __future__ import annotations

import importlib

from pagedllm.errors import ModelLoadError

# architecture -> (module under pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ModelLoadError(f"model architecture {architecture!r} is not supported; "
                             f"supported: {', '.join(supported_architectures())}")
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(f"pagedllm.models.{module}"), cls)
