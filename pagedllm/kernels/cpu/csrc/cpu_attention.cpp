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
// - avx512 (attention_avx512.h): keys in chunks of 16 read in place, vdpbf16ps on
//   bfloat16; head_size a multiple of 16, fixed at compile time. On CPUs with AMX a
//   bfloat16 cache's items run its pass on tiles (attention_amx.h).
// - generic (below; its row math in attention_generic.h): steps of ~128 keys, rows in
//   pairs (in-place bfloat16 / fp8 caches: fours or threes), 8 lanes wide with AVX2 (head
//   sizes that are multiples of 8), scalar loops otherwise; other head sizes and CPUs
//   without AVX-512.
// When there are enough tiles, an item takes all KV heads of its tile, so the cache is
// read in address order (the heads of a token are adjacent).
//
// The cache holds the query's dtype or fp8 (e4m3fn / e5m2, attention/kv_quant.py): written
// as fp8(clamp(x / scale)), read converted on the fly (fp8.h); the keys' scale multiplies
// the softmax scale and the values' the output normalization, so every pass runs unchanged
// on the converted values (bfloat16 queries: the same tile pass, so fp8 keeps the batch
// invariance of bfloat16).
//
// Built lazily by pagedllm/kernels/cpu/ops.py and build.py with -O3 -march=native.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "attention_avx512.h"
#include "attention_common.h"
#include "attention_generic.h"
#include "ops.h"

