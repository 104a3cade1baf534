"""GGUF block-quantized weights for the native quantized GEMM (csrc/cpu_quant.cpp).

A `QuantizedWeight` is a 2-D weight [N, K] as the GGUF file stores it: each row is K / 32
blocks of ggml's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 (32 weights) or Q2_K / Q4_K / Q5_K / Q6_K
(256) layout, kept as raw bytes [N, K / block * block size].
The loader yields it in place of a dequantized tensor; rows can be permuted or
concatenated as bytes (a block never straddles rows). `repack` regroups the blocks once,
16 output columns side by side, into the kernel's layout [ceil(N / 16), K / block,
block_bytes] (described in cpu_quant.cpp): the same bits, moved (Q8_0's with the sign bit
flipped; Q5's and Q6_K's high bits regrouped into "planes"; Q4_K's and Q5_K's 6-bit
scales unpacked to bytes: +2.8% and +2.3%), so weights stay file-sized: packed / file
bytes is 1 for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K and Q6_K, 1.028 for Q4_K, 1.023 for
Q5_K.

The dequantizers here reproduce gguf-py's `gguf.quants.dequantize` bit for bit (float32,
the same operations), so a tensor dequantized here equals the one the dequantizing
loader produces.
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32
"""Weights per block of the activations (and of Q8_0 / Q4_* / Q5_*; K-types: 8 of them)."""
GROUP = 16
"""Output columns per group of the packed layout."""

# qtype name -> (weights per block, raw bytes per block in the file, packed bytes per
# (group, block)).
_SIZES = {"Q8_0": (32, 34, 544), "Q4_0": (32, 18, 288), "Q4_1": (32, 20, 320),
          "Q5_0": (32, 22, 352), "Q5_1": (32, 24, 384), "Q4_K": (256, 144, 2368),
          "Q5_K": (256, 176, 2880), "Q6_K": (256, 210, 3360), "Q2_K": (256, 84, 1344)}
NATIVE_QTYPES = frozenset(_SIZES)
"""GGUF tensor types the quantized GEMM runs on (others are dequantized on load)."""
_BY_PACKED = {packed: name for name, (_, _, packed) in _SIZES.items()}


def raw_row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of K weights of a native type, as the file stores them."""
    elems, raw_size, _ = _SIZES[qtype]
    return k // elems * raw_size


def block_elems(qtype: str) -> int:
    """Weights per block of a native or converted type (K must be a multiple)."""
    native = CONVERTED_QTYPES[qtype][0] if qtype in CONVERTED_QTYPES else qtype
    return _SIZES[native][0]


@dataclass
class QuantizedWeight:
    """A GGUF-quantized 2-D weight: `raw` [N, K / 32 * block size] uint8, as stored."""

    qtype: str
    """ggml type name: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q4_K, Q5_K or Q6_K."""
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
        return _combine(self.qtype, *_file_fields(self.qtype, blocks)).reshape(n, k).to(dtype)

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (dim 0), or columns (dim 1) cut at whole blocks (ValueError elsewhere),
        as a tensor's narrow: a rank's slice of the weight under tensor parallelism."""
        if dim == 0:
            return QuantizedWeight(self.qtype, self.raw.narrow(0, start, length),
                                   self.in_features)
        elems, raw_size, _ = _SIZES[self.qtype]
        if start % elems or length % elems:
            raise ValueError(f"{self.qtype} blocks hold {elems} weights: columns "
                             f"[{start}, {start + length}) do not fall on whole blocks")
        raw = self.raw.narrow(1, start // elems * raw_size, length // elems * raw_size)
        return QuantizedWeight(self.qtype, raw.contiguous(), length)

    def split(self, sizes: list[int], dim: int = 0) -> list[QuantizedWeight]:
        """Row blocks of `sizes`, as a tensor's split."""
        assert dim == 0 and sum(sizes) == self.raw.shape[0], (dim, sizes)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.narrow(0, start, size) for start, size in zip(starts, sizes)]

    def padded(self, rows: int) -> QuantizedWeight:
        """Zero rows appended up to `rows`: all-zero blocks are zeros in every type (their
        scales are zero)."""
        extra = rows - self.raw.shape[0]
        if extra <= 0:
            return self
        return QuantizedWeight(self.qtype, torch.cat(
            [self.raw, self.raw.new_zeros(extra, self.raw.shape[1])]), self.in_features)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of `parts` stacked (same type and K)."""
        assert len({(p.qtype, p.in_features) for p in parts}) == 1
        return QuantizedWeight(parts[0].qtype, torch.cat([p.raw for p in parts]),
                               parts[0].in_features)


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (a little-endian float16) -> [..., 1] float32."""
    return two_bytes.contiguous().view(torch.float16).float()


