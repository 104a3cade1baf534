// The quantized GEMM's kernels for CPUs with AVX2, FMA and F16C but no AVX512-VNNI (Zen 2
// and 3, Intel's client cores since Haswell, Alder Lake's included): cpu_quant.cpp runs
// them where the AVX-512 ones are not compiled, or when asked to (path "avx2").
//
// Same repacked weights (quant_layout.h, cpu_quant.cpp's header), same integer dots and
// the same float operations in the same order per (row, column) as the AVX-512 kernels,
// so the same bits; on 8 columns at a time: a group of 16 is done as two halves, half h
// reading bytes [32h, 32h + 32) of each 64-byte weight vector and scales [8h, 8h + 8).
//
// AVX2 has no vpdpbusd. vpmaddubsw multiplies unsigned weight bytes by signed activation
// bytes and adds adjacent pairs into int16 (saturating); vpmaddwd by ones adds pairs of
// those into int32. The int16 sums never saturate: |q_x| <= 127 (quantize_row), so one
// vpmaddubsw is at most 2 x 127 x the largest weight, and its sums are widened to int32
// before they could pass 32767: 4-bit weights (<= 3810 each) after 8 of them, 5-bit
// (7874) after 4, 6-bit (16002) after 2, 2-bit (762) after 8. Q8_0 multiplies signed by
// signed (llama.cpp's AVX2 trick): its stored bytes (q + 128) back to q, then |q| times x
// with q's sign moved onto x (vpsignb), one vpmaddubsw (<= 2 x 128 x 127 = 32512) widened
// at once. That is the signed dot itself, so no -128 sum q_x correction follows; the
// integer is the same, so the bits are.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The one test of "these kernels are in the build" (cpu_quant.cpp asks it).
#define PAGEDLLM_QUANT_AVX2 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_layout.h"
#include "simd.h"

namespace pagedllm_ops {
namespace quant {
namespace avx2 {

// Rows per micro-kernel call: four rows' int16 and float32 accumulators, the weight
// vectors and a broadcast fit AVX2's 16 registers.
constexpr int kRows = 4;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256i bytes(int8_t v) { return _mm256_set1_epi8(v); }

// 8 float16 / u8 / i8 scales (one per column of a half group) as float32.
inline __m256 load_halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load_i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Unsigned weight bytes w times the signed bytes x, adjacent pairs summed (int16).
inline __m256i madd(__m256i w, __m256i x) { return _mm256_maddubs_epi16(w, x); }

// Adjacent int16 pairs summed into int32 (each 4 weights' dot of a column).
inline __m256i widen(__m256i s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }

// A row's int16 sums are held in registers after each term (in_register): without it
// GCC computes the rows' products of a whole block ahead and spills them (Q4_1 at 4
// rows: ~50 vector spills and reloads a block, ~9 with it). Measured on Zen 3, 2 threads, SmolLM2's
// shapes, in-process A/B (same bits), medians at 16 / 64 rows: Q4_1 172 -> 206 / 176 ->
// 203 GOP/s, Q4_K 105 -> 130 / 118 -> 150, Q5_K 109 -> 123 / 120 -> 125, Q5_1 even; Q8_0
// (99 -> 88) and Q2_K (111 -> 90) lost with it and Q6_K was even, so they go without.
using pagedllm_simd::in_register;

// Calls that stream their weight (one micro-kernel call per half group: at most kRows
// rows, a decode) prefetch it this many bytes ahead of the block they read. Each core
// reads memory at only ~10 GB/s (Zen 3: 11.5 GB/s alone, 20.8 with two), and without
// this it computed and waited in turn: 30 layers of SmolLM2's shapes at one row took
// about the sum of the compute time (weights in cache) and the memory time. Measured on
// Zen 3, 2 threads, in-process A/B (same bits; runs of ~1-2 GB/s noise, medians of 7-9):
// one row, Q4_1 176 -> 147-153 us a layer (with micro's H = 2), the Q8_0 LM head (49152 x
// 576) 2.27 -> 1.82 ms, Q4_K 254 -> 201 us, Q6_K 269 -> 201-212 us; Q4_1 at 2 rows
// 201 -> 175-182 us, at 4 rows 216 -> 201 us. 1024 and 4096 bytes measured the same
// within the noise; 256 no gain.
constexpr int64_t kStreamPrefetch = 2048;

// Prefetches [p, p + bytes) into L1.
inline void prefetch_lines(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// s16 after the step'th int16 term p of a run of `every` (kept below saturation, above);
// at the run's last term it is widened into dot (assigned on the first run).
template <int kEvery>
inline void add_term(__m256i& s16, __m256i& dot, __m256i p, int step) {
  s16 = step % kEvery == 0 ? p : _mm256_add_epi16(s16, p);
  if (step % kEvery == kEvery - 1)
    dot = step == kEvery - 1 ? widen(s16) : _mm256_add_epi32(dot, widen(s16));
}

// Bits of `p` moved left by s (right by -s) within each byte, for the bits kept by the
// mask applied next (as cpu_quant.cpp's shift_bits).
inline __m256i shift_bits(__m256i p, int s) {
  return s >= 0 ? _mm256_slli_epi16(p, s) : _mm256_srli_epi16(p, -s);
}

// Q4 bytes `raw` as low and high nibbles; with Q5's plane, the fifth bits of vector v.
template <bool kFifth>
inline void unpack_q4(__m256i raw, __m256i plane, int v, __m256i& lo, __m256i& hi) {
  lo = _mm256_and_si256(raw, bytes(0x0f));
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), bytes(0x0f));
  if constexpr (kFifth) {
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift_bits(plane, 4 - v % 4), bytes(0x10)));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift_bits(plane, -(v % 4)), bytes(0x10)));
  }
}

