// AVX-512 work item of the paged attention kernel (cpu_attention.cpp): keys in chunks of
// 16, read in place from the cache (no copies).
// Scores of one row for a chunk: a 16-lane partial dot product per key (vdpbf16ps on
// bfloat16, FMAs otherwise) folded by hsum16 into one vector whose lane t is key t.
// Tiles of many rows in bfloat16 (prefill chunks, the cascade's shared prefix) instead
// run GEMM-shaped micro-kernels over keys transposed once per step (run_item_tiles_bf16),
// by vdpbf16ps or, on Intel, by float32 FMAs (bf16_attention_by_fma); where the CPU has
// AMX, a bfloat16 cache's items take attention_amx.h's pass instead (bf16_attention_amx).
// P.V: FMAs into a float32 accumulator per row; on bfloat16, vdpbf16ps over pairs of
// keys (probabilities rounded to bfloat16, as bf16 attention kernels do; the FMA form
// keeps them float32), which leaves the accumulator's head dims in the unpack order,
// undone when the output is stored.
// An fp8 cache (C, fp8.h) is read through the same code: keys and values are converted on
// the fly, exactly, to bfloat16 pairs (the vdpbf16ps paths) or float32 lanes (the others);
// k_scale is folded into the softmax scale and v_scale into the output normalization.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "amx.h"
#include "attention_common.h"
#include "simd.h"

namespace pagedllm_attention {

using pagedllm_simd::exp16;
using pagedllm_simd::load16;

// 32 bfloat16 values (bits, in order) of a cache row: a bfloat16 cache as it is, fp8
// converted exactly (fp8.h).
inline __m512i load32_bf16(const c10::BFloat16* src) { return _mm512_loadu_si512(src); }

template <typename C, std::enable_if_t<pagedllm_fp8::kIsFp8<C>, int> = 0>
inline __m512i load32_bf16(const C* src) {
  return pagedllm_fp8::bf16x32<C>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// The same, or zeros without reading anything when !valid (a masked load, no branch).
inline __m512i load32_bf16(const c10::BFloat16* src, bool valid) {
  return _mm512_maskz_loadu_epi32(valid ? 0xffff : 0, src);
}

template <typename C, std::enable_if_t<pagedllm_fp8::kIsFp8<C>, int> = 0>
inline __m512i load32_bf16(const C* src, bool valid) {
  // A zero byte is +0 in both fp8 formats.
  return pagedllm_fp8::bf16x32<C>(_mm256_maskz_loadu_epi8(valid ? ~0u : 0u, src));
}

// Lane t of the result = sum of the 16 lanes of v[kSlotOfLane[t]] (a reduction tree).
inline __m512 hsum16(const __m512 v[16]) {
  return pagedllm_simd::reduce16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// Partial dot product (16 lanes) of key row k (cache dtype C) with query row q (float32
// or, kBf16, raw bfloat16 pairs).
template <typename C, int NV, bool kBf16>
inline __m512 key_dot(const C* k, const void* q) {
#if defined(__AVX512BF16__)
  if constexpr (kBf16) {
    const uint16_t* qb = static_cast<const uint16_t*>(q);
    __m512 a = _mm512_setzero_ps();
    for (int j = 0; j < NV / 2; ++j) {
      a = _mm512_dpbf16_ps(a, (__m512bh)load32_bf16(k + 32 * j),
                           (__m512bh)_mm512_loadu_si512(qb + 32 * j));
    }
    return a;
  }
#endif
  const float* qf = static_cast<const float*>(q);
  __m512 a = _mm512_mul_ps(load16(k), _mm512_loadu_ps(qf));
  for (int j = 1; j < NV; ++j)
    a = _mm512_fmadd_ps(load16(k + 16 * j), _mm512_loadu_ps(qf + 16 * j), a);
  return a;
}

// The online-softmax state of the item's rows and the per-chunk probabilities.
struct RowState {
  float* acc;     // [rows, D] unnormalized outputs
  float* m;       // [rows] running max
  float* l;       // [rows, 16] running sums by lane (added up once, after the last chunk)
  float* probs;   // [head_rows, 16] this chunk's probabilities (float32)
  uint16_t* pb;   // [head_rows, 16] the same in bfloat16 (kBf16)
  float* alpha;   // [head_rows] rescale of acc for this chunk
};

// Online-softmax update of one row from its raw scores s (lane t: key t of the chunk,
// before `scale`) over the visible lanes `mask`; writes the chunk's probabilities. The
// sum stays a vector of lanes (l): no horizontal add per chunk.
template <bool kBf16>
// Always inlined (measured: the out-of-line call was ~25% of a prefill tile's time).
__attribute__((always_inline)) inline void row_softmax(__m512 s, __mmask16 mask, float scale,
                                                       float& m, float* l, float* probs,
                                                       uint16_t* pb, float& alpha) {
  alpha = 1.0f;
  __m512 p = _mm512_setzero_ps();
  if (mask != 0) {
    s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
    const float m_new = std::max(m, _mm512_mask_reduce_max_ps(mask, s));
    __m512 lanes = _mm512_loadu_ps(l);
    if (m_new > m) {
      alpha = exp_poly(m - m_new);  // 0 on the first chunk (m = -inf)
      lanes = _mm512_mul_ps(lanes, _mm512_set1_ps(alpha));
      m = m_new;
    }
    p = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
    _mm512_storeu_ps(l, _mm512_add_ps(lanes, p));
  }
#if defined(__AVX512BF16__)
  if constexpr (kBf16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb), (__m256i)_mm512_cvtneps_pbh(p));
    return;
  }
#endif
  _mm512_storeu_ps(probs, p);
}

// Scores and softmax update of one row against keys kb[0..n); writes its probabilities.
template <typename C, int NV, bool kBf16>
inline void row_scores(const C* const* kb, int n, const void* q, __mmask16 mask, float scale,
                       float& m, float* l, float* probs, uint16_t* pb, float& alpha) {
  __m512 s = _mm512_setzero_ps();
  if (mask != 0) {
    __m512 v[16];
    for (int t = 0; t < 16; ++t)
      v[pagedllm_simd::kSlotOfLane[t]] =
          t < n ? key_dot<C, NV, kBf16>(kb[t], q) : _mm512_setzero_ps();
    s = hsum16(v);
  }
  row_softmax<kBf16>(s, mask, scale, m, l, probs, pb, alpha);
}

#if defined(__AVX512BF16__)
// Keys of a chunk "transposed" for the bfloat16 dot products of many rows: kt[j] lane t is
// dims (2j, 2j + 1) of key t (keys at k0 + t * stride elements; lanes >= n are 0). A row's
// 16 scores are then D / 2 vdpbf16ps against broadcast query pairs, with no horizontal
// sums (hsum16 per row costs as much as its dot products).
//
// A 16 x 16 dword transpose per 32 dims, in registers (4 rounds of 16 shuffles): measured
// ~10 cycles per vpgatherdd here, so the gathers (32 per chunk of 64 dims) cost ~5x the
// shuffles and ~12% of a prefill tile's time.
template <int NV, typename C>
inline void transpose_keys(const C* k0, int64_t stride, int n, __m512i* kt) {
  for (int b = 0; b < NV / 2; ++b) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i)  // rows >= n read nothing and are 0
      r[i] = load32_bf16(k0 + i * stride + 32 * b, i < n);
    // Pairs of rows interleaved by dwords, then by qwords: r[4q + m] then holds, per
    // 128-bit lane L, dword 4L + m of rows 4q .. 4q + 3.
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int q = 0; q < 4; ++q) {
      const __m512i a0 = t[4 * q], a1 = t[4 * q + 1], b0 = t[4 * q + 2], b1 = t[4 * q + 3];
      r[4 * q] = _mm512_unpacklo_epi64(a0, b0);
      r[4 * q + 1] = _mm512_unpackhi_epi64(a0, b0);
      r[4 * q + 2] = _mm512_unpacklo_epi64(a1, b1);
      r[4 * q + 3] = _mm512_unpackhi_epi64(a1, b1);
    }
    // 128-bit lanes: gather lane L of the four row quads into output dwords 4L + m.
    for (int m = 0; m < 4; ++m) {
      const __m512i q01lo = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88);
      const __m512i q01hi = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xDD);
      const __m512i q23lo = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88);
      const __m512i q23hi = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xDD);
      kt[16 * b + m] = _mm512_shuffle_i32x4(q01lo, q23lo, 0x88);
      kt[16 * b + 8 + m] = _mm512_shuffle_i32x4(q01lo, q23lo, 0xDD);
      kt[16 * b + 4 + m] = _mm512_shuffle_i32x4(q01hi, q23hi, 0x88);
      kt[16 * b + 12 + m] = _mm512_shuffle_i32x4(q01hi, q23hi, 0xDD);
    }
  }
}
#endif

