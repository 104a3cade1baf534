"""The quantized GEMM (csrc/cpu_quant.cpp) and the GGUF block helpers (kernels/cpu/quant.py).

References: the weights dequantized by gguf-py itself, and x quantized per row to int8
blocks as the kernel does (`_quantize_rows`, numpy float32: the same operations). With both
operands the kernel's, the only difference left is the float32 arithmetic over K (one
rounded product d_w d_x and one fused multiply-add per block, or per half block for Q6_K's
and Q2_K's sub-blocks of 16, plus one for the min term of Q4_1 / Q5_1 / Q2_K / Q4_K / Q5_K;
the integer dots exact): the reference sums in float64, so the
tolerance is a few float32 rounding steps (rtol 1e-5 of the sum of |terms|), the same for
every type. Against the unquantized x the int8 activations cost ~1% (checked too).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.build import load_cpu_kernels
from pagedllm.kernels.cpu.features import cpu_flags
from pagedllm.kernels.cpu.quant import QuantizedWeight, dequantize_rows, repack
from tests.loader.test_gguf import random_k_blocks

QTYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q4_K", "Q5_K", "Q6_K"]
K_QTYPES = ("Q2_K", "Q4_K", "Q5_K", "Q6_K")
_QT = gguf.GGMLQuantizationType


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    assert load_cpu_kernels()


def make_weight(qtype: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """A random [n, k] weight quantized by gguf-py (as the file would hold it); K-types
    (which gguf-py cannot quantize): random blocks, every scale and quant bit exercised
    (Q6_K's int8 scales of both signs), k rounded up to their 256-weight blocks."""
    rng = np.random.default_rng(seed)
    if qtype in K_QTYPES:
        k = -(-k // 256) * 256
        raw = random_k_blocks(rng, (n, k), getattr(_QT, qtype))
        return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(raw)), k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, :32] += 0.02  # a non-zero mean in a block: exercises Q4_1's min
    raw = gguf.quants.quantize(w, getattr(_QT, qtype))  # [n, k / 32 * block size] uint8
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(raw)), k)


def gguf_dequantize(weight: QuantizedWeight) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(weight.raw.numpy(),
                                                   getattr(_QT, weight.qtype))).float()