// R rows of sums plus the bias into out: `cols` (<= 8) columns of a half group.
template <int R, typename T>
inline void store_rows(const __m256* acc, const float* bias, T* out, int64_t ldo,
                       int64_t cols, bool accumulate) {
  alignas(32) float v[8];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(v, acc[r]);
    for (int64_t c = 0; c < cols; ++c) store_out(out + r * ldo, c, v[c] + bias[c], accumulate);
  }
}

// The arguments every micro-kernel takes: rows [m, m + R) of x, the group's weights wg,
// its half h, and bias / out at that half's first column.
#define PAGEDLLM_MICRO_ARGS                                                              \
  const QuantRows &x, int64_t m, const uint8_t *wg, int64_t block_bytes, int h,         \
      const float *bias, T *out, int64_t ldo, int64_t cols, bool accumulate

// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1. kStream: prefetch the weight ahead (kStreamPrefetch),
// twice as far on the second half's pass, which re-reads lines the first brought in.
// H = 2 (one row, h = 0): both halves of the group in one pass over its blocks, so the
// stream is read once, in order, each line whole when it arrives; a column's arithmetic
// is the same (its bits). One row, Q4_1, SmolLM2's layers (Zen 3, 2 threads, in-process
// A/B): 176 -> 163 us a layer without the prefetch, 147 with it.
template <QType Q, int R, typename T, bool kStream, int H = 1>
void micro(PAGEDLLM_MICRO_ARGS) {
  static_assert(H == 1 || R == 1, "both halves at once: one row");
  constexpr bool q5 = Q == QType::kQ5_0 || Q == QType::kQ5_1;
  constexpr int64_t qs_bytes = Q == QType::kQ8_0 ? 512 : (q5 ? 320 : 256);
  // (Q8_0's dot is signed already: the header)
  constexpr int32_t offset = Q == QType::kQ4_0 ? 8 : (Q == QType::kQ5_0 ? 16 : 0);
  __m256 acc[H * R];
  for (int r = 0; r < H * R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = wg + b * block_bytes;
    if constexpr (kStream)
      prefetch_lines(blk + kStreamPrefetch * (H == 2 ? 1 : 1 + h), block_bytes);
    for (int hh = 0; hh < H; ++hh) {
      const int hx = H == 2 ? hh : h;
      const uint8_t* half = blk + 32 * hx;
      __m256i dot[R], s16[R];
      if constexpr (Q == QType::kQ8_0) {
        // Measured on Zen 3 (2 threads, the 49152 x 576 LM head, in-process A/B, same
        // bits) against the unsigned bytes split as low 7 bits + 128 x bit 7 (two
        // vpmaddubsw): 1 row 1.07 -> 0.94 ms, 4 rows 2.39 -> 1.72, 64 rows 27.9 -> 19.9.
        for (int v = 0; v < 8; ++v) {
          const __m256i q = _mm256_xor_si256(load32(half + 64 * v), bytes(-128));
          const __m256i magnitude = _mm256_abs_epi8(q);  // -128 -> 128 as unsigned
          for (int r = 0; r < R; ++r) {
            const __m256i xb = bcast4(x.q + (m + r) * x.k + b * kBlock + 4 * v);
            add_term<1>(s16[r], dot[r], madd(magnitude, _mm256_sign_epi8(xb, q)), v);
          }
        }
      } else {
        constexpr int kEvery = q5 ? 2 : 4;  // vectors (2 terms each) between widenings
        const __m256i plane = q5 ? load32(half + 256) : _mm256_setzero_si256();
#pragma GCC unroll 4  // shift_bits' counts as constants
        for (int v = 0; v < 4; ++v) {
          __m256i lo, hi;
          unpack_q4<q5>(load32(half + 64 * v), plane, v, lo, hi);
          for (int r = 0; r < R; ++r) {
            const int8_t* xq = x.q + (m + r) * x.k + b * kBlock;
            const __m256i p = _mm256_add_epi16(madd(lo, bcast4(xq + 4 * v)),
                                               madd(hi, bcast4(xq + 16 + 4 * v)));
            add_term<kEvery>(s16[r], dot[r], p, v);
            in_register(s16[r]);
          }
        }
      }
      const __m256 dw = load_halves8(blk + qs_bytes + 16 * hx);
      if constexpr (Q == QType::kQ4_1 || Q == QType::kQ5_1) {
        const __m256 mw = load_halves8(blk + qs_bytes + 32 + 16 * hx);
        for (int r = 0; r < R; ++r) {
          const int64_t i = (m + r) * x.nb + b;
          const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i]));
          acc[hh * R + r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot[r]), acc[hh * R + r]);
          acc[hh * R + r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.dsum[i]), acc[hh * R + r]);
        }
      } else {
        for (int r = 0; r < R; ++r) {
          const int64_t i = (m + r) * x.nb + b;
          const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i]));
          const __m256i adj = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(offset * x.sum[i]));
          acc[hh * R + r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(adj), acc[hh * R + r]);
        }
      }
    }
  }
  if constexpr (H == 1) {  // bias / out at the half's first column, cols <= 8
    store_rows<R>(acc, bias, out + m * ldo, ldo, cols, accumulate);
  } else {  // at the group's, cols <= 16
    for (int hh = 0; hh < H && 8 * hh < cols; ++hh)
      store_rows<R>(acc + hh * R, bias + 8 * hh, out + m * ldo + 8 * hh, ldo,
                    std::min<int64_t>(8, cols - 8 * hh), accumulate);
  }
}