namespace pagedllm_ops {

using namespace pagedllm_attention;

// ---------------------------------------------------------------------------------------
// Generic item: one step of keys at a time, its KV heads in turn, rows one by one (two by
// two with AVX2, where both see keys of the step: each K and V load then serves two rows).
//
// A step is whole cache blocks, about kGenericStep keys, starting at a multiple of its
// length (absolute positions). A float32 cache is read in place (each key row by its own
// pointer: the step spans several blocks), and so is a bfloat16 one with AVX2 (widened
// 8 elements a load, exactly); other dtypes are converted to float32 rows in the scratch
// first. Per row and step: the scores of its visible keys, the step's max,
// the rescale, exp, and P . V. With AVX2 the loops run 8 lanes wide (scores and P . V for
// head sizes that are multiples of 8). A key's score is the same whatever its neighbours
// (its own accumulator, reduced by one fixed tree), the step's exp sum adds each lane's
// keys in order (zeros for keys the row cannot see, which leave the non-negative partial
// sums unchanged) and P . V adds the keys in order, so a row's result depends on its
// visible keys only, whether it ran alone or in a pair: batch invariant like the scalar
// loops.
// Measured on Zen 3 (2 threads, float32, 64 requests x 9 heads of 64 sharing 496 keys,
// per layer): against 16-key steps that copied every block to the scratch and summed the
// exps one by one, decodes over 560 keys 2.3 -> ~1.7 ms and 40-token prefill chunks
// 63 -> ~45 ms (rows in pairs: 52 -> 44 ms, same process; 128-key steps ~3% faster than
// 64, 16-key steps ~25% slower); shared_prefix.json with the bundled Q4_1 model 155-186
// -> 222-248 output tok/s.
constexpr int64_t kGenericStep = 128;

inline int64_t generic_step(int64_t block_size) {
  return block_size * std::max<int64_t>(1, kGenericStep / block_size);
}

// Whether the generic item reads a bfloat16 or fp8 cache in place, 8 elements widened per
// load (AVX2, head sizes that are multiples of 8: the paths that run 8 lanes wide),
// instead of converting each step's K / V rows into the scratch first: the scratch's copy
// cost a second pass over every key per item and head, and the cache's reads landed in it
// (profiled on Zen 3, bfloat16 shared_prefix: 10.5% of the time in that copy; an fp8
// cache converted element by element made float32 decodes slower than a float32 cache
// of four times the bytes).
template <typename C>
constexpr bool kInPlaceType = std::is_same_v<C, c10::BFloat16> || pagedllm_fp8::kIsFp8<C>;

template <typename C>
constexpr bool reads_in_place(int64_t d) {
#if defined(PAGEDLLM_SIMD_AVX2)
  return kInPlaceType<C> && d % 8 == 0;
#else
  (void)d;
  return false;
#endif
}

// The element type of a cache read in place: a bfloat16's bits, or the fp8 type itself.
template <typename C>
using InPlace = std::conditional_t<std::is_same_v<C, c10::BFloat16>, uint16_t, C>;

// Pointers to the K and V rows of keys [base, base + n) of request r, KV head h
// (Scratch::rows): into the cache itself (float32; bfloat16 and fp8 where
// reads_in_place) or into the scratch after conversion to float32.
template <typename T, typename C>
void step_rows(const Params<T, C>& p, int64_t r, int64_t h, int64_t base, int64_t n,
               Scratch& sc) {
  const int64_t d = p.head_size, bs = p.block_size;
  // row(t, K row) for each key t of the step (its V row is cache_half further).
  const auto each_row = [&](auto&& row) {
    for (int64_t b = 0; b < n; b += bs) {  // base is a multiple of bs
      const C* kb = p.kc + slot_of(p, r, base + b) * p.tok_stride + h * d;
      for (int64_t t = b; t < std::min(n, b + bs); ++t) row(t, kb + (t - b) * p.tok_stride);
    }
  };
  if constexpr (std::is_same_v<C, float>) {
    const auto [kp, vp] = sc.rows<float>();
    each_row([&](int64_t t, const C* kr) {
      kp[t] = kr;
      vp[t] = kr + p.cache_half;
    });
    return;
  } else if constexpr (kInPlaceType<C>) {
    if (reads_in_place<C>(d)) {
      const auto [kp, vp] = sc.rows<InPlace<C>>();
      each_row([&](int64_t t, const C* kr) {
        kp[t] = reinterpret_cast<const InPlace<C>*>(kr);
        vp[t] = reinterpret_cast<const InPlace<C>*>(kr + p.cache_half);
      });
      return;
    }
  }
  const auto [kp, vp] = sc.rows<float>();
  const auto [kf, vf] = sc.converted();
  each_row([&](int64_t t, const C* kr) {
    to_float(kr, kf + t * d, d);
    to_float(kr + p.cache_half, vf + t * d, d);
    kp[t] = kf + t * d;
    vp[t] = vf + t * d;
  });
}

#if defined(PAGEDLLM_SIMD_AVX2)
// Rows [row, row + R) of one KV head over one step, all seeing its keys [lo, hi) (a
// decode's query heads of that KV head): scores, softmax and P x V for the R at once, so
// each K / V conversion serves R rows (the same results as one by one); their scores go
// to s, step_keys apart.
template <int R, typename E>
void rows_together(const float* q, float* acc, float* m, float* l, const E* const* kp,
                   const E* const* vp, float* s, int64_t step_keys, int64_t d, int64_t row,
                   int64_t lo, int64_t hi) {
  float* sr[R];
  float* ar[R];
  const float* qr[R];
  const float* pr[R];
  for (int r = 0; r < R; ++r) {
    sr[r] = s + r * step_keys;
    pr[r] = sr[r];
    ar[r] = acc + (row + r) * d;
    qr[r] = q + (row + r) * d;
  }
  key_scores_rows<R, R == 4 ? 2 : 4>(qr, kp, d, lo, hi, sr);
  for (int r = 0; r < R; ++r) softmax_step(sr[r], lo, hi, m[row + r], l[row + r], ar[r], d);
  add_pv_rows<R>(ar, pr, vp, d, lo, hi);
}
#endif

// The rows of one KV head over one step of keys [base, base + n) (step_rows done: its K
// and V rows kp / vp): q, acc, m and l are that head's.
template <typename T, typename C, typename E>
void step_head_rows(const Params<T, C>& p, const Span& sp, int64_t base, int64_t n,
                    int64_t rows, const float* q, float* acc, float* m, float* l,
                    const E* const* kp, const E* const* vp, Scratch& sc) {
  const int64_t d = p.head_size;
  float* s = sc.s.data();
  // Visible keys of a row within the step: [t_lo, t_hi).
  auto visible = [&](int64_t row) {
    const int64_t pos = sp.pos0 + row / p.group;
    const int64_t t_lo =
        p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1 - base) : 0;
    return std::pair<int64_t, int64_t>(t_lo, std::min(n, pos - base + 1));
  };
  for (int64_t row = 0; row < rows;) {
    const auto [lo0, hi0] = visible(row);
    float* a0 = acc + row * d;
    if (hi0 <= lo0) {
      ++row;
      continue;
    }
#if defined(PAGEDLLM_SIMD_AVX2)
    // A cache read in place (converted per load): rows in fours, else threes, where all
    // see the same keys of this step (a decode's query heads of one KV head), so each
    // conversion serves them all (the same results as one by one). Threes measured on Zen 3
    // (30 layers, 64 decodes x 240 keys, against pairs, old and new builds alternated):
    // fp8_e4m3 74-79 -> 38-41 ms, fp8_e5m2 32-38 -> 30-35 ms; batch64's decode step
    // 139 -> 101 ms (e4m3), 101 -> 91 ms (e5m2). A float32 cache stays in pairs: in
    // threes it measured even or slower (its steps wait on memory, not on conversions).
    if constexpr (!std::is_same_v<E, float>) {
      int64_t same = 1;  // rows from `row` on that see this row's keys, up to 4
      while (d % 8 == 0 && same < 4 && row + same < rows && visible(row + same) == visible(row))
        ++same;
      const int64_t step_keys = generic_step(p.block_size) + 8;
      if (same == 4) {
        rows_together<4>(q, acc, m, l, kp, vp, s, step_keys, d, row, lo0, hi0);
        row += 4;
        continue;
      }
      if (same == 3) {
        rows_together<3>(q, acc, m, l, kp, vp, s, step_keys, d, row, lo0, hi0);
        row += 3;
        continue;
      }
    }
    // Rows in pairs where both see keys of this step (the same results as one by one).
    if (d % 8 == 0 && row + 1 < rows) {
      const auto [lo1, hi1] = visible(row + 1);
      if (hi1 > lo1) {
        float* s1 = s + generic_step(p.block_size) + 8;
        float* a1 = a0 + d;
        key_scores2(q + row * d, q + (row + 1) * d, kp, d, std::min(lo0, lo1),
                    std::max(hi0, hi1), s, s1);
        softmax_step(s, lo0, hi0, m[row], l[row], a0, d);
        softmax_step(s1, lo1, hi1, m[row + 1], l[row + 1], a1, d);
        add_pv2(a0, a1, s, s1, vp, d, lo0, hi0, lo1, hi1);
        row += 2;
        continue;
      }
    }
#endif
    key_scores(q + row * d, kp, d, lo0, hi0, s);
    softmax_step(s, lo0, hi0, m[row], l[row], a0, d);
    add_pv(a0, s, vp, d, lo0, hi0);
    ++row;
  }
}

