// gemm_bf16 on AMX tiles (Intel since Sapphire Rapids: AMX-TILE and AMX-BF16), for every
// call whose K is a multiple of 32, whatever its rows; included by cpu_gemm.cpp.
//
// The packed panels [ceil(N / 48), K / 2, 48, 2] are already what tdpbf16ps multiplies:
// 16 pair steps of 16 columns are a weight tile (rows 192 bytes apart), 16 rows of x by
// 32 of K the other operand, so a panel is 3 tiles wide and the weight needs no other
// layout. A row tile of x (16 rows; a call of fewer configures that many) walks one
// panel over all of K into 3 float32 sum tiles, which then go through memory to
// gemm_bf16's epilogue (sum + bias, rounded once to bfloat16; `accumulate` as there).
//
// tdpbf16ps sums products its own way: its bits are neither vdpbf16ps's nor a float32
// FMA chain's (measured: about half of 51200 outputs differ from each). So on a CPU that
// runs these tiles every call with such a K takes them, decode rows included: a row's
// result is then the same whatever the batch (each row of a tile is summed alone, the K
// steps in one order; `tests/models/test_cpu_layer_ops.py` checks rows alone against
// batches of up to 300). Calls of 16 rows or more run whole tiles: the last partial tile
// reads its rows from a zero-padded copy.
#pragma once

#include "amx.h"

#if defined(PAGEDLLM_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDLLM_GEMM_AMX 1

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "simd.h"
#include "work_split.h"

