"""PEFT LoRA adapters on disk: checked against the model's shapes, then read.

An adapter directory (PEFT's `save_pretrained`) holds adapter_config.json (r,
lora_alpha, use_rslora, target_modules, ...) and adapter_model.safetensors with, per
adapted linear of the base model,

    base_model.model.<module>.lora_A.weight   [r, in_features]
    base_model.model.<module>.lora_B.weight   [out_features, r]

and the linear becomes y = x W^T + scale (x A^T) B^T, scale = lora_alpha / r
(use_rslora: lora_alpha / sqrt(r)). The check reads only the config and the safetensors
header, so the front end can refuse a bad adapter (naming what is wrong) before a worker
loads it. Supported: the linears of the attention and MLP blocks of the Llama-shaped
families (q/k/v/o and gate/up/down; Phi-3's fused qkv and gate_up; Mixtral's attention).
Not supported (refused by name): DoRA, trained biases, modules_to_save, per-module rank
or alpha patterns, embedding or LM-head adapters, pickled adapter_model.bin files.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.errors import InvalidRequestError

if TYPE_CHECKING:  # the front end checks adapters without importing torch
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
_MODULE = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)")
_DENSE = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                    "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"})
_SUPPORTED = _DENSE | {"Phi3ForCausalLM", "MixtralForCausalLM"}
_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})


@dataclass(frozen=True)
class AdapterSpec:
    """What the check found: the rank, the scale and the adapted modules' paths."""

    rank: int
    scale: float
    modules: tuple[str, ...]


def lora_targets(hf_config: Any) -> dict[str, tuple[str, int, int]]:
    """The linears an adapter may target in this model: PEFT's module name ->
    (parent block, in_features, out_features)."""
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    inter = getattr(hf_config, "intermediate_size", None)
    if arch in _DENSE or arch == "MixtralForCausalLM":
        targets = {"q_proj": ("self_attn", hidden, q), "k_proj": ("self_attn", hidden, kv),
                   "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", q, hidden)}
        if arch in _DENSE:
            targets |= {"gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter),
                        "down_proj": ("mlp", inter, hidden)}
        return targets
    if arch == "Phi3ForCausalLM":
        return {"qkv_proj": ("self_attn", hidden, q + 2 * kv),
                "o_proj": ("self_attn", q, hidden),
                "gate_up_proj": ("mlp", hidden, 2 * inter), "down_proj": ("mlp", inter, hidden)}
    raise InvalidRequestError(f"LoRA adapters are not supported for {arch} (supported: "
                              f"{', '.join(sorted(_SUPPORTED))})")


# vLLM's names of fused linears, standing for their parts in lora_target_modules.
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}


def targeted(module: str, target_modules: tuple[str, ...] | None) -> bool:
    """Whether a PEFT module name (model.layers.3.self_attn.q_proj) is among
    `target_modules` (None: every module)."""
    if target_modules is None:
        return True
    leaf = module.rpartition(".")[2]
    return any(leaf == t or leaf in FUSED_TARGETS.get(t, ()) for t in target_modules)


def check_adapter(path: str, hf_config: Any, max_rank: int) -> AdapterSpec:
    """The adapter at `path` as this model can run it; InvalidRequestError naming the
    first thing that is wrong (files, config options, names, shapes, rank)."""
    where = Path(path)
    config = _read_config(where)
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidRequestError(f"LoRA adapter {path}: r must be a positive integer, "
                                  f"got {rank!r}")
    if rank > max_rank:
        raise InvalidRequestError(f"LoRA adapter {path}: its rank {rank} is more than "
                                  f"max_lora_rank ({max_rank})")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) \
            or not math.isfinite(alpha):
        raise InvalidRequestError(f"LoRA adapter {path}: lora_alpha must be a number, "
                                  f"got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes = _read_header(where)
    targets = lora_targets(hf_config)
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, (dtype, shape) in shapes.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise InvalidRequestError(f"LoRA adapter {path}: tensor {key!r} is not a LoRA "
                                      f"A or B weight of a linear (embedding and LM-head "
                                      f"adapters, biases and saved modules are not "
                                      f"supported)")
        if dtype not in _FLOAT_DTYPES:
            raise InvalidRequestError(f"LoRA adapter {path}: tensor {key!r} has dtype "
                                      f"{dtype}; float32, float16 or bfloat16 expected")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tuple(shape)
    if not pairs:
        raise InvalidRequestError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA "
                                  f"weights")
    for module, parts in pairs.items():
        m = _MODULE.fullmatch(module)
        target = targets.get(m.group(3)) if m else None
        if m is None or target is None or target[0] != m.group(2) \
                or int(m.group(1)) >= hf_config.num_hidden_layers:
            raise InvalidRequestError(
                f"LoRA adapter {path}: module {module!r} is not a linear this model can "
                f"adapt (model.layers.<i>.self_attn|mlp.<name>, <i> below "
                f"{hf_config.num_hidden_layers}, <name> one of {', '.join(targets)})")
        _, fan_in, fan_out = target
        want = {"A": (rank, fan_in), "B": (fan_out, rank)}
        for part, shape in want.items():
            if part not in parts:
                raise InvalidRequestError(f"LoRA adapter {path}: module {module!r} has no "
                                          f"lora_{part} weight")
            if parts[part] != shape:
                raise InvalidRequestError(
                    f"LoRA adapter {path}: {module}.lora_{part} has shape "
                    f"{list(parts[part])}, expected {list(shape)} (r={rank} and this "
                    f"model's sizes)")
    return AdapterSpec(rank=rank, scale=float(scale), modules=tuple(sorted(pairs)))


