"""The decoder layers of a Llama-shaped model as one native call on CPU.

`LlamaDecoderLayer.forward` on CPU is a chain of native kernels (fused norms, packed
linears, RoPE, paged attention, SiLU-and-mul) glued by ~15 Python-level calls per layer;
at one token per step that glue is ~25% of the step. kernels/cpu/csrc/cpu_decoder.cpp runs
the same kernels in the same order from C++, so outputs are bit-identical to the Python
layers (tests/models/test_native_layers.py) and the Python layers stay the reference
(and what torch.compile, other devices and other families run).

Applies when every layer is plain Llama: RMSNorm, fused qkv (+ bias), RoPE through the
native op, the native paged attention (no soft-cap, no ALiBi), fused gate_up with SiLU,
packed weights (native bfloat16 GEMM, GGUF blocks for the quantized GEMM, or oneDNN), one
KV cache group (the stack reads one block table); a fused projection of mixed GGUF types
(LinearBase.native_shards) runs shard by shard. The model's final RMSNorm runs at the end
of the same call (one Python call fewer per step; after a decode step's weight stream
every Python call runs on cold caches). Qwen3's q/k norm, Mixtral's experts and models
mixing sliding-window and full layers (KV cache groups) keep the Python layers. The
step's prompt rows (AttentionMetadata.prompt_rows) go to the quantized GEMMs, as the
Python layers' linears get them from the model's StepRows (worker/prompt_rows.py).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.attention.cpu import CpuAttention
from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.ops import load_cpu_kernels
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.layers.activation import SiluAndMul
from pagedllm.models.layers.linear import LinearBase
from pagedllm.models.layers.norm import RMSNorm


# Shards a linear may have in the native stack (cpu_decoder.cpp: kMaxShards).
MAX_SHARDS = 3


def _linear_slots(linear: LinearBase) -> list[torch.Tensor | None]:
    """One linear's slots in cpu_decoder.cpp's order: oneDNN-packed, native, bias, native
    bias, then (GGUF blocks, float32 bias) of a mixed-type projection's further shards."""
    (first, first_bias), *rest = (linear.native_shards
                                  or [(linear.native_weight, linear.native_bias)])
    slots = [linear.packed_weight, first, linear.bias, first_bias]
    for blocks, bias in rest:
        slots += [blocks, bias]
    return slots + [None] * (4 + 2 * (MAX_SHARDS - 1) - len(slots))


def _fits(layer: Any, spec: Any, rotary: Any, eps: float, offset: float) -> bool:
    """Whether a decoder layer is the plain Llama layer the native stack runs, with the
    shared attention shape, rotary table and norm parameters of the first layer."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_norm is not None or not isinstance(getattr(mlp, "act_fn", None), SiluAndMul):
        return False  # Qwen3's q/k norm; Mixtral's experts, GELU MLPs
    impl, own = attn.attn.impl, attn.attn.spec
    if not (isinstance(impl, CpuAttention) and impl.runs_kernel
            and attn.attn.kv_cache is not None and attn.rotary_emb is rotary):
        return False
    if attn.attn.kv_group != 0:
        return False  # one block table for every layer (KV cache groups: per layer)
    if (own.num_heads, own.num_kv_heads, own.head_size, own.scale) != (
            spec.num_heads, spec.num_kv_heads, spec.head_size, spec.scale):
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (all(isinstance(n, RMSNorm) and (n.eps, n.offset) == (eps, offset) for n in norms)
            and all((lin.packed_weight is not None or lin.native_weight is not None
                     or len(lin.native_shards or ()) in range(2, MAX_SHARDS + 1))
                    and lin.tp_size == 1 for lin in linears))


class NativeLlamaLayers:
    """Runs `layers` (LlamaDecoderLayer list) in one native call; build() checks they fit."""

    def __init__(self, layers: Any, weights: list[torch.Tensor | None], spec: Any,
                 rotary: Any, eps: float, norm_offset: float) -> None:
        self.rotary = rotary
        # The attention modules themselves: reaching them through the layers costs three
        # nn.Module lookups each, ~0.15 ms a step over 30 layers (is_current runs per step).
        self.attns = [layer.self_attn.attn for layer in layers]
        # Each layer's linears in the native stack's LoRA order (cpu_decoder.cpp).
        self.linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj) for layer in layers]
        self.kv_caches = [attn.kv_cache for attn in self.attns]
        # The model's side of the call, bound once: passing the ~1000 weight slots and
        # the per-layer lists with every step's call cost ~0.07 ms on its cold caches.
        self.bound = cpu_ops.llama_layers(
            weights, [attn.spec.sliding_window or 0 for attn in self.attns],
            # (k_scale, v_scale) of each layer in turn, read by fp8 caches.
            [scale for attn in self.attns for scale in (attn.k_scale, attn.v_scale)],
            spec.num_heads, spec.num_kv_heads, spec.head_size, rotary.rotary_dim,
            rotary.is_neox_style, spec.scale, eps, norm_offset)

    @classmethod
    def build(cls, layers: Any) -> NativeLlamaLayers | None:
        """None unless every layer can run natively (see the module docstring)."""
        if not layers or not load_cpu_kernels():
            return None
        first = layers[0]
        spec, rotary = first.self_attn.attn.spec, first.self_attn.rotary_emb
        eps, offset = first.input_layernorm.eps, first.input_layernorm.offset
        weights: list[torch.Tensor | None] = []
        for layer in layers:
            if not _fits(layer, spec, rotary, eps, offset):
                return None
            attn, mlp = layer.self_attn, layer.mlp
            weights.append(layer.input_layernorm.weight)
            weights += _linear_slots(attn.qkv_proj) + _linear_slots(attn.o_proj)
            weights.append(layer.post_attention_layernorm.weight)
            weights += _linear_slots(mlp.gate_up_proj) + _linear_slots(mlp.down_proj)
            weights.append(attn.attn.kv_cache)
        return cls(layers, weights, spec, rotary, eps, offset)

    def is_current(self) -> bool:
        """False once the KV caches were re-bound (the weights list holds the old ones)."""
        return all(attn.kv_cache is cache for attn, cache in zip(self.attns, self.kv_caches))

    def __call__(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata,
                 final_norm: Any = None, lora: Any = None) -> torch.Tensor:
        """x [T, hidden] (the embedded tokens; updated in place) -> the residual stream
        after the last layer, through `final_norm` if given (an RMSNorm runs inside the
        native call). `lora`: the step's LoRA adapters (lora/layers.py LoRABatch), run
        inside the call from the weights each linear's LinearLoRA holds."""
        cos, sin = self.rotary.tables(x.device, x.dtype)
        inside = isinstance(final_norm, RMSNorm)
        weights, rows = self._lora_args(lora)
        cpu_ops.llama_decoder_stack(
            self.bound, x, positions, md.slot_mapping, md.block_table, md.seq_lens,
            md.query_start_loc, cos, sin, final_norm.weight if inside else None,
            final_norm.eps if inside else 0.0, final_norm.offset if inside else 0.0,
            weights, rows, md.prompt_rows)
        return x if inside or final_norm is None else final_norm(x)

    def _lora_args(self, lora: Any) -> tuple[list[torch.Tensor | None], list]:
        """(weights, rows) of llama_decoder_stack for the step's adapters."""
        if lora is None or not lora.active:
            return [], []
        weights: list[torch.Tensor | None] = []
        for lora_id, _ in lora.segments:
            for linears in self.linears:
                for linear in linears:
                    adapter = linear.lora.adapters.get(lora_id) if linear.lora else None
                    weights += adapter if adapter is not None else (None, None)
        return weights, [rows for _, rows in lora.segments]