// Q4_K, Q5_K, over super-blocks of 8 sub-blocks of 32.
template <QType Q, int R, typename T, bool kStream>
void micro_q4k(PAGEDLLM_MICRO_ARGS) {
  constexpr bool q5 = Q == QType::kQ5_K;
  constexpr int64_t scales = q5 ? kQ5KScales : kQ4KScales;
  constexpr int kEvery = q5 ? 4 : 8;  // terms between widenings
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < x.nb / 8; ++sb) {
    const uint8_t* blk = wg + sb * block_bytes;
    const uint8_t* half = blk + 32 * h;
    const __m256 d = load_halves8(blk + scales + 16 * h);
    const __m256 dmin = load_halves8(blk + scales + 32 + 16 * h);
    for (int chunk = 0; chunk < 4; ++chunk) {
      if constexpr (kStream)  // a quarter of the super-block per chunk, as micro does
        prefetch_lines(blk + kStreamPrefetch * (1 + h) + chunk * block_bytes / 4,
                       block_bytes / 4);
      __m256i dot[2][R], s16[2][R];  // sub-blocks 2 chunk (low nibbles) and 2 chunk + 1
      __m256i planes[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      if constexpr (q5) {
        for (int p = 0; p < 2; ++p) planes[p] = load32(half + kQ5KPlanes + chunk * 128 + 64 * p);
      }
#pragma GCC unroll 8  // shift_bits' counts as constants
      for (int v = 0; v < 8; ++v) {
        __m256i lo, hi;
        unpack_q4<q5>(load32(half + chunk * 512 + 64 * v), planes[v / 4], v, lo, hi);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + (m + r) * x.k + sb * 256 + chunk * 64;
          add_term<kEvery>(s16[0][r], dot[0][r], madd(lo, bcast4(xq + 4 * v)), v);
          add_term<kEvery>(s16[1][r], dot[1][r], madd(hi, bcast4(xq + 32 + 4 * v)), v);
          in_register(s16[0][r]);
          in_register(s16[1][r]);
        }
      }
      for (int s = 0; s < 2; ++s) {
        const int64_t sub = 2 * chunk + s;
        const __m256 dw = _mm256_mul_ps(d, load_u8x8(blk + scales + 64 + 16 * sub + 8 * h));
        const __m256 mw = _mm256_mul_ps(dmin, load_u8x8(blk + scales + 192 + 16 * sub + 8 * h));
        for (int r = 0; r < R; ++r) {
          const int64_t i = (m + r) * x.nb + sb * 8 + sub;
          const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i]));
          acc[r] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(dot[s][r]), acc[r]);
          acc[r] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(x.dsum[i]), acc[r]);
        }
      }
    }
  }
  store_rows<R>(acc, bias, out + m * ldo, ldo, cols, accumulate);
}

