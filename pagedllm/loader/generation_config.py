"""A model's generation_config.json: the sampling defaults its makers recommend, and
the tokens that end its turns.

As vLLM (its `--generation-config auto`, the default): the fields set in the file
(transformers' `to_diff_dict`: what differs from transformers' own defaults) among
temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens become the
defaults of requests that leave them unset; its eos_token_id list ends generation as
the tokenizer's EOS does (Llama 3's <|eot_id|> beside <|end_of_text|>, Qwen's
<|im_end|> beside <|endoftext|>).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pagedllm.errors import ModelLoadError

logger = logging.getLogger(__name__)

# generation_config.json field -> SamplingParams field.
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                   "max_new_tokens": "max_tokens"}


def load_generation_config(source: str) -> tuple[dict[str, Any], list[int]]:
    """(sampling defaults as SamplingParams keywords, end-of-generation token ids) of
    the generation_config.json in directory `source`; ({}, []) when there is none (a
    GGUF file, a directory without one)."""
    if not os.path.isfile(os.path.join(source, "generation_config.json")):
        return {}, []
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read generation_config.json in {source!r}: {e}") from e
    diff = config.to_diff_dict()
    defaults = {SAMPLING_FIELDS[k]: v for k, v in diff.items()
                if k in SAMPLING_FIELDS and v is not None}
    eos = config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return defaults, eos_ids


def override_sampling_defaults(defaults: dict[str, Any],
                               override: dict[str, Any] | None) -> dict[str, Any]:
    """`defaults` with --override-generation-config's fields (generation_config.json's
    names) on top; ValueError for a field that is not a sampling default."""
    if not override:
        return defaults
    if not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be a dict (JSON object), got "
                         f"{override!r}")
    unknown = sorted(set(override) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config: {unknown[0]!r} is not one of "
                         f"{', '.join(SAMPLING_FIELDS)}")
    return defaults | {SAMPLING_FIELDS[k]: v for k, v in override.items()}