#if defined(PAGEDLLM_SIMD_AVX2)
// Loads every cache line of the K and V rows of KV heads [h0, h1) for keys [base, base +
// n) of request r, one independent load per line, before the step's math reads them:
// that math issues its loads a few at a time between FMAs, and a step whose keys come
// from memory waited on each in turn. Blocks that other requests of the call read too
// are skipped: those are mostly already in cache (a shared prefix), where the loads only
// add work (touching every block: batch64 +4%, shared_prefix -7..-14%). Measured on
// Zen 3, 2 threads, float32 cache: 64 decodes of 240 keys each (9 heads of 64 over 3 KV
// heads, 30 layers' caches) 97 -> 82 ms a step, 16 decodes 24.5 -> 19.9 ms; 64 sharing
// 208 of their keys 37 -> 32-36 ms; the engine on the bundled Q4_1 model, in-process
// A/B over 5 rounds (same tokens): batch64 215 -> 230 output tok/s, shared_prefix
// 190 -> 204, one request even (86 -> 87 tok/s).
template <typename T, typename C>
void touch_step(const Params<T, C>& p, int64_t r, int64_t h0, int64_t h1, int64_t base,
                int64_t n) {
  const int64_t bs = p.block_size;
  const int64_t row_bytes = (h1 - h0) * p.head_size * static_cast<int64_t>(sizeof(C));
  const int64_t tok_bytes = p.tok_stride * static_cast<int64_t>(sizeof(C));
  const int64_t half_bytes = p.cache_half * static_cast<int64_t>(sizeof(C));
  uint8_t sink = 0;
  for (int64_t b = 0; b < n; b += bs) {  // base is a multiple of bs
    const int64_t blk = p.bt[r * p.bt_stride + (base + b) / bs];
    if (p.shared_blocks != nullptr && p.shared_blocks[blk] > 1) continue;
    const char* k0 = reinterpret_cast<const char*>(p.kc + blk * bs * p.tok_stride +
                                                   h0 * p.head_size);
    for (int64_t t = 0; t < std::min(bs, n - b); ++t) {
      const char* kr = k0 + t * tok_bytes;
      for (int64_t i = 0; i < row_bytes; i += 64)
        sink |= *reinterpret_cast<const volatile uint8_t*>(kr + i) |
                *reinterpret_cast<const volatile uint8_t*>(kr + half_bytes + i);
      sink |= *reinterpret_cast<const volatile uint8_t*>(kr + row_bytes - 1) |
              *reinterpret_cast<const volatile uint8_t*>(kr + half_bytes + row_bytes - 1);
    }
  }
  asm volatile("" : : "r"(sink));
}
#endif