def _quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel quantizes it (per row, blocks of 32), dequantized: float64."""
    xb = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint((xb * inv).astype(np.float32))
    return torch.from_numpy((q.astype(np.float64) * d).reshape(x.shape))


def run_gemm(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None = None,
             path: str = "auto") -> torch.Tensor:
    n = weight.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    b = torch.zeros(n) if bias is None else bias
    cpu_ops.gemm_quant(out, x, repack(weight), b, path=path)
    return out


# Byte offsets of the float16 fields (scales, mins) in each ggml block.
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q2_K": (80, 82), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def extreme_weight(qtype: str, n: int, k: int, fill: int) -> QuantizedWeight:
    """Every byte of every block `fill` but the float16 scales (0.01): 0xff puts every
    quant at its largest (Q8_0: -1), 0x7f / 0x80 give Q8_0 its +127 / -128."""
    block, size = gguf.GGML_QUANT_SIZES[getattr(_QT, qtype)]
    raw = np.full((n, k // block, size), fill, dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        raw[:, :, at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return QuantizedWeight(qtype, torch.from_numpy(raw.reshape(n, -1)), k)


def _built(path: str) -> bool:
    """Whether the build (-march=native) has this path's kernels (AMX: and the OS lets
    the process use the tiles)."""
    if path == "amx":
        return cpu_ops.quant_amx_usable()
    if path == "avx512":  # quant_avx512.h's guard: AVX512-VNNI and AVX512-BW
        return {"avx512_vnni", "avx512bw"} <= cpu_flags()
    return path != "avx2" or {"avx2", "fma", "f16c"} <= cpu_flags()


def _require_path(path: str) -> None:
    if not _built(path):
        pytest.skip(f"this CPU has no {path.upper()} (its kernels are not in the build)")


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf(qtype: str) -> None:
    weight = make_weight(qtype, 37, 320)  # K-types: 512, two blocks of 256
    ref = gguf_dequantize(weight)
    assert torch.equal(weight.dequantize(torch.float32), ref)
    rows = torch.tensor([0, 36, 5, 16, 15, 5])
    assert torch.equal(dequantize_rows(repack(weight), rows), ref[rows])


@pytest.mark.parametrize("qtype", QTYPES)
def test_native_rows_match_python_rows(qtype: str) -> None:
    """The native lookup (quant_rows) == dequantize_rows then .to(dtype), bit for bit: the
    same float32 operations, one rounding to the output dtype."""
    weight = make_weight(qtype, 37, 320, seed=3)
    packed, ref = repack(weight), gguf_dequantize(weight)
    rows = torch.tensor([36, 0, 5, 16, 15, 5, 31, 32])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.full((len(rows), weight.shape[1]), float("nan"), dtype=dtype)
        cpu_ops.quant_rows(out, packed, rows, 37)
        assert torch.equal(out, dequantize_rows(packed, rows).to(dtype)), dtype
    assert torch.equal(out.float(), ref[rows].half().float())
    with pytest.raises(RuntimeError, match="id 37 is out of range"):
        cpu_ops.quant_rows(out[:1], packed, torch.tensor([37]), 37)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 33, 64), (3, 7, 32), (17, 129, 160), (40, 48, 576),
                                   (9, 20, 1024)])
def test_gemm_matches_dequantized_matmul(qtype: str, dtype: torch.dtype, m: int, n: int,
                                         k: int) -> None:
    weight = make_weight(qtype, n, k, seed=m + n + k)
    k = weight.shape[1]
    torch.manual_seed(m * n)
    x = torch.randn(m, k).to(dtype)
    x[0, :32] = 0  # an all-zero block (d = 0)
    bias = torch.randn(n)
    out = run_gemm(weight, x, bias).double()
    w = gguf_dequantize(weight).double()
    ref = _quantize_rows(x) @ w.T + bias.double()
    # float32 accumulation (and the bfloat16 rounding of the output) vs float64.
    scale = _quantize_rows(x).abs() @ w.abs().T + bias.double().abs()
    out_rtol = 2 ** -8 if dtype == torch.bfloat16 else 0.0
    assert ((out - ref).abs() <= 1e-5 * scale + out_rtol * ref.abs() + 1e-30).all()
    # Against x itself (no activation quantization): int8 blocks cost ~1%.
    exact = x.double() @ w.T + bias.double()
    assert (out - exact).norm() <= 0.02 * exact.norm()


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_bit_identical_whatever_the_batch(qtype: str) -> None:
    """Batch invariance: a row's output is the same bits alone, or anywhere in a batch
    (70 rows: micro-kernels of 8 rows and fewer, and two blocks of 64 rows)."""
    weight = make_weight(qtype, 200, 512)
    x = torch.randn(70, 512).to(torch.bfloat16)
    full = run_gemm(weight, x)
    for i in (0, 5, 17, 32, 69):
        assert torch.equal(run_gemm(weight, x[i:i + 1]), full[i:i + 1])
    assert torch.equal(run_gemm(weight, x[3:20]), full[3:20])
    assert torch.equal(run_gemm(weight, x[60:]), full[60:])


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", ["avx2", "portable"])
def test_every_path_same_bits(qtype: str, path: str) -> None:
    """The kernels of CPUs without AVX512-VNNI (AVX2: 8 columns at a time, int16 sums;
    portable C++) give the same bits as the widest ones: 11 rows (AVX2 micro-kernels of 4,
    4 and 3; AVX-512: two groups of 16 columns at a time), 6 rows of 29 columns (a pair of
    groups whose second has 13), 3 and 1 (a decode: the weight streamed, one row's both
    halves in one pass), 45 columns (a last group of 13: a full half and one of 5), and 7
    (one half); float32
    and bfloat16 activations; a bias, and accumulation. K is 512 or 768 (x quantized 16
    blocks at a time on AVX-512, then 8 one by one), one block of x all zeros."""
    _require_path(path)
    for n, m, k in ((45, 11, 512), (29, 6, 768), (7, 3, 512), (45, 1, 768), (7, 1, 512)):
        weight = make_weight(qtype, n, k, seed=n)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(m, weight.shape[1]) * 3).to(dtype)
            x[0, 32:64] = 0
            bias = torch.randn(n)
            assert torch.equal(run_gemm(weight, x, bias, path=path), run_gemm(weight, x, bias))
            start = torch.randn(m, n).to(dtype)
            outs = [start.clone(), start.clone()]
            for out, kernels in zip(outs, (path, "auto")):
                cpu_ops.gemm_quant(out, x, repack(weight), bias, accumulate=True, path=kernels)
            assert torch.equal(*outs)


@pytest.mark.parametrize("qtype", QTYPES)
def test_amx_same_bits_as_avx512(qtype: str) -> None:
    """The AMX kernels (csrc/quant_amx.h: tiles of 16 rows, x padded with zero rows) give
    the AVX-512 kernels' bits: 1 row (a tile of 15 padding rows), 11 and 16, 37 (three
    tiles, the last of 5), 70, 300 (blocks of 256 rows, the second of 44); 45 columns
    (a last group of 13) and 7; K of 512 and 768 (the K-types: 2 and 3 super-blocks);
    float32 and bfloat16 x, a bias, accumulation. Q2_K and Q6_K have no AMX kernels: their
    calls on that path take the AVX-512 ones."""
    _require_path("amx")
    for n, m, k in ((45, 11, 512), (7, 1, 768), (45, 16, 768), (29, 37, 512), (200, 70, 512),
                    (45, 300, 512)):
        weight = make_weight(qtype, n, k, seed=m)
        packed = repack(weight)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(m, weight.shape[1]) * 3).to(dtype)
            x[0, 32:64] = 0
            bias = torch.randn(n)
            outs = [torch.empty(m, n, dtype=dtype) for _ in range(2)]
            for out, path in zip(outs, ("amx", "avx512")):
                cpu_ops.gemm_quant(out, x, packed, bias, path=path)
            assert torch.equal(*outs), (n, m, k, dtype)
            start = torch.randn(m, n).to(dtype)
            outs = [start.clone(), start.clone()]
            for out, path in zip(outs, ("amx", "avx512")):
                cpu_ops.gemm_quant(out, x, packed, bias, accumulate=True, path=path)
            assert torch.equal(*outs), (n, m, k, dtype, "accumulate")


@pytest.mark.parametrize("qtype", QTYPES)
def test_extreme_quants_same_bits_on_every_path(qtype: str) -> None:
    """The largest products (every quant at its extreme, every activation at +-127,
    alternating signs too): the AVX2 kernels' int16 sums stay below saturation (a kernel
    summing 8 instead of 4 five-bit terms fails here), and the results are the same bits
    as the int32 dots of the AVX-512 ones."""
    for fill in (0xff, 0x7f, 0x80):
        weight = extreme_weight(qtype, 24, 512, fill)
        x = torch.full((4, 512), 3.0)
        x[1] = -3.0
        x[2] *= torch.tensor([1.0, -1.0]).repeat(256)
        x[3] = torch.randn(512)
        expected = run_gemm(weight, x)
        w = gguf_dequantize(weight).double()
        ref, scale = _quantize_rows(x) @ w.T, _quantize_rows(x).abs() @ w.abs().T
        assert ((expected.double() - ref).abs() <= 1e-5 * scale + 1e-30).all(), fill
        for path in filter(_built, ("amx", "avx512", "avx2", "portable")):
            assert torch.equal(run_gemm(weight, x, path=path), expected), (fill, path)
            for r in range(4):  # one row: a decode's kernels
                assert torch.equal(run_gemm(weight, x[r:r + 1], path=path), expected[r:r + 1])


def test_path_names() -> None:
    weight = make_weight("Q4_0", 16, 64)
    x = torch.randn(2, 64)
    if _built("avx512"):
        assert torch.equal(run_gemm(weight, x, path="avx512"), run_gemm(weight, x))
        assert torch.equal(run_gemm(weight, x, path="int8"), run_gemm(weight, x))
    with pytest.raises(RuntimeError, match="path must be auto, int8, amx_bf16, amx, avx512, "
                                           "avx2 or portable, got 'sse'"):
        run_gemm(weight, x, path="sse")


@pytest.mark.parametrize("qtype", QTYPES)
def test_accumulate_adds_rounded_result(qtype: str) -> None:
    weight = make_weight(qtype, 50, 64)
    k = weight.shape[1]
    x = torch.randn(4, k).to(torch.bfloat16)
    out = torch.randn(4, 50).to(torch.bfloat16)
    expected = out + run_gemm(weight, x)
    cpu_ops.gemm_quant(out, x, repack(weight), torch.zeros(50), accumulate=True)
    assert torch.equal(out, expected)


# packed / file bytes (kernels/cpu/quant.py): the K-types' 6-bit scales unpacked to bytes.
_PACKED_RATIO = {"Q4_K": 2368 / 2304, "Q5_K": 2880 / 2816}


@pytest.mark.parametrize("qtype", QTYPES)
def test_repacked_weight_is_file_sized(qtype: str) -> None:
    weight = make_weight(qtype, 64, 512)
    packed = repack(weight)
    assert packed.numel() == weight.raw.numel() * _PACKED_RATIO.get(qtype, 1)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q2_K", "Q6_K", "Q8_0"])
def test_decode_calls_same_bits_whatever_the_threads(qtype: str) -> None:
    """Calls of up to 4 rows claim the column groups in runs (csrc/work_split.h), larger
    ones split them evenly: the bits of a row are the same either way, with 1, 2 or 3
    threads (a weight large enough for the threads to start: 64 groups of 16 columns)."""
    weight = make_weight(qtype, 1024, 512, seed=11)
    x = torch.randn(40, weight.shape[1]).to(torch.bfloat16)
    batched = run_gemm(weight, x)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for rows in (1, 2, 4):
                assert torch.equal(run_gemm(weight, x[:rows]), batched[:rows]), (n, rows)
            assert torch.equal(run_gemm(weight, x[29:30]), batched[29:30]), n
    finally:
        torch.set_num_threads(threads)