def _file_fields(qtype: str, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """ggml's blocks [..., raw_size] -> `_combine`'s fields: q [..., elems] (uint8, the
    unsigned weights in element order; Q8_0: the int8 bytes), d [..., 1] float32, then m
    (Q4_1, Q5_1) or dmin, sc and mins [..., 8] (Q4_K, Q5_K) or sc [..., 16] (Q6_K) or
    dmin and the scale bytes [..., 16] (Q2_K: scale low nibble, min high nibble)."""
    if qtype == "Q6_K":
        return _q6k_values(blocks), _half(blocks[..., 208:210]), blocks[..., 192:208]
    if qtype == "Q2_K":
        return (_q2k_values(blocks[..., 16:80]), _half(blocks[..., 80:82]),
                _half(blocks[..., 82:84]), blocks[..., :16])
    d = _half(blocks[..., 0:2])
    if qtype == "Q8_0":
        return blocks[..., 2:], d
    if qtype in ("Q4_K", "Q5_K"):
        q = _chunk_nibbles(blocks[..., -128:])
        if qtype == "Q5_K":
            q = q | (_bits(blocks[..., 16:48], 1) << 4)
        return (q, d, _half(blocks[..., 2:4]), *_q4k_scales(blocks[..., 4:16]))
    has_min = qtype in ("Q4_1", "Q5_1")
    start = (4 if has_min else 2) + (4 if qtype.startswith("Q5") else 0)
    q = _nibbles(blocks[..., start:])
    if qtype.startswith("Q5"):
        q = q | (_q5_fifth_bits(blocks[..., start - 4:start]) << 4)
    return (q, d, _half(blocks[..., 2:4])) if has_min else (q, d)


def _combine(qtype: str, q: torch.Tensor, d: torch.Tensor, *rest: torch.Tensor
             ) -> torch.Tensor:
    """The weights [..., elems] float32 from a block's fields (`_file_fields`), with
    gguf-py's float32 operations in its order."""
    if qtype == "Q8_0":
        return q.view(torch.int8).float() * d
    if qtype in ("Q4_0", "Q5_0"):
        return (q.to(torch.int8) - (8 if qtype == "Q4_0" else 16)).float() * d
    if qtype in ("Q4_1", "Q5_1"):
        return q.float() * d + rest[0]
    if qtype == "Q6_K":
        d_sub = (d * rest[0].view(torch.int8).float()).unsqueeze(-1)  # [..., 16, 1]
        return (d_sub * (q.to(torch.int8) - 32).float().unflatten(-1, (16, 16))).flatten(-2)
    if qtype == "Q2_K":
        dmin, scales = rest
        d_sub = (d * (scales & 0x0F).float()).unsqueeze(-1)  # [..., 16, 1]
        dm_sub = (dmin * (scales >> 4).float()).unsqueeze(-1)
        return (d_sub * q.unflatten(-1, (16, 16)).float() - dm_sub).flatten(-2)
    dmin, sc, mins = rest  # Q4_K, Q5_K
    d_sub = (d * sc.float()).unsqueeze(-1)  # [..., 8, 1]
    dm_sub = (dmin * mins.float()).unsqueeze(-1)
    return (d_sub * q.unflatten(-1, (8, 32)).float() - dm_sub).flatten(-2)


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


def _chunk_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's / Q5_K's 128 bytes [..., 128] -> the 256 low 4 bits [..., 256]: bytes
    [32c, 32c + 32) hold elements 64c + l (low nibbles) and 64c + 32 + l (high)."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    return ((qs.unflatten(-1, (4, 1, 32)) >> shifts) & 0x0F).flatten(-3)


def _bits(qh: torch.Tensor, width: int) -> torch.Tensor:
    """Fields of `width` bits [..., B] -> [..., 8 / width * B]: field f of every byte, f
    after f (gguf-py's order for Q5_K's and Q6_K's high bits)."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).view(-1, 1)
    return ((qh.unsqueeze(-2) >> shifts) & ((1 << width) - 1)).flatten(-2)


def _q5_fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's / Q5_1's little-endian u32 qh [..., 4] -> bit e for element e [..., 32]."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q6k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [..., 210] -> the unsigned 6-bit weights [..., 256] (q - 32 is the
    weight): ql [0:128] holds the low 4 bits of each half of 128 as _chunk_nibbles' 64
    pairs, qh [128:192] the top 2 bits of element 128h + 32f + l in field f of byte 32h + l."""
    ql = blocks[..., :128].unflatten(-1, (2, 64))
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-1).flatten(-2)
    high = _bits(blocks[..., 128:192].unflatten(-1, (2, 32)), 2).flatten(-2)
    return low | (high << 4)


