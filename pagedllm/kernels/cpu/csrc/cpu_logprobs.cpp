// Logprobs on CPU: for each row of logits, the log-softmax at a chosen token and its
// rank, and the top-k tokens with theirs (sample/logprobs.py, score_logprobs, which calls
// this where it can: the sampler's logprobs and prompt logprobs). torch took ~300 us a row
// of a 49k vocabulary (a float32 copy, the log-softmax written whole, a boolean [N, V]
// comparison summed for the rank, topk): a 7,000-token prompt's logprobs cost 2.8 s of
// engine steps, more than a third of its prefill. Here a row is read three times and
// nothing but the k + 1 entries is written.
//
// Per row: m = max(x); s = sum(exp(x - m)) (float32 lanes over blocks of 256, each
// block's sum added in float64); logprob(v) = (v - m) - log(s), in float32, as
// torch.log_softmax forms it. rank(v) = 1 + the number of tokens whose logprob is
// strictly larger (ties share a rank). The top-k are the k largest x, ties by smaller
// id, most likely first. The 8-lane exp has exp16's bits, so AVX-512 and AVX2 machines
// score alike. Rows with a NaN or no finite maximum are left to torch (`ok` false).

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace pagedllm_ops {
namespace {

using pagedllm_simd::load_f;

constexpr int64_t kSumBlock = 256;
constexpr float kInf = std::numeric_limits<float>::infinity();

// A top-k candidate.
struct Entry {
  float x;
  int64_t id;
};

// The k largest values seen so far, most likely first (ties: the earlier id first, as
// ids arrive in increasing order and an equal value is placed after).
struct TopK {
  int64_t k;
  std::vector<Entry> e;
  float threshold = -kInf;  // the k-th value once there are k: only larger ones enter

  explicit TopK(int64_t k_) : k(k_) { e.reserve(k_ + 1); }

  void reset() {
    e.clear();
    threshold = -kInf;
  }

  bool full() const { return static_cast<int64_t>(e.size()) == k; }

  void offer(float v, int64_t id) {
    if (full() && !(v > threshold)) return;
    auto at = std::upper_bound(e.begin(), e.end(), v,
                               [](float a, const Entry& b) { return a > b.x; });
    e.insert(at, Entry{v, id});
    if (static_cast<int64_t>(e.size()) > k) e.pop_back();
    if (full()) threshold = e.back().x;
  }
};

// max(x[0, n)); false when a NaN is among them.
template <typename T>
bool row_max(const T* x, int64_t n, float& m) {
  m = -kInf;
  int64_t i = 0;
#if defined(PAGEDLLM_SIMD_AVX2)
  using namespace pagedllm_simd;
  __m256 mx = _mm256_set1_ps(-kInf);
  int nan = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  if (nan) return false;
  m = hmax8(mx);
#endif
  for (; i < n; ++i) {
    const float v = load_f(x, i);
    if (std::isnan(v)) return false;
    m = std::max(m, v);
  }
  return true;
}

// sum(exp(x - m)) over x[0, n), offering every value to `top` on the way.
template <typename T>
double row_sum_exp(const T* x, int64_t n, float m, TopK& top) {
  double s = 0.0;
  for (int64_t b = 0; b < n; b += kSumBlock) {
    const int64_t len = std::min(kSumBlock, n - b);
    const T* xb = x + b;
#if defined(PAGEDLLM_SIMD_AVX2)
    using namespace pagedllm_simd;
    const __m256 vm = _mm256_set1_ps(m), floor = _mm256_set1_ps(-87.0f);
    __m256 acc = _mm256_setzero_ps();
    auto lanes8 = [&](const T* x8, int64_t base) {
      const __m256 v = load8(x8);
      const __m256 y = _mm256_sub_ps(v, vm);
      // Below -87 (a masked -inf too) exp is 0, not exp8's clamped ~1e-38.
      acc = _mm256_add_ps(acc, _mm256_and_ps(exp8(y), _mm256_cmp_ps(y, floor, _CMP_GE_OQ)));
      if (top.k == 0) return;
      int hits = top.full() ? _mm256_movemask_ps(_mm256_cmp_ps(
                                  v, _mm256_set1_ps(top.threshold), _CMP_GT_OQ))
                            : 0xff;
      while (hits) {
        const int l = __builtin_ctz(hits);
        hits &= hits - 1;
        if (base + l < n) top.offer(load_f(x8, l), base + l);
      }
    };
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) lanes8(xb + i, b + i);
    if (i < len) {  // the tail through an 8-lane buffer padded with -inf
      T x8[8];
      std::fill(x8, x8 + 8, static_cast<T>(-kInf));
      std::copy(xb + i, xb + len, x8);
      lanes8(x8, b + i);
    }
    s += static_cast<double>(hsum8(acc));
#else
    float acc = 0.0f;
    for (int64_t i = 0; i < len; ++i) {
      const float v = load_f(xb, i), y = v - m;
      acc += y >= -87.0f ? pagedllm_simd::exp_poly(y) : 0.0f;
      if (top.k > 0) top.offer(v, b + i);
    }
    s += static_cast<double>(acc);
#endif
  }
  return s;
}

// The number of x[0, n) whose logprob (v - m) - ls is larger than `lp`.
template <typename T>
int64_t count_above(const T* x, int64_t n, float m, float ls, float lp) {
  int64_t count = 0, i = 0;
#if defined(PAGEDLLM_SIMD_AVX2)
  using namespace pagedllm_simd;
  const __m256 vm = _mm256_set1_ps(m), vls = _mm256_set1_ps(ls), vlp = _mm256_set1_ps(lp);
  for (; i + 8 <= n; i += 8) {
    const __m256 l = _mm256_sub_ps(_mm256_sub_ps(load8(x + i), vm), vls);
    count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(l, vlp, _CMP_GT_OQ)));
  }
