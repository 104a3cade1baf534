// The quantized GEMM on AMX bfloat16 tiles, for bfloat16 activations on Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks (Q2_K keeps the int8 kernels); included by
// cpu_quant.cpp.
//
// Why not the int8 tiles (quant_amx.h) for these: a 16 x 16 block of int8 dots needs its
// float epilogue (two scales and a min per block of 32) in vector registers, ~4 operations
// per 16 sums and block, and the tiles do not overlap it: ~28 ns per 16 x 16 x 32 block and
// core at 512 rows, where bfloat16 tiles summing over all of K take ~16. Here each panel
// of 48 columns is dequantized once per call (per 512 rows) into the thread's scratch,
// exactly in the packed bfloat16 layout of gemm_amx.h ([K / 2, 48, 2]), and
// gemm_amx::run multiplies it as it does the packed weights of a bfloat16 model.
//
// The weights are dequantized as gguf's dequantize and `--dequantize` do: w = d q + m
// (Q4_1, Q5_1), d (q - 8) (Q4_0), d (q - 16) (Q5_0), d q (Q8_0), (d sc) q - dmin m per
// sub-block (Q4_K, Q5_K), (d sc) (q - 32) (Q6_K) in float32, where the products d q, d sc
// and (d sc) q are exact (at most 11 + 6 + 5 significant bits), so one fused multiply-add
// rounds as the separate multiply and add do (Q6_K's one multiply (d sc)(q - 32) rounds
// once as gguf's does); then rounded to bfloat16 to nearest even, as torch's conversion. So every output
// has the bits of gemm_bf16 on the dequantized weights (tested): native and
// dequantized runs of a GGUF file give the same tokens on an AMX machine.
//
// Which rows take it (PAGEDLLM_CPU_QUANT_GEMM, read per call): its sums are not the int8
// path's, so a row's path may depend only on the row itself, never on the batch (DESIGN
// §10). By default (unset or "auto") a call's prompt rows take it and its other rows the
// int8 kernels (gemm_quant's `prompt_rows`, which the decoder stack passes: a token is a
// prompt row when it is one of its request's prompt tokens, whatever step computes it).
// At one row the dequantization is the cost (~0.23 cycles a weight, where the int8
// kernels stream ~14 weights a cycle: a single decode would run ~2.2x slower), while
// prefills run ~1.8x faster: so prefills and first tokens gain, decodes keep their speed.
// "amx_bf16" runs every row here (batches of decodes gain too, single decodes lose);
// "int8" none (measured: docs/architecture.md, AMX).
#pragma once

#include "gemm_amx.h"

#if defined(PAGEDLLM_GEMM_AMX) && defined(__AVX512VBMI__)
#define PAGEDLLM_QUANT_AMX_BF16 1

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "quant_avx512.h"
#include "quant_layout.h"

namespace pagedllm_ops {
namespace quant {
namespace amx_bf16 {

inline bool supports(QType type) {
  switch (type) {
    case QType::kQ8_0: case QType::kQ4_0: case QType::kQ4_1: case QType::kQ5_0:
    case QType::kQ5_1: case QType::kQ4_K: case QType::kQ5_K: case QType::kQ6_K: return true;
    default: return false;  // Q2_K (and any type added later without a dequantizer here)
  }
}

// Weights of K per block of type Q (a K-type's super-block: 8 blocks of 32).
template <QType Q>
constexpr int64_t kElems =
    Q == QType::kQ4_K || Q == QType::kQ5_K || Q == QType::kQ6_K ? 8 * kBlock : kBlock;

// Whether it is built and the OS grants the tiles.
inline bool usable() { return pagedllm_amx::granted(); }

// The process's choice (the header comment): which rows of a call `auto` runs here.
enum class Rows { kPrompt, kAll, kNone };
inline Rows rows_chosen() {
  const char* mode = std::getenv("PAGEDLLM_CPU_QUANT_GEMM");
  if (mode == nullptr || std::strcmp(mode, "auto") == 0) return Rows::kPrompt;
  return std::strcmp(mode, "amx_bf16") == 0 ? Rows::kAll : Rows::kNone;
}

// Whether `auto` runs every row of calls on bfloat16 x here.
inline bool chosen() { return rows_chosen() == Rows::kAll && usable(); }

// Whether `auto` runs the prompt rows a call names here.
inline bool prompt_rows_chosen() { return rows_chosen() == Rows::kPrompt && usable(); }

// vpermb indices putting byte 4c + s + e of a group vector (column c's byte s + e) in
// dword lane 2c' + e, c' = c - 8h: half h of a panel row's 16 columns, byte pair s / 2
// (the masked permute zeroes each dword's other bytes): tables [h][s / 2], built at
// compile time rather than on every group's dequantization.
struct alignas(64) PairBytes {
  uint8_t idx[2][2][64] = {};
  constexpr PairBytes() {
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 2; ++s)
        for (int lane = 0; lane < 16; ++lane)
          idx[h][s][4 * lane] = static_cast<uint8_t>(4 * (8 * h + lane / 2) + 2 * s + lane % 2);
  }
};
inline constexpr PairBytes kPairBytes{};

// vpermps indices giving lane 2c' + e of half h column 8h + c''s scale.
struct alignas(64) PairColumns {
  int32_t idx[2][16] = {};
  constexpr PairColumns() {
    for (int h = 0; h < 2; ++h)
      for (int lane = 0; lane < 16; ++lane) idx[h][lane] = 8 * h + lane / 2;
  }
};
inline constexpr PairColumns kPairColumns{};

// A panel row: 16 columns x 2 weights, from the two halves' float32 weights.
inline void put_row(uint16_t* dst, __m512 lo_half, __m512 hi_half) {
  _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi_half, lo_half));
}

