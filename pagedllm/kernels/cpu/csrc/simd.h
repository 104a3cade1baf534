// AVX-512 helpers shared by the CPU kernels: 16-lane float32 loads/stores from/to the
// storage dtypes (float32, bfloat16, float16) and a vectorized exp. Conversions to
// bfloat16 round to nearest even like c10::BFloat16 (and torch's vectorized kernels), so
// fused ops store the same bits the unfused torch ops would; with AVX512-BF16 one
// vcvtneps2bf16 does it (~20% faster element-wise ops), which flushes float32 denormals
// (|x| < 1.2e-38) to zero where c10 keeps a bfloat16 denormal.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <algorithm>
#include <cmath>
#include <cstring>

namespace pagedllm_simd {

// The deleter of a std::unique_ptr over std::aligned_alloc's memory.
struct FreeAligned {
  void operator()(void* p) const { std::free(p); }
};

// Whether bfloat16 products run as float32 FMAs (a bfloat16 widened exactly) instead of
// vdpbf16ps: on Intel CPUs, or as the environment variable `env` ("fma" | "dpbf16") says.
// The Intel Xeon measured (family 6 model 207) issues half a vdpbf16ps per cycle against
// two FMAs, so the FMAs' twice as many instructions finish first; AMD's Zen 4 and Zen 5
// run vdpbf16ps at twice their FMA rate. A property of the machine, read once per process
// by each caller: outputs' bits follow it as they follow the ISA, every row the same way.
inline bool bf16_by_fma(const char* env) {
  const char* mode = std::getenv(env);
  if (mode != nullptr && std::strcmp(mode, "fma") == 0) return true;
  if (mode != nullptr && std::strcmp(mode, "dpbf16") == 0) return false;
#if defined(__x86_64__)
  return static_cast<bool>(__builtin_cpu_is("intel"));
#else
  return false;
#endif
}

// How far ahead of its reads a call that streams its weight (a decode's few rows: the
// bfloat16 / float32 GEMM's panels, the quantized GEMM's column groups) prefetches it
// into L2 (0: not at all, the hardware prefetcher alone): 8 KB on Intel CPUs, or as
// PAGEDLLM_CPU_STREAM_PREFETCH (bytes) says. Measured on the Intel Xeon above (2
// threads, SmolLM2's 30 layers at one row; in-process A/B, 40 interleaved passes):
// - bfloat16: median 12.3-13.0 -> 9.2-10.0 ms at 4-16 KB ahead (1 KB: no gain, 32-64 KB:
//   less), against 10.6-11.5 prefetching the next panel as calls of more rows do (the L2
//   streamer alone starts each run of panels cold); in separate processes 11.1-12.5 ->
//   6.9-8.5 ms (~17 -> ~27 GB/s); engine bfloat16 decode 55-73 -> 80-92 tok/s.
// - GGUF blocks: Q8_0 4.3-4.7 -> 3.5-3.7 ms, Q4_0 2.94 -> 2.48, Q4_1 within -4..+8%.
// On Zen 4 a next-panel prefetch measured slower than none (cpu_gemm.cpp, kMinRunPanels)
// and the distance form is untried, so AMD keeps none.
inline int64_t stream_prefetch_bytes() {
  static const int64_t bytes = []() -> int64_t {
    if (const char* env = std::getenv("PAGEDLLM_CPU_STREAM_PREFETCH")) return std::atoll(env);
#if defined(__x86_64__)
    return __builtin_cpu_is("intel") ? 8192 : 0;
#else
    return 0;
#endif
  }();
  return bytes;
}

// Element i of a float32 / bfloat16 / float16 row as float32 (exact); a bfloat16's bits
// widened directly.
template <typename T>
inline float load_f(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

template <>
inline float load_f<c10::BFloat16>(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) by Cephes' polynomial (~1 ulp); x is clamped to [-87, 88]. Always inlined: it
// sits in the attention kernels' per-chunk rescale.
__attribute__((always_inline)) inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

// n bfloat16 values widened to float32 (exact: a bfloat16 is the top half of its float32).
inline void widen_bf16(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

}  // namespace pagedllm_simd


#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedllm_simd {

inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }

inline __m512 load16(const c10::BFloat16* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 load16(const c10::Half* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// The first lanes set in `mask`; the others read nothing and are 0.
inline __m512 load16(const float* src, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, src);
}

inline __m512 load16(const c10::BFloat16* src, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 load16(const c10::Half* src, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, src));
}

// float32 -> bfloat16 bits (round to nearest even, as c10::BFloat16), in the low halves.
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_srli_epi32(rounded, 16);
}