#endif
  for (; i < n; ++i) count += ((load_f(x, i) - m) - ls) > lp;
  return count;
}

// One row into lp / ids / ranks [k + 1] (column 0: the target); false: left to torch.
template <typename T>
bool score_row(const T* x, int64_t n, int64_t target, TopK& top, float* lp, int64_t* ids,
               int64_t* ranks) {
  float m;
  if (!row_max(x, n, m) || !std::isfinite(m)) return false;
  top.reset();
  const float ls = static_cast<float>(std::log(row_sum_exp(x, n, m, top)));
  const float chosen = (load_f(x, target) - m) - ls;
  lp[0] = chosen;
  ids[0] = target;
  ranks[0] = 1 + count_above(x, n, m, ls, chosen);
  // Every token more likely than a top-k token is itself in the top-k: a rank there is
  // one more than the entries before its first equal.
  int64_t first_equal = 0;
  for (int64_t j = 0; j < static_cast<int64_t>(top.e.size()); ++j) {
    const float v = (top.e[j].x - m) - ls;
    if (j > 0 && v != lp[j]) first_equal = j;
    lp[j + 1] = v;
    ids[j + 1] = top.e[j].id;
    ranks[j + 1] = 1 + first_equal;
  }
  return true;
}

template <typename T>
void score_rows_impl(const at::Tensor& lp, const at::Tensor& ids, const at::Tensor& ranks,
                     const at::Tensor& ok, const at::Tensor& x, const at::Tensor& targets,
                     int64_t k) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), w = k + 1;
  const T* xp = x.data_ptr<T>();
  const int64_t* tp = targets.data_ptr<int64_t>();
  float* lpp = lp.data_ptr<float>();
  int64_t* idp = ids.data_ptr<int64_t>();
  int64_t* rp = ranks.data_ptr<int64_t>();
  bool* okp = ok.data_ptr<bool>();
#pragma omp parallel if (rows * n > 65536)
  {
    TopK top(k);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      okp[r] = score_row(xp + r * xs, n, tp[r], top, lpp + r * w, idp + r * w, rp + r * w);
    }
  }
}

}  // namespace

void score_rows(const at::Tensor& lp, const at::Tensor& ids, const at::Tensor& ranks,
                const at::Tensor& ok, const at::Tensor& x, const at::Tensor& targets,
                int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "score_rows: x is [N, V] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 0 && k <= n, "score_rows: k must be in [0, V]");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == rows && targets.is_contiguous() &&
                  targets.scalar_type() == at::kLong,
              "score_rows: targets is a contiguous int64 [N]");
  const int64_t* tp = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(tp[r] >= 0 && tp[r] < n, "score_rows: a target is out of the vocabulary");
  }
  for (const auto& [t, dtype] : {std::pair{&lp, at::kFloat}, std::pair{&ids, at::kLong},
                                 std::pair{&ranks, at::kLong}}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == k + 1 &&
                    t->is_contiguous() && t->scalar_type() == dtype,
                "score_rows: lp, ids and ranks are contiguous [N, k + 1] float32 / int64");
  }
  TORCH_CHECK(ok.dim() == 1 && ok.size(0) == rows && ok.is_contiguous() &&
                  ok.scalar_type() == at::kBool,
              "score_rows: ok is a contiguous bool [N]");
  switch (x.scalar_type()) {
    case at::kFloat: return score_rows_impl<float>(lp, ids, ranks, ok, x, targets, k);
    case at::kBFloat16:
      return score_rows_impl<c10::BFloat16>(lp, ids, ranks, ok, x, targets, k);
    case at::kHalf: return score_rows_impl<c10::Half>(lp, ids, ranks, ok, x, targets, k);
    default: TORCH_CHECK(false, "score_rows: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "score_rows(Tensor(a!) lp, Tensor(b!) ids, Tensor(c!) ranks, Tensor(d!) ok, Tensor x, "
      "Tensor targets, int k) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("score_rows", &pagedllm_ops::score_rows); }