// acc (R rows) = acc * alpha + P . V over keys vb[0..n).
template <typename C, int NV, int R, bool kBf16>
inline void rows_pv(float* acc, const float* alpha, const float* probs, const uint16_t* pb,
                    int64_t pstride, const C* const* vb, int n) {
  constexpr int D = NV * 16;
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + j * 16), al);
  }
#if defined(__AVX512BF16__)
  if constexpr (kBf16) {
    // Keys t, t + 1 interleaved: dword i of unpacklo/hi is (V[t][d], V[t+1][d]) for the
    // d of that lane; the probability pair (p_t, p_t+1) is one broadcast dword.
    for (int t = 0; t < n; t += 2) {
      for (int j = 0; j < NV / 2; ++j) {
        const __m512i va = load32_bf16(vb[t] + 32 * j);
        const __m512i vn = t + 1 < n ? load32_bf16(vb[t + 1] + 32 * j)
                                     : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(va, vn);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(va, vn);
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, pb + r * pstride + t, sizeof(pair));  // p_t | p_t+1 << 16
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
          a[r][2 * j] = _mm512_dpbf16_ps(a[r][2 * j], lo, pp);
          a[r][2 * j + 1] = _mm512_dpbf16_ps(a[r][2 * j + 1], hi, pp);
        }
      }
    }
  } else
