// Fused element-wise ops of the decoder layers for CPUs: each replaces a chain of small
// torch ops (one dispatch and one pass over memory instead of 5-15), which is most of
// the per-layer host overhead at small batches. Math is float32 whatever the storage
// dtype, in the same operation order as the torch code they replace
// (models/layers/norm.py, rotary.py, activation.py); the library is built with
// -ffp-contract=off so float32 results round like the unfused torch ops. Also the
// sampler's row ops: the argmax of greedy rows and the draw of sampled ones.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace pagedllm_ops {

using pagedllm_simd::exp_poly;
using pagedllm_simd::load_f;

// Rows processed per thread before parallelizing pays off.
constexpr int64_t kMinElemsPerThread = 32768;

// out [T, H] = x * rsqrt(mean(x^2) + eps) * (w + offset), in float32.
template <typename T, typename W>
void rms_norm_impl(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                   double eps, double offset) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const W* wp = weight.data_ptr<W>();
  const float feps = static_cast<float>(eps), foff = static_cast<float>(offset);
#pragma omp parallel for if (rows * hidden > kMinElemsPerThread)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = xp + r * xs;
    T* orow = op + r * os;
#if defined(__AVX512F__)
    using namespace pagedllm_simd;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
      const __m512 v = load16(xr + i, first_lanes(hidden - i));
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    const float ss = _mm512_reduce_add_ps(acc);
    const __m512 inv =
        _mm512_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(hidden) + feps));
    for (int64_t i = 0; i < hidden; i += 16) {
      const __mmask16 m = first_lanes(hidden - i);
      const __m512 w = _mm512_add_ps(load16(wp + i, m), _mm512_set1_ps(foff));
      store16(orow + i, _mm512_mul_ps(_mm512_mul_ps(load16(xr + i, m), inv), w), m);
    }
#else
    float ss = 0.0f;
    for (int64_t i = 0; i < hidden; ++i) {
      const float v = load_f(xr, i);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + feps);
    for (int64_t i = 0; i < hidden; ++i) {
      const float normed = load_f(xr, i) * inv;
      orow[i] = static_cast<T>(normed * (load_f(wp, i) + foff));
    }
#endif
  }
}

template <typename T>
void rms_norm_w(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                double eps, double offset) {
  switch (weight.scalar_type()) {
    case at::kFloat: return rms_norm_impl<T, float>(out, x, weight, eps, offset);
    case at::kBFloat16: return rms_norm_impl<T, c10::BFloat16>(out, x, weight, eps, offset);
    case at::kHalf: return rms_norm_impl<T, c10::Half>(out, x, weight, eps, offset);
    default: TORCH_CHECK(false, "rms_norm: unsupported weight dtype ", weight.scalar_type());
  }
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
              double eps, double offset) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes(), "rms_norm: x and out are [T, H]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "rms_norm: rows must be contiguous and weight [H]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "rms_norm: out must have x's dtype");
  switch (x.scalar_type()) {
    case at::kFloat: return rms_norm_w<float>(out, x, weight, eps, offset);
    case at::kBFloat16: return rms_norm_w<c10::BFloat16>(out, x, weight, eps, offset);
    case at::kHalf: return rms_norm_w<c10::Half>(out, x, weight, eps, offset);
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
}

// In place on x [T, heads * head_size] (rows strided): the first rotary_dim dims of each
// head rotate by the angle of the token's position. cos/sin: [max_pos, rotary_dim / 2].
// neox: pairs (i, i + rotary_dim / 2); otherwise adjacent pairs (2i, 2i + 1).
// The products round to T before the add, as the torch code computes in T.
template <typename T>
void rotate(const at::Tensor& x, const int64_t* pos, const T* cos, const T* sin,
            int64_t head_size, int64_t rotary_dim, bool neox) {
  const int64_t tokens = x.size(0), heads = x.size(1) / head_size, half = rotary_dim / 2;
  const int64_t xs = x.stride(0);
  T* xp = x.data_ptr<T>();
#pragma omp parallel for if (tokens * heads * rotary_dim > kMinElemsPerThread)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + pos[t] * half;
    const T* s = sin + pos[t] * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = xp + t * xs + h * head_size;
#if defined(__AVX512F__)
      if (neox) {
        using namespace pagedllm_simd;
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = first_lanes(half - i);
          const __m512 x1 = load16(v + i, m), x2 = load16(v + half + i, m);
          const __m512 ci = load16(c + i, m), si = load16(s + i, m);
          const __m512 p1 = round_to<T>(_mm512_mul_ps(x1, ci));
          const __m512 p2 = round_to<T>(_mm512_mul_ps(x2, si));
          const __m512 p3 = round_to<T>(_mm512_mul_ps(x2, ci));
          const __m512 p4 = round_to<T>(_mm512_mul_ps(x1, si));
          store16(v + i, _mm512_sub_ps(p1, p2), m);
          store16(v + half + i, _mm512_add_ps(p3, p4), m);
        }
        continue;
      }
