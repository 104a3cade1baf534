// Native linear layers: out [M, N] = x [M, K] . W^T + bias with float32 sums.
// - gemm_bf16 (AVX512-BF16, or AVX2 + FMA below): bfloat16 x and W, one rounding to
//   bfloat16 at the end (with `accumulate`, the rounded result is then added to out and
//   rounded again, as out.add_(linear(x)) would). W packed once (pack_native in
//   models/layers/linear.py) into panels of 48 output columns: [ceil(N / 48), K / 2, 48,
//   2], so one vdpbf16ps multiplies a broadcast pair of x's columns by 16 columns of W.
// - gemm_f32 (AVX-512F or AVX2 + FMA; a scalar path with the same bits elsewhere):
//   float32 x and W, panels [ceil(N / 48), K, 48], one FMA per (row, column, k). It
//   exists for batch invariance (DESIGN.md §10): oneDNN's float32 GEMM picks its
//   blocking of K by the number of rows, so a row's sums depended on the batch it came in.
// An AVX-512 micro-kernel keeps 8 rows x 48 columns of sums in 24 registers and walks K
// once, one chain per output in K order whatever the row count (the AVX2 ones, below,
// do the same in smaller blocks, and in chunks of K above a few rows); threads split the
// panels (claimed in runs at a few rows: work_split.h) or, on long prefills, the rows.
// Measured (bf16) on this repo's 2-core Zen 5 VM, SmolLM2-135M shapes, weights cold: at 64 rows ~920 GFLOP/s against
// oneDNN's packed GEMM's ~620; at 2048 rows about equal (~880); at one row it streams
// the weights at ~49 GB/s (with the next panel prefetched, since left to the hardware
// prefetcher at up to 4 rows: measured faster on Zen 4, not remeasured on Zen 5). Up to
// 4 rows the weight is read with non-temporal loads (load_weight).

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <memory>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gemm_amx.h"
#include "ops.h"
#include "simd.h"
#include "work_split.h"