#endif
  {
    for (int t = 0; t < n; ++t) {
      __m512 vt[NV];
      for (int j = 0; j < NV; ++j) vt[j] = load16(vb[t] + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512 pt = _mm512_set1_ps(probs[r * pstride + t]);
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(pt, vt[j], a[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * D + j * 16, a[r][j]);
}

// Write normalized outputs of one head's rows; kBf16 accumulators are in unpack order:
// within each 32 head dims, lane 4L + m of the even vector is d = 8L + m, of the odd
// vector d = 8L + 4 + m.
template <typename T, typename C, int NV, bool kBf16>
void store_rows(const Params<T, C>& p, const Item& item, int64_t h, const float* acc,
                const float* l, int64_t head_rows) {
  constexpr int D = NV * 16;
  if constexpr (!kBf16) {
    store_outputs(p, item, h, acc, l);
    return;
  } else {
    alignas(64) int32_t idx[2][16];
    for (int half = 0; half < 2; ++half) {
      for (int i = 0; i < 16; ++i) {
        const int lane = 2 * half + i / 8, r = i % 8;  // d = 16 * half + i = 8 * lane + r
        idx[half][i] = r < 4 ? 4 * lane + r : 16 + 4 * lane + r - 4;
      }
    }
    const __m512i idx0 = _mm512_load_si512(idx[0]), idx1 = _mm512_load_si512(idx[1]);
    for (int64_t row = 0; row < head_rows; ++row) {
      T* dst = p.out + (item.tok_begin + row / p.group) * p.os0 +
               (h * p.group + row % p.group) * p.os1;
      const __m512 inv = _mm512_set1_ps(p.v_scale / l[row]);
      for (int j = 0; j < NV / 2; ++j) {
        const __m512 ev = _mm512_loadu_ps(acc + row * D + 32 * j);
        const __m512 od = _mm512_loadu_ps(acc + row * D + 32 * j + 16);
        pagedllm_simd::store16(dst + 32 * j,
                               _mm512_mul_ps(_mm512_permutex2var_ps(ev, idx0, od), inv));
        pagedllm_simd::store16(dst + 32 * j + 16,
                               _mm512_mul_ps(_mm512_permutex2var_ps(ev, idx1, od), inv));
      }
    }
  }
}

// Visible lanes of chunk c for the query at `pos`: keys lo <= c + t <= pos, t < n.
template <typename T, typename C>
inline __mmask16 visible(const Params<T, C>& p, int64_t pos, int64_t c, int n) {
  const int64_t hi = std::min<int64_t>(n, pos - c + 1);
  const int64_t lo =
      p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1 - c) : 0;
  return hi <= lo ? 0 : static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
}

// Cache offsets (slot * tok_stride) of keys [c, c + n) of request r.
template <typename T, typename C>
inline void chunk_offsets(const Params<T, C>& p, int64_t r, int64_t c, int n, int64_t* off) {
  if (p.block_size % 16 == 0) {
    // c is a multiple of 16, so the chunk lies inside one block: consecutive slots.
    const int64_t first = slot_of(p, r, c) * p.tok_stride;
    for (int t = 0; t < n; ++t) off[t] = first + t * p.tok_stride;
  } else {
    for (int t = 0; t < n; ++t) off[t] = slot_of(p, r, c + t) * p.tok_stride;
  }
}

template <typename T, typename C, int NV, bool kBf16>
void head_chunk(const Params<T, C>& p, const Item& item, const Span& sp, int64_t h, int64_t c,
                const int64_t* off, int n, const void* q, RowState& st) {
  constexpr int D = NV * 16;
  const int64_t head_rows = sp.num_toks * p.group;
  const int64_t row0 = (h - item.head_begin) * head_rows;
  const C* kb[16];
  const C* vb[16];
  for (int t = 0; t < n; ++t) {
    kb[t] = p.kc + off[t] + h * D;
    vb[t] = kb[t] + p.cache_half;
  }
  const size_t q_bytes = kBf16 ? sizeof(uint16_t) : sizeof(float);
  for (int64_t rr = 0; rr < head_rows; ++rr) {
    const int64_t row = row0 + rr;
    const void* qr = static_cast<const char*>(q) + row * D * q_bytes;
    row_scores<C, NV, kBf16>(kb, n, qr, visible(p, sp.pos0 + rr / p.group, c, n), p.scale,
                             st.m[row], st.l + row * 16, st.probs + rr * 16, st.pb + rr * 16,
                             st.alpha[rr]);
  }
  for (int64_t r0 = 0; r0 < head_rows; r0 += 4) {
    float* acc = st.acc + (row0 + r0) * D;
    const float* al = st.alpha + r0;
    const float* pr = st.probs + r0 * 16;
    const uint16_t* pb = st.pb + r0 * 16;
    switch (std::min<int64_t>(4, head_rows - r0)) {
      case 4: rows_pv<C, NV, 4, kBf16>(acc, al, pr, pb, 16, vb, n); break;
      case 3: rows_pv<C, NV, 3, kBf16>(acc, al, pr, pb, 16, vb, n); break;
      case 2: rows_pv<C, NV, 2, kBf16>(acc, al, pr, pb, 16, vb, n); break;
      default: rows_pv<C, NV, 1, kBf16>(acc, al, pr, pb, 16, vb, n); break;
    }
  }
}

// Read the K and V rows of the item's heads in a chunk (n keys at cache offsets off) ahead
// of use. Contexts come mostly from memory; plain loads of the next chunk, independent of
// the current chunk's math, overlap with it better than prefetch hints issued all at once
// did here (measured: 1.65 -> 1.1 ms per layer for a batch of 64 decodes with cold caches).
template <typename T, typename C>
inline void touch_chunk(const Params<T, C>& p, const Item& item, const int64_t* off, int n,
                        int64_t head_size) {
  const int64_t bytes = (item.head_end - item.head_begin) * head_size * sizeof(C);
  __m512i sink = _mm512_setzero_si512();
  for (int t = 0; t < n; ++t) {
    const char* k = reinterpret_cast<const char*>(p.kc + off[t] + item.head_begin * head_size);
    const char* v = k + p.cache_half * sizeof(C);
    for (int64_t b = 0; b < bytes; b += 64) {
      // A row's tail shorter than 64 bytes (fp8 rows, head size 80) is read masked: the
      // bytes past it may lie past the end of the cache.
      const __mmask64 m = bytes - b >= 64 ? ~__mmask64{0} : ~__mmask64{0} >> (64 - (bytes - b));
      sink = _mm512_xor_si512(sink, _mm512_maskz_loadu_epi8(m, k + b));
      sink = _mm512_xor_si512(sink, _mm512_maskz_loadu_epi8(m, v + b));
    }
  }
  // Keep the loads (their values are not needed).
  asm volatile("" : : "v"(sink));
}

// Prefetches into L2 of the K and V rows of the item's heads for a step's keys (n keys at
// cache offsets off), `per` 64-byte lines of each at a time: the bfloat16 tile pass calls
// next() once per query pair of every micro-kernel of the step before, so the lines stream
// in at about the rate that step computes. Into L1 (prefetcht0) a step's 36 KB evicted
// the step in use, and prefetches issued all at once were no better than none (measured).
template <typename C>
class StepPrefetch {
 public:
  StepPrefetch() = default;
  template <typename T>
  StepPrefetch(const Params<T, C>& p, const Item& item, const int64_t* off, int n,
               int64_t calls)
      : kc_(reinterpret_cast<const char*>(p.kc)), off_(off), n_(n),
        begin_(item.head_begin * p.head_size * sizeof(C)),
        bytes_((item.head_end - item.head_begin) * p.head_size * sizeof(C)),
        half_(p.cache_half * sizeof(C)) {
    const int64_t lines = n * ((bytes_ + 63) / 64);
    per_ = static_cast<int>((lines + calls - 1) / calls);
  }
  void next() { issue(per_); }
  void rest() { issue(INT32_MAX); }

 private:
  void issue(int lines) {
    for (; lines > 0 && t_ < n_; --lines) {
      const char* k = kc_ + off_[t_] * static_cast<int64_t>(sizeof(C)) + begin_ + at_;
      _mm_prefetch(k, _MM_HINT_T1);
      _mm_prefetch(k + half_, _MM_HINT_T1);
      at_ += 64;
      if (at_ >= bytes_) at_ = 0, ++t_;
    }
  }
  const char* kc_ = nullptr;
  const int64_t* off_ = nullptr;
  int n_ = 0, t_ = 0, per_ = 0;
  int64_t begin_ = 0, bytes_ = 0, half_ = 0, at_ = 0;
};

// A pass's walk over its steps of kKeys keys, and its reads ahead. Steps start at
// multiples of kKeys: a row's steps are the same whatever the other rows of its item (a
// sliding window's lower end differs per row; a step wholly below a row's window leaves
// its state untouched). The cache comes mostly from memory (a layer of 64 contexts of 240
// keys is 12 MB, and every layer has its own). Measured per layer there, 2 threads, Zen
// 4, the tile pass: 733 us with step c + 1 read as step c starts; 631 us also reading
// the first step in one burst before any math (the transposes' strided misses overlapped
// worse); 576 us also prefetching step c + 2 into L2 while step c computes
// (StepPrefetch), so that the burst of step c + 1 comes from L2. 1024 keys: 2.75 -> 2.34
// ms. The last two steps prefetch the first two of the thread's next item instead (its
// first step, read in a burst when it starts, then comes from L2): the first step of the
// next item during the second-to-last step, and during the last step its second (or its
// first, for an item of one step).
template <int kKeys, typename T, typename C>
class StepWalk {
 public:
  // `next`: the thread's next item, if claimed; `shared_keys`: the cascade's shared
  // prefix, whose keys that item (then a decode continuing from the shared state) does
  // not read; `calls`: how often the pass calls StepPrefetch::next() per step.
  StepWalk(const Params<T, C>& p, const Item& item, const Span& sp, const Item* next,
           int64_t shared_keys, int64_t calls)
      : p_(p), item_(item), sp_(sp), next_(next), calls_(calls),
        first_(sp.key_lo / kKeys * kKeys),
        num_steps_((sp.key_hi - first_ + kKeys - 1) / kKeys) {
    offsets(item_, sp_, first_, off_[0]);
    touch_chunk(p, item, off_[0], keys(sp_, first_), p.head_size);
    if (keys(sp_, first_ + kKeys) > 0) offsets(item_, sp_, first_ + kKeys, off_[1]);
    if (next != nullptr) {
      next_sp_ = span_of(p, *next);
      next_sp_.key_lo = std::max(next_sp_.key_lo, shared_keys);
      next_first_ = next_sp_.key_lo / kKeys * kKeys;
    }
  }
  int64_t first() const { return first_; }
  int keys(int64_t c) const { return keys(sp_, c); }
  // The cache offsets (slot * tok_stride) of the keys of the step begun last.
  const int64_t* offsets() const { return off_[cur_]; }

  // Begin step i (keys from c): read step c + 1 in a burst, and return the prefetcher of
  // step c + 2 or of the next item's step.
  StepPrefetch<C> begin(int64_t c, int64_t i) {
    cur_ = static_cast<int>(i % 3);
    if (const int next_n = keys(sp_, c + kKeys); next_n > 0)
      touch_chunk(p_, item_, off_[(cur_ + 1) % 3], next_n, p_.head_size);
    int64_t* far = off_[(cur_ + 2) % 3];
    if (const int far_n = keys(sp_, c + 2 * kKeys); far_n > 0) {
      offsets(item_, sp_, c + 2 * kKeys, far);
      return StepPrefetch<C>(p_, item_, far, far_n, calls_);
    }
    if (next_ == nullptr) return {};
    const int64_t j = num_steps_ == 1 ? 0 : i + 2 - num_steps_;  // the next item's step
    const int64_t nc = next_first_ + j * kKeys;
    const int far_n = keys(next_sp_, nc);
    if (far_n == 0) return {};
    offsets(*next_, next_sp_, nc, far);
    return StepPrefetch<C>(p_, *next_, far, far_n, calls_);
  }

 private:
  static int keys(const Span& sp, int64_t c) {
    return static_cast<int>(std::clamp<int64_t>(sp.key_hi - c, 0, kKeys));
  }
  void offsets(const Item& item, const Span& sp, int64_t c, int64_t* o) const {
    const int n = keys(sp, c);
    for (int v = 0; 16 * v < n; ++v)
      chunk_offsets(p_, item.req, c + 16 * v, std::min(16, n - 16 * v), o + 16 * v);
  }

  const Params<T, C>& p_;
  const Item& item_;
  const Span sp_;
  const Item* next_;
  const int64_t calls_, first_, num_steps_;
  Span next_sp_{};
  int64_t next_first_ = 0;
  int64_t off_[3][kKeys];  // cache offsets of the keys of steps c, c + 1, c + 2 (mod 3)
  int cur_ = 0;
};

// The item's query rows, head-major (head h owns head_rows rows): raw bfloat16 for the
// vdpbf16ps paths (`raw`; scores are scaled after the dot product), else float32.
template <typename T, typename C, int NV>
void load_item_queries(const Params<T, C>& p, const Item& item, int64_t head_rows,
                       Scratch& sc, bool raw) {
  constexpr int D = NV * 16;
  const int64_t num_heads = item.head_end - item.head_begin;
  for (int64_t h = 0; h < num_heads; ++h) {
    if (raw) {
      // Raw bfloat16 rows (the score is scaled after the dot product).
      uint16_t* qb = reinterpret_cast<uint16_t*>(sc.q.data()) + h * head_rows * D;
      for (int64_t rr = 0; rr < head_rows; ++rr) {
        const T* src = p.q + (item.tok_begin + rr / p.group) * p.qs0 +
                       ((item.head_begin + h) * p.group + rr % p.group) * p.qs1;
        std::memcpy(qb + rr * D, src, D * sizeof(uint16_t));
      }
    } else {
      load_queries(p, item, item.head_begin + h, sc.q.data() + h * head_rows * D, 1.0f);
    }
  }
}

#if defined(__AVX512BF16__)
// Whether the bfloat16 tile pass takes tile_rows' FMA form (pagedllm_simd::bf16_by_fma;
// PAGEDLLM_CPU_BF16_ATTENTION overrides), fixed for the process: every row of every item
// then reduces the same way (batch invariance, DESIGN.md §10).
inline bool bf16_attention_by_fma() {
  static const bool by_fma = pagedllm_simd::bf16_by_fma("PAGEDLLM_CPU_BF16_ATTENTION");
  return by_fma;
}

// Whether a bfloat16 cache's items take the AMX pass (attention_amx.h) in this process:
// where the build has it and the OS grants the tiles, unless PAGEDLLM_CPU_BF16_ATTENTION
// names another form (fma, dpbf16). Fixed for the process, like the choice above.
inline bool bf16_attention_amx() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  static const bool amx = pagedllm_amx::chosen("PAGEDLLM_CPU_BF16_ATTENTION");
  return amx;
#else
  return false;
#endif
}

// Whether the items of this call take the AMX pass: bfloat16 queries and cache, head dims
// in 32s, whole 16-key runs per block, and a process that takes it.
template <typename T, typename C>
bool amx_pass(const Params<T, C>& p) {
  return std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> &&
         p.head_size % 32 == 0 && p.block_size % 16 == 0 && bf16_attention_amx();
}

// The AMX pass's key loop (defined in attention_amx.h, which builds on this header).
namespace amx {
template <typename T, int NV>
void run_item(const Params<T, c10::BFloat16>& p, const Item& item, const Span& sp,
              Scratch& sc, int64_t shared_keys);
}  // namespace amx

// The bfloat16 tile pass, shaped like a small GEMM: per step of kTileKeys keys and KV head,
// the keys are transposed and the values interleaved in pairs once, then micro-kernels of
// kTileRows<NV> query rows compute their scores (rows x 3 vectors of sums in registers, so
// each loaded key vector serves every row and each broadcast query pair three keys), the
// online softmax (one horizontal max per row per 48 keys), and P . V (rows x D sums in
// registers). Measured per layer on shared_prefix's first step (47 chunks of 32 tokens
// after a 512-token prefix, 2 threads): 7.4 ms with chunks of 16 keys and 4 rows (loads
// of keys and query pairs outnumbered the vdpbf16ps), 5.9 ms with these micro-kernels,
// 4.5 ms with the lazy max below; 64 decodes' cascade over 512 shared keys 0.33 -> 0.19 ms.
constexpr int kTileVecs = 3;
constexpr int kTileKeys = 16 * kTileVecs;
constexpr float kRescaleAbove = 8.0f;

// Rows per micro-kernel: R x NV output sums (plus NV values and a probability pair) must
// fit the 32 vector registers.
template <int NV>
constexpr int kTileRows = std::clamp(24 / NV, 1, 6);

// Values of keys [0, n) in pairs for vdpbf16ps over the keys: vi[t * NV + 2j] and
// vi[t * NV + 2j + 1] are unpacklo/hi of keys 2t and 2t + 1 over dims [32j, 32j + 32)
// (the accumulators' unpack order, undone by store_rows). A missing key 2t + 1 reads as 0.
template <int NV, typename C>
inline void interleave_values(const C* const* vb, int n, __m512i* vi) {
  for (int t = 0; 2 * t < n; ++t) {
    for (int j = 0; j < NV / 2; ++j) {
      const __m512i va = load32_bf16(vb[2 * t] + 32 * j);
      const __m512i vn = 2 * t + 1 < n ? load32_bf16(vb[2 * t + 1] + 32 * j)
                                       : _mm512_setzero_si512();
      vi[t * NV + 2 * j] = _mm512_unpacklo_epi16(va, vn);
      vi[t * NV + 2 * j + 1] = _mm512_unpackhi_epi16(va, vn);
    }
  }
}

// The online-softmax update of one row (at position pos) over a step of V x 16 keys from
// key c, n of them: its raw scores s[v] (lane t: key c + 16 v + t, before `scale`) become
// probabilities e[v] (0 for keys it cannot see), its sums by lane l grow by them, and
// alpha is what its acc must be scaled by; returns whether the step rescaled (alpha != 1).
// The running max m is lazy: a step rescales only when a visible score exceeds m by more
// than kRescaleAbove (exact either way: acc and l share the reference m, and p <= e^8
// stays far inside bfloat16 and float32 range), so most steps need no horizontal max.
template <int V, typename T, typename C>
__attribute__((always_inline)) inline bool step_softmax(const Params<T, C>& p, int64_t pos,
                                                        int64_t c, int n, const __m512* s,
                                                        float& m, float* l, __m512* e,
                                                        float& alpha) {
  const __m512 sc = _mm512_set1_ps(p.scale), above = _mm512_set1_ps(kRescaleAbove);
  __mmask16 mask[V];
  __m512 x[V];
  __mmask16 over = 0;
  const __m512 mr = _mm512_set1_ps(m);
  for (int v = 0; v < V; ++v) {
    const int nv = std::clamp(n - 16 * v, 0, 16);
    mask[v] = nv > 0 ? visible(p, pos, c + 16 * v, nv) : 0;
    x[v] = _mm512_fmsub_ps(s[v], sc, mr);
    over |= _mm512_mask_cmp_ps_mask(mask[v], x[v], above, _CMP_GT_OQ);
  }
  alpha = 1.0f;
  __m512 lanes = _mm512_loadu_ps(l);
  if (over != 0) {  // the first step (m = -inf), or a new max well above m
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < V; ++v) mx = _mm512_mask_max_ps(mx, mask[v], mx, s[v]);
    // max(s) * scale is max(s * scale): the scale is positive and rounding monotonic.
    const float m_new = _mm512_reduce_max_ps(mx) * p.scale;
    alpha = exp_poly(m - m_new);  // 0 on the first step
    lanes = _mm512_mul_ps(lanes, _mm512_set1_ps(alpha));
    m = m_new;
    for (int v = 0; v < V; ++v) x[v] = _mm512_fmsub_ps(s[v], sc, _mm512_set1_ps(m_new));
  }
  for (int v = 0; v < V; ++v) {
    e[v] = _mm512_maskz_mov_ps(mask[v], exp16(x[v]));
    lanes = _mm512_add_ps(lanes, e[v]);
  }
  _mm512_storeu_ps(l, lanes);
  return over != 0;
}

