"""The `transformers` config of a model directory or GGUF file, and what a model
directory's own code (`trust_remote_code`) needs in pagedllm's other processes."""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

from pagedllm.errors import ModelLoadError


def load_hf_config(path: str, trust_remote_code: bool = False) -> Any:
    """The `transformers` config of an HF directory or a GGUF file (from its metadata).
    `trust_remote_code` lets transformers run the directory's own config class (its
    config.json's `auto_map`); without it such a directory is refused, never asked about
    (transformers would otherwise prompt on a terminal)."""
    from transformers import AutoConfig

    try:
        if path.endswith(".gguf"):
            # Cached next to the converted weights: transformers' GGUF parsing is slow.
            from pagedllm.loader.gguf_cache import load_gguf_config

            cfg = load_gguf_config(path)
        else:
            cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as e:
        if needs_remote_code(e):
            raise remote_code_refused("config", path, "config.json") from e
        raise ModelLoadError(f"cannot read the model config at {path!r}: {e}") from e
    if getattr(cfg, "model_type", None) in _VISION_LANGUAGE_MODEL_TYPES:
        return flatten_vision_language_config(cfg)
    if not getattr(cfg, "architectures", None):
        # GGUF-derived configs carry model_type but no architectures list.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type)
        cfg.architectures = [arch] if arch else []
    return cfg


def needs_remote_code(error: BaseException) -> bool:
    """Whether transformers refused a directory because its own code was not trusted."""
    return isinstance(error, ValueError) and "trust_remote_code" in str(error)


def remote_code_refused(what: str, path: str, file: str) -> ModelLoadError:
    """The error of a `what` (config, tokenizer) that is the directory's own code."""
    return ModelLoadError(f"the {what} of {path!r} is the directory's own code (auto_map in "
                          f"{file}): pass trust_remote_code=True (--trust-remote-code) to "
                          f"run it")


def import_remote_code_modules() -> None:
    """Let this process import the modules transformers made of model directories' own
    code (`transformers_modules`, under HF_MODULES_CACHE): a config whose class is one
    is pickled by reference, so a child process (the engine core, a worker) unpickles
    it only with that directory on sys.path, as transformers put it on the loader's.
    Called before a child unpickles its config; nothing is imported until a pickle
    names such a module, and only the front end's own pickles reach a child."""
    from transformers.utils import HF_MODULES_CACHE

    if HF_MODULES_CACHE not in sys.path and os.path.isdir(HF_MODULES_CACHE):
        sys.path.append(HF_MODULES_CACHE)


# Vision-language configs the engine reads through their decoder's (text) config.
_VISION_LANGUAGE_MODEL_TYPES = frozenset({"llava"})
# The fields of a LLaVA config beside its text and vision configs.
_LLAVA_FIELDS = ("vision_feature_layer", "vision_feature_select_strategy",
                 "projector_hidden_act", "multimodal_projector_bias")


def flatten_vision_language_config(cfg: Any) -> Any:
    """A LLaVA config as the engine reads it: a copy of its decoder's config (so that
    layers, heads, vocabulary and windows are where every part of the engine looks),
    with the architecture, `text_architecture` (the decoder's class name),
    `vision_config`, `image_token_id` and LLaVA's own fields added."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = copy.deepcopy(cfg.get_text_config())
    text_arch = (getattr(text, "architectures", None) or [None])[0] \
        or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text.model_type)
    if text_arch is None:
        raise ModelLoadError(f"no decoder for the text model type {text.model_type!r} of "
                             f"this {cfg.model_type} model")
    text.architectures = list(cfg.architectures or ["LlavaForConditionalGeneration"])
    text.text_architecture = text_arch
    text.vision_config = cfg.vision_config
    image_token = getattr(cfg, "image_token_id", None)
    text.image_token_id = image_token if image_token is not None else cfg.image_token_index
    for name in _LLAVA_FIELDS:
        setattr(text, name, getattr(cfg, name))
    # The wrapper's tie flag is the one transformers honours for the LM head.
    text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
    return text