// Every KV head of the item, step by step: the heads of a token are adjacent in the
// cache, so a step's reads stay within one stretch of it (measured on Zen 3, per layer,
// against each head walking the whole context in turn: 64 decodes over 560 keys of their
// own 5.9 -> 5.8 ms, sharing 496 of them 2.2 -> 2.0 ms, 40-token prefill chunks about
// the same).
template <typename T, typename C>
void attend_item_generic(const Params<T, C>& p, const Item& item, Scratch& sc) {
  const Span sp = span_of(p, item);
  const int64_t d = p.head_size, rows = sp.num_toks * p.group;
  const int64_t heads = item.head_end - item.head_begin;
  const int64_t step = generic_step(p.block_size);
  for (int64_t i = 0; i < heads; ++i)
    load_queries(p, item, item.head_begin + i, sc.q.data() + i * rows * d, p.scale);
  std::fill(sc.acc.begin(), sc.acc.begin() + heads * rows * d, 0.0f);
  std::fill(sc.m.begin(), sc.m.begin() + heads * rows, -INFINITY);
  std::fill(sc.l.begin(), sc.l.begin() + heads * rows, 0.0f);
  for (int64_t base = sp.key_lo / step * step; base < sp.key_hi; base += step) {
    const int64_t n = std::min(step, sp.key_hi - base);
#if defined(PAGEDLLM_SIMD_AVX2)
    touch_step(p, item.req, item.head_begin, item.head_end, base, n);
#endif
    for (int64_t i = 0; i < heads; ++i) {
      step_rows(p, item.req, item.head_begin + i, base, n, sc);
      float *q = sc.q.data() + i * rows * d, *acc = sc.acc.data() + i * rows * d;
      float *m = sc.m.data() + i * rows, *l = sc.l.data() + i * rows;
      if constexpr (kInPlaceType<C>) {
        if (reads_in_place<C>(d)) {
          const auto [kp, vp] = sc.rows<InPlace<C>>();
          step_head_rows(p, sp, base, n, rows, q, acc, m, l, kp, vp, sc);
          continue;
        }
      }
      const auto [kp, vp] = sc.rows<float>();
      step_head_rows(p, sp, base, n, rows, q, acc, m, l, kp, vp, sc);
    }
  }
  for (int64_t i = 0; i < heads; ++i)
    store_outputs(p, item, item.head_begin + i, sc.acc.data() + i * rows * d,
                  sc.l.data() + i * rows);
}

template <typename T, typename C>
void decode_item_generic(const Params<T, C>& p, const Item& item, Scratch& sc,
                         const SharedPrefix*) {
  attend_item_generic(p, item, sc);
}

template <typename T, typename C>
using ItemFn = void (*)(const Params<T, C>&, const Item&, Scratch&);
template <typename T, typename C>
using DecodeFn = void (*)(const Params<T, C>&, const Item&, Scratch&, const SharedPrefix*);
template <typename T, typename C>
using SharedFn = void (*)(const Params<T, C>&, const Item&, Scratch&, SharedPrefix&);

// The item implementations for a head size: tiles of several query tokens, decodes, and
// the shared-prefix part of a cascade (nullptr: no cascade for this dtype / head size).
template <typename T, typename C>
struct ItemFns {
  ItemFn<T, C> tile;
  DecodeFn<T, C> decode;
  SharedFn<T, C> shared;
};