// 16 i8 (one per column of a group) as float32.
inline __m512 load_i8x16(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// Pair s of half h of a vector of Q4 bytes `raw` (`sel`: kPairBytes' indices for it) as
// dword lanes of 4-bit weights: ql the low nibbles, qh the high ones; with kFifth (Q5's),
// bits `bit` and 4 + `bit` of `plane`'s same bytes added as their fifth bits.
template <bool kFifth>
inline void unpack_pair(__m512i raw, __m512i plane, __m512i sel, int bit, __m512i& ql,
                        __m512i& qh) {
  constexpr __mmask64 kFirstBytes = 0x1111111111111111ull;
  const __m512i bytes = _mm512_maskz_permutexvar_epi8(kFirstBytes, sel, raw);
  ql = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0f));
  qh = _mm512_srli_epi32(bytes, 4);
  if constexpr (kFifth) {
    const __m512i p = _mm512_maskz_permutexvar_epi8(kFirstBytes, sel, plane);
    const __m512i bit0 = _mm512_set1_epi32(1);
    ql = _mm512_or_si512(
        ql, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(p, bit), bit0), 4));
    qh = _mm512_or_si512(
        qh, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(p, 4 + bit), bit0), 4));
  }
}

// Group g's weights (its nb blocks at wg, of kElems<Q> weights of K each) as panel
// columns [16 j, 16 j + 16) of `panel` [K / 2, 48, 2] (rows 96 elements apart).
template <QType Q>
void dequantize_group(const uint8_t* wg, int64_t block_bytes, int64_t nb, uint16_t* panel,
                      int j) {
  constexpr int64_t kRow = 2 * gemm_amx::kPanelCols;  // elements per pair row
  __m512i sel[2][2], col[2];
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 2; ++s) sel[h][s] = _mm512_load_si512(kPairBytes.idx[h][s]);
    col[h] = _mm512_load_si512(kPairColumns.idx[h]);
  }
  auto halves = [&](__m512 per_column, __m512* out) {
    for (int h = 0; h < 2; ++h) out[h] = _mm512_permutexvar_ps(col[h], per_column);
  };
  constexpr __mmask64 kFirstBytes = 0x1111111111111111ull;
  const __m512i low4 = _mm512_set1_epi32(0x0f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * block_bytes;
    // pair row i of the block at rows + i * kRow
    uint16_t* rows = panel + b * (kElems<Q> / 2) * kRow + 32 * j;
    if constexpr (Q == QType::kQ4_K || Q == QType::kQ5_K) {
      // 4 chunks of 8 vectors [16 columns][4 bytes]: chunk c's low nibbles are sub-block
      // 2c (vector v holds its k = 4v + i), its high nibbles sub-block 2c + 1; Q5_K's
      // planes the fifth bits (plane v / 4 of the chunk, bits v % 4 and 4 + v % 4, as
      // Q5_0's); w = (d sc) q - dmin m as gguf computes it (d sc q exact: one rounding).
      constexpr bool kFifth = Q == QType::kQ5_K;
      constexpr int64_t kScales = kFifth ? kQ5KScales : kQ4KScales;
      const __m512 dv = load_halves(blk + kScales);
      const __m512 dminv = load_halves(blk + kScales + 32);
      for (int c = 0; c < 4; ++c) {
        __m512 dsc[2][2], dm[2][2];  // [sub-block 2c + t][half]
        for (int t = 0; t < 2; ++t) {
          const int64_t sub = 2 * c + t;
          halves(_mm512_mul_ps(dv, load_bytes16(blk + kScales + 64 + 16 * sub)), dsc[t]);
          halves(_mm512_mul_ps(dminv, load_bytes16(blk + kScales + 192 + 16 * sub)), dm[t]);
        }
        for (int v = 0; v < 8; ++v) {
          const __m512i raw = _mm512_loadu_si512(blk + 512 * c + 64 * v);
          const __m512i plane =
              kFifth ? _mm512_loadu_si512(blk + kQ5KPlanes + 128 * c + 64 * (v / 4))
                     : _mm512_setzero_si512();
          for (int s = 0; s < 2; ++s) {
            __m512 lo[2], hi[2];
            for (int h = 0; h < 2; ++h) {
              __m512i ql, qh;
              unpack_pair<kFifth>(raw, plane, sel[h][s], v % 4, ql, qh);
              lo[h] = _mm512_fmsub_ps(dsc[0][h], _mm512_cvtepi32_ps(ql), dm[0][h]);
              hi[h] = _mm512_fmsub_ps(dsc[1][h], _mm512_cvtepi32_ps(qh), dm[1][h]);
            }
            put_row(rows + (32 * c + 2 * v + s) * kRow, lo[0], lo[1]);
            put_row(rows + (32 * c + 16 + 2 * v + s) * kRow, hi[0], hi[1]);
          }
        }
      }
    } else if constexpr (Q == QType::kQ6_K) {
      // 8 blocks of 32, each Q4_0's 4 vectors of low 4 bits plus two planes of top 2
      // bits (bits 2v, 2v + 1 of a byte: vector v's); its low nibbles are sub-block 2jb
      // (of 16), its high nibbles 2jb + 1; w = (d sc) (q - 32) as gguf computes it.
      const __m512 dv = load_halves(blk + kQ6KScales);
      const __m512i off = _mm512_set1_epi32(32), low2 = _mm512_set1_epi32(3);
      for (int jb = 0; jb < 8; ++jb) {
        const uint8_t* sb = blk + jb * kQ6KBlock;
        const __m512i top_lo = _mm512_loadu_si512(sb + 256);
        const __m512i top_hi = _mm512_loadu_si512(sb + 320);
        __m512 dsc[2][2];  // [sub-block 2jb + t][half]
        for (int t = 0; t < 2; ++t)
          halves(_mm512_mul_ps(dv, load_i8x16(blk + kQ6KScales + 32 + 16 * (2 * jb + t))),
                 dsc[t]);
        uint16_t* jrows = rows + jb * 16 * kRow;
        for (int v = 0; v < 4; ++v) {
          const __m512i raw = _mm512_loadu_si512(sb + 64 * v);
          for (int s = 0; s < 2; ++s) {
            __m512 lo[2], hi[2];
            for (int h = 0; h < 2; ++h) {
              const __m512i bytes = _mm512_maskz_permutexvar_epi8(kFirstBytes, sel[h][s], raw);
              const __m512i tl = _mm512_maskz_permutexvar_epi8(kFirstBytes, sel[h][s], top_lo);
              const __m512i th = _mm512_maskz_permutexvar_epi8(kFirstBytes, sel[h][s], top_hi);
              const __m512i ql = _mm512_or_si512(
                  _mm512_and_si512(bytes, low4),
                  _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(tl, 2 * v), low2), 4));
              const __m512i qh = _mm512_or_si512(
                  _mm512_srli_epi32(bytes, 4),
                  _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(th, 2 * v), low2), 4));
              lo[h] = _mm512_mul_ps(dsc[0][h], _mm512_cvtepi32_ps(_mm512_sub_epi32(ql, off)));
              hi[h] = _mm512_mul_ps(dsc[1][h], _mm512_cvtepi32_ps(_mm512_sub_epi32(qh, off)));
            }
            put_row(jrows + (2 * v + s) * kRow, lo[0], lo[1]);
            put_row(jrows + (8 + 2 * v + s) * kRow, hi[0], hi[1]);
          }
        }
      }
    } else if constexpr (Q == QType::kQ8_0) {
      // 8 vectors of [16 columns][4 bytes] (q + 128): vector v holds k = 4v + i.
      __m512 d[2];
      halves(load_halves(blk + 512), d);
      const __m512i off = _mm512_set1_epi32(128);
      for (int v = 0; v < 8; ++v) {
        const __m512i raw = _mm512_loadu_si512(blk + 64 * v);
        for (int s = 0; s < 2; ++s) {
          __m512 w[2];
          for (int h = 0; h < 2; ++h) {
            const __m512i q = _mm512_sub_epi32(
                _mm512_maskz_permutexvar_epi8(kFirstBytes, sel[h][s], raw), off);
            w[h] = _mm512_mul_ps(d[h], _mm512_cvtepi32_ps(q));
          }
          put_row(rows + (2 * v + s) * kRow, w[0], w[1]);
        }
      }
    } else {
      // Q4_0 / Q4_1 / Q5_0 / Q5_1: 4 vectors of [16 columns][4 bytes]: vector v's low
      // nibbles hold k = 4v + i, its high nibbles k = 16 + 4v + i; Q5's plane after them
      // their fifth bits (bit v: the low nibble's, bit 4 + v: the high one's).
      constexpr bool kFifth = Q == QType::kQ5_0 || Q == QType::kQ5_1;
      constexpr int64_t kScales = kFifth ? 320 : 256;
      const __m512 dv = load_halves(blk + kScales);
      // Q4_1 / Q5_1: + m; Q4_0: - 8 d, Q5_0: - 16 d (exact: d times a power of two, and
      // d q - 16 d = d (q - 16), the one product gguf takes, exactly).
      const __m512 mv = Q == QType::kQ4_1 || Q == QType::kQ5_1
                            ? load_halves(blk + kScales + 32)
                            : _mm512_mul_ps(dv, _mm512_set1_ps(kFifth ? -16.0f : -8.0f));
      __m512 d[2], m[2];
      halves(dv, d);
      halves(mv, m);
      const __m512i plane = kFifth ? _mm512_loadu_si512(blk + 256) : _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_loadu_si512(blk + 64 * v);
        for (int s = 0; s < 2; ++s) {
          __m512 lo[2], hi[2];
          for (int h = 0; h < 2; ++h) {
            __m512i ql, qh;
            unpack_pair<kFifth>(raw, plane, sel[h][s], v, ql, qh);
            lo[h] = _mm512_fmadd_ps(d[h], _mm512_cvtepi32_ps(ql), m[h]);
            hi[h] = _mm512_fmadd_ps(d[h], _mm512_cvtepi32_ps(qh), m[h]);
          }
          put_row(rows + (2 * v + s) * kRow, lo[0], lo[1]);
          put_row(rows + (8 + 2 * v + s) * kRow, hi[0], hi[1]);
        }
      }
    }
  }
}

