// LoRA on a linear's output, row by row: out[i] = round(out[i] + (x[i] A^T) B^T) for the
// rows i of an adapter (lora/layers.py; the native decoder stack calls it per linear).
//
// A^T [K, R] and B^T [R, N] are float32 (B with the adapter's scale folded in). For a
// row, t = x A^T is computed as kParts partial sums over fixed quarters of K (each one
// fused multiply-add chain in K order from 0), added in part order; d = t B^T is one
// chain per output in R order; d is added to the output in float32 and rounded once to
// its dtype. Nothing in that depends on the number of rows or threads, so a row's result
// is the same whatever shares the step (DESIGN.md section 10), and the AVX-512 and
// portable loops below give the same bits (lanes are outputs; no chain is reordered).
//
// A decode step's adapter weights come from memory, not cache (the step has just
// streamed the base weights through it): few rows are split across the threads inside
// the row (the K parts, then the output columns); more rows go to the threads in tiles
// of kTile rows that share each weight load (AVX-512), the rest one by one.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace pagedllm_ops {
namespace {

constexpr int64_t kParts = 4;     // partial sums over K of x A^T
constexpr int64_t kColumns = 64;  // output columns per unit of work (4 vectors)
// Rows from which threads take whole rows (fewer: threads split each row).
constexpr int64_t kRowsPerThread = 4;

// t[j] for j < r = sum over i in [i0, i1) of x[i] * a_t[i r + j]: one chain per j from 0.
template <typename T>
void shrink_part(const T* x, const float* a_t, int64_t r, int64_t i0, int64_t i1, float* t) {
#if defined(__AVX512F__)
  using namespace pagedllm_simd;
  for (int64_t j0 = 0; j0 < r; j0 += kColumns) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    __mmask16 mask[4];
    for (int b = 0; b < 4; ++b) mask[b] = first_lanes(std::max<int64_t>(r - j0 - 16 * b, 0));
    for (int64_t i = i0; i < i1; ++i) {
      const __m512 xi = _mm512_set1_ps(static_cast<float>(x[i]));
      const float* row = a_t + i * r + j0;
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b)
        if (mask[b]) acc[b] = _mm512_fmadd_ps(xi, _mm512_maskz_loadu_ps(mask[b], row + 16 * b),
                                              acc[b]);
    }
    for (int b = 0; b < 4; ++b) _mm512_mask_storeu_ps(t + j0 + 16 * b, mask[b], acc[b]);
  }
#else
  std::fill(t, t + r, 0.0f);
  for (int64_t i = i0; i < i1; ++i) {
    const float xi = static_cast<float>(x[i]);
    for (int64_t j = 0; j < r; ++j) t[j] = std::fma(xi, a_t[i * r + j], t[j]);
  }
#endif
}

// out[c] for c in [c0, c1) = round(out[c] + sum over j < r of t[j] * b_t[j n + c]).
template <typename T>
void expand_columns(T* out, const float* t, const float* b_t, int64_t r, int64_t n,
                    int64_t c0, int64_t c1) {
#if defined(__AVX512F__)
  using namespace pagedllm_simd;
  for (int64_t c = c0; c < c1; c += kColumns) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    __mmask16 mask[4];
    for (int b = 0; b < 4; ++b) mask[b] = first_lanes(std::max<int64_t>(c1 - c - 16 * b, 0));
    for (int64_t j = 0; j < r; ++j) {
      const __m512 tj = _mm512_set1_ps(t[j]);
      const float* row = b_t + j * n + c;
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b)
        if (mask[b]) acc[b] = _mm512_fmadd_ps(tj, _mm512_maskz_loadu_ps(mask[b], row + 16 * b),
                                              acc[b]);
    }
    for (int b = 0; b < 4; ++b)
      if (mask[b])
        store16(out + c + 16 * b, _mm512_add_ps(load16(out + c + 16 * b, mask[b]), acc[b]),
                mask[b]);
  }
#else
  for (int64_t c = c0; c < c1; ++c) {
    float acc = 0.0f;
    for (int64_t j = 0; j < r; ++j) acc = std::fma(t[j], b_t[j * n + c], acc);
    out[c] = static_cast<T>(static_cast<float>(out[c]) + acc);
  }
#endif
}

// Rows that share each weight load when a thread takes whole rows (AVX-512).
constexpr int kTile = 4;