namespace pagedllm_ops {
namespace {

constexpr int64_t kPanel = 48;      // output columns per panel (3 vectors of 16)
constexpr int64_t kRows = 8;        // rows per micro-kernel call
// Bytes of x kept in cache (L2 / L3) while the panels go by.
constexpr int64_t kRowBlockBytes = 4 << 20;
// From this many rows threads split the rows, not the panels: each thread's outputs then
// sit in its own cache for the row-parallel ops that follow (norms, RoPE, SiLU, adds,
// attention). Measured on a 2048-token prefill step: those ops 1.6-5x faster than after
// a panel split (RMSNorm 40 -> 8 ms over 30 layers), and the GEMMs ~15% faster too;
// below it (decode batches) splitting the panels streams each weight once.
constexpr int64_t kRowSplitMin = 256;
// Calls of up to kStreamRows rows (work_split.h) leave the streaming of their weight to
// the hardware prefetcher: the micro-kernel's loop is then so short that the software
// prefetches of the next panel only compete with it. Measured on Zen 4 (30 SmolLM2
// layers, weights cold, in-process A/B): one row 9.37 -> 8.17 ms per step and the LM head
// 1.76 -> 1.45 ms (39 GB/s) without them, 4 rows -5%, 6 rows even; from 8 rows the
// prefetch wins (12 rows +17% without it). They also claim their panels in runs, at
// least this many at a time.
constexpr int64_t kMinRunPanels = 2;

// AVX2: calls of more than kStreamRows rows (compute-bound) walk K in chunks of this
// many steps (a 24 KB slice of a panel: float32 [128, 48], bfloat16 [128, 48, 2]), each
// chunk for a group of rows whose x fits kGroupBytes (Gemm::run_chunked). A walk over the
// whole K read each block's weight from L2 at 96 bytes a step (more than L1 holds: a
// panel is 110 KB at K = 576, 295 KB at 1536), and at K = 1536 a thread's x and panel
// together overflowed L2. Measured on Zen 3 (2 threads, SmolLM2's 4 shapes, in-process
// A/B, same bits; GFLOP/s): float32 79 -> 91-96 at 64 rows, 90 -> 91-94 at 128, 87 ->
// 95-96 at 2048 (the down projection, K = 1536: 73 -> 87, 81 -> 95); bfloat16 62 -> 73-76,
// 80 -> 80, 64 -> 69-74. 64 and 96 steps, or 96 KB of x, measured slower; 256 steps and
// 384 KB even.
constexpr int64_t kChunkSteps = 128;
constexpr int64_t kGroupBytes = 256 << 10;
// AVX2 bfloat16 calls of at least this many rows (per thread) widen each chunk of a panel
// to float32 once (64 pair steps: 24 KB) and run the float32 kernels over it, for every
// row of the group: no widening in the inner loop, whose shifts competed with the FMAs
// (the same bits: the same FMAs in the same order). Measured on Zen 3 (2 threads,
// SmolLM2's shapes, in-process A/B; GFLOP/s): 55 -> 58 at 8 rows, 59 -> 66 at 12, 69 ->
// 74 at 16, 82 -> 90-91 at 64, 78 -> 87-89 at 128, 85 -> 98 at 2048 (float32, the same
// run: 91-92); at 5 rows 39 -> 38, so fewer rows keep widening in registers.
constexpr int64_t kWidenRows = 8;

// Spreads `lines` cache-line prefetches of `ahead` (the next panel's share of this call)
// evenly over the `steps` steps of a K loop, the remainder carried (Bresenham-style).
struct Prefetcher {
  const char* ahead;
  int64_t lines, steps, next = 0, carry = 0;
  inline void step() {
    for (carry += lines; carry >= steps; carry -= steps)
      __builtin_prefetch(ahead + 64 * next++, 0, 2);
  }
  inline void finish() {
    for (; next < lines; ++next) __builtin_prefetch(ahead + 64 * next, 0, 2);
  }
};

#if defined(__AVX512F__)
// 64 bytes of a packed weight (64-byte aligned when kStream: vmovntdqa requires it).
// kStream: a call that reads each weight line once (at most kStreamRows rows, one
// micro-kernel call per panel) loads it with the non-temporal hint, so the stream does
// not evict what the rest of the step uses (the KV cache, activations, the interpreter's
// working set) from L2 and L3. Measured on Zen 4 (2 threads, in-process A/B, same bits):
// bfloat16 single-request decode 7.91 -> 7.41 ms per engine step; 30 SmolLM2 layers'
// GEMMs alone (212 MB, one row) 7.99 -> 6.39 ms, float32 (425 MB) 15.4 -> 14.8 ms; at 2
// and 4 rows within noise. (The quantized GEMM's loads were tried the same way: Q4_1
// decode no faster, so it keeps plain loads.)
template <bool kStream>
inline __m512i load_weight(const void* p) {
  if constexpr (kStream) return _mm512_stream_load_si512(const_cast<void*>(p));
  return _mm512_loadu_si512(p);
}
#endif

// A micro-kernel: rows [0, R) of x (row stride ldx, in X units) times one panel over
// `steps` steps of K; adds bias, stores (or, accumulate, adds to) the first `cols` columns
// of each row; prefetches `ahead_lines` lines from `ahead` meanwhile. One chain of sums
// per output over K in order, whatever R: a row's result must not depend on how many rows
// share its call (batch invariance, DESIGN.md §10).
template <typename X, typename W, typename O>
using MicroFn = void (*)(const X* x, int64_t ldx, const W* panel, int64_t steps,
                         const float* bias, O* out, int64_t ldo, int64_t cols, bool accumulate,
                         const char* ahead, int64_t ahead_lines);

// A K chunk of a micro-kernel call (chunk_avx2, below).
template <typename X, typename W, typename O>
using ChunkFn = void (*)(const X* x, int64_t ldx, const W* panel, int64_t steps,
                         float* part, bool first, bool last, const float* bias, O* out,
                         int64_t ldo, int64_t cols, bool accumulate, const char* ahead,
                         int64_t ahead_lines);

#if defined(__AVX512F__)
// The micro-kernels' epilogue: for each of the panel's 3 vectors of columns that exist
// (the last may be partial: `mask`), hands acc + bias of each row to `store`.
template <int R, typename Store>
inline void each_output(const __m512 (&acc)[R][3], const float* bias, int64_t cols,
                        Store&& store) {
  for (int j = 0; j < 3; ++j) {
    const int64_t c0 = 16 * j;
    if (c0 >= cols) break;
    const __mmask16 mask =
        cols - c0 >= 16 ? 0xffff : static_cast<__mmask16>((1u << (cols - c0)) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store(r, c0, mask, _mm512_add_ps(acc[r][j], b));
  }
}
#endif

// AVX2 kernels (Zen 2/3, Intel client cores; also AVX-512 CPUs without AVX512-BF16 for
// bfloat16): x as float32 rows (gemm_bf16 widens its bfloat16 x first, exactly), the
// weight widened to float32 in registers (a bfloat16 pair step [48, 2] splits into its
// even and odd k), one FMA chain per output over K in order. float32: the same bits as
// the AVX-512 kernel and the scalar one. bfloat16: float32 sums rounded once to bfloat16,
// so a row's result does not depend on the batch (vdpbf16ps's pairwise sums round
// differently: the bits differ from an AVX512-BF16 CPU's, as any kernel of another ISA).
// AVX2 has 16 registers, not 32, so a call runs in blocks of R rows x V vectors of 8
// columns whose sums stay in registers (Blocks, below).
#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_GEMM_AVX2 1

// k per step: 2 for bfloat16 pairs (uint16_t), 1 for float32 and float16 (c10::Half,
// panels laid out as float32's, for gemm_f32 over float16 weights).
template <typename W>
constexpr int kSubSteps = std::is_same_v<W, uint16_t> ? 2 : 1;

// 8 consecutive weights of a one-k step as float32 (float16 widened exactly, F16C).
inline __m256 load_w8(const float* w) { return _mm256_loadu_ps(w); }
#if defined(__F16C__)
inline __m256 load_w8(const c10::Half* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
#endif

// How far ahead of its reads a bfloat16 block that streams its weight from memory
// prefetches it (kAhead, below). A Zen 3 core keeps too few misses in flight for the
// hardware prefetcher alone to overlap the stream with the arithmetic (the widening
// doubles a step's work against float32's). Measured on Zen 3 (2 threads, 30 SmolLM2
// layers, one row, weights cold, in-process A/B, same bits): 452 -> 394 us a layer in one
// run, 472 -> 438 and 487 -> 458 in others (512 B: -5%, 2 KB / 4 KB and prefetches into
// L2: less); single-request decode 20.9 -> 20.0 ms a step. float32's stream (half the
// work a byte) measured no faster with it.
constexpr int64_t kStreamAhead = 1024;

template <int R, int V, typename W, typename O, bool kAhead = false>
inline void block_avx2(const float* x, int64_t ldx, const W* panel, int64_t steps,
                       const float* bias, O* out, int64_t ldo, int64_t cols, bool accumulate,
                       Prefetcher* pf, const float* part_in = nullptr,
                       float* part_out = nullptr) {
  constexpr int S = kSubSteps<W>;
  __m256 acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j)
      acc[r][j] = part_in != nullptr ? _mm256_loadu_ps(part_in + r * kPanel + 8 * j)
                                     : _mm256_setzero_ps();
  // A local copy: stores through `pf` inside the loop made GCC keep `acc` in memory.
  Prefetcher prefetch = pf != nullptr ? *pf : Prefetcher{nullptr, 0, steps};
  if constexpr (S == 1 && R * V + V + 1 <= 16) {
    // float32 with room for the step's weight vectors in registers: each is loaded once
    // and the rows' broadcasts take turns in the last register. Left to itself GCC folds
    // the loads into the FMAs (R loads of each vector per step, R x V + R in all), and the
    // loads then bound the loop. Measured on Zen 3, 4 x 3, SmolLM2's shapes at 64 rows:
    // one thread 41-46 -> 74-80 GFLOP/s, two 80 -> 90 (in-process A/B, the same bits);
    // batch64.json float32 122 / 127 -> 185 / 184 output tok/s (interleaved runs).
    for (int64_t kk = 0; kk < steps; ++kk) {
      const W* w = panel + kk * kPanel;
      prefetch.step();
      __m256 wv[V];
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) {
        wv[j] = load_w8(w + 8 * j);
        pagedllm_simd::in_register(wv[j]);  // not a memory operand of each FMA
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + kk);
#pragma GCC unroll 8
        for (int j = 0; j < V; ++j) acc[r][j] = _mm256_fmadd_ps(xb, wv[j], acc[r][j]);
      }
    }
  } else if constexpr (S == 2 && !kAhead && R >= 3 && R * V + V + 1 <= 16) {
    // bfloat16 blocks of 3+ rows (compute-bound): a pair step's halves one after the
    // other, each widened into V registers (its lines re-read from L1), so 3 rows' sums
    // fit beside them; 2 x 3 blocks have too few chains (2 dependent FMAs each per step) to
    // keep both FMA pipes busy. Measured on Zen 3 (SmolLM2's shapes, in-process A/B, same
    // bits), 3 x 3 against 2 x 3 with both halves kept: 2 threads 95 -> 99 GFLOP/s at 64
    // rows and 107 -> 121 at 128, one thread 67 -> 74. (4 x 3 leaves GCC short of
    // registers: spills, 121 against 2 x 3's 127; 2 x 3 this way: 114.)
    for (int64_t kk = 0; kk < steps; ++kk) {
      const W* w = panel + kk * kPanel * S;
      prefetch.step();
#pragma GCC unroll 2
      for (int s = 0; s < 2; ++s) {
        __m256 wv[V];
#pragma GCC unroll 8
        for (int j = 0; j < V; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j));
          // The odd half by two shifts, not a mask: the mask's register would push a sum
          // out to the stack.
          wv[j] = _mm256_castsi256_ps(
              s == 0 ? _mm256_slli_epi32(raw, 16)
                     : _mm256_slli_epi32(_mm256_srli_epi32(raw, 16), 16));
          pagedllm_simd::in_register(wv[j]);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 xb = _mm256_broadcast_ss(x + r * ldx + kk * 2 + s);
#pragma GCC unroll 8
          for (int j = 0; j < V; ++j) acc[r][j] = _mm256_fmadd_ps(xb, wv[j], acc[r][j]);
        }
      }
    }
  } else {
    for (int64_t kk = 0; kk < steps; ++kk) {
      const W* w = panel + kk * kPanel * S;
      prefetch.step();
      if constexpr (kAhead) {  // the step's 3 lines, kStreamAhead on
        const char* ahead = reinterpret_cast<const char*>(w) + kStreamAhead;
        for (int line = 0; line < 3; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) {
        __m256 wv[S];
        if constexpr (S == 1) {
          wv[0] = load_w8(w + 8 * j);
        } else {  // 8 columns x (k, k + 1) as bfloat16 pairs: k in the low halves
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j));
          wv[0] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
          wv[1] = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-65536)));
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
          for (int s = 0; s < S; ++s)
            acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + kk * S + s), wv[s],
                                        acc[r][j]);
      }
    }
  }
  if (pf != nullptr) *pf = prefetch;
  if (part_out != nullptr) {  // a K chunk before the last: the sums as they stand
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) _mm256_storeu_ps(part_out + r * kPanel + 8 * j, acc[r][j]);
    return;
  }
  alignas(32) float sums[R][V][8];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) _mm256_store_ps(sums[r][j], acc[r][j]);
  // out = sum + bias, or out + (sum + bias) (bfloat16: each sum rounded, as
  // out.add_(linear(x))); a partial last vector goes through a buffer (the panel's
  // columns past `cols` belong to no output).
  for (int j = 0; j < V; ++j) {
    const int64_t c0 = 8 * j;
    if (c0 >= cols) break;
    const int64_t n = std::min<int64_t>(8, cols - c0);
    alignas(32) float b8[8] = {};
    if (bias != nullptr) std::copy(bias + c0, bias + c0 + n, b8);
    const __m256 b = _mm256_load_ps(b8);
    for (int r = 0; r < R; ++r) {
      O* o = out + r * ldo + c0;
      O o8[8] = {};
      O* dst = n == 8 ? o : o8;
      if (accumulate && n < 8) std::copy(o, o + n, o8);
      __m256 sum = _mm256_add_ps(_mm256_load_ps(sums[r][j]), b);
      if constexpr (std::is_same_v<O, float>) {
        if (accumulate) sum = _mm256_add_ps(_mm256_loadu_ps(dst), sum);
        _mm256_storeu_ps(dst, sum);
      } else {
        auto* bf = reinterpret_cast<c10::BFloat16*>(dst);
        if (accumulate)
          sum = _mm256_add_ps(pagedllm_simd::load8(bf), pagedllm_simd::round_to8<c10::BFloat16>(sum));
        pagedllm_simd::store8(bf, sum);
      }
      if (n < 8) std::copy(o8, o8 + n, o);
    }
  }
}

