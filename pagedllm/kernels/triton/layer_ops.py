"""RMSNorm, SiLU-and-mul and rotary embedding as single Triton kernels (see __init__).

Each computes in float32 and rounds once to the output dtype (the torch formulas round
bfloat16 / float16 intermediates too, so those bits may differ; float32 agrees to
rounding). Every program works on one row (a token, or a token's head): a row's result
never depends on its batch-mates (batch invariance, DESIGN.md section 10).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, n_cols, eps, offset,
                     BLOCK: tl.constexpr):
    # One row per program: x * rsqrt(mean(x^2) + eps) * (w + offset), as RMSNorm.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd) * (w + offset)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr):
    # Program (row, block): silu(gate) * up for BLOCK of the row's d outputs.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, x_stride, cos_stride,
                   HEAD_SIZE: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                   NEOX: tl.constexpr):
    # Program (token, head), in place: the head's first 2 * HALF dims as pairs (x1, x2)
    # -> (x1 cos - x2 sin, x2 cos + x1 sin); NEOX pairs dim i with i + HALF (halves),
    # otherwise 2i with 2i + 1 (GPT-J).
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    pos = tl.load(pos_ptr + token)
    cos = tl.load(cos_ptr + pos * cos_stride + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * cos_stride + i, mask=mask, other=0.0).to(tl.float32)
    base = x_ptr + token * x_stride + head * HEAD_SIZE
    if NEOX:
        i1 = i
        i2 = i + HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    x1 = tl.load(base + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + i1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + i2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with contiguous rows (a view where its strides allow)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _warps(block: int) -> int:
    # ~8 elements per thread, 1 to 16 warps.
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of x [..., D] over D with weight [D] (+ offset: Gemma's 1 + w), x's dtype."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(rows.shape[1])
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0),
                                           rows.shape[1], eps, offset, BLOCK=block,
                                           num_warps=_warps(block))
    return out.view(x.shape)


# Outputs per program of silu_and_mul.
_SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2d] (gate | up) -> silu(gate) * up [T, d], x's dtype."""
    rows = _rows(x)
    d = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(_SILU_BLOCK, triton.next_power_of_2(d))
        grid = (rows.shape[0], triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), d, BLOCK=block,
                                   num_warps=_warps(block))
    return out


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, head_size: int, rotary_dim: int,
                     is_neox_style: bool) -> None:
    """Rotates q [T, H * head_size] and k [T, KVH * head_size] in place (rows may be
    strided, as q and k split from one qkv projection; the last dim contiguous) by the
    cos / sin [max_position, rotary_dim // 2] rows of `positions` [T]."""
    assert cos.is_contiguous() and sin.is_contiguous() and cos.stride(0) == sin.stride(0)
    half = rotary_dim // 2
    block = triton.next_power_of_2(half)
    for x in (q, k):
        assert x.dim() == 2 and x.stride(-1) == 1, "rotary_embedding: [T, heads * D] rows"
        if x.shape[0] == 0:
            continue
        grid = (x.shape[0], x.shape[1] // head_size)
        _rotary_kernel[grid](x, positions, cos, sin, x.stride(0), cos.stride(0),
                             HEAD_SIZE=head_size, HALF=half, BLOCK=block,
                             NEOX=is_neox_style, num_warps=1)
