// Paged attention for CPUs: one op that writes the step's K/V into the paged cache and
// attends every scheduled query (prefill chunks and decodes alike) over its context,
// reading K/V through the block table (no gathered copy of the context).
//
// Work items are (request, KV head, tile of query tokens). An item keeps the G query heads
// of its KV head together ("GQA folded into the rows": row i * G + g is token i, head g of
// the group), so every key is loaded once for tile * G rows. Softmax is online (flash
// style): per row a running max m, a running sum l and an unnormalized accumulator.
//
// Two implementations of an item:
// - avx512: keys in chunks of 16; a chunk's K is converted to float32 and transposed
//   ([D][16]) so one row's 16 scores are D broadcast-FMAs, 4 rows at a time; head_size a
//   multiple of 16 (compile-time).
// - generic: plain loops for the auto-vectorizer (other head sizes, CPUs without AVX-512).
//
// Built lazily by pagedllm/attention/cpu_kernels.py with -O3 -march=native.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Everything an item needs to find its queries, its context and its output.
template <typename T>
struct Params {
  const T* q;           // [T, H, D] with strides qs0, qs1
  T* out;               // [T, H, D] with strides os0, os1
  const T* kc;          // K half of the cache: slot s, kv head h at kc + s * tok_stride + h * D
  const int32_t* bt;    // block table rows, bt_stride apart
  const int32_t* lens;  // seq_lens [R]
  const int32_t* qsl;   // query_start_loc [R + 1]
  int64_t qs0, qs1, os0, os1, bt_stride;
  int64_t head_size, group, block_size, tok_stride;
  int64_t cache_half;  // elements from a K entry to its V entry
  int64_t sliding_window;  // 0: none
  float scale;
};

// Query tokens [tok_begin, tok_end) of request `req`, KV heads [head_begin, head_end).
struct Item {
  int64_t req, head_begin, head_end, tok_begin, tok_end;
};

// Positions of an item: query token tok_begin + i sits at pos0 + i; keys [key_lo, key_hi)
// cover what any of its rows may see.
struct Span {
  int64_t pos0, num_toks, key_lo, key_hi;
};

template <typename T>
Span span_of(const Params<T>& p, const Item& item) {
  const int64_t r = item.req;
  const int64_t q_len = p.qsl[r + 1] - p.qsl[r];
  Span s;
  // The chunk's queries are the last q_len positions of the context.
  s.pos0 = p.lens[r] - q_len + (item.tok_begin - p.qsl[r]);
  s.num_toks = item.tok_end - item.tok_begin;
  s.key_lo = p.sliding_window > 0 ? std::max<int64_t>(0, s.pos0 - p.sliding_window + 1) : 0;
  s.key_hi = s.pos0 + s.num_toks;
  return s;
}