template <typename T, typename C, int NV>
ItemFns<T, C> avx512_item_fns() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // vdpbf16ps needs head dims in pairs of 32. The cascade pays off only there: its shared
  // tile prepares each key chunk once for many rows (transpose_keys).
  // Decodes take the prefill rows' pass (decode_item_avx512): every row then reduces its
  // keys in the same steps with the same arithmetic, whatever its item (batch invariance).
  if constexpr (std::is_same_v<T, c10::BFloat16> && kHasBf16Dot && NV % 2 == 0)
    return {attend_item_avx512<T, C, NV, true>, decode_item_avx512<T, C, NV, true>,
            shared_prefix_item_avx512<T, C, NV, true>};
  else
    return {attend_item_avx512<T, C, NV, false>, decode_item_avx512<T, C, NV, false>, nullptr};
#else
  return {attend_item_generic<T, C>, decode_item_generic<T, C>, nullptr};
#endif
}

template <typename T, typename C>
ItemFns<T, C> pick_item_fns(int64_t head_size) {
  switch (head_size) {
    case 32: return avx512_item_fns<T, C, 2>();
    case 64: return avx512_item_fns<T, C, 4>();
    case 80: return avx512_item_fns<T, C, 5>();
    case 96: return avx512_item_fns<T, C, 6>();
    case 128: return avx512_item_fns<T, C, 8>();
    case 256: return avx512_item_fns<T, C, 16>();
    default: return {attend_item_generic<T, C>, decode_item_generic<T, C>, nullptr};
  }
}

// ---------------------------------------------------------------------------------------

// One token's K or V row (n elements) into the cache: copied, or (fp8) divided by the
// scale, saturated and rounded to nearest even, bit for bit as torch converts.
template <typename T, typename C>
inline void store_row(const T* src, C* dst, int64_t n, float scale) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(dst, src, n * sizeof(T));
  } else {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // x / 1 is x (the default scale): skip the division, a slow instruction.
    const bool divide = scale != 1.0f;
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 mask = pagedllm_simd::first_lanes(n - i);
      __m512 x = pagedllm_simd::load16(src + i, mask);
      if (divide) x = _mm512_div_ps(x, s);
      _mm_mask_storeu_epi8(dst + i, mask, pagedllm_fp8::fp8x16<C>(x));
    }
#else
    int64_t i = 0;
#if defined(PAGEDLLM_SIMD_AVX2)
    // 8 at a time: measured on Zen 3, 30 layers' K / V of batch64.json's 11k prompt
    // tokens (float32, 3 KV heads of 64) 312 -> 47 ms (e5m2), 365 -> 47 ms (e4m3fn)
    // against element by element.
    const bool divide = scale != 1.0f;
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
      __m256 x = pagedllm_simd::load8(src + i);
      if (divide) x = _mm256_div_ps(x, s);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), pagedllm_fp8::fp8x8<C>(x));
    }
#endif
    for (; i < n; ++i)
      dst[i] = pagedllm_fp8::from_float<C>(static_cast<float>(src[i]), scale);
#endif
  }
}

// Write this step's K/V [T, KVH, D] into their slots of kv_cache [2, NB, BS, KVH, D].
template <typename T, typename C>
void write_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                 const at::Tensor& slot_mapping, float k_scale, float v_scale) {
  const int64_t num_tokens = key.size(0);
  const int64_t row = key.size(1) * key.size(2);  // KVH * D, contiguous within a token
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const int64_t ks = key.stride(0), vs = value.stride(0);
  C* kc = static_cast<C*>(kv_cache.data_ptr());
  C* vc = kc + num_slots * row;
  // Quantizing a long prefill is worth the threads (copies are not); tokens own distinct
  // slots, so they never write the same bytes.
  constexpr bool kConverts = !std::is_same_v<T, C>;
#pragma omp parallel for if (kConverts && num_tokens >= 256)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding
    store_row(k + t * ks, kc + slot * row, row, k_scale);
    store_row(v + t * vs, vc + slot * row, row, v_scale);
  }
}