// Block shapes (rows x vectors of 8 columns) whose sums, weight and broadcasts fit the 16
// registers (checked in the generated code: no spills but 3 in bfloat16's 2 x 6). Calls
// of up to kStreamRows rows stream the weight from memory: rows go kStreamBlock at a time
// over the whole panel (each pass reads it front to back, the next from L2). Larger ones
// are compute-bound: rows go kRowBlock at a time over column groups of kGroup vectors;
// float32's 8 rows split evenly (with 3-row blocks the 2-row tail took ~19% of a batch64
// run's samples). float32 holds a step's 3 weight vectors in registers (4 x 3 sums + 3 +
// one broadcast at a time; block_avx2); bfloat16 goes 3 + 3 + 2 rows, the 3-row blocks
// widening one half of a pair step at a time (3 x 3 sums + 3 + one broadcast), the 2-row
// tail both halves of a vector at once (2 x 3 sums + 4 broadcasts + 2 halves). Measured
// on Zen 3 (2 threads, 30 SmolLM2 layers' shapes, rows 64 / 128), with float32's weight
// then read as memory operands of the FMAs: float32 4 x 3 115-119 GFLOP/s (4 x 2: 98-101,
// 3 x 3: 99-107; oneDNN's packed float32 GEMM 123-144 on the same shapes), bfloat16 2 x 3
// 125-127 (3 x 2: 99-118); the 3-row bfloat16 blocks: block_avx2. (bfloat16 calls of
// kWidenRows rows or more per thread now run float32's blocks on widened chunks, so its
// own compute-bound blocks serve calls of 5 to 7 rows.)
template <typename W>
struct Blocks {
  static constexpr int kStreamBlock = 2, kRowBlock = 4, kGroup = 3;
};
template <>
struct Blocks<uint16_t> {
  static constexpr int kStreamBlock = 2, kRowBlock = 3, kGroup = 3;
};

// Rows [r0, r0 + RB) of a block run, then the rest, RB at a time; over column groups of V
// vectors. The prefetch of the next panel rides on the first block's walk over K.
// kAhead: the first block streams the weight from memory (the others re-read it from L2).
template <int R, int RB, int V, typename W, typename O, bool kAhead = false>
inline void run_blocks(const float* x, int64_t ldx, const W* panel, int64_t steps,
                       const float* bias, O* out, int64_t ldo, int64_t cols, bool accumulate,
                       Prefetcher*& pf, const float* part_in = nullptr,
                       float* part_out = nullptr) {
  for (int64_t c = 0; c < kPanel && c < cols; c += 8 * V) {
    block_avx2<std::min(R, RB), V, W, O, kAhead>(
        x, ldx, panel + c * kSubSteps<W>, steps, bias != nullptr ? bias + c : nullptr, out + c,
        ldo, cols - c, accumulate, pf, part_in != nullptr ? part_in + c : nullptr,
        part_out != nullptr ? part_out + c : nullptr);
    pf = nullptr;
  }
  if constexpr (R > RB)
    run_blocks<R - RB, RB, V, W, O>(
        x + RB * ldx, ldx, panel, steps, bias, out + RB * ldo, ldo, cols, accumulate, pf,
        part_in != nullptr ? part_in + RB * kPanel : nullptr,
        part_out != nullptr ? part_out + RB * kPanel : nullptr);
}

