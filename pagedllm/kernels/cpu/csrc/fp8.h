// fp8 KV cache elements (c10::Float8_e4m3fn, c10::Float8_e5m2) in the attention kernels:
// exact conversion to bfloat16 / float32 on read, and on write the rule of
// pagedllm/attention/kv_quant.py: fp8(clamp(x / scale, -max, max)), rounded to nearest
// even, bit-identical to torch's conversion.
//
// Read: every fp8 value is exactly a bfloat16 (e4m3: 4 significant bits, 2^-9 .. 448;
// e5m2: 3 bits, 2^-16 .. 57344), so a table of the bfloat16 bits of the 128 magnitudes
// converts any encoding exactly (subnormals, NaN, inf included). With AVX512-VBMI two
// vpermt2b look up the high and low bytes of 64 values at once (128-entry byte tables in
// two registers each), the sign bit is copied in and one more vpermt2b interleaves the
// bytes into words: 4 shuffles per 32 values. Without VBMI (AVX512-BW only): widen to
// words, two vpermt2w over 64-entry word tables and a blend. Both avoid the alternative
// of shifting the bits into a float16 / float32 and rescaling by a power of two, which
// passes fp8 subnormals through float32 denormals that MXCSR.DAZ would flush to zero.
// Write: c10's fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value, 16 lanes at a time.
//
// With AVX2 only (F16C): 8 values at a time both ways (float8_of, fp8x8). Read: e5m2 is
// the high byte of the float16 of the same value; e4m3fn's exponent and mantissa bits,
// moved into a float16's, give the value / 2^8 (biases 7 and 15), and one float32
// multiply by 2^8 restores it exactly. F16C widens float16 subnormals to float32 normals
// whatever MXCSR.DAZ says (checked on Zen 3 with DAZ and FTZ set), and the smallest fp8
// magnitude (e4m3fn 2^-9, e5m2 2^-16) is a float32 normal, so no denormal is ever flushed.
// Write: fp8x16's arithmetic on 8 lanes.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pagedllm_fp8 {

template <typename C>
inline constexpr bool kIsFp8 =
    std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;

// Layout of a format: mantissa bits, exponent bias, largest finite value, inf or not.
template <typename C>
struct Format;
template <>
struct Format<c10::Float8_e4m3fn> {
  static constexpr int kMantBits = 3, kBias = 7;
  static constexpr float kMax = 448.0f;
  static constexpr bool kHasInf = false;  // S.1111.111 is NaN, the rest is finite
};
template <>
struct Format<c10::Float8_e5m2> {
  static constexpr int kMantBits = 2, kBias = 15;
  static constexpr float kMax = 57344.0f;
  static constexpr bool kHasInf = true;  // IEEE-like: S.11111.00 is inf, .01-.11 NaN
};

// bfloat16 bits of the fp8 magnitude with code i (0 .. 127: the sign bit clear).
template <typename C>
constexpr uint16_t bf16_bits_of(int i) {
  using F = Format<C>;
  constexpr int mb = F::kMantBits, emax = (1 << (7 - mb)) - 1;
  const int e = i >> mb, m = i & ((1 << mb) - 1);
  if (e == emax) {
    if (F::kHasInf) return m == 0 ? 0x7F80 : 0x7FC0;
    if (m == (1 << mb) - 1) return 0x7FC0;
  }
  if (e == 0) {
    if (m == 0) return 0;
    // A subnormal is m * 2^(1 - bias - mb); normalized, m = 2^k * (1 + f).
    int k = 0;
    while ((m >> (k + 1)) != 0) ++k;
    const int exponent = k + 1 - F::kBias - mb + 127;
    return static_cast<uint16_t>((exponent << 7) | ((m - (1 << k)) << (7 - k)));
  }
  return static_cast<uint16_t>(((e - F::kBias + 127) << 7) | (m << (7 - mb)));
}

// The read tables of a format: bfloat16 bits of the 128 magnitudes, as words and as
// separate high / low bytes.
template <typename C>
struct Tables {
  alignas(64) uint16_t words[128];
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
};