// One micro-kernel: R rows (bfloat16 queries q, D apart; row `row` of the item's head,
// at position pos[r]) against a step of n keys starting at key c: scores, online softmax
// (m, l by lane, acc rescaled) and acc += P . V.
//
// kFma (bf16_attention_by_fma): the same steps with float32 FMAs instead of vdpbf16ps,
// for CPUs that issue half a vdpbf16ps per cycle against two FMAs (Intel's), where the
// FMAs' twice as many instructions finish first: queries are
// float32 rows (widened exactly), each key pair dword splits into its even and odd dim
// as float32 (a bfloat16 is the top half of its float32), every score is one FMA chain
// over the dims in order, and the probabilities stay float32 for P . V (each value pair
// split the same way: key 2t, then key 2t + 1).
template <typename T, typename C, int NV, int R, bool kFma>
inline void tile_rows(const Params<T, C>& p, const __m512i* kt, const __m512i* vi, int64_t c,
                      int n, const void* qv, const int64_t* pos, float* m, float* l,
                      float* acc, StepPrefetch<C>& ahead) {
  constexpr int D = NV * 16;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  // The even (low) and odd (high) bfloat16 of each dword of x as float32.
  auto even = [](__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); };
  auto odd = [&high](__m512i x) { return _mm512_castsi512_ps(_mm512_and_si512(x, high)); };
  __m512 s[R][kTileVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kTileVecs; ++v) s[r][v] = _mm512_setzero_ps();
  for (int j = 0; j < NV * 8; ++j) {
    ahead.next();
    if constexpr (kFma) {
      const float* q = static_cast<const float*>(qv);
      __m512 ke[kTileVecs], ko[kTileVecs];
      for (int v = 0; v < kTileVecs; ++v) {
        ke[v] = even(kt[v * NV * 8 + j]);
        ko[v] = odd(kt[v * NV * 8 + j]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 qe = _mm512_set1_ps(q[r * D + 2 * j]);
        for (int v = 0; v < kTileVecs; ++v) s[r][v] = _mm512_fmadd_ps(qe, ke[v], s[r][v]);
        const __m512 qo = _mm512_set1_ps(q[r * D + 2 * j + 1]);
        for (int v = 0; v < kTileVecs; ++v) s[r][v] = _mm512_fmadd_ps(qo, ko[v], s[r][v]);
      }
    } else {
      const uint16_t* q = static_cast<const uint16_t*>(qv);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, q + r * D + 2 * j, sizeof(pair));
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(pair);
        for (int v = 0; v < kTileVecs; ++v)
          s[r][v] = _mm512_dpbf16_ps(s[r][v], (__m512bh)kt[v * NV * 8 + j], qp);
      }
    }
  }
  // Softmax (step_softmax): probabilities in bfloat16, pairs of keys per dword (the P . V
  // operand; kFma: float32, one key per lane).
  alignas(64) uint16_t pb[R][kTileKeys];
  alignas(64) float pf[R][kTileKeys];  // kFma: float32 probabilities
  float alpha[R];
  bool rescaled = false;
  for (int r = 0; r < R; ++r) {
    __m512 e[kTileVecs];
    rescaled |= step_softmax<kTileVecs>(p, pos[r], c, n, s[r], m[r], l + r * 16, e, alpha[r]);
    for (int v = 0; v < kTileVecs; ++v) {
      if constexpr (kFma)
        _mm512_store_ps(pf[r] + 16 * v, e[v]);
      else
        _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r] + 16 * v),
                           (__m256i)_mm512_cvtneps_pbh(e[v]));
    }
  }
  // P . V over the step's key pairs.
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_loadu_ps(acc + r * D + 16 * j);
    if (rescaled) {
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_mul_ps(a[r][j], _mm512_set1_ps(alpha[r]));
    }
  }
  for (int t = 0; 2 * t < n; ++t) {
    if constexpr (kFma) {
      for (int j = 0; j < NV; ++j) {
        const __m512 ve = even(vi[t * NV + j]), vo = odd(vi[t * NV + j]);
        for (int r = 0; r < R; ++r) {
          a[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(pf[r][2 * t]), ve, a[r][j]);
          a[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(pf[r][2 * t + 1]), vo, a[r][j]);
        }
      }
    } else {
      __m512bh vt[NV];
      for (int j = 0; j < NV; ++j) vt[j] = (__m512bh)vi[t * NV + j];
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, pb[r] + 2 * t, sizeof(pair));  // p_2t | p_2t+1 << 16
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_dpbf16_ps(a[r][j], vt[j], pp);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * D + 16 * j, a[r][j]);
}

