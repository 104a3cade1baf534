"""The worker's LoRA adapters: loaded on first use, attached to the model's linears, and
selected per token row for each step (lora/layers.py applies them).

A PEFT module name maps to the model's linear of that name, or to its shard of a fused
linear by the model's stacked parameters (q_proj -> qkv_proj shard "q", gate_proj ->
gate_up_proj shard 0; the table the weight loader fills them by). Up to max_cpu_loras
adapters stay loaded; the least recently used one not in the step is dropped for a new
one (the scheduler keeps a step's adapters within max_loras <= max_cpu_loras).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.lora.adapter import read_adapter, targeted
from pagedllm.lora.layers import LinearLoRA, LoRABatch
from pagedllm.lora_request import LoRARequest
from pagedllm.models.layers.linear import LinearBase
from pagedllm.models.pipeline import missing_prefixes
from pagedllm.models.utils import LLAMA_STACKED_PARAMS

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, hf_config: Any,
                 device: torch.device) -> None:
        self.config, self.hf_config, self.device = config, hf_config, device
        self.batch = LoRABatch()
        self.linears = {name: m for name, m in model.named_modules()
                        if isinstance(m, LinearBase)}
        # Layers another pipeline stage holds: their adapter weights are skipped here.
        self.elsewhere = missing_prefixes(model)
        variant = getattr(model, "variant", None)
        self.stacked = getattr(variant, "stacked_params", LLAMA_STACKED_PARAMS)
        # The models whose forward picks a path by it (LlamaModel: the native stack
        # runs only steps without adapters).
        for module in model.modules():
            if hasattr(type(module), "lora_batch"):
                module.lora_batch = self.batch
        # lora_int_id -> the layers it was added to, least recently used first.
        self.loaded: OrderedDict[int, list[LinearLoRA]] = OrderedDict()

    def begin_step(self, token_lora_ids: np.ndarray,
                   requests: dict[int, LoRARequest]) -> dict[int, str]:
        """Select each token row's adapter (`token_lora_ids`: one id per token, 0 for
        none) for the next forward, loading adapters not loaded yet.

        Returns the adapters that failed to load (lora_int_id -> why): their rows run
        without an adapter, and the caller fails their requests. The front end checked
        each adapter when a request first named it, but its files may have changed or
        gone since; that fails those requests, not the step.
        """
        ids = [int(i) for i in np.unique(token_lora_ids) if i]
        failed: dict[int, str] = {}
        for lora_id in ids:
            try:
                self._use(requests[lora_id], keep=ids)
            except Exception as e:  # unreadable, malformed or changed files
                lora = requests[lora_id]
                logger.warning("LoRA adapter %r (%s) failed to load: %s", lora.lora_name,
                               lora.lora_path, e)
                failed[lora_id] = (f"LoRA adapter {lora.lora_name!r} could not be loaded "
                                   f"from {lora.lora_path}: {e}")
        ids = [i for i in ids if i not in failed]
        if len(ids) == 1 and (token_lora_ids == ids[0]).all():
            self.batch.segments = ((ids[0], None),)
        else:
            self.batch.segments = tuple(
                (i, torch.from_numpy(np.nonzero(token_lora_ids == i)[0]).to(self.device))
                for i in ids)
        return failed

    def end_step(self) -> None:
        self.batch.segments = ()

    def _use(self, lora: LoRARequest, keep: list[int]) -> None:
        if lora.lora_int_id in self.loaded:
            self.loaded.move_to_end(lora.lora_int_id)
            return
        while len(self.loaded) >= self.config.max_cpu_loras:
            # The scheduler keeps a step's adapters within max_loras <= max_cpu_loras,
            # so one loaded adapter is always outside the step.
            old = next((i for i in self.loaded if i not in keep), None)
            assert old is not None, "a step has more adapters than max_cpu_loras"
            for layer in self.loaded.pop(old):
                layer.remove(old)
        self.loaded[lora.lora_int_id] = self._load(lora)

    def _load(self, lora: LoRARequest) -> list[LinearLoRA]:
        spec, weights = read_adapter(lora.lora_path, self.hf_config,
                                     self.config.max_lora_rank)
        if self.config.lora_dtype != "auto":  # rounded as vLLM would store them
            rounded = getattr(torch, self.config.lora_dtype)
            weights = {m: (a.to(rounded).float(), b.to(rounded).float())
                       for m, (a, b) in weights.items()}
        shards: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
        for module, (a, b) in weights.items():
            if not targeted(module, self.config.target_modules):
                continue  # left unused (lora_target_modules)
            if self.elsewhere and module.startswith(self.elsewhere):
                continue  # another pipeline stage's layer
            name, shard_id = self._target(module)
            linear = self.linears[name]
            # Under tensor parallelism: this rank's rows of B, or its columns of A.
            for sid, a_part, b_part in linear.lora_parts(a, b, shard_id):
                start, rows = linear.output_range(sid)
                if b_part.shape[0] != rows or a_part.shape[1] != linear.input_size:
                    raise ValueError(f"LoRA adapter {lora.lora_path}: {module} does not "
                                     f"fit {name} ({rows} x {linear.input_size})")
                shards.setdefault(name, []).append((start, a_part, b_part, spec.scale))
        layers: list[LinearLoRA] = []
        try:
            for name, parts in shards.items():
                linear = self.linears[name]
                if linear.lora is None:
                    linear.lora = LinearLoRA(self.batch, linear.input_size,
                                             linear.output_size, self.device)
                linear.lora.add(lora.lora_int_id, parts)
                layers.append(linear.lora)
        except BaseException:  # out of memory: no layer keeps half an adapter
            for layer in layers:
                layer.remove(lora.lora_int_id)
            raise
        return layers

    def _target(self, module: str) -> tuple[str, str | int | None]:
        """The model's linear (and shard) a PEFT module name adapts."""
        if module in self.linears:
            return module, None
        parent, _, leaf = module.rpartition(".")
        for fused, part, shard_id in self.stacked:
            if leaf == part and f"{parent}.{fused}" in self.linears:
                return f"{parent}.{fused}", shard_id
        raise ValueError(f"LoRA: the model has no linear for {module}")