// gemm_amx::run's source: panel p is groups [3p, 3p + 3), dequantized into the thread's
// scratch (a last panel's missing groups: zeros, their columns never stored).
template <QType Q>
struct DequantizedPanels {
  const uint8_t* w;
  int64_t block_bytes, nb, groups;

  int64_t scratch_elems() const { return nb * kElems<Q> * gemm_amx::kPanelCols; }

  const uint16_t* panel(int64_t p, uint16_t* scratch) const {
    const int64_t group_bytes = nb * block_bytes;
    for (int j = 0; j < 3; ++j) {
      const int64_t g = 3 * p + j;
      if (g < groups) {
        dequantize_group<Q>(w + g * group_bytes, block_bytes, nb, scratch, j);
      } else {
        for (int64_t r = 0; r < nb * kElems<Q> / 2; ++r)
          std::memset(scratch + r * 2 * gemm_amx::kPanelCols + 32 * j, 0, 64);
      }
    }
    return scratch;
  }
};

// Row tiles per block: each panel is dequantized once per block, and a block of 512 rows of
// x (K = 1536: 1.5 MB) stays in L2 and L3.
constexpr int64_t kBlockTiles = 32;

// out [M, N] (+)= x [M, K] . dequant(W)^T + bias (gemm_quant's contract, bfloat16 x).
template <QType Q>
void run(const c10::BFloat16* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* w,
         int64_t groups, int64_t block_bytes, const float* bias, c10::BFloat16* out,
         int64_t ldo, int64_t n, bool accumulate) {
  const DequantizedPanels<Q> source{w, block_bytes, k / kElems<Q>, groups};
  const int64_t panels = (groups + 2) / 3;
  gemm_amx::run(reinterpret_cast<const uint16_t*>(x), ldx, m, k, source, panels, n, bias,
                /*min_run_panels=*/1, /*stream_lead=*/0, kBlockTiles,
                [&](int64_t r, int64_t c0, __mmask16 mask, __m512 sum) {
                  store16_out(out + r * ldo + c0, sum, mask, accumulate);
                });
}

}  // namespace amx_bf16
}  // namespace quant
}  // namespace pagedllm_ops

#endif