// R = 1 .. kTileRows rows: the micro-kernel of that size.
template <typename T, typename C, int NV, bool kFma, int R = kTileRows<NV>>
inline void tile_rows_n(int rows, const Params<T, C>& p, const __m512i* kt, const __m512i* vi,
                        int64_t c, int n, const void* q, const int64_t* pos, float* m,
                        float* l, float* acc, StepPrefetch<C>& ahead) {
  if constexpr (R > 1) {
    if (rows < R) {
      tile_rows_n<T, C, NV, kFma, R - 1>(rows, p, kt, vi, c, n, q, pos, m, l, acc, ahead);
      return;
    }
  }
  tile_rows<T, C, NV, R, kFma>(p, kt, vi, c, n, q, pos, m, l, acc, ahead);
}

// run_item_chunks' key loop for bfloat16 with whole 16-key runs per block
// (block_size % 16 == 0): steps of kTileKeys keys through the micro-kernels (`shared_keys`:
// StepWalk's).
template <typename T, typename C, int NV, bool kFma>
void run_item_tiles_bf16(const Params<T, C>& p, const Item& item, const Span& sp,
                         Scratch& sc, int64_t shared_keys) {
  constexpr int D = NV * 16;
  constexpr int R = kTileRows<NV>;
  const int64_t head_rows = sp.num_toks * p.group;
  // Query rows: float32 (kFma) or raw bfloat16 (load_item_queries).
  const size_t q_bytes = kFma ? sizeof(float) : sizeof(uint16_t);
  const char* qb = reinterpret_cast<const char*>(sc.q.data());
  alignas(64) __m512i kt[kTileVecs * NV * 8];
  alignas(64) __m512i vi[kTileKeys / 2 * NV];
  // One micro-kernel call per (head, run of R rows); next() once per query pair of each.
  const int64_t calls = (item.head_end - item.head_begin) * ((head_rows + R - 1) / R) * NV * 8;
  StepWalk<kTileKeys, T, C> walk(p, item, sp, sc.next, shared_keys, calls);
  for (int64_t c = walk.first(), i = 0; c < sp.key_hi; c += kTileKeys, ++i) {
    const int n = walk.keys(c);
    StepPrefetch<C> ahead = walk.begin(c, i);
    const int64_t* off = walk.offsets();
    // Heads of a token are adjacent in the cache: all of them per step reads it in order.
    for (int64_t h = item.head_begin; h < item.head_end; ++h) {
      const C* vb[kTileKeys];
      for (int t = 0; t < n; ++t) vb[t] = p.kc + off[t] + h * D + p.cache_half;
      for (int v = 0; v < kTileVecs; ++v) {
        const int nv = std::clamp(n - 16 * v, 0, 16);
        if (nv > 0)
          transpose_keys<NV>(p.kc + off[16 * v] + h * D, p.tok_stride, nv, kt + v * NV * 8);
        else
          std::fill(kt + v * NV * 8, kt + (v + 1) * NV * 8, _mm512_setzero_si512());
      }
      interleave_values<NV>(vb, n, vi);
      const int64_t row0 = (h - item.head_begin) * head_rows;
      for (int64_t rr = 0; rr < head_rows; rr += R) {
        int64_t pos[R];
        for (int r = 0; r < R; ++r) pos[r] = sp.pos0 + (rr + r) / p.group;
        const int64_t row = row0 + rr;
        tile_rows_n<T, C, NV, kFma>(static_cast<int>(std::min<int64_t>(R, head_rows - rr)), p,
                                    kt, vi, c, n, qb + row * D * q_bytes, pos,
                                    sc.m.data() + row, sc.l_lanes.data() + row * 16,
                                    sc.acc.data() + row * D, ahead);
      }
    }
    ahead.rest();
  }
}
#endif

