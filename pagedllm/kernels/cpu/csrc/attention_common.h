// Shared pieces of the paged attention kernels (cpu_attention.cpp): the parameters of a
// call, work items, per-thread scratch and the query/output row helpers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "fp8.h"
#include "simd.h"

namespace pagedllm_attention {

// Everything an item needs to find its queries, its context and its output. T: the query
// and output dtype; C: the cache's (T, or an fp8 type whose scales are folded into
// `scale` and `v_scale`).
template <typename T, typename C = T>
struct Params {
  const T* q;           // [T, H, D] with strides qs0, qs1
  T* out;               // [T, H, D] with strides os0, os1
  const C* kc;          // K half of the cache: slot s, kv head h at kc + s * tok_stride + h * D
  const int32_t* bt;    // block table rows, bt_stride apart
  const int32_t* lens;  // seq_lens [R]
  const int32_t* qsl;   // query_start_loc [R + 1]
  int64_t qs0, qs1, os0, os1, bt_stride;
  int64_t head_size, group, block_size, tok_stride;
  int64_t cache_half;  // elements from a K entry to its V entry
  int64_t sliding_window;  // 0: none
  float scale;         // softmax scale (times k_scale for an fp8 cache)
  float v_scale = 1;   // outputs are scaled by v_scale / l (fp8: the V scale)
  // Per cache block, how many requests of the call read it, counted up to 2 (nullptr:
  // one request); the generic item loads only the blocks of one reader ahead (touch_step).
  const uint8_t* shared_blocks = nullptr;
};

// Cascade attention for a decode batch whose block tables share leading blocks: every row
// first attends the `keys` shared keys together (one tile of many requests, so each key
// chunk is prepared once for all of them), then its own suffix, and the two partial
// softmaxes are merged. Per (token, query head): running max, sum, unnormalized output.
// The cascade's shared part: each decode row's online-softmax state (running max m, sum
// by lane l_lanes, unnormalized acc) after the shared keys [0, keys), from which the row's
// own pass continues, so the row sees the same steps in the same order as without the
// cascade (batch invariance, DESIGN.md §10).
struct SharedPrefix {
  int64_t keys = 0;  // 0: no cascade
  int64_t heads = 0, head_size = 0;
  std::vector<float> m, l_lanes, acc;  // [T * H], [T * H * 16], [T * H * D]
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

template <typename T, typename C>
Span span_of(const Params<T, C>& p, const Item& item) {
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
template <typename T, typename C>
inline int64_t slot_of(const Params<T, C>& p, int64_t r, int64_t pos) {
  return static_cast<int64_t>(p.bt[r * p.bt_stride + pos / p.block_size]) * p.block_size +
         pos % p.block_size;
}

inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  pagedllm_simd::widen_bf16(src, dst, n);
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// fp8 cache elements, unscaled (the kernels apply k_scale / v_scale folded).
template <typename C, std::enable_if_t<pagedllm_fp8::kIsFp8<C>, int> = 0>
inline void to_float(const C* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// exp for the softmax rescaling (arguments are <= 0 there).
using pagedllm_simd::exp_poly;

// Per-thread buffers, sized for the largest item. The generic item's K / V rows (pointers,
// and float32 copies where it converts) are sized on first use: a call builds one Scratch
// per thread, and each path needs at most one of those sets (two 32 KB copies zeroed per
// thread and layer cost every AVX-512 decode, which never touches them).
struct Scratch {
  std::vector<float> q, acc, m, l, l_lanes, s, probs, alpha;
  std::vector<uint16_t> probs_b;
  std::vector<uint32_t> qt;  // the AMX pass's queries as tile operands (attention_amx.h)
  // The item this thread runs after the current one, when it is already claimed: the
  // current item's last steps prefetch its first keys (nullptr: none known).
  const Item* next = nullptr;
  Scratch(int64_t max_rows, int64_t head_size, int64_t keys)
      : q(max_rows * head_size), acc(max_rows * head_size), m(max_rows), l(max_rows),
        l_lanes(max_rows * 16), s(4 * (keys + 8)), probs(max_rows * 16), alpha(max_rows),
        probs_b(max_rows * 16 + 2), keys_(keys), head_size_(head_size) {}

  // The K and V row pointers of a step of keys, of element type E: float32 (a float32
  // cache's rows, or the converted copies), or a cache read in place (uint16_t: bfloat16
  // bits; fp8).
  template <typename E>
  std::pair<const E**, const E**> rows() {
    auto& [k, v] = row_pointers<E>();
    if (k.empty()) {
      k.resize(keys_);
      v.resize(keys_);
    }
    return {k.data(), v.data()};
  }

  // Room for a step's K and V rows converted to float32.
  std::pair<float*, float*> converted() {
    if (k_.empty()) {
      k_.resize(keys_ * head_size_);
      v_.resize(keys_ * head_size_);
    }
    return {k_.data(), v_.data()};
  }

 private:
  template <typename E>
  using Pointers = std::pair<std::vector<const E*>, std::vector<const E*>>;

  template <typename E>
  Pointers<E>& row_pointers() {
    if constexpr (std::is_same_v<E, float>) {
      return f32_;
    } else if constexpr (std::is_same_v<E, uint16_t>) {
      return bf16_;
    } else if constexpr (std::is_same_v<E, c10::Float8_e4m3fn>) {
      return e4m3_;
    } else {
      static_assert(std::is_same_v<E, c10::Float8_e5m2>, "no reads of this type");
      return e5m2_;
    }
  }

  int64_t keys_, head_size_;
  std::vector<float> k_, v_;
  Pointers<float> f32_;
  Pointers<uint16_t> bf16_;
  Pointers<c10::Float8_e4m3fn> e4m3_;
  Pointers<c10::Float8_e5m2> e5m2_;
};

// Load the queries of KV head h as float32 times `scale`, rows i * G + g.
template <typename T, typename C>
void load_queries(const Params<T, C>& p, const Item& item, int64_t h, float* qf, float scale) {
  const int64_t d = p.head_size;
  for (int64_t i = 0; i < item.tok_end - item.tok_begin; ++i) {
    for (int64_t g = 0; g < p.group; ++g) {
      const T* src = p.q + (item.tok_begin + i) * p.qs0 + (h * p.group + g) * p.qs1;
      float* dst = qf + (i * p.group + g) * d;
      to_float(src, dst, d);
      for (int64_t j = 0; j < d; ++j) dst[j] *= scale;
    }
  }
}

template <typename T, typename C>
void store_outputs(const Params<T, C>& p, const Item& item, int64_t h, const float* acc,
                   const float* l) {
  const int64_t d = p.head_size;
  const int64_t rows = (item.tok_end - item.tok_begin) * p.group;
  for (int64_t row = 0; row < rows; ++row) {
    T* dst = p.out + (item.tok_begin + row / p.group) * p.os0 +
             (h * p.group + row % p.group) * p.os1;
    // l > 0: every row sees at least its own key.
    const float inv = p.v_scale / l[row];
    for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(acc[row * d + j] * inv);
  }
}

}  // namespace pagedllm_attention
