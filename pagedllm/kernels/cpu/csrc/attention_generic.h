// The generic attention item's row math (cpu_attention.cpp): a key row's scores, one
// row's online-softmax step and P . V, for one row and for several rows at once (each
// K / V load then serves them all; the same results as one by one). Scalar loops, 8 lanes
// wide with AVX2 where the head size is a multiple of 8; K / V elements are float32,
// bfloat16 bits (uint16_t) or fp8, each converted exactly as it is read.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_common.h"
#include "fp8.h"
#include "simd.h"

namespace pagedllm_ops {

using pagedllm_attention::exp_poly;

// A K / V element as float32: a float32 cache's own, or a bfloat16 cache's bits
// (uint16_t) widened, which is exact.
inline float elem(float x) { return x; }
inline float elem(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <typename C, std::enable_if_t<pagedllm_fp8::kIsFp8<C>, int> = 0>
inline float elem(C x) {
  return static_cast<float>(x);
}

#if defined(PAGEDLLM_SIMD_AVX2)
// 8 K / V elements as float32 lanes (elem's values).
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
template <typename C, std::enable_if_t<pagedllm_fp8::kIsFp8<C>, int> = 0>
inline __m256 load8(const C* x) {
  return pagedllm_fp8::float8_of<C>(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
}

// All-ones lanes for the keys t0 + i inside [lo, hi).
inline __m256 keys_in(int64_t t0, int64_t lo, int64_t hi) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(t0)),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i ge = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(static_cast<int32_t>(lo - 1)));
  const __m256i lt = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(hi)), idx);
  return _mm256_castsi256_ps(_mm256_and_si256(ge, lt));
}
#endif

// s[t] = q . k_t for keys [t_lo, t_hi) (rows k[t]). With AVX2, groups of 8 keys from
// t_lo rounded down to a multiple of 8 also write s[t] outside the range (scores of
// visible keys: finite); s has 8 entries past the step.
template <typename E>
inline void key_scores(const float* q, const E* const* k, int64_t d, int64_t t_lo,
                       int64_t t_hi, float* s) {
#if defined(PAGEDLLM_SIMD_AVX2)
  if (d % 8 == 0) {
    for (int64_t t0 = t_lo / 8 * 8; t0 < t_hi; t0 += 8) {
      const E* kr[8];  // lanes outside the range read a visible key (then dropped)
      for (int i = 0; i < 8; ++i) kr[i] = k[std::clamp<int64_t>(t0 + i, t_lo, t_hi - 1)];
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t j = 0; j < d; j += 8) {
        const __m256 qj = _mm256_loadu_ps(q + j);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qj, load8(kr[i] + j), a[i]);
      }
      _mm256_storeu_ps(s + t0, pagedllm_simd::hsum8x8(a));
    }
    return;
  }
#endif
  for (int64_t t = t_lo; t < t_hi; ++t) {
    const E* kr = k[t];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < d; ++j) dot += q[j] * elem(kr[j]);
    s[t] = dot;
  }
}

#if defined(PAGEDLLM_SIMD_AVX2)
// key_scores for two rows at once (d % 8 == 0), over the union of their ranges [t_lo,
// t_hi), 4 keys at a time: each K load serves both rows, 6 loads per 8 FMAs instead of 9.
// A score's arithmetic is key_scores' (its lanes, then hsum8x8's tree).
template <typename E>
inline void key_scores2(const float* q0, const float* q1, const E* const* k, int64_t d,
                        int64_t t_lo, int64_t t_hi, float* s0, float* s1) {
  for (int64_t t0 = t_lo / 4 * 4; t0 < t_hi; t0 += 4) {
    const E* kr[4];
    for (int i = 0; i < 4; ++i) kr[i] = k[std::clamp<int64_t>(t0 + i, t_lo, t_hi - 1)];
    __m256 a[8];  // a[i]: row 0, key t0 + i; a[4 + i]: row 1
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
      const __m256 x0 = _mm256_loadu_ps(q0 + j), x1 = _mm256_loadu_ps(q1 + j);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256 kv = load8(kr[i] + j);
        pagedllm_simd::in_register(kv);  // one load for both rows
        a[i] = _mm256_fmadd_ps(x0, kv, a[i]);
        a[4 + i] = _mm256_fmadd_ps(x1, kv, a[4 + i]);
      }
    }
    const __m256 sums = pagedllm_simd::hsum8x8(a);
    _mm_storeu_ps(s0 + t0, _mm256_castps256_ps128(sums));
    _mm_storeu_ps(s1 + t0, _mm256_extractf128_ps(sums, 1));
  }
}