template <typename C>
constexpr Tables<C> make_tables() {
  Tables<C> t{};
  for (int i = 0; i < 128; ++i) {
    t.words[i] = bf16_bits_of<C>(i);
    t.hi[i] = static_cast<uint8_t>(t.words[i] >> 8);
    t.lo[i] = static_cast<uint8_t>(t.words[i] & 0xFF);
  }
  return t;
}

template <typename C>
inline constexpr Tables<C> kTables = make_tables<C>();

// Scalar write (paths without AVX-512): clamp keeps a NaN (and c10 turns it into NaN).
template <typename C>
inline C from_float(float x, float scale) {
  return static_cast<C>(std::clamp(x / scale, -Format<C>::kMax, Format<C>::kMax));
}

}  // namespace pagedllm_fp8

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace pagedllm_fp8 {

#if defined(__AVX512VBMI__)
// vpermt2b index interleaving bytes [0, 32) of lo (word low bytes) and of hi.
struct InterleaveIndex {
  alignas(64) uint8_t idx[64];
};
constexpr InterleaveIndex make_interleave() {
  InterleaveIndex x{};
  for (int i = 0; i < 32; ++i) {
    x.idx[2 * i] = static_cast<uint8_t>(i);
    x.idx[2 * i + 1] = static_cast<uint8_t>(64 + i);
  }
  return x;
}
inline constexpr InterleaveIndex kInterleave = make_interleave();
#endif

// 32 fp8 values (the bytes of `bytes`, in order) -> their bfloat16 bits, in order.
template <typename C>
inline __m512i bf16x32(__m256i bytes) {
  const Tables<C>& t = kTables<C>;
#if defined(__AVX512VBMI__)
  const __m512i x = _mm512_zextsi256_si512(bytes);
  // vpermt2b indexes 128 entries by bits 6:0 (bit 7, the sign, is ignored).
  __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), x, _mm512_load_si512(t.hi + 64));
  const __m512i lo =
      _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), x, _mm512_load_si512(t.lo + 64));
  hi = _mm512_ternarylogic_epi32(hi, x, _mm512_set1_epi8(static_cast<char>(0x80)),
                                 0xF8);  // hi | (x & 0x80)
  return _mm512_permutex2var_epi8(lo, _mm512_load_si512(kInterleave.idx), hi);
#else
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  // vpermt2w indexes 64 entries by bits 5:0; bit 6 picks the table half, bit 7 the sign.
  const __m512i a = _mm512_permutex2var_epi16(_mm512_load_si512(t.words), w,
                                              _mm512_load_si512(t.words + 32));
  const __m512i b = _mm512_permutex2var_epi16(_mm512_load_si512(t.words + 64), w,
                                              _mm512_load_si512(t.words + 96));
  const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)),
                                              a, b);
  return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(w, 8),
                                   _mm512_set1_epi16(static_cast<short>(0x8000)),
                                   0xF8);  // mag | (w << 8 & 0x8000)
#endif
}