#endif
      const int64_t step = neox ? 1 : 2, other = neox ? half : 1;
      for (int64_t i = 0; i < half; ++i) {
        T* a = v + i * step;
        T* b = a + other;
        const float x1 = static_cast<float>(*a), x2 = static_cast<float>(*b);
        const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
        // (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded to T.
        const float p1 = static_cast<float>(static_cast<T>(x1 * ci));
        const float p2 = static_cast<float>(static_cast<T>(x2 * si));
        const float p3 = static_cast<float>(static_cast<T>(x2 * ci));
        const float p4 = static_cast<float>(static_cast<T>(x1 * si));
        *a = static_cast<T>(p1 - p2);
        *b = static_cast<T>(p3 + p4);
      }
    }
  }
}

void rotary_embedding(const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t head_size, int64_t rotary_dim,
                      bool is_neox) {
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.stride(1) == 1 &&
                  key.stride(1) == 1,
              "rotary_embedding: query/key are [T, heads * head_size] with contiguous rows");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == query.size(0) && key.size(0) == query.size(0),
              "rotary_embedding: positions are int64 [T]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == rotary_dim / 2 &&
                  cos.scalar_type() == query.scalar_type() &&
                  sin.scalar_type() == query.scalar_type() &&
                  key.scalar_type() == query.scalar_type(),
              "rotary_embedding: cos/sin [max_pos, rotary_dim / 2] in the query's dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  switch (query.scalar_type()) {
#define PAGEDLLM_ROTATE(T)                                                                  \
  rotate<T>(query, pos, cos.data_ptr<T>(), sin.data_ptr<T>(), head_size, rotary_dim, is_neox); \
  rotate<T>(key, pos, cos.data_ptr<T>(), sin.data_ptr<T>(), head_size, rotary_dim, is_neox);   \
  return;
    case at::kFloat: PAGEDLLM_ROTATE(float)
    case at::kBFloat16: PAGEDLLM_ROTATE(c10::BFloat16)
    case at::kHalf: PAGEDLLM_ROTATE(c10::Half)
#undef PAGEDLLM_ROTATE
    default: TORCH_CHECK(false, "rotary_embedding: unsupported dtype ", query.scalar_type());
  }
}

// out [T, d] = silu(x[:, :d]) * x[:, d:], silu rounded to T before the product (as torch).
template <typename T>
void silu_and_mul_impl(const at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  const int64_t xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for if (rows * d > kMinElemsPerThread)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = xp + r * xs;
    const T* up = gate + d;
    T* o = op + r * os;
#if defined(__AVX512F__)
    using namespace pagedllm_simd;
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = first_lanes(d - i);
      const __m512 g = load16(gate + i, m);
      const __m512 e = std::is_same_v<T, c10::BFloat16>
                           ? exp2_16(_mm512_mul_ps(g, _mm512_set1_ps(-1.44269504088896341f)))
                           : exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = round_to<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      store16(o + i, _mm512_mul_ps(silu, load16(up + i, m)), m);
    }
#else
    int64_t i = 0;
#if defined(PAGEDLLM_SIMD_AVX2)
    // exp16's arithmetic 8 lanes at a time: float32 results have the AVX-512 path's bits.
    // Measured (PAGEDLLM_CPU_ISA=avx2 build, Zen 4): 10.9% of a 128-token first token
    // with the scalar loop, ~1% now.
    using namespace pagedllm_simd;
    auto silu_mul8 = [](const T* g8, const T* u8, T* o8) {
      const __m256 g = load8(g8);
      const __m256 e = std::is_same_v<T, c10::BFloat16>
                           ? exp2_8(_mm256_mul_ps(g, _mm256_set1_ps(-1.44269504088896341f)))
                           : exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
      const __m256 silu = round_to8<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
      store8(o8, _mm256_mul_ps(silu, load8(u8)));
    };
    for (; i + 8 <= d; i += 8) silu_mul8(gate + i, up + i, o + i);
    if (i < d) {  // the tail through 8-lane buffers: the same arithmetic
      T g8[8] = {}, u8[8] = {}, o8[8];
      std::copy(gate + i, gate + d, g8);
      std::copy(up + i, up + d, u8);
      silu_mul8(g8, u8, o8);
      std::copy(o8, o8 + (d - i), o + i);
      i = d;
    }