// Q6_K: blocks of 32 = Q4_0-like low 4 bits plus two planes with the top 2 bits.
template <int R, typename T, bool kStream>
void micro_q6k(PAGEDLLM_MICRO_ARGS) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < x.nb / 8; ++sb) {
    const uint8_t* sblk = wg + sb * block_bytes;
    const __m256 d = load_halves8(sblk + kQ6KScales + 16 * h);
    for (int j = 0; j < 8; ++j) {
      if constexpr (kStream)
        prefetch_lines(sblk + kStreamPrefetch * (1 + h) + j * block_bytes / 8,
                       block_bytes / 8);  // an eighth of the super-block per block
      const uint8_t* half = sblk + j * kQ6KBlock + 32 * h;
      const __m256i top_lo = load32(half + 256), top_hi = load32(half + 320);
      // sub-blocks 2j (x[0, 16)) and 2j + 1 (x[16, 32)), from -32 sum16 q_x
      __m256i dot[2][R], s16[2][R];
#pragma GCC unroll 4  // shift_bits' counts as constants
      for (int v = 0; v < 4; ++v) {
        const __m256i raw = load32(half + 64 * v);
        const __m256i lo = _mm256_or_si256(
            _mm256_and_si256(raw, bytes(0x0f)),
            _mm256_and_si256(shift_bits(top_lo, 4 - 2 * v), bytes(0x30)));
        const __m256i hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(raw, 4), bytes(0x0f)),
            _mm256_and_si256(shift_bits(top_hi, 4 - 2 * v), bytes(0x30)));
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + (m + r) * x.k + sb * 256 + j * 32;
          add_term<2>(s16[0][r], dot[0][r], madd(lo, bcast4(xq + 4 * v)), v);
          add_term<2>(s16[1][r], dot[1][r], madd(hi, bcast4(xq + 16 + 4 * v)), v);
        }
      }
      __m256 dw[2];
      for (int s = 0; s < 2; ++s)
        dw[s] = _mm256_mul_ps(d, load_i8x8(sblk + kQ6KScales + 32 + 16 * (2 * j + s) + 8 * h));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m + r) * x.nb + sb * 8 + j;
        const __m256 dx = _mm256_set1_ps(x.d[i]);
        for (int s = 0; s < 2; ++s) {  // the lower sub-block first
          const __m256i dots = _mm256_add_epi32(dot[s][r], _mm256_set1_epi32(x.off16[2 * i + s]));
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw[s], dx), _mm256_cvtepi32_ps(dots), acc[r]);
        }
      }
    }
  }
  store_rows<R>(acc, bias, out + m * ldo, ldo, cols, accumulate);
}

