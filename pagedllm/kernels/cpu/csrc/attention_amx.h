// The bfloat16 attention pass on AMX tiles (Intel since Sapphire Rapids: AMX-TILE and
// AMX-BF16), for a bfloat16 cache read in whole 16-key runs (block_size % 16 == 0): every
// row of every item (prefill chunks, decodes, the cascade's shared part) takes it on a CPU
// that runs the tiles, so a row's arithmetic is the same whatever its item (batch
// invariance, DESIGN.md §10).
//
// Steps of 32 keys at multiples of 32. Per step, KV head and tile of up to 16 query rows:
// - scores: the keys are the left operand as they lie in the cache (16 keys x 32 dims, one
//   tile load, rows tok_stride apart: no transposition), the queries the right one (their
//   dim pairs by rows, [16 pairs][16 rows][2], laid out once per item); tdpbf16ps sums
//   [16 keys][16 rows] over the head in steps of 32 dims. A row's 16 scores of a half are
//   then one gather of a column.
// - softmax: step_softmax (attention_avx512.h), the lazy max of the tile pass.
// - P . V: the probabilities rounded to bfloat16 are the left operand ([16 rows][32
//   keys]), the values the right one, interleaved in key pairs as the vdpbf16ps form
//   interleaves them (interleave order: column j of block 2i + e is head dim 32i + 8(j / 4)
//   + 4e + j % 4, undone by store_rows); the step's [16 rows][16 dims] sums, from zero,
//   are added to the row's float32 acc (scaled first when the step rescaled).
// Each tile element is summed alone (its row and column only), so a row's result does
// not depend on the other rows of its tile.
//
// Measured on a 2-core AMX Xeon (docs/architecture.md, AMX), SmolLM2's heads, against the
// float32-FMA tile pass: prefill chunks ~2x (the tiles take the products of 16 rows at a
// time); decodes ~10% (a decode's 3 rows leave the tiles mostly empty, and the value
// interleave and softmax remain; over 64 contexts read from memory the pass is bound by
// the reads).
#pragma once

#include "amx.h"

#if defined(PAGEDLLM_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDLLM_ATTENTION_AMX 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention_avx512.h"
#include "attention_common.h"

