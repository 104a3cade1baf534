// The quantized GEMM's AMX kernels (Intel since Sapphire Rapids: AMX-TILE and AMX-INT8),
// for compute-bound calls on Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K blocks; included
// by cpu_quant.cpp, whose layout and arithmetic they share.
//
// One tdpbsud multiplies a tile of 16 rows of x (int8, one activation block of 32: 16
// rows x 32 bytes) by a tile of one column group's unsigned weights (the block's 8
// vectors of [16 columns][4 bytes], exactly the repacked layout: 8 rows x 64 bytes), which
// gives the 16 x 16 int32 dots of that block at once: 8192 multiply-adds where vpdpbusd
// does 64. Q8_0's weight tiles load straight from the packed blocks; Q4 / Q5 nibbles (and
// the K-types' sub-blocks) are spread to bytes once per group into a scratch of
// [blocks][8][64] that every row tile of the call reads. The dots go through memory (a
// tile store) into the AVX-512 kernel's float epilogue, the same operations in the same
// order per (row, column): d_w d_x, one fused multiply-add per block (and one for the min
// term), block after block over K. The integer dots are exact whichever unit sums them,
// so every output has the AVX-512 kernel's bits (tested), whatever the rows and whichever
// path a call takes: `auto` picks this one by the row count alone.
//
// Two dot tiles alternate, so the unit computes block b + 1 while the vector units scale
// block b. Rows run in tiles of 16 whatever the call's count: the quantized x is padded
// with zero rows to a multiple of 16 (gemm_quant_impl), their sums computed and dropped.
//
// The tiles' permission and configuration: amx.h.
#pragma once

#include "amx.h"

#if defined(PAGEDLLM_AMX) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BW__)
#define PAGEDLLM_QUANT_AMX 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "quant_avx512.h"
#include "quant_layout.h"
#include "simd.h"