// Cache slot of key position `pos` of request r: block_table[pos / B] * B + pos % B.
template <typename T>
inline int64_t slot_of(const Params<T>& p, int64_t r, int64_t pos) {
  return static_cast<int64_t>(p.bt[r * p.bt_stride + pos / p.block_size]) * p.block_size +
         pos % p.block_size;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// exp(x) for x <= 0, Cephes' polynomial (~1 ulp); x below -87 (or -inf) gives ~1e-38.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
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

// Per-thread buffers, sized for the largest item.
struct Scratch {
  std::vector<float> q, acc, m, l, k, v, s;
  Scratch(int64_t max_rows, int64_t head_size, int64_t keys)
      : q(max_rows * head_size), acc(max_rows * head_size), m(max_rows), l(max_rows),
        k(keys * head_size + 16), v(keys * head_size + 16), s(keys + 16) {}
};

// Load the queries of KV head h as float32, pre-scaled, rows i * G + g.
template <typename T>
void load_queries(const Params<T>& p, const Item& item, int64_t h, float* qf) {
  const int64_t d = p.head_size;
  for (int64_t i = 0; i < item.tok_end - item.tok_begin; ++i) {
    for (int64_t g = 0; g < p.group; ++g) {
      const T* src = p.q + (item.tok_begin + i) * p.qs0 + (h * p.group + g) * p.qs1;
      float* dst = qf + (i * p.group + g) * d;
      to_float(src, dst, d);
      for (int64_t j = 0; j < d; ++j) dst[j] *= p.scale;
    }
  }
}

template <typename T>
void store_outputs(const Params<T>& p, const Item& item, int64_t h, const float* acc,
                   const float* l) {
  const int64_t d = p.head_size;
  const int64_t rows = (item.tok_end - item.tok_begin) * p.group;
  for (int64_t row = 0; row < rows; ++row) {
    T* dst = p.out + (item.tok_begin + row / p.group) * p.os0 +
             (h * p.group + row % p.group) * p.os1;
    // l > 0: every row sees at least its own key.
    const float inv = 1.0f / l[row];
    for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(acc[row * d + j] * inv);
  }
}

// ---------------------------------------------------------------------------------------
// Generic item: one KV head, one block of keys at a time, rows one by one.
template <typename T>
void attend_head_generic(const Params<T>& p, const Item& item, int64_t h, Scratch& sc) {
  const Span sp = span_of(p, item);
  const int64_t d = p.head_size, rows = sp.num_toks * p.group, bs = p.block_size;
  load_queries(p, item, h, sc.q.data());
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * d, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + rows, -INFINITY);
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.0f);
  float* s = sc.s.data();
  for (int64_t base = sp.key_lo / bs * bs; base < sp.key_hi; base += bs) {
    const int64_t n = std::min(bs, sp.key_hi - base);
    const T* kb = p.kc + slot_of(p, item.req, base) * p.tok_stride + h * d;
    for (int64_t t = 0; t < n; ++t) {
      to_float(kb + t * p.tok_stride, sc.k.data() + t * d, d);
      to_float(kb + p.cache_half + t * p.tok_stride, sc.v.data() + t * d, d);
    }
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t pos = sp.pos0 + row / p.group;
      // Visible keys of this row within the block: [t_lo, t_hi).
      const int64_t t_hi = std::min(n, pos - base + 1);
      const int64_t t_lo =
          p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1 - base) : 0;
      if (t_hi <= t_lo) continue;
      const float* qr = sc.q.data() + row * d;
      float blk_max = -INFINITY;
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const float* kr = sc.k.data() + t * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < d; ++j) dot += qr[j] * kr[j];
        s[t] = dot;
        blk_max = std::max(blk_max, dot);
      }
      float* ar = sc.acc.data() + row * d;
      const float m_new = std::max(sc.m[row], blk_max);
      if (m_new > sc.m[row]) {
        // Rescale what was accumulated under the old max (nothing on the first block).
        const float alpha = exp_nonpos(sc.m[row] - m_new);
        sc.l[row] *= alpha;
        for (int64_t j = 0; j < d; ++j) ar[j] *= alpha;
        sc.m[row] = m_new;
      }
      float sum = 0.0f;
      for (int64_t t = t_lo; t < t_hi; ++t) {
        s[t] = exp_nonpos(s[t] - m_new);
        sum += s[t];
      }
      sc.l[row] += sum;
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const float* vr = sc.v.data() + t * d;
        for (int64_t j = 0; j < d; ++j) ar[j] += s[t] * vr[j];
      }
    }
  }
  store_outputs(p, item, h, sc.acc.data(), sc.l.data());
}

template <typename T>
void attend_item_generic(const Params<T>& p, const Item& item, Scratch& sc) {
  for (int64_t h = item.head_begin; h < item.head_end; ++h) attend_head_generic(p, item, h, sc);
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------------
// AVX-512 item: chunks of 16 keys, rows in groups of up to 4.

inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }

inline __m512 load16(const c10::BFloat16* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 load16(const c10::Half* src) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

// In-register transpose of a 16 x 16 float32 tile.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}

// exp of 16 lanes (x <= 0), the same polynomial as exp_nonpos.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
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

// Convert keys [c, c + n) (n <= 16) of the item to float32: K transposed into kt [D][16]
// (lanes >= n zero), V row-major into v [16][D].
template <typename T, int NV>
void load_chunk(const Params<T>& p, const Item& item, int64_t h, int64_t c, int64_t n,
                float* kt, float* v) {
  constexpr int D = NV * 16;
  const T* rows[16];
  if (p.block_size % 16 == 0) {
    // c is a multiple of 16, so the chunk lies inside one block: consecutive slots.
    const T* first = p.kc + slot_of(p, item.req, c) * p.tok_stride + h * D;
    for (int t = 0; t < n; ++t) rows[t] = first + t * p.tok_stride;
  } else {
    for (int t = 0; t < n; ++t)
      rows[t] = p.kc + slot_of(p, item.req, c + t) * p.tok_stride + h * D;
  }
  for (int j = 0; j < NV; ++j) {
    __m512 r[16];
    for (int t = 0; t < 16; ++t) r[t] = t < n ? load16(rows[t] + j * 16) : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_store_ps(kt + (j * 16 + i) * 16, r[i]);
  }
  for (int t = 0; t < n; ++t) {
    for (int j = 0; j < NV; ++j)
      _mm512_store_ps(v + t * D + j * 16, load16(rows[t] + p.cache_half + j * 16));
  }
}

// Ask for the next chunk's K and V rows while this one is computed (contexts are read
// once per step, mostly from memory).
template <typename T, int NV>
inline void prefetch_chunk(const Params<T>& p, const Item& item, int64_t c) {
  if (p.block_size % 16 != 0) return;
  // The item's heads are adjacent within a token.
  const int64_t bytes = (item.head_end - item.head_begin) * NV * 16 * sizeof(T);
  const char* first = reinterpret_cast<const char*>(
      p.kc + slot_of(p, item.req, c) * p.tok_stride + item.head_begin * NV * 16);
  const int64_t stride = p.tok_stride * sizeof(T), half = p.cache_half * sizeof(T);
  for (int t = 0; t < 16; ++t) {
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(first + t * stride + b, _MM_HINT_T1);
      _mm_prefetch(first + half + t * stride + b, _MM_HINT_T1);
    }
  }
}