// 16 fp8 values -> float32 lanes.
template <typename C>
inline __m512 float16_of(__m128i bytes) {
  const __m256i b = _mm512_castsi512_si256(bf16x32<C>(_mm256_zextsi128_si256(bytes)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// 16 float32 lanes (already divided by the scale) -> fp8 bytes: saturated to +-max, then
// c10's rounding (denormal range: one float add rounds to the subnormal grid; normal
// range: round-to-nearest-even on the mantissa bits).
template <typename C>
inline __m128i fp8x16(__m512 x) {
  using F = Format<C>;
  constexpr int mb = F::kMantBits, shift = 23 - mb;
  // VMAXPS / VMINPS return their second operand when either is NaN: a NaN stays NaN.
  x = _mm512_min_ps(_mm512_set1_ps(F::kMax), _mm512_max_ps(_mm512_set1_ps(-F::kMax), x));
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  // Below the smallest normal: adding 2^(24 - bias - mb) leaves the value's multiple of
  // the subnormal step (2^(1 - bias - mb)) in the low mantissa bits, rounded by the add.
  const __m512 denorm = _mm512_castsi512_ps(_mm512_set1_epi32((127 + 24 - F::kBias - mb) << 23));
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(mag), denorm)),
      _mm512_castps_si512(denorm));
  // Normal: rebias the exponent and round the mantissa to mb bits (ties to even).
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, shift), _mm512_set1_epi32(1));
  const __m512i rebias = _mm512_set1_epi32(-((127 - F::kBias) << 23) + (1 << (shift - 1)) - 1);
  const __m512i normal =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(mag, rebias), odd), shift);
  const __mmask16 is_sub =
      _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32((128 - F::kBias) << 23));
  __m512i r = _mm512_mask_blend_epi32(is_sub, normal, sub);
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_mov_epi32(r, is_nan, _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, sign));
}

}  // namespace pagedllm_fp8
#endif  // __AVX512F__ && __AVX512BW__

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace pagedllm_simd {

// 16-lane float32 loads of fp8 cache elements (beside simd.h's float32 / bfloat16 /
// float16 ones); masked-off lanes read nothing and are 0.
template <typename C, std::enable_if_t<pagedllm_fp8::kIsFp8<C>, int> = 0>
inline __m512 load16(const C* src) {
  return pagedllm_fp8::float16_of<C>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

template <typename C, std::enable_if_t<pagedllm_fp8::kIsFp8<C>, int> = 0>
inline __m512 load16(const C* src, __mmask16 mask) {
  return pagedllm_fp8::float16_of<C>(_mm_maskz_loadu_epi8(mask, src));
}

}  // namespace pagedllm_simd
#endif

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

namespace pagedllm_fp8 {

// 8 fp8 values (the low 8 bytes of `bytes`, in order) -> float32 lanes, exactly (NaN codes
// as NaN, e5m2's infinities as infinities).
template <typename C>
inline __m256 float8_of(__m128i bytes) {
  if constexpr (std::is_same_v<C, c10::Float8_e5m2>) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
  } else {
    // Sign-extended and shifted by 7, a byte's bits 6:0 land on the float16's exponent
    // and mantissa and its sign on bit 15; bit 14 (a copy of the sign) is cleared.
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                                    _mm_set1_epi16(static_cast<short>(0xBF80)));
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
    // S.1111.111 (NaN) reads as +-480, which no finite code does: all ones (a NaN) there.
    const __m256 nan = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x),
                                     _mm256_set1_ps(480.0f), _CMP_EQ_OQ);
    return _mm256_or_ps(x, nan);
  }
}

// 8 float32 lanes (already divided by the scale) -> fp8 bytes (the low 8 of the result):
// fp8x16's steps. Every lane's magnitude is below 2^31, so signed compares order them.
template <typename C>
inline __m128i fp8x8(__m256 x) {
  using F = Format<C>;
  constexpr int mb = F::kMantBits, shift = 23 - mb;
  // VMAXPS / VMINPS return their second operand when either is NaN: a NaN stays NaN.
  x = _mm256_min_ps(_mm256_set1_ps(F::kMax), _mm256_max_ps(_mm256_set1_ps(-F::kMax), x));
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256 denorm = _mm256_castsi256_ps(_mm256_set1_epi32((127 + 24 - F::kBias - mb) << 23));
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(mag), denorm)),
      _mm256_castps_si256(denorm));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(mag, shift), _mm256_set1_epi32(1));
  const __m256i rebias = _mm256_set1_epi32(-((127 - F::kBias) << 23) + (1 << (shift - 1)) - 1);
  const __m256i normal =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(mag, rebias), odd), shift);
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32((128 - F::kBias) << 23), mag);
  __m256i r = _mm256_blendv_epi8(normal, sub, is_sub);
  const __m256i is_nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000));
  r = _mm256_or_si256(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), is_nan), sign);
  // Lanes hold 0 .. 255: two unsigned packs keep them, in order.
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  return _mm_packus_epi16(w, w);
}

}  // namespace pagedllm_fp8
#endif
