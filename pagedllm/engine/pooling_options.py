"""vLLM's pooling start-up options: --pooler-config (the defaults of pooling requests)
and --convert (a causal LM served as an embedding model or a classifier).

vLLM 0.32's PoolerConfig keys that mean something here are taken; those of features not
built (token-wise pooling, chunked processing of over-long inputs, process reward
models) are refused by name, as is `normalize`, which vLLM removed for
`use_activation`.
"""

from __future__ import annotations

from typing import Any

from pagedllm.config import ModelConfig, PoolerConfig, require_json_object
from pagedllm.errors import ConfigError

CONVERTS = ("auto", "none", "embed", "classify")
# vLLM's names of the sequence poolings, by ours.
_POOLING_TYPES = {"LAST": "last", "MEAN": "mean", "CLS": "cls"}
_NOT_BUILT = {
    "tok_pooling_type": "token-wise pooling (one vector per token)",
    "enable_chunked_processing": "chunked processing of inputs longer than the model",
    "max_embed_len": "inputs longer than max_model_len",
    "step_tag_id": "process reward models",
    "returned_token_ids": "process reward models",
}
# vLLM's task names of the pooling tasks here (ModelConfig.pooling_task).
_TASKS = {"embed": ("embed",), "classify": ("classify", "score"), "score": ("score",)}


def pooler_config(values: dict[str, Any] | None, model: ModelConfig) -> PoolerConfig:
    """The PoolerConfig of --pooler-config's JSON object, checked against the model."""
    if not values:
        return PoolerConfig()
    require_json_object("pooler_config", values)
    values = dict(values)
    if "normalize" in values:
        raise ConfigError("pooler_config: normalize was removed (as in vLLM); use "
                          "use_activation instead")
    for key, what in _NOT_BUILT.items():
        if values.pop(key, None) not in (None, False):
            raise ConfigError(f"pooler_config {key}: {what} is not supported")
    values.pop("enable_flash_late_interaction", None)  # a CUDA kernel's switch
    task = values.pop("task", None)
    if task is not None and model.pooling_task not in _TASKS.get(task, ()):
        raise ConfigError(f"pooler_config task {task!r}: {model.architecture} does "
                          f"{model.pooling_task!r}")
    kinds = [kind for kind in (values.pop("pooling_type", None),
                               values.pop("seq_pooling_type", None)) if kind is not None]
    if len(kinds) == 2:
        raise ConfigError("pooler_config: give pooling_type or seq_pooling_type, not both")
    pooling = None
    if kinds:
        pooling = _POOLING_TYPES.get(str(kinds[0]).upper())
        if pooling is None:
            raise ConfigError(f"pooler_config pooling_type must be one of "
                              f"{tuple(_POOLING_TYPES)}, got {kinds[0]!r}")
    config = PoolerConfig(pooling_type=pooling)
    for key, kind in (("use_activation", bool), ("dimensions", int),
                      ("logit_mean", float), ("logit_sigma", float)):
        value = values.pop(key, None)
        if value is None:
            continue
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, (kind, int)):
            raise ConfigError(f"pooler_config {key} must be a {kind.__name__}, got "
                              f"{value!r}")
        setattr(config, key, value)
    if values:
        raise ConfigError(f"pooler_config: unknown key {sorted(values)[0]!r}")
    if config.logit_sigma == 0:
        raise ConfigError("pooler_config logit_sigma must not be 0")
    if config.dimensions is not None:
        check_dimensions(config.dimensions, model, ConfigError)
    return config


def check_dimensions(dimensions: int, model: ModelConfig, error: type[Exception]) -> None:
    """`error` unless the model's embeddings may be cut to `dimensions` (vLLM's
    checks)."""
    size = model.hf_config.hidden_size
    if not model.is_matryoshka:
        raise error(f"dimensions={dimensions}: {model.architecture} does not support "
                    f"Matryoshka embeddings (its config sets neither is_matryoshka nor "
                    f"matryoshka_dimensions; hf_overrides can)")
    if not 1 <= dimensions <= size:
        raise error(f"dimensions must be in [1, {size}], got {dimensions}")
    allowed = model.matryoshka_dimensions
    if allowed is not None and dimensions not in allowed:
        raise error(f"dimensions must be one of the model's Matryoshka dimensions "
                    f"{list(allowed)}, got {dimensions}")


def converted_architecture(hf_config: Any, convert: str) -> str | None:
    """The architecture a causal LM is read as under --convert classify: its family's
    ForSequenceClassification, whose score head is the LM head's rows of hf_overrides'
    classifier_from_token (a causal LM's checkpoint holds no other); None when nothing
    changes."""
    if convert not in CONVERTS:
        raise ConfigError(f"convert must be one of {CONVERTS}, got {convert!r}")
    architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if convert != "classify" or architecture.endswith("ForSequenceClassification"):
        return None
    from pagedllm.models.registry import supported_architectures

    target = architecture.replace("ForCausalLM", "ForSequenceClassification")
    if target == architecture or target not in supported_architectures():
        raise ConfigError(f"convert 'classify': {architecture} has no sequence "
                          f"classification form here")
    if getattr(hf_config, "classifier_token_ids", None) is None:
        raise ConfigError(f"convert 'classify': a {architecture} checkpoint has an LM head, "
                          f"no classification head; name the tokens whose LM-head rows "
                          f"make one: hf_overrides '{{\"classifier_from_token\": "
                          f"[\"no\", \"yes\"]}}'")
    return target