// The online-softmax pass of an item over keys [sp.key_lo, sp.key_hi): rows' m, l and
// unnormalized acc (head-major: head h owns a run of head_rows rows) in sc.
//
// `sh` (a decode item of a cascade, bfloat16 tile pass only): the rows start from their
// state after the shared keys and go on from there.
template <typename T, typename C, int NV, bool kBf16>
void run_item_chunks(const Params<T, C>& p, const Item& item, Span sp, Scratch& sc,
                     const SharedPrefix* sh = nullptr) {
  constexpr int D = NV * 16;
  const int64_t head_rows = sp.num_toks * p.group;
  const int64_t rows = head_rows * (item.head_end - item.head_begin);
#if defined(__AVX512BF16__)
  const bool tiles = kBf16 && p.block_size % 16 == 0;
  const bool on_amx = tiles && amx_pass(p);
  const bool by_fma = tiles && !on_amx && bf16_attention_by_fma();
#else
  const bool by_fma = false;  // (no tile pass: AVX-512 without BF16)
#endif
  load_item_queries<T, C, NV>(p, item, head_rows, sc, kBf16 && !by_fma);
  if (sh != nullptr && sh->keys > 0) {
    // One token: row = (h - head_begin) * group + g, as the shared part stored it.
    const int64_t at0 = item.tok_begin * sh->heads + item.head_begin * p.group;
    std::copy_n(sh->m.data() + at0, rows, sc.m.data());
    std::copy_n(sh->l_lanes.data() + at0 * 16, rows * 16, sc.l_lanes.data());
    std::copy_n(sh->acc.data() + at0 * D, rows * D, sc.acc.data());
    sp.key_lo = sh->keys;
  } else {
    std::fill(sc.acc.begin(), sc.acc.begin() + rows * D, 0.0f);
    std::fill(sc.m.begin(), sc.m.begin() + rows, -INFINITY);
    std::fill(sc.l_lanes.begin(), sc.l_lanes.begin() + rows * 16, 0.0f);
  }
  auto sum_lanes = [&] {
    for (int64_t row = 0; row < rows; ++row)
      sc.l[row] = _mm512_reduce_add_ps(_mm512_loadu_ps(sc.l_lanes.data() + row * 16));
  };
#if defined(__AVX512BF16__)
  if constexpr (kBf16) {
    if (tiles) {
      const int64_t shared_keys = sh != nullptr ? sh->keys : 0;
      if constexpr (std::is_same_v<C, c10::BFloat16>) {
        if (on_amx) {
          amx::run_item<T, NV>(p, item, sp, sc, shared_keys);
          sum_lanes();
          return;
        }
      }
      if (by_fma)
        run_item_tiles_bf16<T, C, NV, true>(p, item, sp, sc, shared_keys);
      else
        run_item_tiles_bf16<T, C, NV, false>(p, item, sp, sc, shared_keys);
      sum_lanes();
      return;
    }
  }
#endif
  RowState st{sc.acc.data(), sc.m.data(), sc.l_lanes.data(), sc.probs.data(),
              reinterpret_cast<uint16_t*>(sc.probs_b.data()), sc.alpha.data()};
  int64_t offsets[2][16];  // this chunk's and the next one's cache offsets
  int64_t c = sp.key_lo / 16 * 16;
  int n = static_cast<int>(std::min<int64_t>(16, sp.key_hi - c));
  chunk_offsets(p, item.req, c, n, offsets[0]);
  touch_chunk(p, item, offsets[0], n, D);  // in one burst (see run_item_tiles_bf16)
  for (int cur = 0; c < sp.key_hi; c += 16, cur ^= 1) {
    const int next_n = static_cast<int>(std::clamp<int64_t>(sp.key_hi - c - 16, 0, 16));
    if (next_n > 0) {
      chunk_offsets(p, item.req, c + 16, next_n, offsets[cur ^ 1]);
      touch_chunk(p, item, offsets[cur ^ 1], next_n, D);
    }
    // Heads of a token are adjacent in the cache: all of them per chunk reads it in order.
    for (int64_t h = item.head_begin; h < item.head_end; ++h)
      head_chunk<T, C, NV, kBf16>(p, item, sp, h, c, offsets[cur], n, sc.q.data(), st);
    n = next_n;
  }
  sum_lanes();
}

