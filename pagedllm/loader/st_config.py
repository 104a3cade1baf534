"""The pooling (and the prompts) a sentence-transformers model directory declares.

A sentence-transformers model lists its modules in `modules.json`; its Pooling module's
`config.json` (e.g. `1_Pooling/config.json`) says how token vectors become one:
`pooling_mode_mean_tokens`, `pooling_mode_cls_token`, `pooling_mode_lasttoken`. vLLM
reads the same files to pick a model's default pooler.
"""

from __future__ import annotations

import json
from pathlib import Path

_POOLING_MODULE = "sentence_transformers.models.Pooling"
# Pooling config key -> PoolingParams.pooling_type, in the order checked.
_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
          ("pooling_mode_lasttoken", "last"))


def load_st_pooling_type(model_path: str) -> str | None:
    """"mean", "cls" or "last" from the directory's sentence-transformers Pooling module;
    None without one (a GGUF file, a plain HF directory) or for a mode pagedllm does not
    implement (max, mean-sqrt-len, weighted), whose caller falls back to its default."""
    root = Path(model_path)
    modules_file = root / "modules.json"
    if not root.is_dir() or not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
        if pooling is None:
            return None
        config = json.loads((root / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError):
        return None
    enabled = [kind for key, kind in _MODES if config.get(key)]
    # More than one mode concatenates vectors in sentence-transformers: not supported.
    return enabled[0] if len(enabled) == 1 else None


def load_st_prompts(model_path: str) -> dict[str, str] | None:
    """The `prompts` of the directory's config_sentence_transformers.json: a text put
    before each input of a kind (e.g. "query": "query: "), as sentence-transformers'
    `encode(prompt_name=...)` does; None without any."""
    file = Path(model_path) / "config_sentence_transformers.json"
    if not file.is_file():
        return None
    try:
        prompts = json.loads(file.read_text()).get("prompts")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(prompts, dict):
        return None
    return {k: v for k, v in prompts.items() if isinstance(k, str) and isinstance(v, str)} or None