// R rows (q, acc: R x D; m, l: R) against one chunk of n keys; masks[r]: visible lanes.
template <int NV, int R>
void rows_chunk(const float* q, float* acc, float* m, float* l, const float* kt,
                const float* v, int n, const __mmask16* masks) {
  constexpr int D = NV * 16;
  __m512 s0[R], s1[R];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
  // Two accumulators per row keep 2R FMA chains in flight.
  for (int d = 0; d < D; d += 2) {
    const __m512 k0 = _mm512_load_ps(kt + d * 16), k1 = _mm512_load_ps(kt + (d + 1) * 16);
    for (int r = 0; r < R; ++r) {
      s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), k0, s0[r]);
      s1[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d + 1]), k1, s1[r]);
    }
  }
  alignas(64) float probs[R][16];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    alpha[r] = 1.0f;
    if (masks[r] == 0) {
      _mm512_store_ps(probs[r], _mm512_setzero_ps());
      continue;
    }
    const __m512 sc = _mm512_add_ps(s0[r], s1[r]);
    const float m_new = std::max(m[r], _mm512_mask_reduce_max_ps(masks[r], sc));
    if (m_new > m[r]) {
      alpha[r] = exp_nonpos(m[r] - m_new);  // 0 on the first chunk (m = -inf)
      l[r] *= alpha[r];
      m[r] = m_new;
    }
    const __m512 pr = _mm512_maskz_mov_ps(masks[r], exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
    l[r] += _mm512_reduce_add_ps(pr);
    _mm512_store_ps(probs[r], pr);
  }
  __m512 a[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int j = 0; j < NV; ++j) a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + j * 16), al);
  }
  for (int t = 0; t < n; ++t) {
    __m512 vt[NV];
    for (int j = 0; j < NV; ++j) vt[j] = _mm512_load_ps(v + t * D + j * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 pt = _mm512_set1_ps(probs[r][t]);
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(pt, vt[j], a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * D + j * 16, a[r][j]);
}

template <typename T, int NV>
void attend_item_avx512(const Params<T>& p, const Item& item, Scratch& sc) {
  constexpr int D = NV * 16;
  const Span sp = span_of(p, item);
  const int64_t head_rows = sp.num_toks * p.group;  // rows of one KV head
  const int64_t num_heads = item.head_end - item.head_begin;
  const int64_t rows = head_rows * num_heads;  // head-major: head h owns a run of head_rows
  for (int64_t h = 0; h < num_heads; ++h)
    load_queries(p, item, item.head_begin + h, sc.q.data() + h * head_rows * D);
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * D, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + rows, -INFINITY);
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.0f);
  // 64-byte aligned views of the K / V scratch.
  float* kt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sc.k.data()) + 63) & ~63);
  float* v = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(sc.v.data()) + 63) & ~63);
  __mmask16 masks[4];
  for (int64_t c = sp.key_lo / 16 * 16; c < sp.key_hi; c += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, sp.key_hi - c));
    // if (c + 32 < sp.key_hi) prefetch_chunk<T, NV>(p, item, c + 32);
    // Heads of a token are adjacent in the cache: all of them per chunk reads it in order.
    for (int64_t h = 0; h < num_heads; ++h) {
      load_chunk<T, NV>(p, item, item.head_begin + h, c, n, kt, v);
      for (int64_t r0 = 0; r0 < head_rows; r0 += 4) {
        const int nr = static_cast<int>(std::min<int64_t>(4, head_rows - r0));
        for (int r = 0; r < nr; ++r) {
          const int64_t pos = sp.pos0 + (r0 + r) / p.group;
          // Visible lanes: key c + t with lo <= c + t <= pos and t < n.
          const int64_t hi = std::min<int64_t>(n, pos - c + 1);
          const int64_t lo =
              p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1 - c) : 0;
          masks[r] =
              hi <= lo ? 0 : static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
        }
        const int64_t row = h * head_rows + r0;
        float* q = sc.q.data() + row * D;
        float* acc = sc.acc.data() + row * D;
        float* m = sc.m.data() + row;
        float* l = sc.l.data() + row;
        switch (nr) {
          case 4: rows_chunk<NV, 4>(q, acc, m, l, kt, v, n, masks); break;
          case 3: rows_chunk<NV, 3>(q, acc, m, l, kt, v, n, masks); break;
          case 2: rows_chunk<NV, 2>(q, acc, m, l, kt, v, n, masks); break;
          default: rows_chunk<NV, 1>(q, acc, m, l, kt, v, n, masks); break;
        }
      }
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    store_outputs(p, item, item.head_begin + h, sc.acc.data() + h * head_rows * D,
                  sc.l.data() + h * head_rows);
  }
}
#endif  // __AVX512F__

template <typename T>
using ItemFn = void (*)(const Params<T>&, const Item&, Scratch&);

template <typename T>
ItemFn<T> pick_item_fn(int64_t head_size) {
#if defined(__AVX512F__)
  switch (head_size) {
    case 32: return attend_item_avx512<T, 2>;
    case 64: return attend_item_avx512<T, 4>;
    case 80: return attend_item_avx512<T, 5>;
    case 96: return attend_item_avx512<T, 6>;
    case 128: return attend_item_avx512<T, 8>;
    case 256: return attend_item_avx512<T, 16>;
    default: break;
  }
#endif
  return attend_item_generic<T>;
}

// ---------------------------------------------------------------------------------------

// Copy this step's K/V [T, KVH, D] into their slots of kv_cache [2, NB, BS, KVH, D].
template <typename T>
void write_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0);
  const int64_t row = key.size(1) * key.size(2);  // KVH * D, contiguous within a token
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  T* kc = kv_cache.data_ptr<T>();
  T* vc = kc + num_slots * row;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding
    std::memcpy(kc + slot * row, k + t * ks, row * sizeof(T));
    std::memcpy(vc + slot * row, v + t * vs, row * sizeof(T));
  }
}