namespace pagedllm_ops {
namespace quant {
namespace amx {

constexpr int kTileRows = 16;      // rows of x per tile
constexpr int64_t kTileBytes = 512;  // one block's weight tile: 8 rows x 64 bytes

inline bool supports(QType type) {
  return type != QType::kQ2_K && type != QType::kQ6_K;
}

// Tiles 0, 1: the dots of alternating blocks (16 x 16 int32); 2, 3: their x (16 rows x
// 32 bytes); 4, 5: their weights (8 rows x 64 bytes).
inline pagedllm_amx::TileConfig tile_config() {
  pagedllm_amx::TileConfig c;
  const uint16_t colsb[6] = {64, 64, 32, 32, 64, 64};
  const uint8_t rows[6] = {16, 16, 16, 16, 8, 8};
  for (int t = 0; t < 6; ++t) {
    c.colsb[t] = colsb[t];
    c.rows[t] = rows[t];
  }
  return c;
}

// The group's weights as bytes, one [8][64] tile per activation block (Q8_0 needs none:
// its packed blocks are the tiles). Row v of block b's tile holds, for each column, the 4
// weights that pair with x[b][4v, 4v + 4): the Q4 / Q5 low nibbles of vector v for
// v < 4, the high nibbles of vector v - 4 after (cpu_quant.cpp's layout); for the
// K-types, sub-block 2c of chunk c takes the low nibbles of its 8 vectors, 2c + 1 the
// high ones.
template <QType Q>
void spread_group(const uint8_t* wg, int64_t block_bytes, int64_t nb, uint8_t* tiles) {
  constexpr bool q5 = Q == QType::kQ5_0 || Q == QType::kQ5_1 || Q == QType::kQ5_K;
  auto put = [](uint8_t* p, __m512i v) { _mm512_store_si512(p, v); };
  if constexpr (Q == QType::kQ4_K || Q == QType::kQ5_K) {
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
      const uint8_t* blk = wg + sb * block_bytes;
      for (int c = 0; c < 4; ++c) {
        uint8_t* lo_tile = tiles + (sb * 8 + 2 * c) * kTileBytes;
        __m512i planes[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        if constexpr (q5) q5k_planes(blk, c, planes);
#pragma GCC unroll 8  // shift_bits' counts as constants
        for (int v = 0; v < 8; ++v) {
          __m512i lo, hi;
          unpack_q4<q5>(_mm512_loadu_si512(blk + c * 512 + 64 * v), planes[v / 4], v, lo, hi);
          put(lo_tile + 64 * v, lo);
          put(lo_tile + kTileBytes + 64 * v, hi);
        }
      }
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wg + b * block_bytes;
      uint8_t* tile = tiles + b * kTileBytes;
      const __m512i plane = q5 ? _mm512_loadu_si512(blk + 256) : _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        __m512i lo, hi;
        unpack_q4<q5>(_mm512_loadu_si512(blk + 64 * v), plane, v, lo, hi);
        put(tile + 64 * v, lo);
        put(tile + 64 * (4 + v), hi);
      }
    }
  }
}

// acc[r] += block b's share for rows [m, m + 16), from its dots (16 x 16 int32 at dots):
// the float part of cpu_quant.cpp's `micro` / `micro_q4k`, operation for operation.
template <QType Q>
inline void scale_block(const QuantRows& x, int64_t m, int64_t b, const uint8_t* wg,
                        int64_t block_bytes, const int32_t* dots, __m512* acc) {
  constexpr bool k_type = Q == QType::kQ4_K || Q == QType::kQ5_K;
  constexpr bool q5 = Q == QType::kQ5_0 || Q == QType::kQ5_1;
  constexpr int64_t qs_bytes = Q == QType::kQ8_0 ? 512 : (q5 ? 320 : 256);
  // The types whose blocks have a min (m_w (d_x sum q_x) added; the K-types' subtracted)
  // and, for the others, what the unsigned weights are offset by.
  constexpr bool has_min = k_type || Q == QType::kQ4_1 || Q == QType::kQ5_1;
  constexpr int32_t offset = Q == QType::kQ8_0 ? 128 :
                             (Q == QType::kQ4_0 ? 8 : (Q == QType::kQ5_0 ? 16 : 0));
  __m512 dw, mw = _mm512_setzero_ps();
  if constexpr (k_type) {
    constexpr int64_t scales = Q == QType::kQ5_K ? kQ5KScales : kQ4KScales;
    const uint8_t* blk = wg + (b / 8) * block_bytes;
    const int64_t sub = b % 8;
    dw = _mm512_mul_ps(load_halves(blk + scales), load_bytes16(blk + scales + 64 + 16 * sub));
    mw = _mm512_mul_ps(load_halves(blk + scales + 32),
                       load_bytes16(blk + scales + 192 + 16 * sub));
  } else {
    const uint8_t* blk = wg + b * block_bytes;
    dw = load_halves(blk + qs_bytes);
    if constexpr (has_min) mw = load_halves(blk + qs_bytes + 32);
  }
  // Row r's scales at i + r nb. Unrolled whole: acc[] stays in registers only when every
  // index is a constant (rolled, GCC kept it on the stack, a load and a store per row).
  const int64_t i = m * x.nb + b;
  const float *d = x.d + i, *dsum = x.dsum + i;
  const int32_t* sum = x.sum + i;
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r, d += x.nb, dsum += x.nb, sum += x.nb) {
    __m512i dot = _mm512_load_si512(dots + 16 * r);
    if constexpr (!has_min) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * *sum));
    const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(*d));
    acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dot), acc[r]);
    if constexpr (k_type) {
      acc[r] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(*dsum), acc[r]);
    } else if constexpr (has_min) {
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*dsum), acc[r]);
    }
  }
}