inline void store16(float* dst, __m512 v, __mmask16 mask = 0xffff) {
  _mm512_mask_storeu_ps(dst, mask, v);
}

inline void store16(c10::BFloat16* dst, __m512 v, __mmask16 mask = 0xffff) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
#else
  _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(bf16_bits(v)));
#endif
}

inline void store16(c10::Half* dst, __m512 v, __mmask16 mask = 0xffff) {
  _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v rounded to T's precision and back to float32 (what storing then loading gives).
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512BF16__)
    return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
#endif
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return v;
  }
}

// exp of 16 lanes, Cephes' polynomial (~1 ulp); x clamped to [-87, 88] (-inf gives
// ~1e-38, not 0).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
}

// 2^y of 16 lanes to ~3e-6 relative (a degree-5 Taylor polynomial of 2^f, f in
// [-0.5, 0.5]); y beyond +-128 gives inf / 0 (scalef saturates), NaN stays NaN.
inline __m512 exp2_16(__m512 y) {
  const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, k);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);                   // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));   // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));   // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));   // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));   // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// reduce16 reads the vector of lane t from slot kSlotOfLane[t].
constexpr int kSlotOfLane[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// Lane t of the result = op over the 16 lanes of v[kSlotOfLane[t]], by a fixed tree
// (op: a lane-wise float32 add or max): 16 horizontal reductions for the price of ~4.
template <typename Op>
inline __m512 reduce16(const __m512 v[16], Op op) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {
    w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = op(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
              _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    y[i] = op(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
              _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  }
  return op(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// Lanes [0, n) of a 16-lane mask (n in [0, 16]).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}

}  // namespace pagedllm_simd
#endif  // __AVX512F__

// AVX2 + FMA + F16C helpers (8 lanes) for CPUs without AVX-512 (and the generic paths of
// AVX-512 builds): the same operations, in the same order, as the 16-lane ones above, so a
// lane of exp8 / exp2_8 has the bits of exp16 / exp2_16.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLLM_SIMD_AVX2 1

namespace pagedllm_simd {

// Holds v in a register at this point (an empty asm that "changes" it). GCC otherwise
// folds a vector's load into every instruction that uses it (an FMA per row: the loads
// then bound the loop) or computes values far ahead and spills them; the call sites say
// what each one measured.
template <typename V>
inline void in_register(V& v) {
  asm("" : "+x"(v));
}

inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }

inline __m256 load8(const c10::BFloat16* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(const c10::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

// float32 -> bfloat16 bits (round to nearest even, as bf16_bits) in the low halves.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_srli_epi32(rounded, 16);
}

inline void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }

inline void store8(c10::BFloat16* dst, __m256 v) {
  // packus works within 128-bit lanes: words 0-3 and 8-11 hold the 8 results.
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(v), bf16_bits8(v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

inline void store8(c10::Half* dst, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

template <typename T>
inline __m256 round_to8(__m256 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return v;
  }
}

// p * 2^k for integral k in [-150, 129] (or NaN), rounded once as vscalefps rounds: two
// exact power-of-two factors of at most 2^75 each, so only the second product rounds.
inline __m256 scale_pow2(__m256 p, __m256 k) {
  const __m256i ki = _mm256_cvtps_epi32(k);
  const __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

// exp16's lanes, 8 at a time (x clamped to [-87, 88]).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  return scale_pow2(p, k);
}

// exp2_16's lanes, 8 at a time: y beyond +-128 gives inf / 0, NaN stays NaN (max/min
// with y second return y when it is NaN).
inline __m256 exp2_8(__m256 y) {
  y = _mm256_min_ps(_mm256_set1_ps(129.0f), _mm256_max_ps(_mm256_set1_ps(-150.0f), y));
  const __m256 k = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(y, k);
  __m256 p = _mm256_set1_ps(1.3333558146e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108665e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650696e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718056e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  return scale_pow2(p, k);
}

// The largest of v's lanes (max is exact: the order does not matter).
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The sum of v's lanes by hsum8x8's tree: ((0+1) + (2+3)) + ((4+5) + (6+7)).
inline float hsum8(__m256 v) {
  const __m256 h = _mm256_hadd_ps(v, v);   // per 128-bit half: (0+1), (2+3), ...
  const __m256 q = _mm256_hadd_ps(h, h);   // ((0+1) + (2+3)) | ((4+5) + (6+7))
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

// Lane i of the result = the sum of the 8 lanes of a[i], by the same tree for every i
// ((0+1) + (2+3)) + ((4+5) + (6+7)).
inline __m256 hsum8x8(const __m256 a[8]) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

}  // namespace pagedllm_simd
#endif  // __AVX2__ && __FMA__ && __F16C__
