// Helpers of the quantized GEMM's AVX-512 kernels (cpu_quant.cpp) that its AMX kernels
// (quant_amx.h) share: x's broadcasts, the weights' nibbles and scales, the stores.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_layout.h"
#include "simd.h"

namespace pagedllm_ops {
namespace quant {

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// 16 float16 scales (one per column of a group) as float32.
inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T>
inline void store16_out(T* dst, __m512 v, __mmask16 mask, bool accumulate) {
  using namespace pagedllm_simd;
  if (accumulate) {
    // out += the rounded result, rounded again (what out.add_(linear(x)) gives).
    v = _mm512_add_ps(load16(dst, mask), round_to<T>(v));
  }
  store16(dst, v, mask);
}

// A micro-kernel's R rows of sums plus the bias into out (the group's cols <= 16 columns).
template <int R, typename T>
inline void store_rows(const __m512* acc, const float* bias, T* out, int64_t ldo, int64_t cols,
                       bool accumulate) {
  const __mmask16 mask = pagedllm_simd::first_lanes(cols);
  const __m512 bv = _mm512_maskz_loadu_ps(mask, bias);
  for (int r = 0; r < R; ++r)
    store16_out(out + r * ldo, _mm512_add_ps(acc[r], bv), mask, accumulate);
}

// Bits of `p` moved left by s (right by -s) within each byte, for the bits kept by the
// mask applied next (a 16-bit shift: bits that cross into the neighbour byte are masked
// off). s is a constant once the callers' loops over v are unrolled.
inline __m512i shift_bits(__m512i p, int s) {
  return s >= 0 ? _mm512_slli_epi16(p, s) : _mm512_srli_epi16(p, -s);
}

// Q4 bytes `raw` as two vectors of 4-bit weights (low nibbles, high nibbles); with
// Q5's `plane`, vector v (v % 4 of its plane) gets the fifth bit of each (layout above).
template <bool kFifth>
inline void unpack_q4(__m512i raw, __m512i plane, int v, __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  lo = _mm512_and_si512(raw, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
  if constexpr (kFifth) {
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    lo = _mm512_or_si512(lo, _mm512_and_si512(shift_bits(plane, 4 - v % 4), bit4));
    hi = _mm512_or_si512(hi, _mm512_and_si512(shift_bits(plane, -(v % 4)), bit4));
  }
}

// The fifth-bit planes of Q5_K chunk c (layout: quant_layout.h), for unpack_q4's
// vectors [0, 4) and [4, 8).
inline void q5k_planes(const uint8_t* blk, int c, __m512i planes[2]) {
  for (int h = 0; h < 2; ++h) planes[h] = _mm512_loadu_si512(blk + kQ5KPlanes + c * 128 + 64 * h);
}

// 16 u8 (one per column of a group) as float32.
inline __m512 load_bytes16(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}

}  // namespace quant
}  // namespace pagedllm_ops

#endif