def _q2k_values(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K's 64 bytes [..., 64] -> the 256 2-bit weights [..., 256]: bits 2s, 2s + 1 of
    byte 32h + l hold element 128h + 32s + l."""
    return _bits(qs.unflatten(-1, (2, 32)), 2).flatten(-2)


def _plane(top: torch.Tensor, width: int) -> torch.Tensor:
    """The kernel's plane bytes [..., 4] (cpu_quant.cpp) from the bits beyond the nibble
    of Q4-paired elements. Q5 (width 1): `top` [..., 2 (low / high nibble), 4 (vector v),
    4 (byte i)], byte i gets (nibble, v) at bit 4 nibble + v. Q6_K (width 2, one plane
    per nibble): `top` [..., 4 (v), 4 (i)], byte i gets v at bits 2v, 2v + 1."""
    if width == 2:
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        return (top << shifts).sum(-2, dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8).view(2, 4, 1)
    return (top << shifts).sum((-3, -2), dtype=torch.uint8)


def q3k_as_q6k(raw: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks [..., 110 * n] -> the same weights as Q6_K blocks [..., 210 * n], exactly:
    both are d * sc * q per sub-block of 16 (Q3_K: q = 0..7 - 4, sc 6-bit - 32; Q6_K:
    q = 0..63 - 32, sc int8), so q + 32, sc and d carry over. Q3_K files then run on the
    Q6_K kernel at 1.9x their bytes (dequantized to bfloat16: 4.65x).

    Q3_K (ggml): hmask [0:32] (bit 4h + j of byte i: the high bit of element 128h + 32j
    + i), qs [32:96] (bits 2j of byte 32h + i: its low two), scales [96:108] (16 x 6 bits:
    low nibbles in bytes 0-7, then bytes 0-7's high nibbles, the top 2 bits in bytes
    8-11), d [108:110]."""
    blocks = raw.unflatten(-1, (-1, 110))
    hmask, qs, sb = blocks[..., :32], blocks[..., 32:96].unflatten(-1, (2, 32)), blocks[..., 96:108]
    j = torch.arange(4, dtype=torch.uint8).view(4, 1)
    low = (qs.unsqueeze(-2) >> (2 * j)) & 3  # [..., 2 (h), 4 (j), 32 (i)]
    high = (hmask.unsqueeze(-2).unsqueeze(-2)
            >> (4 * torch.arange(2, dtype=torch.uint8).view(2, 1, 1) + j)) & 1
    u6 = (low + 4 * high + 28).flatten(-3)  # q3 + 4 = low + 4 high; q6 = q3 + 32
    top = sb[..., 8:12]
    nibbles = torch.cat([sb[..., :8] & 0x0F, sb[..., :8] >> 4], dim=-1)  # scales 0-15, low 4
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).repeat_interleave(4)
    scales = (nibbles | (((top.repeat(*[1] * (top.dim() - 1), 4) >> shifts) & 3) << 4))
    sc = (scales.to(torch.int16) - 32).to(torch.int8).view(torch.uint8)
    # Q6_K (ggml): ql [0:128], qh [128:192] as _q6k_values reads them, sc [192:208], d.
    v = u6.unflatten(-1, (2, 4, 32))  # [..., h, quarter f, l]: element 128h + 32f + l
    ql = torch.cat([(v[..., 0, :] & 0x0F) | ((v[..., 2, :] & 0x0F) << 4),
                    (v[..., 1, :] & 0x0F) | ((v[..., 3, :] & 0x0F) << 4)], dim=-1)
    qh = ((v >> 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)).sum(
        -2, dtype=torch.uint8)
    out = torch.cat([ql.flatten(-2), qh.flatten(-2), sc, blocks[..., 108:110]], dim=-1)
    return out.flatten(-2)


