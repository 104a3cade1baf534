"""Weight-loading helpers shared by the model families."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu.quant import QuantizedWeight
from pagedllm.models.pipeline import missing_prefixes

# (fused param name part, checkpoint name part, shard id) for Llama-like checkpoints.
LLAMA_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def load_stacked_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         stacked_params: Iterable[tuple[str, str, str | int]] = (),
                         skip: tuple[str, ...] = (),
                         rename: dict[str, str] | None = None) -> set[str]:
    """Copy a stream of (hf_name, tensor) into `model`'s parameters.

    Names containing a checkpoint part of `stacked_params` go to the fused parameter's
    shard; `skip` substrings are ignored (e.g. rotary inv_freq buffers, a tied lm_head);
    `rename` maps name prefixes. Weights of parts another pipeline stage holds
    (models/pipeline.py) are skipped. Fails loudly on unexpected names and on
    parameters left unloaded. GGUF blocks (`QuantizedWeight`, quantization "gguf") go to
    the parameter's `quant_loader`, or are dequantized to its dtype where it has none.
    """
    params = dict(model.named_parameters())
    elsewhere = missing_prefixes(model)
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(s in name for s in skip):
            continue
        for old, new in (rename or {}).items():
            if name.startswith(old):
                name = new + name[len(old):]
        target, shard_id = name, None
        for fused, part, sid in stacked_params:
            if f".{part}." in name:
                target, shard_id = name.replace(f".{part}.", f".{fused}."), sid
                break
        if elsewhere and target.startswith(elsewhere):
            continue
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"unexpected weight {name!r} in checkpoint "
                                 f"(no parameter {target!r} in {type(model).__name__})")
        if isinstance(tensor, QuantizedWeight):
            quant_loader = getattr(param, "quant_loader", None)
            if quant_loader is not None:
                quant_loader(param, tensor, shard_id)
                loaded.add(target)
                continue
            tensor = tensor.dequantize(param.dtype)
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is None:
                if param.shape != tensor.shape:
                    raise ModelLoadError(f"{name}: expected shape {tuple(param.shape)}, "
                                         f"got {tuple(tensor.shape)}")
                param.data.copy_(tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        loaded.add(target)
    # named_parameters() lists a tied parameter once, under its first name.
    missing = set(params) - loaded
    if missing:
        raise ModelLoadError(f"weights missing from checkpoint: {sorted(missing)[:10]}")
    return loaded



def split_interleaved_qkv(fused: torch.Tensor, num_heads: int, head_size: int,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [H*D, ...] of a head-major fused query_key_value weight [H*3*D, in] or bias.

    GPT-NeoX and Bloom store the rows as [H, 3, D] (q, k, v of head 0, then of head 1, ...),
    not [3, H, D]; splitting here lets the q | k | v shards load like Llama's (TP-correct).
    """
    rows = fused.view(num_heads, 3, head_size, *fused.shape[1:])
    return tuple(rows[:, i].reshape(num_heads * head_size, *fused.shape[1:])
                 for i in range(3))  # type: ignore[return-value]


# q/k/v only, for checkpoints whose MLP is not gated (GPT-2, OPT, GPT-NeoX, Bloom).
QKV_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
)