namespace pagedllm_ops {
namespace gemm_amx {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileK = 32;        // K per step: one 64-byte row of a tile
constexpr int64_t kPanelCols = 48;    // a panel: 3 tiles of 16 columns
constexpr int64_t kBlockTiles = 8;    // row tiles per block (128 rows: x stays in L2)

// Tiles 0-2: the sums (rows x 16 float32); 3: x (rows x 32 bfloat16); 4-6: the weight
// (16 pair steps x 16 columns x 2).
inline pagedllm_amx::TileConfig tile_config(int rows) {
  pagedllm_amx::TileConfig c;
  for (int t = 0; t < 7; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = t < 4 ? rows : 16;
  }
  return c;
}

// sums [rows][48] (192 bytes a row) = x's rows (ldx elements apart, as configured) times
// one panel over K. `lead` > 0: prefetch the panel that many bytes ahead of the reads (a
// call that streams its weight).
inline void panel_sums(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t k,
                       float* sums, int64_t lead) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  constexpr int64_t step_elems = kTileK / 2 * 2 * kPanelCols;  // 16 pair steps of 48 x 2
  for (int64_t kk = 0; kk < k; kk += kTileK) {
    const uint16_t* w = panel + kk / kTileK * step_elems;
    if (lead > 0) {
      const char* ahead = reinterpret_cast<const char*>(w) + lead;
      for (int64_t l = 0; l < step_elems * 2; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T1);
    }
    _tile_loadd(3, x + kk, ldx * 2);
    _tile_loadd(4, w, 4 * kPanelCols);
    _tile_loadd(5, w + 32, 4 * kPanelCols);
    _tile_loadd(6, w + 64, 4 * kPanelCols);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  _tile_stored(0, sums, 4 * kPanelCols);
  _tile_stored(1, sums + 16, 4 * kPanelCols);
  _tile_stored(2, sums + 32, 4 * kPanelCols);
}

// out [m, n] = x [m, k] . W^T (+ bias) from `panels` panels of N; `store(row, col, mask,
// sum)` writes 16 (mask) columns of sums + bias: the caller's epilogue. k % 32 == 0.
// `source.panel(p, scratch)` gives panel p's [K / 2, 48, 2] elements: packed bfloat16
// weights give theirs in place (PackedPanels); quantized ones are dequantized into the
// thread's `scratch` of source.scratch_elems() (quant_amx_bf16.h), once per block of
// `block_tiles` row tiles. Calls of up to kStreamRows rows claim their panels in runs of
// at least `min_run_panels`, and prefetch them `stream_lead` bytes ahead (as cpu_gemm.cpp's
// streaming calls).
template <typename Source, typename Store>
void run(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, const Source& source,
         int64_t panels, int64_t n, const float* bias, int64_t min_run_panels,
         int64_t stream_lead, int64_t block_tiles, Store&& store) {
  // A partial last tile of a call of 16 rows or more: its rows, then zeros.
  const int64_t full = m >= kTileRows ? m / kTileRows : 0;
  const int64_t tiles = m >= kTileRows ? (m + kTileRows - 1) / kTileRows : 1;
  std::unique_ptr<uint16_t[]> padded;
  if (m >= kTileRows && full < tiles) {
    padded = std::make_unique<uint16_t[]>(kTileRows * k);  // zeroed
    for (int64_t r = full * kTileRows; r < m; ++r)
      std::memcpy(padded.get() + (r - full * kTileRows) * k, x + r * ldx, k * 2);
  }
  const int config_rows = static_cast<int>(std::min(m, kTileRows));
  const bool stream = m <= kStreamRows;
  // Small calls take microseconds, less than waking the other threads.
  const bool parallel = n * k * (m + 16) > (1 << 21);
  const int64_t blocks = (tiles + block_tiles - 1) / block_tiles;
  ClaimCounters next_panel(blocks);
  // Panel p (its elements at w) for row tile t: sums, then the epilogue for its rows.
  auto tile_panel = [&](int64_t t, int64_t p, const uint16_t* w, float* sums) {
    const uint16_t* xt = t < full || m < kTileRows ? x + t * kTileRows * ldx : padded.get();
    const int64_t lx = t < full || m < kTileRows ? ldx : k;
    panel_sums(xt, lx, w, k, sums, stream ? stream_lead : 0);
    const int64_t cols = std::min(kPanelCols, n - p * kPanelCols);
    const int64_t rows = std::min(kTileRows, m - t * kTileRows);
    for (int64_t j = 0; j < 3 && 16 * j < cols; ++j) {
      const int64_t c0 = 16 * j;
      const __mmask16 mask =
          cols - c0 >= 16 ? 0xffff : static_cast<__mmask16>((1u << (cols - c0)) - 1);
      const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + p * kPanelCols + c0)
                                       : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r)
        store(t * kTileRows + r, p * kPanelCols + c0, mask,
              _mm512_add_ps(_mm512_loadu_ps(sums + r * kPanelCols + c0), b));
    }
  };
#pragma omp parallel if (parallel)
  {
    const pagedllm_amx::Tiles held(tile_config(config_rows));
    alignas(64) float sums[kTileRows * kPanelCols];
    std::unique_ptr<uint16_t[], pagedllm_simd::FreeAligned> scratch;
    if (source.scratch_elems() > 0)
      scratch.reset(static_cast<uint16_t*>(std::aligned_alloc(64, source.scratch_elems() * 2)));
    const int64_t threads = omp_get_num_threads();
    for (int64_t bk = 0; bk < blocks; ++bk) {
      const int64_t t0 = bk * block_tiles, t1 = std::min(tiles, t0 + block_tiles);
      claim_runs(next_panel[bk], panels, threads, stream ? min_run_panels : 1,
                 [&](int64_t p0, int64_t p1) {
                   for (int64_t p = p0; p < p1; ++p) {
                     const uint16_t* w = source.panel(p, scratch.get());
                     for (int64_t t = t0; t < t1; ++t) tile_panel(t, p, w, sums);
                   }
                 });
    }
  }
}

// Packed bfloat16 panels [ceil(N / 48), K / 2, 48, 2] (cpu_gemm.cpp), read in place.
struct PackedPanels {
  const uint16_t* w;
  int64_t panel_elems;  // K * 48
  const uint16_t* panel(int64_t p, uint16_t*) const { return w + p * panel_elems; }
  int64_t scratch_elems() const { return 0; }
};

}  // namespace gemm_amx
}  // namespace pagedllm_ops

#endif