namespace pagedllm_attention {
namespace amx {

constexpr int kStepKeys = 32;
constexpr int kRows = 16;  // query rows per tile

// Tiles (all 16 rows x 64 bytes): 0 scores [16 keys][16 rows] float32; 1 keys [16][32
// dims]; 2 queries [16 dim pairs][16 rows][2]; 3 outputs [16 rows][16 dims] float32;
// 4 probabilities [16 rows][32 keys]; 5 values [16 key pairs][16 dims][2].
inline pagedllm_amx::TileConfig tile_config() {
  pagedllm_amx::TileConfig c;
  for (int t = 0; t < 6; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}

// The item's queries (raw bfloat16 rows, head-major as load_item_queries lays them out)
// as right operands: per (head, row tile, 32-dim step) [16 pairs][16 rows] dwords, rows
// past the head's zero.
template <int NV>
void lay_out_queries(const uint16_t* q, int64_t heads, int64_t head_rows, uint32_t* qt) {
  constexpr int D = NV * 16;
  const int64_t tiles = (head_rows + kRows - 1) / kRows;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t rt = 0; rt < tiles; ++rt) {
      for (int ds = 0; ds < D / 32; ++ds) {
        uint32_t* dst = qt + ((h * tiles + rt) * (D / 32) + ds) * 256;
        std::memset(dst, 0, 256 * sizeof(uint32_t));
        const int64_t rows = std::min<int64_t>(kRows, head_rows - rt * kRows);
        for (int64_t r = 0; r < rows; ++r) {
          const uint16_t* src = q + (h * head_rows + rt * kRows + r) * D + 32 * ds;
          for (int j = 0; j < 16; ++j) std::memcpy(dst + j * 16 + r, src + 2 * j, 4);
        }
      }
    }
  }
}

// The values of a step's keys (n of them, rows vb[t]) as NV right operands [16 pairs][16
// dims] dwords: vt + (2i + e) * 256 for head dims [32i, 32i + 32), e the unpack half.
// Missing keys (t >= n) are zero.
template <int NV>
inline void lay_out_values(const c10::BFloat16* const* vb, int n, __m512i* vt) {
  for (int t = 0; t < 16; ++t) {
    for (int i = 0; i < NV / 2; ++i) {
      const __m512i va = load32_bf16(vb[2 * t] + 32 * i, 2 * t < n);
      const __m512i vn = load32_bf16(vb[2 * t + 1] + 32 * i, 2 * t + 1 < n);
      vt[(2 * i) * 16 + t] = _mm512_unpacklo_epi16(va, vn);
      vt[(2 * i + 1) * 16 + t] = _mm512_unpackhi_epi16(va, vn);
    }
  }
}

// One step (keys [c, c + n), cache offsets off) for rows [rr, rr + rows) of head h: their
// scores, online softmax (m, l by lane) and acc += P . V. qt: the row tile's queries (D /
// 32 operands); kb[v]: the first key of half v (16 keys, tok_stride apart).
template <typename T, int NV>
inline void step_rows(const Params<T, c10::BFloat16>& p, const Span& sp, int64_t rr,
                      int rows, int64_t c, int n, const uint32_t* qt,
                      const c10::BFloat16* const* kb, const __m512i* vt, float* m, float* l,
                      float* acc, StepPrefetch<c10::BFloat16>& ahead) {
  constexpr int D = NV * 16;
  const int64_t key_stride = p.tok_stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  alignas(64) float st[2][16 * 16];  // scores [half][key][row]
  for (int v = 0; v < 2; ++v) {
    if (n <= 16 * v) break;  // no keys in this half: masked below, never read
    _tile_zero(0);
    for (int ds = 0; ds < D / 32; ++ds) {
      _tile_loadd(1, kb[v] + 32 * ds, key_stride);
      _tile_loadd(2, qt + ds * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, st[v], 64);
    ahead.next();
  }
  // Lane t of a row's gather: key t of the half, 16 floats a key.
  const __m512i column = _mm512_slli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 4);
  alignas(64) uint16_t pb[kRows][kStepKeys];
  float alpha[kRows];
  bool rescaled[kRows];
  for (int r = 0; r < rows; ++r) {
    __m512 s[2], e[2];
    for (int v = 0; v < 2; ++v)
      s[v] = n > 16 * v ? _mm512_i32gather_ps(column, st[v] + r, 4) : _mm512_setzero_ps();
    const int64_t pos = sp.pos0 + (rr + r) / p.group;
    rescaled[r] = step_softmax<2>(p, pos, c, n, s, m[r], l + r * 16, e, alpha[r]);
    _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
  }
  // pb's rows past `rows` are not written: their sums (out's rows past `rows`) are never
  // read.
  // (Four blocks' sums in flight at once, on four tiles, measured no faster here, and
  // slower on contexts read from memory.)
  alignas(64) float out[16 * 16];
  _tile_loadd(4, pb, 64);
  for (int b = 0; b < NV; ++b) {
    _tile_zero(3);
    _tile_loadd(5, vt + b * 16, 64);
    _tile_dpbf16ps(3, 4, 5);
    _tile_stored(3, out, 64);
    ahead.next();
    for (int r = 0; r < rows; ++r) {
      float* a = acc + r * D + 16 * b;
      __m512 x = _mm512_loadu_ps(a);
      if (rescaled[r]) x = _mm512_mul_ps(x, _mm512_set1_ps(alpha[r]));
      _mm512_storeu_ps(a, _mm512_add_ps(x, _mm512_load_ps(out + 16 * r)));
    }
  }
}

// run_item_chunks' key loop on AMX tiles (the header comment; `shared_keys`: StepWalk's);
// the rows' state in sc as the tile pass leaves it (acc in the interleave order).
template <typename T, int NV>
void run_item(const Params<T, c10::BFloat16>& p, const Item& item, const Span& sp,
              Scratch& sc, int64_t shared_keys) {
  constexpr int D = NV * 16;
  using C = c10::BFloat16;
  const int64_t head_rows = sp.num_toks * p.group;
  const int64_t heads = item.head_end - item.head_begin;
  const int64_t tiles = (head_rows + kRows - 1) / kRows;
  const size_t qt_dwords = static_cast<size_t>(heads * tiles * (D / 32) * 256);
  if (sc.qt.size() < qt_dwords) sc.qt.resize(qt_dwords);
  lay_out_queries<NV>(reinterpret_cast<const uint16_t*>(sc.q.data()), heads, head_rows,
                      sc.qt.data());
  // StepPrefetch::next(): once per half of step_rows' scores and block of its P . V.
  const int64_t calls = heads * tiles * (2 + NV);
  StepWalk<kStepKeys, T, C> walk(p, item, sp, sc.next, shared_keys, calls);
  alignas(64) __m512i vt[NV * 16];
  for (int64_t c = walk.first(), i = 0; c < sp.key_hi; c += kStepKeys, ++i) {
    const int n = walk.keys(c);
    StepPrefetch<C> ahead = walk.begin(c, i);
    const int64_t* off = walk.offsets();
    for (int64_t h = item.head_begin; h < item.head_end; ++h) {
      const C* kb[2];
      const C* vb[kStepKeys];
      for (int v = 0; v < 2; ++v) kb[v] = n > 16 * v ? p.kc + off[16 * v] + h * D : nullptr;
      for (int t = 0; t < n; ++t) vb[t] = p.kc + off[t] + h * D + p.cache_half;
      for (int t = n; t < kStepKeys; ++t) vb[t] = vb[0];  // read masked: never loaded
      lay_out_values<NV>(vb, n, vt);
      const int64_t row0 = (h - item.head_begin) * head_rows;
      for (int64_t rt = 0; rt < tiles; ++rt) {
        const int64_t rr = rt * kRows, row = row0 + rr;
        step_rows<T, NV>(p, sp, rr, static_cast<int>(std::min<int64_t>(kRows, head_rows - rr)),
                         c, n, sc.qt.data() + ((h - item.head_begin) * tiles + rt) * (D / 32) * 256,
                         kb, vt, sc.m.data() + row, sc.l_lanes.data() + row * 16,
                         sc.acc.data() + row * D, ahead);
      }
    }
    ahead.rest();
  }
}

}  // namespace amx
}  // namespace pagedllm_attention

#endif