template <typename T>
void attend(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
            const at::Tensor& block_table, const at::Tensor& seq_lens,
            const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
            int64_t q_tile) {
  Params<T> p;
  p.q = query.data_ptr<T>();
  p.out = out.data_ptr<T>();
  p.kc = kv_cache.data_ptr<T>();
  p.bt = block_table.data_ptr<int32_t>();
  p.lens = seq_lens.data_ptr<int32_t>();
  p.qsl = query_start_loc.data_ptr<int32_t>();
  p.qs0 = query.stride(0), p.qs1 = query.stride(1);
  p.os0 = out.stride(0), p.os1 = out.stride(1);
  p.bt_stride = block_table.stride(0);
  p.head_size = query.size(2);
  p.group = query.size(1) / kv_cache.size(3);
  p.block_size = kv_cache.size(2);
  p.tok_stride = kv_cache.size(3) * p.head_size;
  p.cache_half = kv_cache.size(1) * p.block_size * p.tok_stride;
  p.sliding_window = sliding_window;
  p.scale = static_cast<float>(scale);

  const int64_t num_reqs = seq_lens.size(0), num_kv_heads = kv_cache.size(3);
  int64_t num_tiles = 0;
  for (int64_t r = 0; r < num_reqs; ++r) num_tiles += (p.qsl[r + 1] - p.qsl[r] + q_tile - 1) / q_tile;
  // All KV heads of a tile in one item (contiguous cache reads) when there are enough
  // tiles to keep every thread busy; one head per item otherwise.
  const int64_t heads_per_item = num_tiles >= 4 * omp_get_max_threads() ? num_kv_heads : 1;
  std::vector<Item> items;
  items.reserve(num_tiles * (num_kv_heads / heads_per_item));
  for (int64_t r = 0; r < num_reqs; ++r) {
    for (int64_t t0 = p.qsl[r]; t0 < p.qsl[r + 1]; t0 += q_tile) {
      const int64_t t1 = std::min<int64_t>(t0 + q_tile, p.qsl[r + 1]);
      for (int64_t h = 0; h < num_kv_heads; h += heads_per_item)
        items.push_back({r, h, h + heads_per_item, t0, t1});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const ItemFn<T> fn = pick_item_fn<T>(p.head_size);
  const int64_t keys = std::max<int64_t>(16, p.block_size);
#pragma omp parallel if (num_items > 1)
  {
    Scratch scratch(q_tile * p.group * heads_per_item, p.head_size, keys);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_items; ++it) fn(p, items[it], scratch);
  }
}

void check_inputs(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                  const at::Tensor& query_start_loc) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [T, H, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_size must be contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, NB, BS, KVH, D] tensor");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "head_size mismatch");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "num_heads % num_kv_heads != 0");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table must be int32 with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1,
              "query_start_loc must be contiguous int32 [num_reqs + 1]");
}

void check_kv(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              "key/value must have the query's dtype");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "key/value heads must be contiguous within a token");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "slot_mapping must be contiguous int64 [T]");
}

// out [T, H, D] <- attention of query [T, H, D] over each request's paged context, after
// writing key/value [T, KVH, D] (when given) into kv_cache at slot_mapping.
void paged_attention(const at::Tensor& out, const at::Tensor& query,
                     const std::optional<at::Tensor>& key,
                     const std::optional<at::Tensor>& value, const at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t sliding_window, int64_t q_tile) {
  check_inputs(out, query, kv_cache, block_table, seq_lens, query_start_loc);
  TORCH_CHECK(q_tile >= 1, "q_tile must be >= 1");
  TORCH_CHECK(key.has_value() == value.has_value(), "key and value come together");
  if (key.has_value()) check_kv(query, *key, *value, slot_mapping);
  switch (query.scalar_type()) {
    case at::kFloat:
      if (key.has_value()) write_cache<float>(*key, *value, kv_cache, slot_mapping);
      return attend<float>(out, query, kv_cache, block_table, seq_lens, query_start_loc,
                           scale, sliding_window, q_tile);
    case at::kBFloat16:
      if (key.has_value()) write_cache<c10::BFloat16>(*key, *value, kv_cache, slot_mapping);
      return attend<c10::BFloat16>(out, query, kv_cache, block_table, seq_lens,
                                   query_start_loc, scale, sliding_window, q_tile);
    case at::kHalf:
      if (key.has_value()) write_cache<c10::Half>(*key, *value, kv_cache, slot_mapping);
      return attend<c10::Half>(out, query, kv_cache, block_table, seq_lens, query_start_loc,
                               scale, sliding_window, q_tile);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor? key, Tensor? value, "
      "Tensor(b!) kv_cache, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int sliding_window, int q_tile) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