// Fewest decodes and shared keys for which the cascade beats per-request decodes.
constexpr int64_t kCascadeMinReqs = 8;
constexpr int64_t kCascadeMinKeys = 64;
// The shared keys end on a step of the pass the call's items take (the only passes with
// a cascade): the AMX pass's 32 keys or the bfloat16 tile pass's 48. One alignment for
// both (96) cost the AMX pass up to 64 shared keys, each then read from memory by every
// request: 32 of shared_prefix's 512 (measured, 64 decodes with 64 keys of their own, 30
// layers: 11.8 -> 10.5 ms a step).
template <typename T, typename C>
int64_t cascade_align(const Params<T, C>& p) {
#if defined(PAGEDLLM_ATTENTION_AMX)
  if (amx_pass(p)) return pagedllm_attention::amx::kStepKeys;
#endif
#if defined(__AVX512BF16__)
  return pagedllm_attention::kTileKeys;
#else
  (void)p;
  return 1;  // no cascade here (avx512_item_fns gives no shared pass)
#endif
}

// Keys every request's block table shares (whole leading blocks), when the call is all
// decodes without a sliding window; 0 otherwise. Each request keeps >= 1 key of its own.
template <typename T, typename C>
int64_t shared_prefix_keys(const Params<T, C>& p, int64_t num_reqs, int64_t num_tokens) {
  if (num_tokens != num_reqs || num_reqs < kCascadeMinReqs || p.sliding_window > 0 ||
      p.block_size % 16 != 0)
    return 0;
  int64_t min_len = INT64_MAX;
  for (int64_t r = 0; r < num_reqs; ++r) min_len = std::min<int64_t>(min_len, p.lens[r]);
  const int64_t max_blocks = (min_len - 1) / p.block_size;
  int64_t blocks = 0;
  for (; blocks < max_blocks; ++blocks) {
    const int32_t id = p.bt[blocks];
    bool same = true;
    for (int64_t r = 1; r < num_reqs && same; ++r) same = p.bt[r * p.bt_stride + blocks] == id;
    if (!same) break;
  }
  // Whole steps of the pass (keys aligned to absolute positions), so each row continues
  // from the shared state exactly where its own pass would be.
  const int64_t align = cascade_align(p);
  const int64_t keys = blocks * p.block_size / align * align;
  return keys >= kCascadeMinKeys ? keys : 0;
}