// R rows (1..8) of x times K steps [c0, c0 + steps) of one panel, a chunk of a call
// run in K chunks (Gemm::run_chunked): the sums start from `part` (rows kPanel apart)
// unless `first`, and go back there unless `last` (then the epilogue).
template <int R, typename W, typename O>
void chunk_avx2(const float* x, int64_t ldx, const W* panel, int64_t steps, float* part,
                bool first, bool last, const float* bias, O* out, int64_t ldo, int64_t cols,
                bool accumulate, const char* ahead, int64_t ahead_lines) {
  Prefetcher pf{ahead, ahead_lines, steps};
  Prefetcher* first_pf = &pf;
  run_blocks<R, Blocks<W>::kRowBlock, Blocks<W>::kGroup>(x, ldx, panel, steps, bias, out, ldo,
                                                          cols, accumulate, first_pf,
                                                          first ? nullptr : part,
                                                          last ? nullptr : part);
  pf.finish();
}

// R rows (1..8) of x times one panel. The AVX2 GEMMs send calls of more than kStreamRows
// rows to run_chunked, so here those rows are only the table's filling: one chunk.
template <int R, typename W, typename O>
void micro_avx2(const float* x, int64_t ldx, const W* panel, int64_t steps, const float* bias,
                O* out, int64_t ldo, int64_t cols, bool accumulate, const char* ahead,
                int64_t ahead_lines) {
  if constexpr (R <= kStreamRows) {
    Prefetcher pf{ahead, ahead_lines, steps};
    Prefetcher* first = &pf;
    run_blocks<R, Blocks<W>::kStreamBlock, 6, W, O, std::is_same_v<W, uint16_t>>(
        x, ldx, panel, steps, bias, out, ldo, cols, accumulate, first);
    pf.finish();
  } else {
    chunk_avx2<R, W, O>(x, ldx, panel, steps, nullptr, true, true, bias, out, ldo, cols,
                        accumulate, ahead, ahead_lines);
  }
}

// Widens `steps` pair steps of a bfloat16 panel ([steps, 48, 2]) into float32 [2 * steps,
// 48]: k = 2s and 2s + 1 of step s in turn (exact).
inline void widen_pairs(const uint16_t* chunk, int64_t steps, float* out) {
  const __m256i high = _mm256_set1_epi32(-65536);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* w = chunk + s * 2 * kPanel;
    float* even = out + 2 * s * kPanel;
#pragma GCC unroll 6
    for (int j = 0; j < kPanel / 8; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + 8 * j), _mm256_slli_epi32(raw, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + kPanel + 8 * j),
                          _mm256_and_si256(raw, high));
    }
  }
}

#if defined(__F16C__)
// Widens `steps` steps of a float16 panel ([steps, 48]) into float32 [steps, 48] (exact).
inline void widen_halves(const c10::Half* chunk, int64_t steps, float* out) {
  for (int64_t i = 0; i < steps * kPanel; i += 8) _mm256_storeu_ps(out + i, load_w8(chunk + i));
}
#endif

template <typename W, typename O>
constexpr ChunkFn<float, W, O> kChunkAvx2[kRows + 1] = {
    nullptr,           chunk_avx2<1, W, O>, chunk_avx2<2, W, O>, chunk_avx2<3, W, O>,
    chunk_avx2<4, W, O>, chunk_avx2<5, W, O>, chunk_avx2<6, W, O>, chunk_avx2<7, W, O>,
    chunk_avx2<8, W, O>};

// bfloat16 weights, float32 x, O outputs (no non-temporal loads here): bfloat16 outputs
// for gemm_bf16, float32 for gemm_f32 over weights stored as bfloat16.
template <typename O>
constexpr MicroFn<float, uint16_t, O> kMicroBf16Avx2[kRows + 1] = {
    nullptr, micro_avx2<1, uint16_t, O>, micro_avx2<2, uint16_t, O>,
    micro_avx2<3, uint16_t, O>, micro_avx2<4, uint16_t, O>,
    micro_avx2<5, uint16_t, O>, micro_avx2<6, uint16_t, O>,
    micro_avx2<7, uint16_t, O>, micro_avx2<8, uint16_t, O>};

#if defined(__F16C__)
// float16 weights, float32 x and outputs (gemm_f32 over float16 weights).
constexpr MicroFn<float, c10::Half, float> kMicroF16Avx2[kRows + 1] = {
    nullptr, micro_avx2<1, c10::Half, float>, micro_avx2<2, c10::Half, float>,
    micro_avx2<3, c10::Half, float>, micro_avx2<4, c10::Half, float>,
    micro_avx2<5, c10::Half, float>, micro_avx2<6, c10::Half, float>,
    micro_avx2<7, c10::Half, float>, micro_avx2<8, c10::Half, float>};
#endif
#endif

#if defined(__AVX512BF16__)
// 16 (mask) sums rounded to bfloat16 and stored; with `accumulate`, out += the rounded
// product, rounded again: what out.add_(x . W^T + b) gives.
inline void store_bf16(uint16_t* out, __mmask16 mask, __m512 sum, bool accumulate) {
  __m256i v = (__m256i)_mm512_cvtneps_pbh(sum);
  if (accumulate) {
    const __m512 prev = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, out));
    v = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(prev, _mm512_cvtpbh_ps((__m256bh)v)));
  }
  _mm256_mask_storeu_epi16(out, mask, v);
}

// bfloat16: a step is a pair of K (x read as int32 pairs, the panel as [pairs, 48, 2]).
// (Split sums for R = 1, 2 kept the units busier, but one row streams the weights from
// memory anyway: measured no slower on single-request decode.)
template <int R, bool kStream>
void micro_bf16(const int32_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs,
                const float* bias, uint16_t* out, int64_t ldo, int64_t cols, bool accumulate,
                const char* ahead, int64_t ahead_lines) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_ps();
  Prefetcher pf{ahead, ahead_lines, pairs};
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const uint16_t* w = panel + kk * 2 * kPanel;
    const __m512bh w0 = (__m512bh)load_weight<kStream>(w);
    const __m512bh w1 = (__m512bh)load_weight<kStream>(w + 32);
    const __m512bh w2 = (__m512bh)load_weight<kStream>(w + 64);
    pf.step();
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(x[r * ldx + kk]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xr);
    }
  }
  pf.finish();
  each_output<R>(acc, bias, cols, [&](int r, int64_t c0, __mmask16 mask, __m512 sum) {
    store_bf16(out + r * ldo + c0, mask, sum, accumulate);
  });
}