#endif
    for (; i < d; ++i) {
      const float g = load_f(gate, i);
      const float silu = static_cast<float>(static_cast<T>(g / (1.0f + exp_poly(-g))));
      o[i] = static_cast<T>(silu * load_f(up, i));
    }
#endif
  }
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) &&
                  x.size(1) == 2 * out.size(1) && x.stride(1) == 1 && out.stride(1) == 1,
              "silu_and_mul: x [T, 2d] -> out [T, d] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "silu_and_mul: out must have x's dtype");
  switch (x.scalar_type()) {
    case at::kFloat: return silu_and_mul_impl<float>(out, x);
    case at::kBFloat16: return silu_and_mul_impl<c10::BFloat16>(out, x);
    case at::kHalf: return silu_and_mul_impl<c10::Half>(out, x);
    default: TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", x.scalar_type());
  }
}

// out [N] int64 = index of the first maximum of each row of x [N, V] (torch.argmax's
// semantics: NaN counts as the maximum). Greedy sampling over the logits: torch's argmax is
// slow on bfloat16 (~6 ms for 64 x 49k), and converting to float32 first writes a second
// copy; this reads the logits once.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
#if defined(__AVX512F__)
  using namespace pagedllm_simd;
  // Vector pass for the row maximum (or a NaN), then the first index holding it; rows
  // with a NaN take the scalar loop below.
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    const __m512 v = _mm512_mask_mov_ps(mx, m, load16(x + j, m));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  if (nan == 0) {
    const __m512 target = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = first_lanes(n - j);
      const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, load16(x + j, m), target, _CMP_EQ_OQ);
      if (hit != 0) return j + __builtin_ctz(hit);
    }
  }
#endif
  int64_t best = 0;
  float best_v = load_f(x, 0);
  if (std::isnan(best_v)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = load_f(x, i);
    if (std::isnan(v)) return i;
    if (v > best_v) best_v = v, best = i;
  }
  return best;
}

template <typename T>
void argmax_impl(const at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
#pragma omp parallel for if (rows * n > 4 * kMinElemsPerThread)
  for (int64_t r = 0; r < rows; ++r) op[r] = argmax_row(xp + r * xs, n);
}

void argmax(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax: x is [N, V] with contiguous rows");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == x.size(0) && out.is_contiguous() &&
                  out.scalar_type() == at::kLong,
              "argmax: out is a contiguous int64 [N]");
  switch (x.scalar_type()) {
    case at::kFloat: return argmax_impl<float>(out, x);
    case at::kBFloat16: return argmax_impl<c10::BFloat16>(out, x);
    case at::kHalf: return argmax_impl<c10::Half>(out, x);
    default: TORCH_CHECK(false, "argmax: unsupported dtype ", x.scalar_type());
  }
}

// ---- sampling: one draw per row from softmax(x / t), by its inverse CDF (sample/ops.py's
// draw_tempered and inverse_cdf_draw, which this replaces on CPU), optionally within the
// row's top-p nucleus. torch spent ~9 ms of a 64-row step over a 49k vocabulary on the
// plain draw in five passes, each writing a [64, V] tensor (float32 copy, division,
// softmax, block sums, the chosen block's cumulative sums), and up to ~100 ms on top-p,
// whose nucleus was found by sorting the rows; this keeps a row's probabilities in a
// buffer of its thread and writes nothing but the token.

constexpr int64_t kDrawBlock = 256;  // sample/ops.py's DRAW_BLOCK