#if defined(__AVX512F__)
// shrink_part and expand_columns for kTile rows at once (t rows `ts` apart): each
// weight vector loaded once serves every row of the tile; every output's chain is the
// one the single-row functions compute (same order, same start), so the bits do not
// depend on the tiling.
template <typename T>
void shrink_part_tile(const T* const* x, const float* a_t, int64_t r, int64_t i0, int64_t i1,
                      float* t, int64_t ts) {
  using namespace pagedllm_simd;
  for (int64_t j0 = 0; j0 < r; j0 += 32) {
    __m512 acc[kTile][2];
    for (int q = 0; q < kTile; ++q) acc[q][0] = acc[q][1] = _mm512_setzero_ps();
    const __mmask16 m0 = first_lanes(std::max<int64_t>(r - j0, 0));
    const __mmask16 m1 = first_lanes(std::max<int64_t>(r - j0 - 16, 0));
    for (int64_t i = i0; i < i1; ++i) {
      const float* row = a_t + i * r + j0;
      const __m512 w0 = _mm512_maskz_loadu_ps(m0, row);
      const __m512 w1 = _mm512_maskz_loadu_ps(m1, row + 16);
#pragma GCC unroll 4
      for (int q = 0; q < kTile; ++q) {
        const __m512 xq = _mm512_set1_ps(static_cast<float>(x[q][i]));
        acc[q][0] = _mm512_fmadd_ps(xq, w0, acc[q][0]);
        if (m1) acc[q][1] = _mm512_fmadd_ps(xq, w1, acc[q][1]);
      }
    }
    for (int q = 0; q < kTile; ++q) {
      _mm512_mask_storeu_ps(t + q * ts + j0, m0, acc[q][0]);
      _mm512_mask_storeu_ps(t + q * ts + j0 + 16, m1, acc[q][1]);
    }
  }
}

template <typename T>
void expand_columns_tile(T* const* out, const float* t, int64_t ts, const float* b_t,
                         int64_t r, int64_t n) {
  using namespace pagedllm_simd;
  for (int64_t c = 0; c < n; c += 32) {
    __m512 acc[kTile][2];
    for (int q = 0; q < kTile; ++q) acc[q][0] = acc[q][1] = _mm512_setzero_ps();
    const __mmask16 m0 = first_lanes(std::max<int64_t>(n - c, 0));
    const __mmask16 m1 = first_lanes(std::max<int64_t>(n - c - 16, 0));
    for (int64_t j = 0; j < r; ++j) {
      const float* row = b_t + j * n + c;
      const __m512 w0 = _mm512_maskz_loadu_ps(m0, row);
      const __m512 w1 = _mm512_maskz_loadu_ps(m1, row + 16);
#pragma GCC unroll 4
      for (int q = 0; q < kTile; ++q) {
        const __m512 tq = _mm512_set1_ps(t[q * ts + j]);
        acc[q][0] = _mm512_fmadd_ps(tq, w0, acc[q][0]);
        if (m1) acc[q][1] = _mm512_fmadd_ps(tq, w1, acc[q][1]);
      }
    }
    for (int q = 0; q < kTile; ++q) {
      T* o = out[q] + c;
      store16(o, _mm512_add_ps(load16(o, m0), acc[q][0]), m0);
      if (m1) store16(o + 16, _mm512_add_ps(load16(o + 16, m1), acc[q][1]), m1);
    }
  }
}
#endif

// t = the parts' sums added in part order.
void sum_parts(const float* parts, int64_t r, float* t) {
  for (int64_t j = 0; j < r; ++j) {
    float s = parts[j];
    for (int64_t p = 1; p < kParts; ++p) s += parts[p * r + j];
    t[j] = s;
  }
}