// Q2_K: per activation block j, its sub-blocks 2j and 2j + 1, one 64-byte vector each
// whose 2-bit fields s pair with x[16 s' + 4s, + 4).
template <int R, typename T>
void micro_q2k(PAGEDLLM_MICRO_ARGS) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < x.nb / 8; ++sb) {
    const uint8_t* blk = wg + sb * block_bytes;
    const __m256 d = load_halves8(blk + kQ2KScales + 16 * h);
    const __m256 dmin = load_halves8(blk + kQ2KScales + 32 + 16 * h);
    for (int j = 0; j < 8; ++j) {
      __m256i dot[2][R], s16[2][R];
      for (int s = 0; s < 2; ++s) {
        const __m256i raw = load32(blk + (2 * j + s) * 64 + 32 * h);
#pragma GCC unroll 4  // shift_bits' counts as constants
        for (int f = 0; f < 4; ++f) {
          const __m256i w = _mm256_and_si256(shift_bits(raw, -2 * f), bytes(0x03));
          for (int r = 0; r < R; ++r) {
            const int8_t* xq = x.q + (m + r) * x.k + sb * 256 + j * 32 + 16 * s;
            add_term<4>(s16[s][r], dot[s][r], madd(w, bcast4(xq + 4 * f)), f);
          }
        }
      }
      __m256 dw[2], mw[2];
      for (int s = 0; s < 2; ++s) {
        const __m128i sc = _mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(blk + kQ2KScales + 64 + 16 * (2 * j + s) + 8 * h));
        const __m128i low4 = _mm_set1_epi8(0x0f);
        dw[s] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(sc, low4))));
        mw[s] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                        _mm_and_si128(_mm_srli_epi16(sc, 4), low4))));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m + r) * x.nb + sb * 8 + j;
        const float dx = x.d[i];
        for (int s = 0; s < 2; ++s) {  // the lower sub-block first
          const float ds = dx * static_cast<float>(x.off16[2 * i + s] / -32);
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw[s], _mm256_set1_ps(dx)),
                                   _mm256_cvtepi32_ps(dot[s][r]), acc[r]);
          acc[r] = _mm256_fnmadd_ps(mw[s], _mm256_set1_ps(ds), acc[r]);
        }
      }
    }
  }
  store_rows<R>(acc, bias, out + m * ldo, ldo, cols, accumulate);
}

// Q2_K goes without the stream's prefetch (not measured).
template <QType Q, int R, typename T, bool kStream>
void micro_any(PAGEDLLM_MICRO_ARGS) {
  if constexpr (Q == QType::kQ4_K || Q == QType::kQ5_K) {
    micro_q4k<Q, R, T, kStream>(x, m, wg, block_bytes, h, bias, out, ldo, cols, accumulate);
  } else if constexpr (Q == QType::kQ6_K) {
    micro_q6k<R, T, kStream>(x, m, wg, block_bytes, h, bias, out, ldo, cols, accumulate);
  } else if constexpr (Q == QType::kQ2_K) {
    micro_q2k<R, T>(x, m, wg, block_bytes, h, bias, out, ldo, cols, accumulate);
  } else {
    micro<Q, R, T, kStream>(x, m, wg, block_bytes, h, bias, out, ldo, cols, accumulate);
  }
}

#undef PAGEDLLM_MICRO_ARGS

