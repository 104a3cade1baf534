"""Llama family (Llama 1-3, SmolLM, TinyLlama, Mistral) and the parts other Llama-shaped
decoders are built from.

Pre-norm decoder: x += attn(rmsnorm(x)); x += mlp(rmsnorm(x)). q/k/v and gate/up are
fused into single matmuls and filled from HF's separate tensors on load. Families that
differ from Llama only in a few switches (Qwen2, Qwen3, Phi-3, Mixtral) are a
`LlamaModel` built with a `LlamaVariant`; Gemma 2/3 reuse the attention and MLP.

RoPE: every HF rope_type goes through transformers' own frequency init (layers/rotary.py),
so linear, llama3, yarn and longrope match HF. NOTE: HF's `dynamic` (NTK) rope recomputes
the frequencies of the whole sequence once it grows past max_position_embeddings;
within that range (the default max_model_len) it equals plain rope, which is what runs here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedllm.attention.backend import AttentionSpec
from pagedllm.kernels.cpu.ops import cpu_ops_available
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.models.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.models.layers.embedding import VocabEmbedding
from pagedllm.models.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from pagedllm.models.layers.norm import RMSNorm
from pagedllm.models.layers.rotary import RotaryEmbedding, get_rope
from pagedllm.models.native_layers import NativeLlamaLayers
from pagedllm.models.pipeline import make_layers, stage_lm_head, stage_part
from pagedllm.models.utils import LLAMA_STACKED_PARAMS, load_stacked_weights
from pagedllm.nn import Module


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rotary_dim_of(cfg: Any, head_dim: int) -> int:
    """Rotated dims per head: head_dim * partial_rotary_factor (Phi-3-small, Phi-4-mini)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None)
    return int(head_dim * (factor or 1.0))


def layer_sliding_window(cfg: Any, layer_idx: int) -> int | None:
    """Sliding window of one layer: per layer through HF's `layer_types` when the config
    has them (Qwen2/3 max_window_layers, Gemma's alternation), else config-wide (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def layer_sliding_windows(cfg: Any) -> list[int | None]:
    """Every layer's sliding window (None: full attention)."""
    return [layer_sliding_window(cfg, i) for i in range(cfg.num_hidden_layers)]


def gated_act(name: str) -> nn.Module:
    """act(gate) * up over a fused [.., 2d] gate_up output, by HF activation name."""
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"unsupported gated activation {name!r}")