template <typename T>
void lora_apply_impl(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a_t,
                     const at::Tensor& b_t, const int64_t* rows, int64_t num_rows) {
  const int64_t k = a_t.size(0), r = a_t.size(1), n = b_t.size(1);
  const int64_t xs = x.stride(0), os = out.stride(0);
  T* op = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const float* ap = a_t.data_ptr<float>();
  const float* bp = b_t.data_ptr<float>();
  auto part = [&](int64_t p) { return std::make_pair(k * p / kParts, k * (p + 1) / kParts); };
  std::vector<float> parts(kParts * r), t(r);
  auto row_of = [&](int64_t i) { return rows != nullptr ? rows[i] : i; };
  if (num_rows >= kRowsPerThread * omp_get_max_threads()) {
#if defined(__AVX512F__)
    const int64_t tiles = num_rows / kTile;
#else
    const int64_t tiles = 0;
#endif
#pragma omp parallel
    {
      std::vector<float> my_parts(kParts * r * kTile), my_t(r * kTile);
#if defined(__AVX512F__)
      // Whole tiles of kTile rows, then the rows left one by one.
#pragma omp for
      for (int64_t g = 0; g < tiles; ++g) {
        const T* x4[kTile];
        T* o4[kTile];
        for (int q = 0; q < kTile; ++q) {
          x4[q] = xp + row_of(g * kTile + q) * xs;
          o4[q] = op + row_of(g * kTile + q) * os;
        }
        for (int64_t p = 0; p < kParts; ++p) {
          const auto [i0, i1] = part(p);
          shrink_part_tile(x4, ap, r, i0, i1, my_parts.data() + p * r * kTile, r);
        }
        for (int q = 0; q < kTile; ++q) {
          // Row q's parts, in part order, as sum_parts adds them.
          for (int64_t j = 0; j < r; ++j) {
            float sum = my_parts[q * r + j];
            for (int64_t p = 1; p < kParts; ++p) sum += my_parts[(p * kTile + q) * r + j];
            my_t[q * r + j] = sum;
          }
        }
        expand_columns_tile(o4, my_t.data(), r, bp, r, n);
      }
#endif
#pragma omp for
      for (int64_t i = tiles * kTile; i < num_rows; ++i) {
        const int64_t row = row_of(i);
        for (int64_t p = 0; p < kParts; ++p) {
          const auto [i0, i1] = part(p);
          shrink_part(xp + row * xs, ap, r, i0, i1, my_parts.data() + p * r);
        }
        sum_parts(my_parts.data(), r, my_t.data());
        expand_columns(op + row * os, my_t.data(), bp, r, n, 0, n);
      }
    }
    return;
  }
  const int64_t units = (n + kColumns - 1) / kColumns;
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t row = rows != nullptr ? rows[i] : i;
#pragma omp parallel
    {
#pragma omp for
      for (int64_t p = 0; p < kParts; ++p) {
        const auto [i0, i1] = part(p);
        shrink_part(xp + row * xs, ap, r, i0, i1, parts.data() + p * r);
      }
#pragma omp single
      sum_parts(parts.data(), r, t.data());
#pragma omp for
      for (int64_t u = 0; u < units; ++u)
        expand_columns(op + row * os, t.data(), bp, r, n, u * kColumns,
                       std::min(n, (u + 1) * kColumns));
    }
  }
}

}  // namespace

void lora_apply(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a_t,
                const at::Tensor& b_t, const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) &&
                  x.stride(1) == 1 && out.stride(1) == 1,
              "lora_apply: x [T, K] and out [T, N] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "lora_apply: out must have x's dtype");
  TORCH_CHECK(a_t.scalar_type() == at::kFloat && b_t.scalar_type() == at::kFloat &&
                  a_t.is_contiguous() && b_t.is_contiguous() && a_t.dim() == 2 &&
                  b_t.dim() == 2 && a_t.size(0) == x.size(1) && b_t.size(0) == a_t.size(1) &&
                  b_t.size(1) == out.size(1),
              "lora_apply: A^T [K, R] and B^T [R, N] contiguous float32");
  const int64_t* row_ids = nullptr;
  int64_t num_rows = x.size(0);
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->is_contiguous(),
                "lora_apply: rows is a contiguous int64 [rows]");
    row_ids = rows->data_ptr<int64_t>();
    num_rows = rows->size(0);
    for (int64_t i = 0; i < num_rows; ++i)
      TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < x.size(0), "lora_apply: row out of range");
  }
  switch (x.scalar_type()) {
    case at::kFloat: return lora_apply_impl<float>(out, x, a_t, b_t, row_ids, num_rows);
    case at::kBFloat16:
      return lora_apply_impl<c10::BFloat16>(out, x, a_t, b_t, row_ids, num_rows);
    case at::kHalf: return lora_apply_impl<c10::Half>(out, x, a_t, b_t, row_ids, num_rows);
    default: TORCH_CHECK(false, "lora_apply: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("lora_apply(Tensor(a!) out, Tensor x, Tensor a_t, Tensor b_t, Tensor? rows) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("lora_apply", &pagedllm_ops::lora_apply);
}
