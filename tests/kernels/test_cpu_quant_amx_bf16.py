"""gemm_quant's "amx_bf16" path (csrc/quant_amx_bf16.h): weights of every block type but
Q2_K dequantized to bfloat16 panels and multiplied on AMX bfloat16 tiles. Its contract is
exact: the bits of gemm_bf16 on the weights gguf-py dequantizes, rounded to bfloat16, in
every shape (panels of 48 columns cut short, row tiles of 16 cut short, blocks of 512
rows), with a bias and with accumulation; and a row's bits whatever the batch. `auto`
takes it for the prompt rows a call marks (by default), for every row where
PAGEDLLM_CPU_QUANT_GEMM=amx_bf16 asks, for none under "int8"; only for bfloat16 x on
those types."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu import ops as cpu_ops
from pagedllm.kernels.cpu.build import load_cpu_kernels
from pagedllm.kernels.cpu.quant import repack
from pagedllm.models.layers.linear import pack_native
from tests.kernels.test_cpu_quant import gguf_dequantize, make_weight, run_gemm

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module", autouse=True)
def _usable() -> None:
    assert load_cpu_kernels()
    if not cpu_ops.quant_amx_bf16_usable():
        pytest.skip("no AMX-BF16 tiles here (their kernels are not in the build)")


def _dequantized_gemm(weight, x: torch.Tensor, bias: torch.Tensor,
                      start: torch.Tensor | None = None) -> torch.Tensor:
    """gemm_bf16 on the gguf-dequantized weight rounded to bfloat16 (what a `--dequantize`
    run multiplies)."""
    packed = pack_native(gguf_dequantize(weight).to(torch.bfloat16))
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    if start is not None:
        out.copy_(start)
    cpu_ops.gemm_bf16(out, x, packed, bias, accumulate=start is not None)
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_bits_of_the_dequantized_bf16_gemm(qtype: str) -> None:
    """1 and 3 rows (a tile configured that short), 16, 17 (a zero-padded last tile),
    70, 600 (two blocks of 512 rows); 45 columns (one panel, its third group 13 wide), 7,
    50 (a second panel of one group, 2 wide), 130; K of 64 to 768 (the K-types' rounded
    up to their super-blocks of 256)."""
    for n, m, k in ((45, 1, 512), (7, 3, 768), (50, 16, 64), (130, 17, 96), (200, 70, 512),
                    (45, 600, 512)):
        if qtype.endswith("_K"):
            k = -(-k // 256) * 256
        weight = make_weight(qtype, n, k, seed=m)
        packed = repack(weight)
        x = (torch.randn(m, k) * 3).to(torch.bfloat16)
        x[0, 32:64] = 0
        bias = torch.randn(n)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        cpu_ops.gemm_quant(out, x, packed, bias, path="amx_bf16")
        assert torch.equal(out, _dequantized_gemm(weight, x, bias)), (n, m, k)
        start = torch.randn(m, n).to(torch.bfloat16)
        out = start.clone()
        cpu_ops.gemm_quant(out, x, packed, bias, accumulate=True, path="amx_bf16")
        assert torch.equal(out, _dequantized_gemm(weight, x, bias, start)), (n, m, k, "acc")


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_bit_identical_whatever_the_batch(qtype: str) -> None:
    weight = make_weight(qtype, 100, 512)
    x = torch.randn(600, 512).to(torch.bfloat16)
    full = run_gemm(weight, x, path="amx_bf16")
    for i in (0, 5, 17, 530, 599):
        assert torch.equal(run_gemm(weight, x[i:i + 1], path="amx_bf16"), full[i:i + 1])
    assert torch.equal(run_gemm(weight, x[3:20], path="amx_bf16"), full[3:20])
    assert torch.equal(run_gemm(weight, x[500:], path="amx_bf16"), full[500:])


def test_auto_takes_it_only_when_asked(monkeypatch) -> None:
    q41, q2k = make_weight("Q4_1", 40, 256), make_weight("Q2_K", 40, 256)
    x = torch.randn(5, 256).to(torch.bfloat16)
    int8 = run_gemm(q41, x, path="avx512")
    tiles = run_gemm(q41, x, path="amx_bf16")
    assert not torch.equal(int8, tiles)  # int8 activations against bfloat16 ones
    monkeypatch.delenv("PAGEDLLM_CPU_QUANT_GEMM", raising=False)
    assert torch.equal(run_gemm(q41, x), int8)  # the default: int8 kernels (no marks)
    monkeypatch.setenv("PAGEDLLM_CPU_QUANT_GEMM", "amx_bf16")
    assert torch.equal(run_gemm(q41, x), tiles)
    # Other types and float32 x keep the int8 kernels.
    assert torch.equal(run_gemm(q2k, x), run_gemm(q2k, x, path="avx512"))
    xf = x.float()
    assert torch.equal(run_gemm(q41, xf), run_gemm(q41, xf, path="avx512"))
    monkeypatch.setenv("PAGEDLLM_CPU_QUANT_GEMM", "int8")
    assert torch.equal(run_gemm(q41, x), int8)


def _marked_gemm(weight, x: torch.Tensor, marks: torch.Tensor, bias: torch.Tensor,
                 start: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    if start is not None:
        out.copy_(start)
    cpu_ops.gemm_quant(out, x, repack(weight), bias, accumulate=start is not None,
                       prompt_rows=marks)
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_marked_prompt_rows_take_the_tiles(qtype: str, monkeypatch) -> None:
    """By default `auto` runs the rows marked in prompt_rows on the tiles and the others on
    the int8 kernels, each row as it would alone: marks in one run, scattered, all and
    none, 40 and 600 rows (two blocks of 512), with accumulation."""
    monkeypatch.delenv("PAGEDLLM_CPU_QUANT_GEMM", raising=False)
    assert cpu_ops.quant_splits_prompt_rows()
    weight = make_weight(qtype, 70, 256, seed=3)
    packed = repack(weight)
    bias = torch.randn(70)
    for m in (40, 600):
        x = torch.randn(m, 256).to(torch.bfloat16)
        start = torch.randn(m, 70).to(torch.bfloat16)
        tiles = [torch.empty(m, 70, dtype=torch.bfloat16) for _ in range(4)]
        int8 = [torch.empty(m, 70, dtype=torch.bfloat16) for _ in range(4)]
        for path, outs in (("amx_bf16", tiles), ("int8", int8)):
            cpu_ops.gemm_quant(outs[0], x, packed, bias, path=path)
            outs[1].copy_(start)
            cpu_ops.gemm_quant(outs[1], x, packed, bias, accumulate=True, path=path)
        run = torch.zeros(m, dtype=torch.bool)
        run[m // 4:m // 2] = True  # decodes then a prefill: no gather
        scattered = torch.rand(m, generator=torch.Generator().manual_seed(m)) < 0.5
        for marks in (run, scattered, ~scattered, torch.ones(m, dtype=torch.bool),
                      torch.zeros(m, dtype=torch.bool)):
            rows = marks[:, None]
            assert torch.equal(_marked_gemm(weight, x, marks, bias),
                               torch.where(rows, tiles[0], int8[0]))
            assert torch.equal(_marked_gemm(weight, x, marks, bias, start),
                               torch.where(rows, tiles[1], int8[1]))


def test_marks_only_where_the_tiles_run(monkeypatch) -> None:
    """Other types, float32 x, and PAGEDLLM_CPU_QUANT_GEMM=int8 / amx_bf16 ignore the
    marks; a mark tensor of the wrong shape or dtype is refused."""
    q41, q2k = make_weight("Q4_1", 40, 256), make_weight("Q2_K", 40, 256)
    x = torch.randn(6, 256).to(torch.bfloat16)
    marks = torch.tensor([True, False, True, True, False, False])
    bias = torch.zeros(40)
    monkeypatch.delenv("PAGEDLLM_CPU_QUANT_GEMM", raising=False)
    assert torch.equal(_marked_gemm(q2k, x, marks, bias), run_gemm(q2k, x, path="int8"))
    assert torch.equal(_marked_gemm(q41, x.float(), marks, bias),
                       run_gemm(q41, x.float(), path="int8"))
    monkeypatch.setenv("PAGEDLLM_CPU_QUANT_GEMM", "int8")
    assert not cpu_ops.quant_splits_prompt_rows()
    assert torch.equal(_marked_gemm(q41, x, marks, bias), run_gemm(q41, x, path="int8"))
    monkeypatch.setenv("PAGEDLLM_CPU_QUANT_GEMM", "amx_bf16")
    assert not cpu_ops.quant_splits_prompt_rows()
    assert torch.equal(_marked_gemm(q41, x, marks, bias), run_gemm(q41, x, path="amx_bf16"))
    for bad in (marks.to(torch.uint8), marks[:5]):
        with pytest.raises(RuntimeError, match="prompt_rows is a contiguous bool"):
            _marked_gemm(q41, x, bad, bias)


def test_refuses_what_it_cannot_run() -> None:
    with pytest.raises(RuntimeError, match="'amx_bf16' takes bfloat16 x on Q8_0 / Q4_0 / Q4_1 / "
                                           "Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K"):
        run_gemm(make_weight("Q4_1", 16, 64), torch.randn(2, 64), path="amx_bf16")
    with pytest.raises(RuntimeError, match="'amx_bf16' takes bfloat16 x on Q8_0 / Q4_0 / Q4_1 / "
                                           "Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K"):
        run_gemm(make_weight("Q2_K", 16, 256), torch.randn(2, 256).to(torch.bfloat16),
                 path="amx_bf16")