class LlamaAttention(Module):
    """qkv_proj -> (per-head q/k RMSNorm) -> RoPE -> paged attention -> o_proj.

    `qk_norm_offset` None means no q/k norm; 0.0 is Qwen3's RMSNorm, 1.0 Gemma 3's (1 + w).
    `rotary_emb` is shared by the layers that use the same frequencies. Under TP a rank
    runs its share of the heads (qkv_proj's num_heads / num_kv_heads) and its KV cache
    holds only those KV heads; o_proj all-reduces.
    """

    def __init__(self, cfg: Any, attn_backend: str, rotary_emb: RotaryEmbedding, *,
                 sliding_window: int | None = None, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm_offset: float | None = None,
                 scale: float | None = None, logits_soft_cap: float | None = None,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim,
                                          cfg.num_attention_heads, num_kv_heads, bias=qkv_bias,
                                          parallel=parallel)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim,
                                        cfg.hidden_size, bias=o_bias, parallel=parallel)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.q_norm = self.k_norm = None
        if qk_norm_offset is not None:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, qk_norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, qk_norm_offset)
        self.rotary_emb = rotary_emb
        spec = AttentionSpec(num_heads=self.qkv_proj.num_heads,
                             num_kv_heads=self.qkv_proj.num_kv_heads, head_size=self.head_dim,
                             scale=self.head_dim ** -0.5 if scale is None else scale,
                             sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        self.attn = Attention(spec, attn_backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            # Normalized over each head's D dims: [T, H*D] -> [T, H, D] -> [T, H*D].
            num_tokens = q.shape[0]
            q = self.q_norm(q.reshape(num_tokens, -1, self.head_dim)).reshape(num_tokens, -1)
            k = self.k_norm(k.reshape(num_tokens, -1, self.head_dim)).reshape(num_tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class LlamaMLP(Module):
    """down(act(gate(x)) * up(x)) with gate/up fused into one matmul."""

    def __init__(self, cfg: Any, act: str | None = None,
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias, parallel=parallel)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias,
                                           parallel=parallel)
        self.act_fn = gated_act(act or getattr(cfg, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def dense_mlp(cfg: Any, parallel: ParallelState | None = None, layer: int = 0) -> LlamaMLP:
    """Every layer's feed-forward block: the dense gated MLP."""
    return LlamaMLP(cfg, parallel=parallel)


class LlamaDecoderLayer(Module):
    def __init__(self, cfg: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), attn_metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class LlamaVariant:
    """What a Llama-shaped family changes; defaults are Llama's (and Mistral's)."""

    # Bias on q/k/v and on o_proj; None: the config's `attention_bias`.
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    # RMSNorm over each q and k head before RoPE (Qwen3).
    qk_norm: bool = False
    # Builds the feed-forward block of layer `layer` from the config and the worker's
    # ParallelState, as make_mlp(cfg, parallel=..., layer=...) (Mixtral: sparse MoE;
    # Qwen3-MoE: sparse or dense by layer).
    make_mlp: Callable[..., nn.Module] = dense_mlp
    # (fused param, checkpoint part, shard id); () for checkpoints stored fused (Phi-3).
    stacked_params: tuple[tuple[str, str, str | int], ...] = LLAMA_STACKED_PARAMS


class LlamaModel(Module):
    """Under pipeline parallelism a stage holds layers [start, end) (models/pipeline.py),
    the embedding on the first stage (and on the last when `keep_embedding`: a tied LM
    head), the final norm on the last."""

    def __init__(self, cfg: Any, attn_backend: str,
                 variant: LlamaVariant = LlamaVariant(),
                 parallel: ParallelState | None = None, keep_embedding: bool = False) -> None:
        super().__init__()
        parallel = self.parallel = parallel or SINGLE_RANK
        self.embed_tokens = stage_part(
            parallel.is_first_stage or keep_embedding,
            lambda: VocabEmbedding(cfg.vocab_size, cfg.hidden_size, parallel))
        head_dim = head_dim_of(cfg)
        # One cos/sin table for all layers (it can be max_position_embeddings long).
        rotary_emb = get_rope(cfg, head_dim, rotary_dim_of(cfg, head_dim))
        bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = bias if variant.qkv_bias is None else variant.qkv_bias
        o_bias = bias if variant.o_bias is None else variant.o_bias
        qk_norm_offset = 0.0 if variant.qk_norm else None
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_hidden_layers, lambda i: LlamaDecoderLayer(cfg, LlamaAttention(
                cfg, attn_backend, rotary_emb, sliding_window=layer_sliding_window(cfg, i),
                qkv_bias=qkv_bias, o_bias=o_bias, qk_norm_offset=qk_norm_offset,
                parallel=parallel),
                variant.make_mlp(cfg, parallel=parallel, layer=i)), parallel)
        self.norm = stage_part(parallel.is_last_stage,
                               lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        # The native stack runs whole (unsharded) models with no communication in them.
        if parallel.tp_size > 1 or parallel.pp_size > 1:
            self.use_native_layers = False

    # Run the layers as one native call on CPU when they fit (models/native_layers.py);
    # False keeps the Python layers (tests compare the two).
    use_native_layers = True
    _native: NativeLlamaLayers | None = None
    # The LoRA adapters of the running step (lora/layers.py LoRABatch, set by the worker's
    # LoRA manager): the native stack runs them itself, the Python layers' linears apply
    # them (the same operations).
    lora_batch: Any = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the last layer (normed), or after this pipeline stage's
        layers when it is not the last; `hidden_states` are the previous stage's.
        `inputs_embeds` [T, hidden] replace the token embeddings (a multimodal prompt's,
        with image rows among them)."""
        if inputs_embeds is not None:
            x = inputs_embeds
        elif self.parallel.is_first_stage:
            x = self.embed_tokens(input_ids)  # [T, hidden]
        else:
            x = hidden_states
        native = self._native_layers(x, attn_metadata)
        if native is not None:
            return native(positions, x, attn_metadata, final_norm=self.norm,
                          lora=self.lora_batch)
        for layer in self.layers[self.start_layer:self.end_layer]:
            x = layer(positions, x, attn_metadata)
        return self.norm(x) if self.parallel.is_last_stage else x

    def unbind_kv_cache(self) -> None:
        """Forget the native stack (it holds the KV cache; rebuilt on the next forward)."""
        self._native = None

    def _native_layers(self, x: torch.Tensor,
                       attn_metadata: AttentionMetadata | None) -> NativeLlamaLayers | None:
        # attn_metadata None: a compiled forward (torch.compile traces the Python layers).
        if not self.use_native_layers or attn_metadata is None or not cpu_ops_available(x):
            return None
        if self._native is None or not self._native.is_current():
            # Built once the weights are packed and the KV cache bound (first forward).
            self._native = NativeLlamaLayers.build(self.layers)
            if self._native is None:
                self.use_native_layers = False
        return self._native


class LlamaForCausalLM(Module):
    """forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> logits [N, vocab] (model dtype; None on tensor
    parallel ranks other than 0, which only take part in the gather)."""

    # Pipeline parallelism: forward takes the previous stage's hidden states.
    supports_pp = True
    # False: a sequence classifier's decoder (models/seq_cls.py), whose head is its own.
    has_lm_head = True

    # Each layer's sliding window, for the KV cache groups (worker/kv_layout.py).
    layer_sliding_windows = staticmethod(layer_sliding_windows)

    def __init__(self, cfg: Any, attn_backend: str,
                 variant: LlamaVariant = LlamaVariant(),
                 parallel: ParallelState | None = None) -> None:
        super().__init__()
        parallel = parallel or SINGLE_RANK
        self.config, self.variant = cfg, variant
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.model = LlamaModel(cfg, attn_backend, variant, parallel,
                                keep_embedding=(parallel.is_last_stage
                                                and self.tie_word_embeddings))
        self.lm_head = stage_lm_head(
            cfg.vocab_size, cfg.hidden_size, parallel,
            tied_to=self.model.embed_tokens if self.tie_word_embeddings else None,
        ) if self.has_lm_head else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata,
                hidden_states: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata, hidden_states, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: the token embeddings (first stage; the rows a prompt's
        embeddings go among)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("rotary_emb.inv_freq",) + (("lm_head.",) if self.tie_word_embeddings else ())
        return load_stacked_weights(self, weights, self.variant.stacked_params, skip=skip)