template <typename T, typename C>
void attend(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
            const at::Tensor& block_table, const at::Tensor& seq_lens,
            const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
            int64_t q_tile, float k_scale, float v_scale) {
  Params<T, C> p;
  p.q = query.data_ptr<T>();
  p.out = out.data_ptr<T>();
  p.kc = static_cast<const C*>(kv_cache.data_ptr());
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
  // Scores of unscaled fp8 keys times k_scale; outputs of unscaled values times v_scale.
  p.scale = static_cast<float>(scale) * k_scale;
  p.v_scale = v_scale;

  const int64_t num_reqs = seq_lens.size(0), num_kv_heads = kv_cache.size(3);
  int64_t num_tiles = 0;
  for (int64_t r = 0; r < num_reqs; ++r)
    num_tiles += (p.qsl[r + 1] - p.qsl[r] + q_tile - 1) / q_tile;
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
  // Largest items first (keys x rows): the dynamic schedule then ends with small ones
  // and the threads finish together (a causal prefill's last tile has the most keys).
  auto cost = [&](const Item& item) {
    const Span sp = span_of(p, item);
    return (sp.key_hi - sp.key_lo) * sp.num_toks * (item.head_end - item.head_begin);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  const int64_t num_items = static_cast<int64_t>(items.size());
  const ItemFns<T, C> fns = pick_item_fns<T, C>(p.head_size);
  // Readers per block, up to 2 (touch_step skips blocks of more than one).
  std::vector<uint8_t> shared_blocks;
  if (fns.tile == attend_item_generic<T, C> && num_reqs > 1) {
    shared_blocks.assign(kv_cache.size(1), 0);
    for (int64_t r = 0; r < num_reqs; ++r) {
      const int32_t* row = p.bt + r * p.bt_stride;
      for (int64_t j = 0; j < (p.lens[r] + p.block_size - 1) / p.block_size; ++j) {
        uint8_t& readers = shared_blocks[row[j]];
        readers = readers == 0 ? 1 : 2;
      }
    }
    p.shared_blocks = shared_blocks.data();
  }
  SharedPrefix shared;
  std::vector<Item> shared_items;
  if (fns.shared != nullptr) shared.keys = shared_prefix_keys(p, num_reqs, query.size(0));
  int64_t shared_tile = q_tile;
  if (shared.keys > 0) {
    // All decodes, so token t is request t; any request's table reads the shared blocks.
    const int64_t num_tokens = query.size(0), heads = query.size(1);
    // Tiles of 2 x q_tile tokens (each transposed key chunk serves twice the rows:
    // measured 0.35 -> 0.29 ms per layer, 64 decodes sharing 512 keys) while that still
    // leaves two items per thread.
    if ((num_tokens + 2 * q_tile - 1) / (2 * q_tile) * num_kv_heads >= 2 * omp_get_max_threads())
      shared_tile = 2 * q_tile;
    shared.heads = heads;
    shared.head_size = p.head_size;
    shared.m.resize(num_tokens * heads);
    shared.l_lanes.resize(num_tokens * heads * 16);
    shared.acc.resize(num_tokens * heads * p.head_size);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t t0 = 0; t0 < num_tokens; t0 += shared_tile)
        shared_items.push_back({t0, h, h + 1, t0, std::min(t0 + shared_tile, num_tokens)});
    }
  }
  const int64_t num_shared_items = static_cast<int64_t>(shared_items.size());
  // Key rows per item step: the generic item's steps, which also hold the AVX-512 item's
  // blocks (whole blocks, at least 16 keys).
  const int64_t keys = generic_step(p.block_size);
  // (query token, key, KV head) triples: below ~512 the call takes a few microseconds,
  // less than waking the other threads. Above, the keys come from memory (each layer has
  // its own cache), so even one decode gains: 200 keys x 3 KV heads 15 -> 13 us per
  // layer, 1000 keys 73 -> 52 us (the threshold was 32k, measured on warm caches).
  int64_t work = 0;
  for (int64_t r = 0; r < num_reqs; ++r) work += (p.qsl[r + 1] - p.qsl[r]) * p.lens[r];
  work *= num_kv_heads;
  // Claiming ahead can leave a thread holding one item while another has run out: only
  // with enough items that the last ones (the smallest, by the sort) are short.
  const bool claim_ahead = num_items >= 8 * omp_get_max_threads();
  std::atomic<int64_t> next_item{0};
#pragma omp parallel if (num_items > 1 && work > 512)
  {
    Scratch scratch(std::max(q_tile * heads_per_item, shared_tile) * p.group, p.head_size,
                    keys);
#if defined(PAGEDLLM_ATTENTION_AMX)
    // The AMX pass's tiles, configured once per thread and call.
    std::optional<pagedllm_amx::Tiles> tiles;
    if (amx_pass(p)) tiles.emplace(pagedllm_attention::amx::tile_config());
#endif
    // The shared parts first (the loop's barrier orders them before the merges).
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_shared_items; ++it)
      fns.shared(p, shared_items[it], scratch, shared);
    // Items claimed one at a time (a dynamic schedule); with many items each thread
    // claims its next one before running the current, whose last steps then prefetch the
    // next one's first keys (the cache comes from memory; without this an item opened
    // with a burst of misses that nothing overlapped). Measured on Zen 4, 2 threads, 64
    // decodes of ~220 keys, per layer: 618 -> 579 us, 706 -> 678 us (two runs);
    // 16 decodes of 1024 keys 716 -> 694 us (fewer, longer items).
    int64_t it = next_item.fetch_add(1, std::memory_order_relaxed);
    while (it < num_items) {
      const int64_t after =
          claim_ahead ? next_item.fetch_add(1, std::memory_order_relaxed) : num_items;
      scratch.next = after < num_items ? &items[after] : nullptr;
      const Item& item = items[it];
      if (item.tok_end - item.tok_begin == 1)
        fns.decode(p, item, scratch, &shared);
      else
        fns.tile(p, item, scratch);
      it = claim_ahead ? after : next_item.fetch_add(1, std::memory_order_relaxed);
    }
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
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() ||
                  kv_cache.scalar_type() == at::kFloat8_e4m3fn ||
                  kv_cache.scalar_type() == at::kFloat8_e5m2,
              "kv_cache must have the query's dtype or be float8_e4m3fn / float8_e5m2");
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