CONVERTED_QTYPES: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q3_K": ("Q6_K", q3k_as_q6k)}
"""GGUF types without a kernel whose blocks convert exactly into a native type's (raw
rows [N, bytes] -> the native type's raw rows)."""


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
    `out` [groups, nb, block_bytes], copied from strided views (Q5_*, Q6_K: their high
    bits decoded first, a few bytes per weight of the chunk)."""
    elems, raw_size, _ = _SIZES[qtype]
    n, nb = raw.shape[0], k // elems
    groups = out.shape[0]
    blocks = raw.view(n, nb, raw_size)
    if n != groups * GROUP:  # the last group of a weight whose N is not a multiple of 16
        blocks = F.pad(blocks, (0, 0, 0, 0, 0, groups * GROUP - n))
    blocks = blocks.view(groups, GROUP, nb, raw_size)
    if qtype in ("Q4_K", "Q5_K"):
        return _repack_q4k(blocks, out)
    if qtype == "Q6_K":
        return _repack_q6k(blocks, out)
    if qtype == "Q2_K":
        return _repack_q2k(blocks, out)
    # ggml's block: d (| m) f16 (| qh u32: Q5) | qs
    num_scales = 2 if qtype in ("Q4_1", "Q5_1") else 1
    is_q5 = qtype in ("Q5_0", "Q5_1")
    qs_start = 2 * num_scales + (4 if is_q5 else 0)
    qs_bytes = (raw_size - qs_start) * GROUP
    # [G, 16 columns, nb, dwords, 4] -> [G, nb, dwords, 16 columns, 4]: vector v of a
    # (group, block) holds dword v of each column's block.
    qs = blocks[..., qs_start:].reshape(groups, GROUP, nb, -1, 4)
    out[..., :qs_bytes].view(groups, nb, -1, GROUP, 4).copy_(qs.permute(0, 2, 3, 1, 4))
    if qtype == "Q8_0":
        # int8 q -> uint8 q + 128 (vpdpbusd's unsigned operand)
        out[..., :qs_bytes].bitwise_xor_(0x80)
    scales_at = qs_bytes
    if is_q5:  # the fifth bits [G, 16, nb, 32] as a plane [G, 16, nb, 4]
        bits = _q5_fifth_bits(blocks[..., qs_start - 4:qs_start])
        plane = _plane(bits.unflatten(-1, (2, 4, 4)), 1)
        out[..., qs_bytes:qs_bytes + 4 * GROUP].view(groups, nb, GROUP, 4).copy_(
            plane.permute(0, 2, 1, 3))
        scales_at += 4 * GROUP
    for i in range(num_scales):  # d, then m: 16 columns x 2 bytes
        at = scales_at + i * 2 * GROUP
        out[..., at:at + 2 * GROUP].view(groups, nb, GROUP, 2).copy_(
            blocks[..., 2 * i:2 * i + 2].permute(0, 2, 1, 3))


def _repack_q4k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_K / Q5_K blocks [G, 16, nb, 144 / 176] into `out` [G, nb, 2368 / 2880] (layout:
    csrc/cpu_quant.cpp): qs [4 chunks][8 dwords][16 columns][4] | Q5_K: qh [4 chunks][2]
    [16 columns][4] | d [16] | dmin [16] f16 | sc, m [8][16] u8."""
    groups, _, nb, raw_size = blocks.shape
    is_q5 = raw_size == _SIZES["Q5_K"][1]
    qs = blocks[..., raw_size - 128:].reshape(groups, GROUP, nb, 4, 8, 4)
    out[..., :2048].view(groups, nb, 4, 8, GROUP, 4).copy_(qs.permute(0, 2, 3, 4, 1, 5))
    at = 2048
    if is_q5:
        # fifth bit of element 64c + 32 nibble + 16p + 4s + i -> plane (c, p), byte i,
        # bit 4 nibble + s
        bits = _bits(blocks[..., 16:48], 1).unflatten(-1, (4, 2, 2, 4, 4))
        plane = _plane(bits.transpose(-4, -3), 1)  # [G, 16, nb, 4, 2, 4]
        out[..., at:at + 512].view(groups, nb, 4, 2, GROUP, 4).copy_(
            plane.permute(0, 2, 3, 4, 1, 5))
        at += 512
    for lo in (0, 2):  # d, dmin: 16 columns x 2 bytes
        out[..., at:at + 2 * GROUP].view(groups, nb, GROUP, 2).copy_(
            blocks[..., lo:lo + 2].permute(0, 2, 1, 3))
        at += 2 * GROUP
    sc, mins = _q4k_scales(blocks[..., 4:16])  # [G, 16, nb, 8]
    out[..., at:at + 128].view(groups, nb, 8, GROUP).copy_(sc.permute(0, 2, 3, 1))
    out[..., at + 128:at + 256].view(groups, nb, 8, GROUP).copy_(mins.permute(0, 2, 3, 1))