// p[0, n) = exp(x / t - m) over one block (n <= kDrawBlock), zero-padded to a multiple of
// 8; 0 where x / t - m < -87, a masked -inf included (the polynomial would give ~1e-38:
// a masked token must never be drawn), and for NaN. The 8-lane exp has exp16's bits, so
// AVX-512 and AVX2 machines draw alike.
template <typename T>
void draw_block_probs(const T* x, int64_t n, float t, float m, float* p) {
  int64_t i = 0;
#if defined(PAGEDLLM_SIMD_AVX2)
  using namespace pagedllm_simd;
  auto probs8 = [t, m](const T* x8, float* p8) {
    const __m256 y = _mm256_sub_ps(_mm256_div_ps(load8(x8), _mm256_set1_ps(t)),
                                   _mm256_set1_ps(m));
    const __m256 keep = _mm256_cmp_ps(y, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    _mm256_storeu_ps(p8, _mm256_and_ps(exp8(y), keep));
  };
  for (; i + 8 <= n; i += 8) probs8(x + i, p + i);
  if (i < n) {  // the tail through an 8-lane buffer padded with -inf: the same arithmetic
    T x8[8];
    std::fill(x8, x8 + 8, static_cast<T>(-INFINITY));
    std::copy(x + i, x + n, x8);
    probs8(x8, p + i);
    return;
  }
#endif
  for (; i < n; ++i) {
    const float y = load_f(x, i) / t - m;
    p[i] = y >= -87.0f ? exp_poly(y) : 0.0f;
  }
  for (; i % 8 != 0; ++i) p[i] = 0.0f;
}

// The float64 sum of p[0, n) (n a multiple of 8): eight lanes, then a fixed tree.
inline double draw_block_sum(const float* p, int64_t n) {
  double acc[8] = {};
  for (int64_t i = 0; i < n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += p[i + l];
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// A thread's buffers, reused from row to row.
struct DrawScratch {
  std::vector<float> p;            // the row's probabilities, zero-padded to 8
  std::vector<double> block_sums;  // of kDrawBlock tokens each
  std::vector<double> mass;        // top-p: of each probability bucket
  std::vector<std::pair<float, int64_t>> edge;  // top-p: the nucleus's last bucket

  explicit DrawScratch(int64_t n)
      : p((n + 7) / 8 * 8), block_sums((n + kDrawBlock - 1) / kDrawBlock) {}
};

// p = exp(x / t - m) of the whole row, m = max(x) / t; false when m is not finite (a
// NaN or all -inf row, or x / t overflowing).
template <typename T>
bool row_probs(const T* x, int64_t n, float t, int64_t top, DrawScratch& s) {
  const float m = load_f(x, top) / t;
  if (!std::isfinite(m)) return false;
  for (int64_t b = 0; b < n; b += kDrawBlock) {
    draw_block_probs(x + b, std::min(kDrawBlock, n - b), t, m, s.p.data() + b);
  }
  return true;
}

// The token of s.p[0, n) whose interval of the cumulative distribution holds u * total:
// the block of kDrawBlock tokens first (float64 block sums), then the token within it
// (its float64 cumulative sums; a target past them, by a last-bit difference from the
// block's sum, takes the block's last token of nonzero probability); -1 when the total
// is not positive and finite.
inline int64_t pick_token(int64_t n, double u, DrawScratch& s) {
  const int64_t num_blocks = (n + kDrawBlock - 1) / kDrawBlock;
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t len = std::min(kDrawBlock, n - b * kDrawBlock);
    s.block_sums[b] = draw_block_sum(s.p.data() + b * kDrawBlock, (len + 7) / 8 * 8);
    total += s.block_sums[b];
  }
  if (!(total > 0.0) || !std::isfinite(total)) return -1;
  const double target = u * total;
  // The block b with cum[b - 1] <= target < cum[b] (cum: the running sums, as a
  // float64 cumsum), else the last with mass.
  double before = 0.0, cum = 0.0, last_before = 0.0;
  int64_t chosen = -1, last = -1;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const double next = cum + s.block_sums[b];
    if (s.block_sums[b] > 0.0) last = b, last_before = cum;
    if (next > target) {
      chosen = b, before = cum;
      break;
    }
    cum = next;
  }
  if (chosen < 0) chosen = last, before = last_before;
  const int64_t base = chosen * kDrawBlock;
  const int64_t len = std::min(kDrawBlock, n - base);
  const float* p = s.p.data() + base;
  const double inner_target = target - before;
  double inner = 0.0;
  int64_t last_nonzero = 0;
  for (int64_t j = 0; j < len; ++j) {
    inner += p[j];
    if (p[j] > 0.0f) last_nonzero = j;
    if (inner > inner_target) return base + j;
  }
  return base + last_nonzero;
}

// A probability's bucket for top-p: its float32 bits' exponent and 5 leading mantissa
// bits (buckets 1/32 of an octave wide, ordered as the probabilities; p <= 1).
constexpr int kBucketShift = 18;
constexpr int64_t kNumBuckets = (0x3F800000 >> kBucketShift) + 1;

inline int64_t prob_bucket(float p) {
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  return bits >> kBucketShift;
}

// Zero the probabilities outside the top-p nucleus of s.p[0, n): the most likely tokens
// while the mass before each (in descending order, ties by id) is below top_p * total.
// Without sorting the row: the buckets' masses, walked from the most likely, find the
// bucket where the nucleus ends; only that bucket's tokens are sorted.
inline void keep_nucleus(int64_t n, float top_p, DrawScratch& s) {
  float* p = s.p.data();
  s.mass.assign(kNumBuckets, 0.0);
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) s.mass[prob_bucket(p[i])] += p[i];
  for (int64_t b = 0; b < kNumBuckets; ++b) total += s.mass[b];
  const double threshold = static_cast<double>(top_p) * total;
  double above = 0.0;  // the mass of the buckets above the edge: all kept
  int64_t edge = -1;
  for (int64_t b = kNumBuckets - 1; b >= 0; --b) {
    if (s.mass[b] == 0.0) continue;
    if (above + s.mass[b] < threshold) {
      above += s.mass[b];
      continue;
    }
    edge = b;
    break;
  }
  if (edge < 0) return;  // rounding: the whole row is the nucleus
  // One pass: tokens below the edge bucket go, the edge's are collected.
  s.edge.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = prob_bucket(p[i]);
    if (b < edge) {
      p[i] = 0.0f;
    } else if (b == edge) {
      s.edge.emplace_back(p[i], i);
    }
  }
  std::sort(s.edge.begin(), s.edge.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  // above < threshold (else the walk had stopped a bucket earlier), so the edge's first
  // token stays.
  double before = above;
  size_t kept = 0;
  while (kept < s.edge.size() && before < threshold) before += s.edge[kept++].first;
  kept = std::max<size_t>(kept, 1);  // top_p 0: the edge is the top bucket, its first stays
  for (size_t j = kept; j < s.edge.size(); ++j) p[s.edge[j].second] = 0.0f;
}