// Dot tile C (0 or 1) = x rows [m, m + 16) of block b times its weight tile, rows `pitch`
// bytes apart. (GCC's tile intrinsics take their tile numbers as literals: hence a macro.)
#define PAGEDLLM_AMX_DOT_TILE(C, XT, WT)                               \
  inline void dot_tile##C(const QuantRows& x, int64_t m, int64_t b,   \
                          const uint8_t* tile, int64_t pitch) {       \
    _tile_zero(C);                                                    \
    _tile_loadd(XT, x.q + m * x.k + b * kBlock, x.k);                 \
    _tile_loadd(WT, tile, pitch);                                     \
    _tile_dpbsud(C, XT, WT);                                          \
  }
PAGEDLLM_AMX_DOT_TILE(0, 2, 4)
PAGEDLLM_AMX_DOT_TILE(1, 3, 5)
#undef PAGEDLLM_AMX_DOT_TILE

// A thread's share of one AMX call: its tiles, configured for it, and the scratch its
// groups' weights are spread into (Q8_0 needs none).
class Session {
 public:
  Session(QType type, int64_t nb) : tiles_(tile_config()) {
    if (type != QType::kQ8_0)
      spread_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, nb * kTileBytes)));
  }
  uint8_t* spread() const { return spread_.get(); }

 private:
  pagedllm_amx::Tiles tiles_;
  std::unique_ptr<uint8_t[], pagedllm_simd::FreeAligned> spread_;
};

// Rows [m0, m1) x groups [g0, g1), as avx512 `run_simd` (cpu_quant.cpp), on the calling
// thread's Session (`spread`: its scratch).
template <QType Q, typename T>
void run(const QuantRows& x, int64_t m0, int64_t m1, const uint8_t* w, int64_t block_bytes,
         const float* bias, T* out, int64_t ldo, int64_t n, bool accumulate, int64_t g0,
         int64_t g1, uint8_t* spread) {
  constexpr bool super = Q == QType::kQ4_K || Q == QType::kQ5_K;
  const int64_t group_bytes = (super ? x.nb / 8 : x.nb) * block_bytes;
  alignas(64) int32_t dots[2][kTileRows * 16];
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    // Block b's weight tile: tiles + b * step, rows 64 bytes apart.
    const uint8_t* tiles = wg;
    int64_t step = block_bytes;
    if constexpr (Q != QType::kQ8_0) {
      spread_group<Q>(wg, block_bytes, x.nb, spread);
      tiles = spread;
      step = kTileBytes;
    }
    const int64_t cols = std::min(kGroup, n - g * kGroup);
    for (int64_t m = m0; m < m1; m += kTileRows) {
      __m512 acc[kTileRows];
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
      dot_tile0(x, m, 0, tiles, 64);
      for (int64_t b = 0; b < x.nb; b += 2) {
        const bool odd = b + 1 < x.nb;
        if (odd) dot_tile1(x, m, b + 1, tiles + (b + 1) * step, 64);
        _tile_stored(0, dots[0], 64);
        scale_block<Q>(x, m, b, wg, block_bytes, dots[0], acc);
        if (odd) {
          if (b + 2 < x.nb) dot_tile0(x, m, b + 2, tiles + (b + 2) * step, 64);
          _tile_stored(1, dots[1], 64);
          scale_block<Q>(x, m, b + 1, wg, block_bytes, dots[1], acc);
        }
      }
      const __mmask16 mask = pagedllm_simd::first_lanes(cols);
      const __m512 bv = _mm512_maskz_loadu_ps(mask, bias + g * kGroup);
      const int64_t rows = std::min<int64_t>(kTileRows, m1 - m);
#pragma GCC unroll 16
      for (int r = 0; r < kTileRows; ++r)
        if (r < rows)
          store16_out(out + (m + r) * ldo + g * kGroup, _mm512_add_ps(acc[r], bv), mask,
                      accumulate);
    }
  }
}

}  // namespace amx
}  // namespace quant
}  // namespace pagedllm_ops

#endif