// Rows [m0, m1) x groups [g0, g1), each group's two halves in turn (the second reads
// the lines the first brought into L1). With at most kRows rows each half is one call
// that streams the weight (prefetched: kStreamPrefetch); one row of the 32-element block
// types reads both halves in one pass (micro's H = 2).
template <QType Q, typename T>
void run(const QuantRows& x, int64_t m0, int64_t m1, const uint8_t* w, int64_t block_bytes,
         const float* bias, T* out, int64_t ldo, int64_t n, bool accumulate, int64_t g0,
         int64_t g1) {
  using Fn = void (*)(const QuantRows&, int64_t, const uint8_t*, int64_t, int, const float*,
                      T*, int64_t, int64_t, bool);
  static constexpr Fn kMicro[kRows + 1] = {
      nullptr, micro_any<Q, 1, T, false>, micro_any<Q, 2, T, false>,
      micro_any<Q, 3, T, false>, micro_any<Q, 4, T, false>};
  static constexpr Fn kStreamMicro[kRows + 1] = {
      nullptr, micro_any<Q, 1, T, true>, micro_any<Q, 2, T, true>,
      micro_any<Q, 3, T, true>, micro_any<Q, 4, T, true>};
  constexpr bool super =
      Q == QType::kQ2_K || Q == QType::kQ4_K || Q == QType::kQ5_K || Q == QType::kQ6_K;
  const int64_t group_bytes = (super ? x.nb / 8 : x.nb) * block_bytes;
  if constexpr (!super) {
    if (m1 - m0 == 1) {
      for (int64_t g = g0; g < g1; ++g)
        micro<Q, 1, T, true, 2>(x, m0, w + g * group_bytes, block_bytes, 0, bias + g * kGroup,
                                out + g * kGroup, ldo, std::min(kGroup, n - g * kGroup),
                                accumulate);
      return;
    }
  }
  const Fn* micros = m1 - m0 <= kRows ? kStreamMicro : kMicro;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    const int64_t cols = std::min(kGroup, n - g * kGroup);
    for (int h = 0; h < 2 && 8 * h < cols; ++h) {
      const int64_t col = g * kGroup + 8 * h;
      for (int64_t m = m0; m < m1; m += kRows)
        micros[std::min<int64_t>(kRows, m1 - m)](x, m, wg, block_bytes, h, bias + col,
                                                 out + col, ldo, std::min<int64_t>(8, cols - 8 * h),
                                                 accumulate);
    }
  }
}

inline int32_t reduce_add(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// One block of 32 quantized as cpu_quant.cpp's quantize_block_avx512: q = the low byte of
// round-half-even(x / d) (vcvtps2dq, then truncation as vpmovdb), the sum of the int32
// values into s[0] or, with `halves`, those of each half of 16 into s. Returns d.
template <typename T>
inline float quantize_block(const T* xb, int8_t* q, int32_t s[2], bool halves) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = pagedllm_simd::load8(xb + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_andnot_ps(sign, v[0]);
  for (int i = 1; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  const float db = pagedllm_simd::hmax8(amax) / 127.0f;
  const float id = db != 0.0f ? 1.0f / db : 0.0f;
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
  const __m256i lower = _mm256_add_epi32(qi[0], qi[1]), upper = _mm256_add_epi32(qi[2], qi[3]);
  if (halves) {
    s[0] = reduce_add(lower);
    s[1] = reduce_add(upper);
  } else {
    s[0] = reduce_add(_mm256_add_epi32(lower, upper));
  }
  // low bytes: masked to 0..255, packs cannot saturate; they interleave 128-bit lanes,
  // which the permutation undoes
  const __m256i low = _mm256_set1_epi32(0xff);
  const __m256i p01 = _mm256_packus_epi32(_mm256_and_si256(qi[0], low), _mm256_and_si256(qi[1], low));
  const __m256i p23 = _mm256_packus_epi32(_mm256_and_si256(qi[2], low), _mm256_and_si256(qi[3], low));
  const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(p01, p23),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), packed);
  return db;
}

}  // namespace avx2
}  // namespace quant
}  // namespace pagedllm_ops
#endif  // __AVX2__ && __FMA__ && __F16C__