// One row: its argmax when its probabilities cannot be formed (NaN, all -inf, overflow).
template <typename T>
int64_t draw_row(const T* x, int64_t n, float t, float top_p, double u, DrawScratch& s) {
  const int64_t top = argmax_row(x, n);
  if (!row_probs(x, n, t, top, s)) return top;
  if (top_p < 1.0f) keep_nucleus(n, top_p, s);
  const int64_t token = pick_token(n, u, s);
  return token < 0 ? top : token;
}

template <typename T>
void sample_draw_impl(const at::Tensor& out, const at::Tensor& x,
                      const at::Tensor& temperature, const float* top_p,
                      const at::Tensor& u) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const float* tp = temperature.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
#pragma omp parallel if (rows * n > 4 * kMinElemsPerThread)
  {
    DrawScratch scratch(n);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      op[r] = draw_row(xp + r * xs, n, tp[r], top_p ? top_p[r] : 1.0f, up[r], scratch);
    }
  }
}

void sample_draw(const at::Tensor& out, const at::Tensor& x, const at::Tensor& temperature,
                 const std::optional<at::Tensor>& top_p, const at::Tensor& u) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "sample_draw: x is [N, V] with contiguous rows");
  const int64_t rows = x.size(0);
  TORCH_CHECK(out.dim() == 1 && out.size(0) == rows && out.is_contiguous() &&
                  out.scalar_type() == at::kLong,
              "sample_draw: out is a contiguous int64 [N]");
  for (const at::Tensor* f : {&temperature, top_p ? &*top_p : &temperature}) {
    TORCH_CHECK(f->dim() == 1 && f->size(0) == rows && f->is_contiguous() &&
                    f->scalar_type() == at::kFloat,
                "sample_draw: temperature and top_p are contiguous float32 [N]");
  }
  TORCH_CHECK(u.dim() == 1 && u.size(0) == rows && u.is_contiguous() &&
                  u.scalar_type() == at::kDouble,
              "sample_draw: u is a contiguous float64 [N]");
  const float* tp = top_p ? top_p->data_ptr<float>() : nullptr;
  switch (x.scalar_type()) {
    case at::kFloat: return sample_draw_impl<float>(out, x, temperature, tp, u);
    case at::kBFloat16: return sample_draw_impl<c10::BFloat16>(out, x, temperature, tp, u);
    case at::kHalf: return sample_draw_impl<c10::Half>(out, x, temperature, tp, u);
    default: TORCH_CHECK(false, "sample_draw: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, float offset) -> ()");
  m.def(
      "rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor positions, Tensor cos, "
      "Tensor sin, int head_size, int rotary_dim, bool is_neox) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("argmax(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "sample_draw(Tensor(a!) out, Tensor x, Tensor temperature, Tensor? top_p, Tensor u) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("rms_norm", &pagedllm_ops::rms_norm);
  m.impl("rotary_embedding", &pagedllm_ops::rotary_embedding);
  m.impl("silu_and_mul", &pagedllm_ops::silu_and_mul);
  m.impl("argmax", &pagedllm_ops::argmax);
  m.impl("sample_draw", &pagedllm_ops::sample_draw);
}