// key_scores2 for R rows that all see keys [t_lo, t_hi) (a cache read in place: each K
// conversion serves the R rows), K keys a pass: R = 3 takes 4 (12 accumulators), R = 4
// (groups of 4 query heads per KV head: Llama 3, Mistral) takes 2, so its 8 accumulators
// leave registers for the loads. A score's arithmetic is still key_scores' (hsum8x8's tree
// reduces each accumulator on its own, whatever its neighbours).
template <int R, int K, typename E>
inline void key_scores_rows(const float* const q[R], const E* const* k, int64_t d,
                            int64_t t_lo, int64_t t_hi, float* const s[R]) {
  constexpr int G = (R * K + 7) / 8;  // groups of 8 accumulators, one hsum8x8 each
  for (int64_t t0 = t_lo / K * K; t0 < t_hi; t0 += K) {
    const E* kr[K];
    for (int i = 0; i < K; ++i) kr[i] = k[std::clamp<int64_t>(t0 + i, t_lo, t_hi - 1)];
    __m256 a[8 * G];  // a[K r + i]: row r, key t0 + i; those past R K stay zero
    for (int i = 0; i < 8 * G; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
#pragma GCC unroll 4
      for (int i = 0; i < K; ++i) {
        __m256 kv = load8(kr[i] + j);
        pagedllm_simd::in_register(kv);  // one conversion for the R rows
        for (int r = 0; r < R; ++r)
          a[K * r + i] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + j), kv, a[K * r + i]);
      }
    }
    alignas(32) float sums[8 * G];  // lane K r + i: row r's score of key t0 + i
    for (int g = 0; g < G; ++g) _mm256_store_ps(sums + 8 * g, pagedllm_simd::hsum8x8(a + 8 * g));
    for (int r = 0; r < R; ++r) std::memcpy(s[r] + t0, sums + K * r, K * sizeof(float));
  }
}
#endif

// One row's online softmax over the step's keys [t_lo, t_hi): the running max m (the
// accumulator acc[0, d) and the sum l rescaled when it grows), then s[t] = exp(s[t] - m)
// and l += their sum.
inline void softmax_step(float* s, int64_t t_lo, int64_t t_hi, float& m, float& l,
                         float* acc, int64_t d) {
#if defined(PAGEDLLM_SIMD_AVX2)
  const int64_t g_lo = t_lo / 8 * 8;
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 mx = neg_inf;
  for (int64_t t0 = g_lo; t0 < t_hi; t0 += 8)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + t0),
                                            keys_in(t0, t_lo, t_hi)));
  const float step_max = pagedllm_simd::hmax8(mx);
#else
  float step_max = -INFINITY;
  for (int64_t t = t_lo; t < t_hi; ++t) step_max = std::max(step_max, s[t]);
#endif
  const float m_new = std::max(m, step_max);
  if (m_new > m) {
    // Rescale what was accumulated under the old max (nothing on the first step).
    const float alpha = exp_poly(m - m_new);
    l *= alpha;
    for (int64_t j = 0; j < d; ++j) acc[j] *= alpha;
    m = m_new;
  }
#if defined(PAGEDLLM_SIMD_AVX2)
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t0 = g_lo; t0 < t_hi; t0 += 8) {
    const __m256 e = _mm256_and_ps(pagedllm_simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t0), mv)),
                                   keys_in(t0, t_lo, t_hi));
    _mm256_storeu_ps(s + t0, e);
    sum = _mm256_add_ps(sum, e);
  }
  l += pagedllm_simd::hsum8(sum);
#else
  float sum = 0.0f;
  for (int64_t t = t_lo; t < t_hi; ++t) {
    s[t] = exp_poly(s[t] - m_new);
    sum += s[t];
  }
  l += sum;
#endif
}

#if defined(PAGEDLLM_SIMD_AVX2)
// acc[j0, j0 + 8 N) += p[t] * v_t over t in [t_lo, t_hi), in order: N independent chains.
template <int N, typename E>
inline void add_pv8(float* acc, const float* p, const E* const* v, int64_t j0,
                    int64_t t_lo, int64_t t_hi) {
  __m256 a[N];
  for (int i = 0; i < N; ++i) a[i] = _mm256_loadu_ps(acc + j0 + 8 * i);
  for (int64_t t = t_lo; t < t_hi; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    const E* vr = v[t] + j0;
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) a[i] = _mm256_fmadd_ps(pt, load8(vr + 8 * i), a[i]);
  }
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(acc + j0 + 8 * i, a[i]);
}
#endif