// bfloat16 by FMAs (Intel's AVX512-BF16 cores, see bf16_gemm_by_fma): x as float32 rows
// (widened exactly), each pair step of the panel split in registers into its even and
// odd k as float32 (a bfloat16 is the top half of its float32), one FMA chain per output
// over K in order, rounded once to bfloat16: the AVX2 kernels' arithmetic, at AVX-512's
// width. vdpbf16ps adds each pair's two products before the running sum; with one
// vdpbf16ps per cycle against two FMAs it computed ~1.6x slower on the Intel Xeon
// measured (family 6 model 207, 2 threads, SmolLM2 shapes at 16-512 rows: ~170 GFLOP/s
// against ~260-300 for float32 FMAs); AMD's Zen 4 runs vdpbf16ps at twice its FMA rate.
template <int R, bool kStream>
void micro_bf16_fma(const float* x, int64_t ldx, const uint16_t* panel, int64_t pairs,
                    const float* bias, uint16_t* out, int64_t ldo, int64_t cols,
                    bool accumulate, const char* ahead, int64_t ahead_lines) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  Prefetcher pf{ahead, ahead_lines, pairs};
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const uint16_t* w = panel + kk * 2 * kPanel;
    const __m512i w0 = load_weight<kStream>(w), w1 = load_weight<kStream>(w + 32),
                  w2 = load_weight<kStream>(w + 64);
    pf.step();
    // k = 2 kk (the low halves), then k = 2 kk + 1 (the high ones): K in order.
    __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)),
           e1 = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)),
           e2 = _mm512_castsi512_ps(_mm512_slli_epi32(w2, 16));
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + 2 * kk]);
      acc[r][0] = _mm512_fmadd_ps(xr, e0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, e1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xr, e2, acc[r][2]);
    }
    e0 = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
    e1 = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
    e2 = _mm512_castsi512_ps(_mm512_and_si512(w2, high));
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + 2 * kk + 1]);
      acc[r][0] = _mm512_fmadd_ps(xr, e0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, e1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xr, e2, acc[r][2]);
    }
  }
  pf.finish();
  each_output<R>(acc, bias, cols, [&](int r, int64_t c0, __mmask16 mask, __m512 sum) {
    store_bf16(out + r * ldo + c0, mask, sum, accumulate);
  });
}

template <bool kStream>
constexpr MicroFn<float, uint16_t, uint16_t> kMicroBf16Fma[kRows + 1] = {
    nullptr, micro_bf16_fma<1, kStream>, micro_bf16_fma<2, kStream>,
    micro_bf16_fma<3, kStream>, micro_bf16_fma<4, kStream>, micro_bf16_fma<5, false>,
    micro_bf16_fma<6, false>, micro_bf16_fma<7, false>, micro_bf16_fma<8, false>};

// Which kernels gemm_bf16 takes, fixed for the process: AMX tiles where the CPU has them
// and the OS grants them (gemm_amx.h; calls whose K is not a multiple of 32 take the
// next choice), else the FMA kernel or vdpbf16ps as pagedllm_simd::bf16_by_fma says.
// PAGEDLLM_CPU_BF16_GEMM=amx|fma|dpbf16 overrides (amx only where it runs).
enum class Bf16Gemm { kAmx, kFma, kDpbf16 };

Bf16Gemm bf16_gemm_mode() {
  static const Bf16Gemm mode = [] {
#if defined(PAGEDLLM_GEMM_AMX)
    if (pagedllm_amx::chosen("PAGEDLLM_CPU_BF16_GEMM")) return Bf16Gemm::kAmx;
#endif
    return pagedllm_simd::bf16_by_fma("PAGEDLLM_CPU_BF16_GEMM") ? Bf16Gemm::kFma
                                                                : Bf16Gemm::kDpbf16;
  }();
  return mode;
}

// [rows]: the micro-kernel for that many rows; kStream: the table of calls of at most
// kStreamRows rows (its larger entries, plain loads, are there only to fill it).
template <bool kStream>
constexpr MicroFn<int32_t, uint16_t, uint16_t> kMicroBf16[kRows + 1] = {
    nullptr, micro_bf16<1, kStream>, micro_bf16<2, kStream>, micro_bf16<3, kStream>,
    micro_bf16<4, kStream>, micro_bf16<5, false>, micro_bf16<6, false>, micro_bf16<7, false>,
    micro_bf16<8, false>};
#endif

// float32: a step is one k (the panel is [K, 48]); out = acc + bias, or out + (acc + bias).
#if defined(__AVX512F__)
template <int R, bool kStream>
void micro_f32(const float* x, int64_t ldx, const float* panel, int64_t k, const float* bias,
               float* out, int64_t ldo, int64_t cols, bool accumulate, const char* ahead,
               int64_t ahead_lines) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_ps();
  Prefetcher pf{ahead, ahead_lines, k};
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* w = panel + kk * kPanel;
    const __m512 w0 = _mm512_castsi512_ps(load_weight<kStream>(w)),
                 w1 = _mm512_castsi512_ps(load_weight<kStream>(w + 16)),
                 w2 = _mm512_castsi512_ps(load_weight<kStream>(w + 32));
    pf.step();
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + kk]);
      acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xr, w2, acc[r][2]);
    }
  }
  pf.finish();
  each_output<R>(acc, bias, cols, [&](int r, int64_t c0, __mmask16 mask, __m512 sum) {
    if (accumulate) sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out + r * ldo + c0), sum);
    _mm512_mask_storeu_ps(out + r * ldo + c0, mask, sum);
  });
}
#elif defined(PAGEDLLM_GEMM_AVX2)
template <int R, bool kStream>
constexpr auto micro_f32 = micro_avx2<R, float, float>;
#else
// The same operations one lane at a time (std::fma rounds once, as vfmadd does): the same
// bits as the AVX-512 kernel (kStream, its load hint, means nothing here).
template <int R, bool kStream>
void micro_f32(const float* x, int64_t ldx, const float* panel, int64_t k, const float* bias,
               float* out, int64_t ldo, int64_t cols, bool accumulate, const char* ahead,
               int64_t ahead_lines) {
  float acc[R][kPanel] = {};
  Prefetcher pf{ahead, ahead_lines, k};
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* w = panel + kk * kPanel;
    pf.step();
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * ldx + kk];
      for (int64_t j = 0; j < kPanel; ++j) acc[r][j] = std::fma(xr, w[j], acc[r][j]);
    }
  }
  pf.finish();
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      const float v = acc[r][j] + bias[j];
      out[r * ldo + j] = accumulate ? out[r * ldo + j] + v : v;
    }
  }
}
#endif