// An item's attention, its rows continued from the cascade's shared state when `sh` has
// one (single-token items only).
template <typename T, typename C, int NV, bool kBf16>
void attend_item_from_avx512(const Params<T, C>& p, const Item& item, Scratch& sc,
                             const SharedPrefix* sh) {
  constexpr int D = NV * 16;
  const Span sp = span_of(p, item);
  const int64_t head_rows = sp.num_toks * p.group;
  run_item_chunks<T, C, NV, kBf16>(p, item, sp, sc, sh);
  for (int64_t h = 0; h < item.head_end - item.head_begin; ++h) {
    store_rows<T, C, NV, kBf16>(p, item, item.head_begin + h, sc.acc.data() + h * head_rows * D,
                             sc.l.data() + h * head_rows, head_rows);
  }
}

template <typename T, typename C, int NV, bool kBf16>
void attend_item_avx512(const Params<T, C>& p, const Item& item, Scratch& sc) {
  attend_item_from_avx512<T, C, NV, kBf16>(p, item, sc, nullptr);
}

// Cascade, first part: the decode tokens [tok_begin, tok_end) (one per request, all
// sharing request item.req's first sh.keys keys) over those keys, into sh.
template <typename T, typename C, int NV, bool kBf16>
void shared_prefix_item_avx512(const Params<T, C>& p, const Item& item, Scratch& sc,
                               SharedPrefix& sh) {
  constexpr int D = NV * 16;
  // Every shared key precedes every query: a position past all keys masks nothing.
  const Span sp{INT64_MAX / 4, item.tok_end - item.tok_begin, 0, sh.keys};
  const int64_t head_rows = sp.num_toks * p.group;
  run_item_chunks<T, C, NV, kBf16>(p, item, sp, sc);
  for (int64_t h = item.head_begin; h < item.head_end; ++h) {
    for (int64_t rr = 0; rr < head_rows; ++rr) {
      const int64_t row = (h - item.head_begin) * head_rows + rr;
      const int64_t at = (item.tok_begin + rr / p.group) * sh.heads + h * p.group + rr % p.group;
      sh.m[at] = sc.m[row];
      std::memcpy(sh.l_lanes.data() + at * 16, sc.l_lanes.data() + row * 16,
                  16 * sizeof(float));
      std::memcpy(sh.acc.data() + at * D, sc.acc.data() + row * D, D * sizeof(float));
    }
  }
}

// Decode item (one query token): the pass of prefill rows (the bfloat16 tile pass, or the
// chunks of 16 keys), continued from the cascade's shared state when there is one. A row's
// arithmetic (score sums, steps of keys at absolute positions, the max, P . V) is then the
// same whether its token is decoded, prefilled in any chunk, or recomputed after
// preemption: attention is batch invariant in every dtype (DESIGN.md §10). (A three-pass
// decode, scores then softmax then P . V, was a little faster on long float32 contexts but
// rounded differently from the prefill rows.)
template <typename T, typename C, int NV, bool kBf16>
void decode_item_avx512(const Params<T, C>& p, const Item& item, Scratch& sc,
                        const SharedPrefix* sh) {
  attend_item_from_avx512<T, C, NV, kBf16>(p, item, sc, sh);
}

}  // namespace pagedllm_attention
#endif  // __AVX512F__ && __AVX512BW__