// acc[0, d) += sum over t in [t_lo, t_hi), in order, of p[t] * v_t.
template <typename E>
inline void add_pv(float* acc, const float* p, const E* const* v, int64_t d, int64_t t_lo,
                   int64_t t_hi) {
#if defined(PAGEDLLM_SIMD_AVX2)
  if (d % 8 == 0) {  // one FMA per term, 8 chains (FMA latency x throughput) where d allows
    int64_t j = 0;
    for (; j + 64 <= d; j += 64) add_pv8<8>(acc, p, v, j, t_lo, t_hi);
    for (; j + 32 <= d; j += 32) add_pv8<4>(acc, p, v, j, t_lo, t_hi);
    for (; j < d; j += 8) add_pv8<1>(acc, p, v, j, t_lo, t_hi);
    return;
  }
#endif
  for (int64_t t = t_lo; t < t_hi; ++t) {
    const E* vr = v[t];
    for (int64_t j = 0; j < d; ++j) acc[j] += p[t] * elem(vr[j]);
  }
}

#if defined(PAGEDLLM_SIMD_AVX2)
// Columns [j0, j0 + 8 N) of add_pv2's joint keys [t_lo, t_hi): N chains per row.
template <int N, typename E>
inline void add_pv2_cols(float* acc0, float* acc1, const float* p0, const float* p1,
                         const E* const* v, int64_t j0, int64_t t_lo, int64_t t_hi) {
  __m256 a[N], b[N];
  for (int i = 0; i < N; ++i) {
    a[i] = _mm256_loadu_ps(acc0 + j0 + 8 * i);
    b[i] = _mm256_loadu_ps(acc1 + j0 + 8 * i);
  }
  for (int64_t t = t_lo; t < t_hi; ++t) {
    const __m256 x0 = _mm256_set1_ps(p0[t]), x1 = _mm256_set1_ps(p1[t]);
    const E* vr = v[t] + j0;
#pragma GCC unroll 4
    for (int i = 0; i < N; ++i) {
      __m256 vv = load8(vr + 8 * i);
      pagedllm_simd::in_register(vv);  // one load for both rows
      a[i] = _mm256_fmadd_ps(x0, vv, a[i]);
      b[i] = _mm256_fmadd_ps(x1, vv, b[i]);
    }
  }
  for (int i = 0; i < N; ++i) {
    _mm256_storeu_ps(acc0 + j0 + 8 * i, a[i]);
    _mm256_storeu_ps(acc1 + j0 + 8 * i, b[i]);
  }
}

// add_pv for two rows at once (d % 8 == 0): the keys both rows see together (each V load
// serves both), the others row by row before and after, so each row still adds its keys
// in order with add_pv's arithmetic.
template <typename E>
inline void add_pv2(float* acc0, float* acc1, const float* p0, const float* p1,
                    const E* const* v, int64_t d, int64_t lo0, int64_t hi0, int64_t lo1,
                    int64_t hi1) {
  const int64_t lo = std::max(lo0, lo1), hi = std::min(hi0, hi1);
  if (lo >= hi) {
    add_pv(acc0, p0, v, d, lo0, hi0);
    add_pv(acc1, p1, v, d, lo1, hi1);
    return;
  }
  add_pv(acc0, p0, v, d, lo0, lo);
  add_pv(acc1, p1, v, d, lo1, lo);
  int64_t j = 0;
  for (; j + 32 <= d; j += 32) add_pv2_cols<4>(acc0, acc1, p0, p1, v, j, lo, hi);
  for (; j < d; j += 8) add_pv2_cols<1>(acc0, acc1, p0, p1, v, j, lo, hi);
  add_pv(acc0, p0, v, d, hi, hi0);
  add_pv(acc1, p1, v, d, hi, hi1);
}

// add_pv for R rows (3 or 4) that see the same keys [t_lo, t_hi) (d % 8 == 0; a cache
// read in place: each V conversion serves all R), 2 column chains per row: each column
// still adds its keys in order with add_pv's arithmetic.
template <int R, typename E>
inline void add_pv_rows(float* const acc[R], const float* const p[R], const E* const* v,
                        int64_t d, int64_t t_lo, int64_t t_hi) {
  static_assert(R == 3 || R == 4, "2 chains x 4 rows fill the accumulator registers");
  for (int64_t j0 = 0; j0 < d; j0 += 16) {
    const int n = d - j0 >= 16 ? 2 : 1;
    __m256 a[R][2];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < n; ++i) a[r][i] = _mm256_loadu_ps(acc[r] + j0 + 8 * i);
    for (int64_t t = t_lo; t < t_hi; ++t) {
      const E* vr = v[t] + j0;
      for (int i = 0; i < n; ++i) {
        __m256 vv = load8(vr + 8 * i);
        pagedllm_simd::in_register(vv);
        for (int r = 0; r < R; ++r)
          a[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(p[r][t]), vv, a[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < n; ++i) _mm256_storeu_ps(acc[r] + j0 + 8 * i, a[r][i]);
  }
}
#endif

}  // namespace pagedllm_ops