template <bool kStream>
constexpr MicroFn<float, float, float> kMicroF32[kRows + 1] = {
    nullptr, micro_f32<1, kStream>, micro_f32<2, kStream>, micro_f32<3, kStream>,
    micro_f32<4, kStream>, micro_f32<5, false>, micro_f32<6, false>, micro_f32<7, false>,
    micro_f32<8, false>};

// One GEMM call: x [m, steps] (X units), panels [panels, steps, step_elems] of W, out
// [m, n]. `micros[R]` handles R rows.
template <typename X, typename W, typename O>
struct Gemm {
  const MicroFn<X, W, O>* micros;
  const X* x;
  int64_t ldx;
  const W* w;
  int64_t steps, step_elems;
  const float* bias;
  O* out;
  int64_t ldo, m, n, panels;
  bool accumulate;
  // The AVX2 kernels' K-chunked form of `micros` (X = float) for calls of more than
  // kStreamRows rows (run_chunked), else nullptr.
  const ChunkFn<X, W, O>* chunked = nullptr;
  // bfloat16 on AVX2: the float32 kernels' chunked form, and what widens a chunk of
  // `steps` pair steps of a panel into float32 [2 * steps, kPanel] for them.
  const ChunkFn<X, float, O>* widened = nullptr;
  void (*widen)(const W* chunk, int64_t steps, float* out) = nullptr;

  // Rows [m0, m1) x panels [p0, p1) in K chunks of kChunkSteps: a chunk of a panel stays
  // in L1 while a group of rows (their x within kGroupBytes: L2) goes by, and the sums
  // wait in `part` between chunks (float32 stored and reloaded as is: the same chain of
  // FMAs per output, the same bits as one walk over K).
  void run_chunked(int64_t m0, int64_t m1, int64_t p0, int64_t p1) const {
    const int64_t panel_elems = steps * step_elems, per_step = step_elems / kPanel;
    const int64_t step_bytes = step_elems * static_cast<int64_t>(sizeof(W));
    const int64_t cap = std::max<int64_t>(
        kRows, kGroupBytes / (steps * per_step * 4) / kRows * kRows);
    const int64_t groups = (m1 - m0 + cap - 1) / cap;
    const int64_t group_rows = ((m1 - m0 + groups - 1) / groups + kRows - 1) / kRows * kRows;
    const auto part = std::make_unique_for_overwrite<float[]>(group_rows * kPanel);
    const bool widening = widened != nullptr && m1 - m0 >= kWidenRows;
    const int64_t chunk_steps = widening ? kChunkSteps / per_step : kChunkSteps;
    // On cache lines, as the packed panels are: from malloc's 16-byte alignment half the
    // kernels' 32-byte loads of it straddled two lines.
    std::unique_ptr<float[], pagedllm_simd::FreeAligned> wide;
    if (widening)
      wide.reset(static_cast<float*>(std::aligned_alloc(64, kChunkSteps * kPanel * sizeof(float))));
    for (int64_t g0 = m0; g0 < m1; g0 += group_rows) {
      const int64_t g1 = std::min(m1, g0 + group_rows);
      const int64_t blocks = (g1 - g0 + kRows - 1) / kRows;
      for (int64_t p = p0; p < p1; ++p) {
        const W* panel = w + p * panel_elems;
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        for (int64_t c0 = 0; c0 < steps; c0 += chunk_steps) {
          const int64_t c1 = std::min(steps, c0 + chunk_steps);
          // Prefetched meanwhile, a share per row block: the next chunk, or the next
          // panel's first.
          const W* next = c1 < steps ? panel + c1 * step_elems
                                     : (p + 1 < p1 ? panel + panel_elems : nullptr);
          const int64_t lines =
              next != nullptr
                  ? std::min(chunk_steps, c1 < steps ? steps - c1 : steps) * step_bytes / 64
                  : 0;
          const int64_t share = (lines + blocks - 1) / blocks;
          if (widening) widen(panel + c0 * step_elems, c1 - c0, wide.get());
          for (int64_t mm = g0, b = 0; mm < g1; mm += kRows, ++b) {
            const int64_t rows = std::min(kRows, g1 - mm);
            const char* ahead =
                next ? reinterpret_cast<const char*>(next) + 64 * b * share : nullptr;
            const int64_t ahead_lines = std::clamp<int64_t>(lines - b * share, 0, share);
            const bool first = c0 == 0, last = c1 == steps;
            float* sums = part.get() + (mm - g0) * kPanel;
            const float* b_p = bias ? bias + p * kPanel : nullptr;
            O* o = out + mm * ldo + p * kPanel;
            if (widening)
              widened[rows](x + mm * ldx + c0 * per_step, ldx, wide.get(), (c1 - c0) * per_step,
                            sums, first, last, b_p, o, ldo, cols, accumulate, ahead, ahead_lines);
            else
              chunked[rows](x + mm * ldx + c0 * per_step, ldx, panel + c0 * step_elems, c1 - c0,
                            sums, first, last, b_p, o, ldo, cols, accumulate, ahead, ahead_lines);
          }
        }
      }
    }
  }

  // Panels [p0, p1) for rows [m0, m1). While a panel is in use, the next one is
  // prefetched a slice per row block (above kStreamRows rows): weights stream from
  // memory once per call (decode steps re-read every layer's weights), and without the
  // prefetch each panel's first reads stall.
  //
  // A streaming call (kStreamRows rows or fewer: one micro-kernel call per panel) instead
  // prefetches its own panel pagedllm_simd::stream_prefetch_bytes() ahead of the reads,
  // where that is on.
  void run_panels(int64_t m0, int64_t m1, int64_t p0, int64_t p1) const {
    const bool stream = m1 - m0 <= kStreamRows;
    if (!stream && chunked != nullptr) return run_chunked(m0, m1, p0, p1);
    const int64_t lead = stream ? pagedllm_simd::stream_prefetch_bytes() : 0;
    const int64_t panel_elems = steps * step_elems;
    const int64_t panel_lines = panel_elems * static_cast<int64_t>(sizeof(W)) / 64;
    const int64_t blocks = (m1 - m0 + kRows - 1) / kRows;
    const int64_t share = (panel_lines + blocks - 1) / blocks;
    for (int64_t p = p0; p < p1; ++p) {
      const W* panel = w + p * panel_elems;
      // (Prefetches past the weight's end are harmless: they never fault.)
      const char* next = nullptr;
      if (!stream && p + 1 < p1)
        next = reinterpret_cast<const char*>(panel + panel_elems);
      else if (lead > 0)
        next = reinterpret_cast<const char*>(panel) + lead;
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      for (int64_t mm = m0, b = 0; mm < m1; mm += kRows, ++b) {
        const int64_t lines = next ? std::clamp<int64_t>(panel_lines - b * share, 0, share) : 0;
        micros[std::min(kRows, m1 - mm)](x + mm * ldx, ldx, panel, steps,
                                         bias ? bias + p * kPanel : nullptr,
                                         out + mm * ldo + p * kPanel, ldo, cols, accumulate,
                                         next ? next + 64 * b * share : nullptr, lines);
      }
    }
  }

