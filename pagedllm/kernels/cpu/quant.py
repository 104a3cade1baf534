"""GGUF block-quantized weights for the native quantized GEMM (csrc/cpu_quant.cpp).

A `QuantizedWeight` is a 2-D weight [N, K] as the GGUF file stores it: each row is K / 32
blocks of ggml's Q8_0 / Q4_0 / Q4_1 (32 weights) or Q4_K (256) layout, kept as raw
bytes [N, K / block * block size].
The loader yields it in place of a dequantized tensor; rows can be permuted or
concatenated as bytes (a block never straddles rows). `repack` regroups the blocks once,
16 output columns side by side, into the kernel's layout [ceil(N / 16), K / block,
block_bytes] (described in cpu_quant.cpp): the same bytes (Q8_0's with the sign bit
flipped, Q4_K's 6-bit scales unpacked to bytes: +3%), so weights stay ~file-sized.

The dequantizers here reproduce gguf-py's `gguf.quants.dequantize` bit for bit (float32,
the same operations), so a tensor dequantized here equals the one the dequantizing
loader produces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32
"""Weights per block of the activations (and of Q8_0 / Q4_0 / Q4_1; Q4_K: 8 of them)."""
GROUP = 16
"""Output columns per group of the packed layout."""

# qtype name -> (weights per block, raw bytes per block in the file, packed bytes per
# (group, block)).
_SIZES = {"Q8_0": (32, 34, 544), "Q4_0": (32, 18, 288), "Q4_1": (32, 20, 320),
          "Q4_K": (256, 144, 2368)}
NATIVE_QTYPES = frozenset(_SIZES)
"""GGUF tensor types the quantized GEMM runs on (others are dequantized on load)."""
ROW_QTYPES = frozenset({"Q8_0", "Q4_0", "Q4_1"})
"""Types `dequantize_rows` reads (embedding lookups; a Q4_K table is dequantized)."""
_BY_PACKED = {packed: name for name, (_, _, packed) in _SIZES.items()}


def block_elems(qtype: str) -> int:
    """Weights per block of a native type (K must be a multiple)."""
    return _SIZES[qtype][0]


@dataclass
class QuantizedWeight:
    """A GGUF-quantized 2-D weight: `raw` [N, K / 32 * block size] uint8, as stored."""

    qtype: str
    """ggml type name: Q8_0, Q4_0, Q4_1 or Q4_K."""
    raw: torch.Tensor
    """The file's bytes, one row of blocks per output row."""
    in_features: int
    """K (the row length in weights)."""

    def __post_init__(self) -> None:
        assert self.qtype in _SIZES, self.qtype
        elems, raw_size, _ = _SIZES[self.qtype]
        assert self.in_features % elems == 0, self.in_features
        assert self.raw.dtype == torch.uint8 and self.raw.dim() == 2
        assert self.raw.shape[1] == self.in_features // elems * raw_size

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.in_features

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype` (via float32, as gguf-py then `.to(dtype)`)."""
        n, k = self.shape
        elems, raw_size, _ = _SIZES[self.qtype]
        blocks = self.raw.view(n, k // elems, raw_size)
        d = _half(blocks[..., 0:2])
        if self.qtype == "Q4_K":
            sc, m = _q4k_scales(blocks[..., 4:16])  # [n, nb, 8] each
            d_sub = (d * sc.float()).unsqueeze(-1)  # [n, nb, 8, 1]
            dm_sub = (_half(blocks[..., 2:4]) * m.float()).unsqueeze(-1)
            qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32) >> torch.tensor(
                [0, 4], dtype=torch.uint8).view(2, 1)
            q = (qs & 0x0F).reshape(n, -1, 8, 32).float()
            w = d_sub * q - dm_sub
        elif self.qtype == "Q8_0":
            w = blocks[..., 2:].view(torch.int8).float() * d
        else:
            start = 4 if self.qtype == "Q4_1" else 2
            q = _nibbles(blocks[..., start:])
            if self.qtype == "Q4_0":
                w = (q.to(torch.int8) - 8).float() * d
            else:
                w = q.float() * d + _half(blocks[..., 2:4])
        return w.reshape(n, k).to(dtype)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of `parts` stacked (same type and K)."""
        assert len({(p.qtype, p.in_features) for p in parts}) == 1
        return QuantizedWeight(parts[0].qtype, torch.cat([p.raw for p in parts]),
                               parts[0].in_features)


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (a little-endian float16) -> [..., 1] float32."""
    return two_bytes.contiguous().view(torch.float16).float()


def _q4k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes [..., 12] -> its 6-bit scales and mins [..., 8] (uint8), as ggml's
    get_scale_min_k4: bytes 0-3 / 4-7 hold scales / mins 0-3 (low 6 bits) and the top 2
    bits of 4-7; bytes 8-11 the low 4 bits of scales / mins 4-7."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 16 Q4 bytes [..., 16] -> the 32 values [..., 32] (low nibbles are elements
    0..15, high nibbles 16..31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def repack(weight: QuantizedWeight) -> torch.Tensor:
    """The kernel's layout [ceil(N / 16), K / 32, block_bytes] uint8 of `weight` (rows past
    N are zero: they contribute 0 and are never stored). Done _CHUNK_ROWS rows at a time,
    so the temporaries stay a few MB even for an embedding table (a whole-table repack
    briefly held ~4 copies of it: +88 MiB at the peak of SmolLM2's load)."""
    n, k = weight.shape
    elems, _, packed_size = _SIZES[weight.qtype]
    out = torch.empty(-(-n // GROUP), k // elems, packed_size, dtype=torch.uint8)
    for r0 in range(0, n, _CHUNK_ROWS):
        rows = weight.raw[r0:r0 + _CHUNK_ROWS]
        g0 = r0 // GROUP
        _repack_rows(rows, weight.qtype, k, out[g0:g0 + -(-rows.shape[0] // GROUP)])
    return out


_CHUNK_ROWS = 64 * GROUP


def _repack_rows(raw: torch.Tensor, qtype: str, k: int, out: torch.Tensor) -> None:
    """Rows `raw` (a whole number of groups, but for the last rows of a weight) into
    `out` [groups, nb, block_bytes], copied from strided views (no other temporaries)."""
    elems, raw_size, _ = _SIZES[qtype]
    n, nb = raw.shape[0], k // elems
    groups = out.shape[0]
    blocks = raw.view(n, nb, raw_size)
    if n != groups * GROUP:  # the last group of a weight whose N is not a multiple of 16
        blocks = F.pad(blocks, (0, 0, 0, 0, 0, groups * GROUP - n))
    blocks = blocks.view(groups, GROUP, nb, raw_size)
    if qtype == "Q4_K":
        return _repack_q4k(blocks, out)
    scales_end = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}[qtype]
    qs_bytes = out.shape[2] - GROUP * scales_end
    # [G, 16 columns, nb, dwords, 4] -> [G, nb, dwords, 16 columns, 4]: vector v of a
    # (group, block) holds dword v of each column's block.
    qs = blocks[..., scales_end:].reshape(groups, GROUP, nb, -1, 4)
    out[..., :qs_bytes].view(groups, nb, -1, GROUP, 4).copy_(qs.permute(0, 2, 3, 1, 4))
    if qtype == "Q8_0":
        # int8 q -> uint8 q + 128 (vpdpbusd's unsigned operand)
        out[..., :qs_bytes].bitwise_xor_(0x80)
    for i, lo in enumerate(range(0, scales_end, 2)):  # d, then m (Q4_1): 16 columns x 2 bytes
        at = qs_bytes + i * 2 * GROUP
        out[..., at:at + 2 * GROUP].view(groups, nb, GROUP, 2).copy_(
            blocks[..., lo:lo + 2].permute(0, 2, 1, 3))


def _repack_q4k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_K blocks [G, 16, nb, 144] into `out` [G, nb, 2368] (layout: csrc/cpu_quant.cpp):
    qs [4 chunks][8 dwords][16 columns][4] | d [16] | dmin [16] f16 | sc, m [8][16] u8."""
    groups, _, nb, _ = blocks.shape
    qs = blocks[..., 16:].reshape(groups, GROUP, nb, 4, 8, 4)
    out[..., :2048].view(groups, nb, 4, 8, GROUP, 4).copy_(qs.permute(0, 2, 3, 4, 1, 5))
    for at, lo in ((2048, 0), (2080, 2)):  # d, dmin: 16 columns x 2 bytes
        out[..., at:at + 2 * GROUP].view(groups, nb, GROUP, 2).copy_(
            blocks[..., lo:lo + 2].permute(0, 2, 1, 3))
    sc, mins = _q4k_scales(blocks[..., 4:16])  # [G, 16, nb, 8]
    out[..., 2112:2240].view(groups, nb, 8, GROUP).copy_(sc.permute(0, 2, 3, 1))
    out[..., 2240:2368].view(groups, nb, 8, GROUP).copy_(mins.permute(0, 2, 3, 1))


def packed_qtype(packed: torch.Tensor) -> str:
    """The ggml type of a repacked weight (told apart by its block size)."""
    return _BY_PACKED[packed.shape[2]]


def dequantize_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [T] (int64) of a repacked weight, dequantized: float32 [T, K], equal to
    `QuantizedWeight.dequantize(torch.float32)[rows]` (embedding lookups; ROW_QTYPES)."""
    qtype = packed_qtype(packed)
    assert qtype in ROW_QTYPES, qtype
    num, nb = rows.numel(), packed.shape[1]
    blk = packed[rows.div(GROUP, rounding_mode="floor")]  # [T, nb, block_bytes]
    lane = (rows % GROUP).view(num, 1, 1, 1).expand(num, nb, -1, 1)
    qs_bytes = packed.shape[2] - (64 if qtype == "Q4_1" else 32)
    qs = blk[..., :qs_bytes].reshape(num, nb, -1, GROUP, 4)  # [T, nb, v, column, 4]
    qs = qs.gather(3, lane.unsqueeze(-1).expand(num, nb, qs.shape[2], 1, 4)).reshape(num, nb, -1)

    def scale(at: int) -> torch.Tensor:  # [T, nb, 1] float32
        pairs = blk[..., at:at + 2 * GROUP].reshape(num, nb, GROUP, 2)
        return _half(pairs.gather(2, lane.expand(num, nb, 1, 1).expand(num, nb, 1, 2))
                     .reshape(num, nb, 2))

    d = scale(qs_bytes)
    if qtype == "Q8_0":
        w = (qs ^ 0x80).view(torch.int8).float() * d
    elif qtype == "Q4_0":
        w = (_nibbles(qs).to(torch.int8) - 8).float() * d
    else:
        w = _nibbles(qs).float() * d + scale(qs_bytes + 2 * GROUP)
    return w.reshape(num, nb * BLOCK)