def _repack_q6k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q6_K blocks [G, 16, nb, 210] into `out` [G, nb, 3360] (layout: csrc/cpu_quant.cpp):
    8 x (qs [4 dwords][16 columns][4] | 2 planes [16 columns][4]) | d [16] f16 |
    sc [16][16] i8."""
    groups, _, nb, _ = blocks.shape
    # element 32j + 16 nibble + 4v + i of the super-block
    q = _q6k_values(blocks).view(groups, GROUP, nb, 8, 2, 4, 4)
    qs = (q[..., 0, :, :] & 0x0F) | (q[..., 1, :, :] << 4)  # [G, 16, nb, 8, 4, 4]
    kernel_blocks = out[..., :3072].view(groups, nb, 8, 384)
    kernel_blocks[..., :256].view(groups, nb, 8, 4, GROUP, 4).copy_(
        qs.permute(0, 2, 3, 4, 1, 5))
    planes = _plane(q >> 4, 2)  # [G, 16, nb, 8, 2, 4]
    kernel_blocks[..., 256:].view(groups, nb, 8, 2, GROUP, 4).copy_(
        planes.permute(0, 2, 3, 4, 1, 5))
    out[..., 3072:3104].view(groups, nb, GROUP, 2).copy_(
        blocks[..., 208:210].permute(0, 2, 1, 3))
    out[..., 3104:].view(groups, nb, 16, GROUP).copy_(blocks[..., 192:208].permute(0, 2, 3, 1))


def _repack_q2k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Q2_K blocks [G, 16, nb, 84] into `out` [G, nb, 1344] (layout: csrc/quant_layout.h):
    qs [16 sub-blocks][16 columns][4] (byte i of sub-block t: element 16t + 4s + i at bits
    2s, 2s + 1) | d [16] | dmin [16] f16 | the scale bytes [16][16] as stored."""
    groups, _, nb, _ = blocks.shape
    q = _q2k_values(blocks[..., 16:80]).view(groups, GROUP, nb, 16, 4, 4)  # t, s, i
    qs = _plane(q, 2)  # [G, 16, nb, 16 (t), 4 (i)]: field s of byte i
    out[..., :1024].view(groups, nb, 16, GROUP, 4).copy_(qs.permute(0, 2, 3, 1, 4))
    for at, lo in ((1024, 80), (1056, 82)):  # d, dmin: 16 columns x 2 bytes
        out[..., at:at + 2 * GROUP].view(groups, nb, GROUP, 2).copy_(
            blocks[..., lo:lo + 2].permute(0, 2, 1, 3))
    out[..., 1088:].view(groups, nb, 16, GROUP).copy_(blocks[..., :16].permute(0, 2, 3, 1))