  void run() const {
    // Small calls take microseconds, less than waking the other threads; a few rows still
    // stream the whole weight (a row's work counts ~1/16 of a panel's reading).
    const int64_t k = steps * step_elems / kPanel;
    const bool parallel = n * k * (m + 16) > (1 << 21);
    // x holds k per row as float32 (4 bytes each) or as bfloat16 pairs in int32 (2).
    const int64_t row_bytes = k * (std::is_same_v<X, float> ? 4 : 2);
    const int64_t row_block = std::max<int64_t>(kRows, kRowBlockBytes / row_bytes / kRows * kRows);
    const int64_t unit_cap = std::max<int64_t>(kRows, kGroupBytes / row_bytes / kRows * kRows);
    const int64_t max_threads = omp_get_max_threads();
    ClaimCounters cursors(max_threads);
    for (int64_t m0 = 0; m0 < m; m0 += row_block) {
      const int64_t m1 = std::min(m, m0 + row_block);
      std::atomic<int64_t> next_panel{0};
      cursors.reset(max_threads);
#pragma omp parallel if (parallel)
      {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        if (m1 - m0 <= kStreamRows) {
          // Streaming the weight is all the call does: runs of panels claimed in turn.
          claim_runs(next_panel, panels, threads, kMinRunPanels,
                     [&](int64_t p0, int64_t p1) { run_panels(m0, m1, p0, p1); });
        } else if (panels >= threads && m1 - m0 < kRowSplitMin) {
          // Compute-bound too: runs of panels claimed in turn, shrinking to one, so a
          // thread that runs slower (a VM's vCPU, a busy SMT sibling) is not waited for.
          claim_runs(next_panel, panels, threads, 1,
                     [&](int64_t p0, int64_t p1) { run_panels(m0, m1, p0, p1); });
        } else {
          // Many rows, or fewer panels than threads: each thread takes its own even share
          // of the rows (kept in its cache for the ops that follow) in units of up to
          // unit_cap rows, then the units of the others that they have not reached.
          const auto share = [&](int64_t o) {
            const int64_t blocks = (m1 - m0 + kRows - 1) / kRows;
            const int64_t r0 = m0 + blocks * o / threads * kRows;
            return RowShare(r0, std::min(m1, m0 + blocks * (o + 1) / threads * kRows), unit_cap,
                            kRows);
          };
          claim_own_then_others(
              cursors.data(), threads, t, [&](int64_t o) { return share(o).units; },
              [&](int64_t o, int64_t j) {
                const RowShare s = share(o);
                run_panels(s.r0 + j * s.unit, std::min(s.r1, s.r0 + (j + 1) * s.unit), 0,
                           panels);
              });
        }
      }
    }
  }
};

// Whether a call takes the kStream micro-kernels (load_weight): a few rows, and panels
// on 64-byte boundaries (a panel step is 192 bytes, so the weight's start decides).
bool streams(const at::Tensor& x, const at::Tensor& weight) {
  return x.size(0) <= kStreamRows && reinterpret_cast<uintptr_t>(weight.data_ptr()) % 64 == 0;
}

// gemm_bf16's call: x (bfloat16 pairs, or rows widened to float32) times the packed
// bfloat16 weight, through `micros`.
template <typename X>
void run_gemm_bf16(const MicroFn<X, uint16_t, uint16_t>* micros, const X* x, int64_t ldx,
                   const at::Tensor& out, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, bool accumulate,
                   const ChunkFn<X, uint16_t, uint16_t>* chunked = nullptr,
                   const ChunkFn<X, float, uint16_t>* widened = nullptr,
                   void (*widen)(const uint16_t*, int64_t, float*) = nullptr) {
  Gemm<X, uint16_t, uint16_t> g{micros,
                                x,
                                ldx,
                                reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                                weight.size(1),
                                2 * kPanel,
                                bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                reinterpret_cast<uint16_t*>(out.data_ptr()),
                                out.stride(0),
                                out.size(0),
                                out.size(1),
                                weight.size(0),
                                accumulate};
  g.chunked = chunked;
  g.widened = widened;
  g.widen = widen;
  g.run();
}

// The checks both GEMMs share: out [M, N] with contiguous rows, N within the panels;
// bias a contiguous float32 [N].
void check_out_bias(const char* op, const at::Tensor& out, const at::Tensor& x,
                    int64_t panels, at::ScalarType dtype, const char* dtype_name,
                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                  out.size(1) <= panels * kPanel && out.size(1) > (panels - 1) * kPanel &&
                  out.scalar_type() == dtype,
              op, ": out is a ", dtype_name, " [M, N] with contiguous rows");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == out.size(1)),
              op, ": bias must be a contiguous float32 [N]");
}

// x [M, K] bfloat16 widened to float32 rows (exact, K apart) in a plain buffer, for the
// kernels that multiply in float32 (the Intel FMA and AVX2 paths): a tensor's allocation
// and dispatch cost ~2 us a call, and a decode step makes 4 calls a layer (in-process A/B
// on Zen 3, single-request bfloat16 decode: 17.5 -> 17.2 ms a step, median of 16).
[[maybe_unused]] std::unique_ptr<float[]> widened_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1);
  auto xf = std::make_unique_for_overwrite<float[]>(m * k);
  const auto* xb = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
  for (int64_t r = 0; r < m; ++r)
    pagedllm_simd::widen_bf16(xb + r * x.stride(0), xf.get() + r * k, k);
  return xf;
}

}  // namespace

void gemm_bf16(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
               const std::optional<at::Tensor>& bias, bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "gemm_bf16: x is a bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous() && weight.size(2) == kPanel &&
                  weight.size(3) == 2 && weight.size(1) * 2 == x.size(1) &&
                  weight.scalar_type() == at::kBFloat16,
              "gemm_bf16: weight is packed bfloat16 [ceil(N / 48), K / 2, 48, 2]");
  check_out_bias("gemm_bf16", out, x, weight.size(0), at::kBFloat16, "bfloat16", bias);
  TORCH_CHECK(x.stride(0) % 2 == 0, "gemm_bf16: x rows must start on bfloat16 pairs");
#if defined(__AVX512BF16__)
  const Bf16Gemm mode = bf16_gemm_mode();
