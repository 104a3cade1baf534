"""Typed wrappers of the native CPU ops (torch.ops.pagedllm_cpu.*), one per op.

Callers check `cpu_ops_available(x)` (or `load_cpu_kernels()`) first; each wrapper then
calls its op once. Shapes and dtypes are those the op's schema in csrc/ops.h documents.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.cpu.build import load_cpu_kernels

__all__ = ["argmax", "cpu_ops_available", "gemm_bf16", "gemm_f32", "gemm_quant",
           "llama_decoder_stack", "llama_layers", "load_cpu_kernels", "lora_apply",
           "paged_attention", "quant_amx_bf16_usable", "quant_amx_usable", "quant_rows",
           "quant_splits_prompt_rows", "rms_norm", "rotary_embedding", "sample_draw",
           "score_rows", "silu_and_mul"]


def cpu_ops_available(x: torch.Tensor) -> bool:
    """True when `x` is on the CPU and the native ops are loaded (fused layer paths).

    False while torch.compile traces: inductor fuses the torch versions itself.
    """
    if torch.compiler.is_compiling():
        return False
    return x.device.type == "cpu" and load_cpu_kernels()


def paged_attention(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                    value: torch.Tensor | None, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None, q_tile: int = 16, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """Write key/value [T, KVH, D] (if given) at slot_mapping, then attend query [T, H, D]
    over each request's paged context into out [T, H, D].

    block_table [R, max_blocks], seq_lens [R] and query_start_loc [R + 1] are int32;
    slot_mapping [T] int64. Query tokens are tiled by `q_tile` per work item. kv_cache has
    the query's dtype or is float8_e4m3fn / float8_e5m2, holding K / k_scale and V / v_scale
    (attention/kv_quant.py; the scales are ignored otherwise).
    """
    torch.ops.pagedllm_cpu.paged_attention.default(
        out, query, key, value, kv_cache, slot_mapping, block_table, seq_lens,
        query_start_loc, scale, sliding_window or 0, q_tile, k_scale, v_scale)


def bf16_attention_amx() -> bool:
    """Whether paged_attention runs bfloat16 queries over a bfloat16 cache (head sizes in
    32s, blocks in 16s) on AMX tiles in this process (csrc/attention_amx.h: a CPU with
    AMX-BF16 whose OS grants the tiles, unless PAGEDLLM_CPU_BF16_ATTENTION names another
    form): every item then, prefill and decode alike."""
    return bool(torch.ops.pagedllm_cpu.bf16_attention_amx.default())


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
             offset: float) -> None:
    """out [N, D] = x / rms(x) * (weight + offset), rows of x [N, D]."""
    torch.ops.pagedllm_cpu.rms_norm.default(out, x, weight, eps, offset)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """out [N, D] = silu(x[:, :D]) * x[:, D:] for x [N, 2D]."""
    torch.ops.pagedllm_cpu.silu_and_mul.default(out, x)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, head_size: int, rotary_dim: int,
                     is_neox_style: bool) -> None:
    """Rotate q [T, H*D] and k [T, KVH*D] in place at positions [T] (int64) by the
    cos/sin tables [max_pos, rotary_dim // 2]."""
    torch.ops.pagedllm_cpu.rotary_embedding.default(q, k, positions, cos, sin, head_size,
                                                    rotary_dim, is_neox_style)


def gemm_bf16(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor, accumulate: bool = False) -> None:
    """out [M, N] = x [M, K] @ W^T + bias (bfloat16) from the packed weight
    [ceil(N/48), K/2, 48, 2] and float32 bias [N]; with `accumulate`, out += that."""
    torch.ops.pagedllm_cpu.gemm_bf16.default(out, x, weight, bias, accumulate)


def bf16_gemm_amx() -> bool:
    """Whether gemm_bf16 runs on AMX tiles in this process (csrc/gemm_amx.h: a CPU with
    AMX-BF16 whose OS grants the tiles, unless PAGEDLLM_CPU_BF16_GEMM names another
    kernel): every call whose K is a multiple of 32, whatever its rows."""
    return bool(torch.ops.pagedllm_cpu.bf16_gemm_amx.default())


def gemm_f32(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor, accumulate: bool = False) -> None:
    """out [M, N] = x [M, K] @ W^T + bias (float32) from the packed weight
    [ceil(N/48), K, 48] and bias [N]; with `accumulate`, out += that. Each output is one
    fused multiply-add chain over K in order, whatever M (batch invariant). Where
    `features.has_f32_gemm_over_16bit()`, the weight may instead be bfloat16 packed as for
    gemm_bf16, or float16 [ceil(N/48), K, 48]: the same bits as float32 panels of the same
    values."""
    torch.ops.pagedllm_cpu.gemm_f32.default(out, x, weight, bias, accumulate)


def gemm_quant(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor, accumulate: bool = False, path: str = "auto",
               prompt_rows: torch.Tensor | None = None) -> None:
    """out [M, N] = x [M, K] @ dequant(W)^T + bias, x and out bfloat16 or float32, from
    GGUF blocks repacked by kernels/cpu/quant.py (uint8 [ceil(N/16), K/32, block_bytes];
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q4_K, Q5_K or Q6_K) and float32 bias [N] (zeros for
    none). With `accumulate`, out += that. `path` picks the kernels:
    - the int8 kernels, all with the same bits: each row of x is quantized to int8 blocks
      of 32 first. "int8" (AMX for compute-bound calls where usable, else the widest this
      build has), "amx" (AMX-INT8 tiles: Q2_K and Q6_K take the AVX-512 kernels),
      "avx512" (AVX512-VNNI), "avx2" (AVX2 + FMA + F16C) or "portable" (plain C++); one
      the build lacks raises RuntimeError.
    - "amx_bf16" (bfloat16 x on every type but Q2_K, where `quant_amx_bf16_usable()`):
      the weights dequantized to bfloat16 and multiplied on AMX bfloat16 tiles with x
      unquantized: the bits of gemm_bf16 on the dequantized weights.
    - "auto": "int8", except that where `quant_splits_prompt_rows()` the rows marked in
      `prompt_rows` (bool [M]) take "amx_bf16" (for the types it runs), and with
      PAGEDLLM_CPU_QUANT_GEMM=amx_bf16 every row does (csrc/quant_amx_bf16.h).
    A row's result depends on that row (and its mark) alone."""
    torch.ops.pagedllm_cpu.gemm_quant.default(out, x, weight, bias, accumulate, path,
                                              prompt_rows)


def quant_amx_usable() -> bool:
    """Whether gemm_quant's AMX kernels are in the build (a CPU with AMX-TILE and AMX-INT8)
    and the OS lets this process use the tiles; `auto` then takes them for calls of 32 rows
    or more."""
    return bool(torch.ops.pagedllm_cpu.quant_amx_usable.default())


def quant_amx_bf16_usable() -> bool:
    """Whether gemm_quant's "amx_bf16" path is in the build (AMX-BF16 and AVX512-VBMI) and
    the OS lets this process use the tiles."""
    return bool(torch.ops.pagedllm_cpu.quant_amx_bf16_usable.default())


def quant_splits_prompt_rows() -> bool:
    """Whether gemm_quant's "auto" runs the prompt rows it is given on the bfloat16 tiles
    ("amx_bf16"; the others on the int8 kernels): where those tiles are usable, unless
    PAGEDLLM_CPU_QUANT_GEMM says "amx_bf16" (every row) or "int8" (none)."""
    return bool(torch.ops.pagedllm_cpu.quant_splits_prompt_rows.default())


def quant_rows(out: torch.Tensor, packed: torch.Tensor, ids: torch.Tensor,
               num_rows: int) -> None:
    """out [T, K] (float32, bfloat16 or float16) = rows `ids` [T] (int64, each in
    [0, num_rows)) of the repacked GGUF weight `packed` (kernels/cpu/quant.py) dequantized:
    the same bits as quant.dequantize_rows(packed, ids).to(out.dtype)."""
    torch.ops.pagedllm_cpu.quant_rows.default(out, packed, ids, num_rows)


def argmax(out: torch.Tensor, x: torch.Tensor) -> None:
    """out [N] (int64) = the first index of each row's maximum of x [N, V]."""
    torch.ops.pagedllm_cpu.argmax.default(out, x)


def sample_draw(out: torch.Tensor, x: torch.Tensor, temperature: torch.Tensor,
                top_p: torch.Tensor | None, u: torch.Tensor) -> None:
    """out [N] (int64) = one token per row of x [N, V] drawn from softmax(x / temperature)
    with the uniform u (float64 [N], in [0, 1)): the token whose interval of the row's
    cumulative distribution holds u times its total (sample/ops.py, inverse_cdf_draw);
    with top_p, within the row's nucleus (rows at 1: the whole row). temperature and
    top_p float32 [N]."""
    torch.ops.pagedllm_cpu.sample_draw.default(out, x, temperature, top_p, u)


def score_rows(lp: torch.Tensor, ids: torch.Tensor, ranks: torch.Tensor, ok: torch.Tensor,
               x: torch.Tensor, targets: torch.Tensor, k: int) -> None:
    """Per row of logits x [N, V]: column 0 of lp / ids / ranks [N, k + 1] (float32,
    int64, int64) the log-softmax at targets [N] (int64), the target, its rank (1 + the
    tokens of larger logprob); columns 1..k the k most likely tokens (ties by smaller id)
    likewise. ok [N] (bool) false where a row holds a NaN or no finite value: its
    columns are not written (csrc/cpu_logprobs.cpp)."""
    torch.ops.pagedllm_cpu.score_rows.default(lp, ids, ranks, ok, x, targets, k)


def llama_layers(weights: list[torch.Tensor | None], sliding_windows: list[int],
                 kv_scales: list[float], num_heads: int, num_kv_heads: int, head_size: int,
                 rotary_dim: int, is_neox_style: bool, scale: float, eps: float,
                 norm_offset: float) -> torch.ScriptObject:
    """The model's side of llama_decoder_stack, bound once: every layer's weight slots
    (models/native_layers.py lists them; the last is the layer's KV cache), each layer's
    sliding window (0: none), (k_scale, v_scale) of each layer in turn, the attention
    shape, RoPE style and the layers' RMSNorm eps / offset."""
    return torch.classes.pagedllm_cpu.LlamaLayers(
        weights, sliding_windows, kv_scales, num_heads, num_kv_heads, head_size, rotary_dim,
        is_neox_style, scale, eps, norm_offset)


def llama_decoder_stack(layers: torch.ScriptObject, x: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor,
                        final_norm: torch.Tensor | None = None, final_eps: float = 0.0,
                        final_offset: float = 0.0,
                        lora_weights: list[torch.Tensor | None] | None = None,
                        lora_rows: list[torch.Tensor | None] | None = None,
                        prompt_rows: torch.Tensor | None = None) -> None:
    """Run every decoder layer of `layers` (llama_layers) over x [T, hidden] in place,
    then the RMSNorm of weight `final_norm` (eps, offset) over x if given.

    LoRA adapters of the step (none by default), per adapter a: lora_rows[a] its token
    rows (int64; None: every row); per adapter, layer and linear (qkv, o, gate_up, down)
    in that nesting, two lora_weights: A^T and B^T as lora_apply takes them, or None and
    None where the adapter leaves the linear alone. prompt_rows (bool [T]): the tokens
    that are prompt tokens of their request, which the quantized GEMMs take as
    gemm_quant's `prompt_rows`."""
    torch.ops.pagedllm_cpu.llama_decoder_stack.default(
        layers, x, positions, slot_mapping, block_table, seq_lens, query_start_loc, cos, sin,
        final_norm, final_eps, final_offset, lora_weights or [], lora_rows or [],
        prompt_rows)


def lora_apply(out: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
               rows: torch.Tensor | None = None) -> None:
    """out[i] = round(out[i] + (x[i] A^T) B^T) for each row i of `rows` (int64; None:
    every row) of x [T, K] and out [T, N] (float32, bfloat16 or float16, rows
    contiguous), A^T [K, R] and B^T [R, N] contiguous float32. In float32: x A^T as four
    partial chains over fixed quarters of K added in order, then one chain over R per
    output; a row's result depends on that row alone (cpu_lora.cpp)."""
    torch.ops.pagedllm_cpu.lora_apply.default(out, x, a_t, b_t, rows)