def packed_qtype(packed: torch.Tensor) -> str:
    """The ggml type of a repacked weight (told apart by its block size)."""
    return _BY_PACKED[packed.shape[2]]


def dequantize_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [T] (int64) of a repacked weight, dequantized: float32 [T, K], equal to
    `QuantizedWeight.dequantize(torch.float32)[rows]` (embedding lookups): each row's
    bytes are gathered from its group back into `_file_fields`' fields. The native op
    `quant_rows` (csrc/cpu_quant_rows.cpp) gives the same bits ~30x faster; this is the
    reference it is tested against and the path without the native kernels."""
    qtype = packed_qtype(packed)
    num, nb = rows.numel(), packed.shape[1]
    blk = packed[rows.div(GROUP, rounding_mode="floor")]  # [T, nb, block_bytes]
    lane = rows % GROUP

    def column(at: int, count: int, width: int, of: torch.Tensor = blk) -> torch.Tensor:
        """The row's bytes of the segment [count][16 columns][width] at byte `at` of
        each block of `of` [T, ..., bytes]: [T, ..., count, width]."""
        seg = of[..., at:at + count * GROUP * width].unflatten(-1, (count, GROUP, width))
        index = lane.view(-1, *[1] * (seg.dim() - 1)).expand(*seg.shape[:-2], 1, width)
        return seg.gather(-2, index).squeeze(-2)

    def half(at: int) -> torch.Tensor:  # [T, nb, 1] float32
        return _half(column(at, 1, 2).flatten(-2))

    if qtype == "Q2_K":
        # sub-block t byte i, bits 2s, 2s + 1: element 16t + 4s + i
        q = _bits(column(0, 16, 4), 2).flatten(-2)
        fields = (q, half(1024), half(1056), column(1088, 16, 1).flatten(-2))
    elif qtype == "Q6_K":
        sub = blk[..., :3072].unflatten(-1, (8, 384))  # [T, nb, 8 blocks, 384]
        low = _nibbles(column(0, 4, 4, sub).flatten(-2))  # [T, nb, 8, 32]
        # plane (nibble) byte i, bits 2v, 2v + 1: element 16 nibble + 4v + i of the block
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
        top = ((column(256, 2, 4, sub).unsqueeze(-2) >> shifts) & 3).flatten(-3)
        fields = ((low | (top << 4)).flatten(-2), half(3072), column(3104, 16, 1).flatten(-2))
    elif qtype in ("Q4_K", "Q5_K"):
        qs = column(0, 32, 4).reshape(num, nb, 4, 32)  # ggml's qs: [32c, 32c + 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).flatten(-2)
        at = 2048
        if qtype == "Q5_K":
            # plane (c, p) byte i, bit 4 nibble + s: element 64c + 32 nibble + 16p + 4s + i
            planes = column(at, 8, 4).reshape(num, nb, 4, 2, 1, 1, 4)
            bits = (planes >> torch.arange(8, dtype=torch.uint8).view(2, 4, 1)) & 1
            q = q | (bits.transpose(-4, -3).flatten(-5) << 4)
            at += 512
        fields = (q, half(at), half(at + 32), column(at + 64, 8, 1).flatten(-2),
                  column(at + 192, 8, 1).flatten(-2))
    elif qtype == "Q8_0":
        fields = (column(0, 8, 4).flatten(-2) ^ 0x80, half(512))
    else:  # Q4_0, Q4_1, Q5_0, Q5_1
        q = _nibbles(column(0, 4, 4).flatten(-2))
        at = 256
        if qtype.startswith("Q5"):
            # byte i, bit 4 nibble + v: element 16 nibble + 4v + i
            plane = column(at, 1, 4).view(num, nb, 1, 1, 4)
            bits = (plane >> torch.arange(8, dtype=torch.uint8).view(2, 4, 1)) & 1
            q = q | (bits.flatten(-3) << 4)
            at += 64
        fields = (q, half(at), half(at + 32)) if qtype in ("Q4_1", "Q5_1") else (q, half(at))
    return _combine(qtype, *fields).reshape(num, nb * _SIZES[qtype][0])