// Write (when given) and attend with query dtype T and cache dtype C.
template <typename T, typename C>
void write_and_attend(const at::Tensor& out, const at::Tensor& query,
                      const std::optional<at::Tensor>& key,
                      const std::optional<at::Tensor>& value, const at::Tensor& kv_cache,
                      const at::Tensor& slot_mapping, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                      double scale, int64_t sliding_window, int64_t q_tile, float k_scale,
                      float v_scale) {
  if (key.has_value())
    write_cache<T, C>(*key, *value, kv_cache, slot_mapping, k_scale, v_scale);
  attend<T, C>(out, query, kv_cache, block_table, seq_lens, query_start_loc, scale,
               sliding_window, q_tile, k_scale, v_scale);
}

// The cache dtype of query dtype T: T itself (scales unused) or fp8.
template <typename T>
void dispatch_cache(const at::Tensor& out, const at::Tensor& query,
                    const std::optional<at::Tensor>& key,
                    const std::optional<at::Tensor>& value, const at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping, const at::Tensor& block_table,
                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                    double scale, int64_t sliding_window, int64_t q_tile, double k_scale,
                    double v_scale) {
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  switch (kv_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return write_and_attend<T, c10::Float8_e4m3fn>(out, query, key, value, kv_cache,
                                                     slot_mapping, block_table, seq_lens,
                                                     query_start_loc, scale, sliding_window,
                                                     q_tile, ks, vs);
    case at::kFloat8_e5m2:
      return write_and_attend<T, c10::Float8_e5m2>(out, query, key, value, kv_cache,
                                                   slot_mapping, block_table, seq_lens,
                                                   query_start_loc, scale, sliding_window,
                                                   q_tile, ks, vs);
    default:
      return write_and_attend<T, T>(out, query, key, value, kv_cache, slot_mapping,
                                    block_table, seq_lens, query_start_loc, scale,
                                    sliding_window, q_tile, 1.0f, 1.0f);
  }
}

// out [T, H, D] <- attention of query [T, H, D] over each request's paged context, after
// writing key/value [T, KVH, D] (when given) into kv_cache at slot_mapping.
void paged_attention(const at::Tensor& out, const at::Tensor& query,
                     const std::optional<at::Tensor>& key,
                     const std::optional<at::Tensor>& value, const at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t sliding_window, int64_t q_tile, double k_scale,
                     double v_scale) {
  check_inputs(out, query, kv_cache, block_table, seq_lens, query_start_loc);
  TORCH_CHECK(q_tile >= 1, "q_tile must be >= 1");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "k_scale and v_scale must be > 0");
  TORCH_CHECK(key.has_value() == value.has_value(), "key and value come together");
  if (key.has_value()) check_kv(query, *key, *value, slot_mapping);
  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_cache<float>(out, query, key, value, kv_cache, slot_mapping,
                                   block_table, seq_lens, query_start_loc, scale,
                                   sliding_window, q_tile, k_scale, v_scale);
    case at::kBFloat16:
      return dispatch_cache<c10::BFloat16>(out, query, key, value, kv_cache, slot_mapping,
                                           block_table, seq_lens, query_start_loc, scale,
                                           sliding_window, q_tile, k_scale, v_scale);
    case at::kHalf:
      return dispatch_cache<c10::Half>(out, query, key, value, kv_cache, slot_mapping,
                                       block_table, seq_lens, query_start_loc, scale,
                                       sliding_window, q_tile, k_scale, v_scale);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace pagedllm_ops

namespace pagedllm_ops {

bool bf16_attention_amx() {
#if defined(PAGEDLLM_ATTENTION_AMX)
  return pagedllm_attention::bf16_attention_amx();
#else
  return false;
#endif
}

}  // namespace pagedllm_ops

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("bf16_attention_amx() -> bool", &pagedllm_ops::bf16_attention_amx);
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor? key, Tensor? value, "
      "Tensor(b!) kv_cache, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int sliding_window, int q_tile, "
      "float k_scale=1.0, float v_scale=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("paged_attention", &pagedllm_ops::paged_attention); }