def read_adapter(path: str, hf_config: Any, max_rank: int,
                 ) -> tuple[AdapterSpec, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """check_adapter, then the weights: module path -> (A [r, in], B [out, r]) float32."""
    from safetensors import safe_open

    spec = check_adapter(path, hf_config, max_rank)
    weights = {}
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
        for module in spec.modules:
            prefix = f"base_model.model.{module}.lora_"
            weights[module] = (f.get_tensor(prefix + "A.weight").float(),
                               f.get_tensor(prefix + "B.weight").float())
    return spec, weights


def _read_config(where: Path) -> dict[str, Any]:
    file = where / CONFIG_FILE
    if not file.is_file():
        raise InvalidRequestError(f"LoRA adapter {where}: no {CONFIG_FILE} there (a PEFT "
                                  f"adapter directory is expected)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"LoRA adapter {where}: {CONFIG_FILE} is not valid "
                                  f"JSON: {e}") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"LoRA adapter {where}: {CONFIG_FILE} is not an object")
    peft_type = config.get("peft_type", "LORA")
    refused = [why for why, applies in (
        (f"peft_type {peft_type!r} (only LORA)", peft_type != "LORA"),
        ("use_dora (DoRA)", bool(config.get("use_dora"))),
        (f"bias {config.get('bias')!r} (trained biases)", config.get("bias", "none") != "none"),
        ("modules_to_save", bool(config.get("modules_to_save"))),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out"))),
        ("rank_pattern", bool(config.get("rank_pattern"))),
        ("alpha_pattern", bool(config.get("alpha_pattern")))) if applies]
    if refused:
        raise InvalidRequestError(f"LoRA adapter {where}: {refused[0]} is not supported")
    return config


def _read_header(where: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in the adapter's safetensors file (its
    header only: no tensor is read)."""
    from safetensors import safe_open

    file = where / WEIGHTS_FILE
    if not file.is_file():
        extra = (" (adapter_model.bin is a pickle, which is not loaded: convert it to "
                 "safetensors)" if (where / "adapter_model.bin").exists() else "")
        raise InvalidRequestError(f"LoRA adapter {where}: no {WEIGHTS_FILE}{extra}")
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
                    for name in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError (an Exception)
        raise InvalidRequestError(f"LoRA adapter {where}: {WEIGHTS_FILE} is not a valid "
                                  f"safetensors file ({e})") from None


class AdapterChecks:
    """The front end's record of the adapters requests named: each checked once, by
    lora_int_id, and an id that later names another adapter (name or path) refused."""

    def __init__(self, hf_config: Any, max_rank: int) -> None:
        self.hf_config, self.max_rank = hf_config, max_rank
        self._checked: dict[int, tuple[Any, AdapterSpec]] = {}

    def check(self, lora_request: Any) -> AdapterSpec:
        known = self._checked.get(lora_request.lora_int_id)
        if known is not None:
            if known[0] != lora_request:
                raise InvalidRequestError(
                    f"lora_int_id {lora_request.lora_int_id} already names the adapter "
                    f"{known[0].lora_name!r} at {known[0].lora_path}; give another adapter "
                    f"another id")
            return known[1]
        spec = check_adapter(lora_request.lora_path, self.hf_config, self.max_rank)
        self._checked[lora_request.lora_int_id] = (lora_request, spec)
        return spec
