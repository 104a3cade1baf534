"""fp8 KV cache: the storage dtypes and the rule every backend writes and reads by.

With `kv_cache_dtype` fp8_e4m3 or fp8_e5m2 the cache holds one byte per element. Each
attention layer has two fixed scales, k_scale and v_scale (`Attention.k_scale`,
`Attention.v_scale`):

    stored = fp8(clamp(x / scale, -max, max))     (round to nearest even)
    read   = float(stored) * scale

The clamp saturates: torch's float -> fp8 conversion does not promise to (e4m3fn has no
inf; c10's scalar path gives NaN beyond 480), so a large K/V value becomes +-max, never
NaN. The scales are 1.0, vLLM's default when a checkpoint carries none. They are
deliberately NOT derived from the traffic (say the first batch's maxima): a request's
outputs must not depend on what it was batched with (DESIGN.md §10), so scales are fixed
per layer; a checkpoint's calibrated scales can be assigned to the layer attributes.
With a non-fp8 cache the scales are ignored.

The native CPU and Triton kernels implement the same rule (bit-exact writes) and fold the
scales into the softmax scale (k) and the output normalization (v).
"""

from __future__ import annotations

import torch

FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn,
                                      "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for CacheConfig.cache_dtype ("auto": the model's)."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(FP8_DTYPES)}, "
                         f"got {cache_dtype!r}")
    return FP8_DTYPES[cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) -> fp8 `dtype`: x / scale in float32, saturated, rounded."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32,
                  ) -> torch.Tensor:
    """fp8 x -> float32 x * scale, then `dtype`; other dtypes are only cast."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    out = x.float()
    if scale != 1.0:
        out.mul_(scale)
    return out.to(dtype)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor viewed as uint8 (same shape) for the copies torch lacks fp8 kernels
    for (index_copy_ on CPU); other tensors unchanged."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def verify_kv_cache_support(dtype: torch.dtype, backend: str, device: torch.device) -> None:
    """Raise ValueError at start-up where `backend` cannot run an fp8 cache of `dtype`
    on `device`, rather than produce garbage later."""
    if not is_fp8(dtype) or backend != "triton" or device.type != "cuda":
        return
    # Triton's e4m3 (fp8e4nv) loads and conversions need Ada / Hopper or newer.
    capability = torch.cuda.get_device_capability(device)
    if dtype == torch.float8_e4m3fn and capability < (8, 9):
        raise ValueError(f"kv_cache_dtype fp8_e4m3 needs a GPU of compute capability 8.9 "
                         f"or newer with the triton backend (this one is "
                         f"{capability[0]}.{capability[1]}); use fp8_e5m2 or auto")