#if defined(PAGEDLLM_GEMM_AMX)
  if (mode == Bf16Gemm::kAmx && x.size(1) % gemm_amx::kTileK == 0) {
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    const int64_t ldo = out.stride(0);
    gemm_amx::run(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), x.size(0),
                  x.size(1),
                  gemm_amx::PackedPanels{reinterpret_cast<const uint16_t*>(weight.data_ptr()),
                                         x.size(1) * gemm_amx::kPanelCols},
                  weight.size(0), out.size(1),
                  bias.has_value() ? bias->data_ptr<float>() : nullptr, kMinRunPanels,
                  pagedllm_simd::stream_prefetch_bytes(), gemm_amx::kBlockTiles,
                  [&](int64_t r, int64_t c0, __mmask16 mask, __m512 sum) {
                    store_bf16(op + r * ldo + c0, mask, sum, accumulate);
                  });
    return;
  }
#endif
  if (mode != Bf16Gemm::kDpbf16) {
    const auto xf = widened_rows(x);
    run_gemm_bf16(streams(x, weight) ? kMicroBf16Fma<true> : kMicroBf16Fma<false>, xf.get(),
                  x.size(1), out, weight, bias, accumulate);
    return;
  }
  run_gemm_bf16(streams(x, weight) ? kMicroBf16<true> : kMicroBf16<false>,
                reinterpret_cast<const int32_t*>(x.data_ptr()), x.stride(0) / 2, out, weight,
                bias, accumulate);
#elif defined(PAGEDLLM_GEMM_AVX2)
  const auto xf = widened_rows(x);
  run_gemm_bf16(kMicroBf16Avx2<uint16_t>, xf.get(), x.size(1), out, weight, bias, accumulate,
                kChunkAvx2<uint16_t, uint16_t>, kChunkAvx2<float, uint16_t>, widen_pairs);
#else
  TORCH_CHECK(false, "gemm_bf16 needs AVX512-BF16 or AVX2 with FMA");
#endif
}

#if defined(PAGEDLLM_GEMM_AVX2) && !defined(__AVX512F__) && defined(__F16C__)
namespace {

// gemm_f32 over 16-bit weights W (bfloat16 pairs: uint16_t, or float16: c10::Half) whose
// packed panels hold `step_elems` per step: the AVX2 kernels widening W exactly.
template <typename W>
void gemm_f32_over(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                   const at::Tensor& bias, bool accumulate, const MicroFn<float, W, float>* micros,
                   int64_t step_elems, void (*widen)(const W*, int64_t, float*)) {
  Gemm<float, W, float> g{micros,
                          x.data_ptr<float>(),
                          x.stride(0),
                          reinterpret_cast<const W*>(weight.data_ptr()),
                          weight.size(1),
                          step_elems,
                          bias.data_ptr<float>(),
                          out.data_ptr<float>(),
                          out.stride(0),
                          x.size(0),
                          out.size(1),
                          weight.size(0),
                          accumulate};
  g.chunked = kChunkAvx2<W, float>;
  g.widened = kChunkAvx2<float, float>;
  g.widen = widen;
  g.run();
}

}  // namespace
#define PAGEDLLM_GEMM_F32_OVER_16BIT 1
#endif

void gemm_f32(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
              const at::Tensor& bias, bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "gemm_f32: x is a float32 [M, K] with contiguous rows");
  if (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf) {
    // float32 weights that are exactly bfloat16 or float16 (such a checkpoint, or an F16
    // GGUF file, run in float32), stored as such: bfloat16 in gemm_bf16's pairs, float16
    // in float32's layout. Each output is the same FMA chain over K in order as from the
    // float32 panels (widened exactly, in registers or a chunk at a time), so the same
    // bits from half the bytes, which is what a decode step reads.
    const bool pairs = weight.scalar_type() == at::kBFloat16;
    TORCH_CHECK(weight.dim() == (pairs ? 4 : 3) && weight.is_contiguous() &&
                    weight.size(2) == kPanel && (!pairs || weight.size(3) == 2) &&
                    weight.size(1) * (pairs ? 2 : 1) == x.size(1),
                "gemm_f32: a 16-bit weight is packed bfloat16 [ceil(N / 48), K / 2, 48, 2] "
                "or float16 [ceil(N / 48), K, 48]");
    check_out_bias("gemm_f32", out, x, weight.size(0), at::kFloat, "float32", bias);
#if defined(PAGEDLLM_GEMM_F32_OVER_16BIT)
    if (pairs)
      gemm_f32_over<uint16_t>(out, x, weight, bias, accumulate, kMicroBf16Avx2<float>,
                              2 * kPanel, widen_pairs);
    else
      gemm_f32_over<c10::Half>(out, x, weight, bias, accumulate, kMicroF16Avx2, kPanel,
                               widen_halves);
    return;
#else
    // The AVX-512 float32 kernel reads float32 panels; these would need their own.
    TORCH_CHECK(false, "gemm_f32: 16-bit weights need the AVX2 build (AVX2, FMA and F16C, "
                       "no AVX-512)");
#endif
  }
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && weight.size(2) == kPanel &&
                  weight.size(1) == x.size(1) && weight.scalar_type() == at::kFloat,
              "gemm_f32: weight is packed float32 [ceil(N / 48), K, 48]");
  check_out_bias("gemm_f32", out, x, weight.size(0), at::kFloat, "float32", bias);
  Gemm<float, float, float> g{streams(x, weight) ? kMicroF32<true> : kMicroF32<false>,
                              x.data_ptr<float>(),      x.stride(0),
                              weight.data_ptr<float>(), weight.size(1),
                              kPanel,                   bias.data_ptr<float>(),
                              out.data_ptr<float>(),    out.stride(0),
                              x.size(0),                out.size(1),
                              weight.size(0),           accumulate};
#if defined(PAGEDLLM_GEMM_AVX2) && !defined(__AVX512F__)
  g.chunked = kChunkAvx2<float, float>;
#endif
  g.run();
}

bool bf16_gemm_amx() {
#if defined(PAGEDLLM_GEMM_AMX)
  return bf16_gemm_mode() == Bf16Gemm::kAmx;
#else
  return false;
#endif
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("bf16_gemm_amx() -> bool", &pagedllm_ops::bf16_gemm_amx);
  m.def(
      "gemm_bf16(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, bool accumulate=False) "
      "-> ()");
  m.def(
      "gemm_f32(Tensor(a!) out, Tensor x, Tensor weight, Tensor bias, bool accumulate=False) "
      "-> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("gemm_bf16", &pagedllm_ops::gemm_bf16);
  m.impl("gemm_f32", &pagedllm_ops::gemm_f32);
}
