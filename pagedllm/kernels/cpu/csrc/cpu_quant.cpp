// Linear layers on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q4_K,
// Q5_K, Q6_K), dequantized in registers: out [M, N] = x [M, K] . dequant(W)^T + bias, as
// llama.cpp computes it.
//
// Activations: each row of x is quantized to int8 in blocks of 32 (d = max|x| / 127,
// q = round(x / d), and the sums of q over the block and over each half of 16), as
// llama.cpp's Q8_0 / Q8_1 / Q8_K activations. A row's quantization depends on that row
// alone, so its result does not depend on M.
//
// Weights (kernels/cpu/quant.py: repack) are kept as stored in the GGUF file, regrouped
// so that 16 output columns sit side by side: [ceil(N / 16), K / 32, block_bytes] (K-types:
// K / 256 super-blocks, laid out as quant_layout.h describes at kQ2KScales / kQ4KScales /
// kQ5KScales / kQ6KScales), where one (group, block) holds
//   Q4_0: qs [4][16 columns][4 bytes] | d [16] f16                              = 288 bytes
//   Q4_1: qs [4][16 columns][4 bytes] | d [16] f16 | m [16] f16                 = 320 bytes
//   Q5_0: qs [4][16 columns][4 bytes] | qh [16 columns][4 bytes] | d [16] f16   = 352 bytes
//   Q5_1: qs [4][16 columns][4 bytes] | qh [16 columns][4 bytes] | d | m        = 384 bytes
//   Q8_0: qs [8][16 columns][4 bytes] (q + 128 as uint8) | d [16]               = 544 bytes
// (the block size tells the type apart). Q4 bytes are ggml's: byte j of a block holds
// element j in its low nibble and element j + 16 in its high one; vector v of the group
// holds bytes [4v, 4v + 4) of each column, so its low nibbles pair with x[4v, 4v + 4)
// and its high nibbles with x[16 + 4v, 16 + 4v + 4). Q8_0 vector v holds elements
// [4v, 4v + 4). Q5's fifth bits (ggml's qh, a u32 per block) are regrouped as a "plane"
// that one vector of the group holds: byte i of a column has in bit v the fifth bit of
// element 4v + i (low nibble of vector v) and in bit 4 + v that of element 16 + 4v + i
// (its high nibble), so one shift and mask puts it at bit 4 of the nibble's byte.
// Weights are unsigned (q = 0..15, 0..31, 0..63 or q + 128), activations signed: one
// AVX512-VNNI vpdpbusd multiplies 4 pairs per lane for 16 columns at once, and
//   Q4_0: sum w x = d_w d_x (dot - 8 sum q_x)
//   Q5_0: sum w x = d_w d_x (dot - 16 sum q_x)
//   Q8_0: sum w x = d_w d_x (dot - 128 sum q_x)
//   Q4_1, Q5_1: sum w x = d_w d_x dot + m_w (d_x sum q_x)
//   Q4_K, Q5_K: sum w x = (d sc) d_x dot - (dmin m) (d_x sum q_x), per sub-block of 32
//   Q6_K: sum w x = (d sc) d_x (dot - 32 sum16 q_x), per sub-block of 16: an activation
//         block spans two, each with its own int32 dot (lower and upper 16 of the block,
//         which are exactly the low and the high nibbles of the Q4 byte layout; started
//         at -32 sum16 q_x) and its own float multiply-add, the lower one first
//   Q2_K: sum w x = (d sc) d_x dot - (dmin m) (d_x sum16 q_x), per sub-block of 16 (two
//         per activation block, the lower one first; sum16 from Q6_K's offset term / -32)
// the integer parts exact, the float parts in one fixed order per (row, column): block
// after block over K, whatever M and wherever the row sits in the batch (batch
// invariance, DESIGN.md §10). The AVX2 kernels (quant_avx2.h: CPUs without AVX512-VNNI)
// and the portable path (no AVX2 either) do the same float operations in the same order
// (_mm256_fmadd_ps, std::fma), so every path gives the same bits.
//
// Threads split the column groups (contiguous runs, so each streams its share of the
// weight once per call), also at M = 1; calls of a few rows claim the runs in turn
// (work_split.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "ops.h"
#include "quant_amx.h"
#include "quant_amx_bf16.h"
#include "quant_avx2.h"
#include "quant_avx512.h"
#include "quant_layout.h"
#include "simd.h"
#include "work_split.h"

namespace pagedllm_ops {
namespace {

using namespace quant;

constexpr int kRows = 8;        // rows per micro-kernel call
constexpr int64_t kRowBlock = 64;  // rows whose quantized x stays in L1/L2 while groups go by
// The AMX kernels' blocks: each group's weights are spread to bytes once per block, and
// 256 rows of quantized x (K = 1536: 384 KB) stay in L2.
constexpr int64_t kAmxRowBlock = 256;
// Calls of up to kStreamRows rows claim their column groups in runs of at least this many
// (work_split.h): they do little more than stream the weight.
constexpr int64_t kMinRunGroups = 4;


template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// Which kernels run: AMX (quant_amx.h), AVX512-VNNI, AVX2 (quant_avx2.h) or the portable
// C++; each is in the library where the compiler targets a CPU that has it. All give the
// same bits. Or AMX bfloat16 tiles on the dequantized weights (quant_amx_bf16.h: bfloat16
// x on every block type but Q2_K), whose bits are the dequantized model's instead.
enum class Path { kAmx, kAvx512, kAvx2, kPortable, kAmxBf16 };

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHasAvx512 = true;
#else
constexpr bool kHasAvx512 = false;
#endif
#if defined(PAGEDLLM_QUANT_AVX2)
constexpr bool kHasAvx2 = true;
#else
constexpr bool kHasAvx2 = false;
#endif
#if defined(PAGEDLLM_QUANT_AMX)
// Whether the AMX kernels are in the build and this process may use the tiles.
inline bool amx_usable() { return pagedllm_amx::granted(); }
#else
inline bool amx_usable() { return false; }
#endif

// Rows from which `auto` takes the AMX kernels (for the block types they have): each tile
// computes 16 rows whatever the call's count, so calls of a few rows do better on AVX-512
// (measured on an Intel Xeon with AMX, 2 threads, SmolLM2's Q4_1 shapes: see
// docs/architecture.md).
constexpr int64_t kAmxMinRows = 32;

// The path named by gemm_quant's `path` argument for a call of `rows` rows on `type`
// ("auto": AMX for compute-bound calls where usable, else the widest compiled; "int8":
// the same among the int8 kernels only).
Path path_of(c10::string_view name, int64_t rows, QType type, bool bf16_x) {
  if (name == "auto" || name == "int8") {
#if defined(PAGEDLLM_QUANT_AMX_BF16)
    // Every call, whatever its rows (a row's bits may not depend on the batch).
    if (name == "auto" && bf16_x && amx_bf16::supports(type) && amx_bf16::chosen())
      return Path::kAmxBf16;
#endif
#if defined(PAGEDLLM_QUANT_AMX)
    if (rows >= kAmxMinRows && amx::supports(type) && amx_usable()) return Path::kAmx;
#endif
    return kHasAvx512 ? Path::kAvx512 : (kHasAvx2 ? Path::kAvx2 : Path::kPortable);
  }
  if (name == "portable") return Path::kPortable;
  if (name == "amx_bf16") {
#if defined(PAGEDLLM_QUANT_AMX_BF16)
    TORCH_CHECK(bf16_x && amx_bf16::supports(type) && amx_bf16::usable(),
                "gemm_quant: path 'amx_bf16' takes bfloat16 x on Q8_0 / Q4_0 / Q4_1 / Q5_0 / "
                "Q5_1 / Q4_K / Q5_K / Q6_K blocks, "
                "where the OS grants the tiles");
    return Path::kAmxBf16;
#else
    TORCH_CHECK(false, "gemm_quant: path 'amx_bf16' is not in this build (a CPU without "
                "AMX-BF16 or AVX512-VBMI)");
#endif
  }
  if (name == "amx") {
    TORCH_CHECK(amx_usable(), "gemm_quant: path 'amx' is not in this build or not granted "
                "by the OS (a CPU without AMX-INT8, or Linux before 5.16)");
    return Path::kAmx;
  }
  if (name == "avx512" || name == "avx2") {
    const bool avx512 = name == "avx512";
    TORCH_CHECK(avx512 ? kHasAvx512 : kHasAvx2, "gemm_quant: path '", std::string(name),
                "' is not in this build (compiled for a CPU without it)");
    return avx512 ? Path::kAvx512 : Path::kAvx2;
  }
  TORCH_CHECK(false,
              "gemm_quant: path must be auto, int8, amx_bf16, amx, avx512, avx2 or portable, "
              "got '",
              std::string(name), "'");
}

// Column groups per claimed step: compute-bound calls of the AVX-512 `micro` take
// two at a time (its G); decode-sized ones one, as they only stream the weight. (The
// K-types' kernels stay at one: a two-group micro_q4k, one sub-block at a time, measured
// slower on the Intel Xeon, Q4_K ~780 -> ~730 GOP/s at 128 rows; theirs already keeps
// two dot chains per row.)
inline int64_t groups_per_step(Path path, QType type, int64_t rows) {
  const bool super = type == QType::kQ2_K || type == QType::kQ4_K || type == QType::kQ5_K ||
                     type == QType::kQ6_K;
  // AMX calls claim groups in pairs too (each still one at a time): a group's bfloat16
  // outputs are 32 bytes a row, so two threads writing neighbouring groups shared every
  // row's cache line (Intel Xeon with AMX, 2 threads, SmolLM2's Q4_1 shapes: 972 -> 1022
  // GOP/s at 64 rows, 1045 -> 1096 at 128).
  if (path == Path::kAmx && rows > kStreamRows) return 2;
  return path == Path::kAvx512 && !super && rows > kStreamRows ? 2 : 1;
}

// One block of 32 of x quantized, per path: q, and the sums of q over its halves of 16
// into s (the SIMD paths: all of it into s[0] unless asked for `halves`, two reductions
// that cost ~1% of a Q4 prefill GEMM, so only Q6_K and Q2_K ask); returns d.
template <typename T>
float quantize_block_portable(const T* xb, int8_t* q, int32_t s[2]) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(to_f(xb[i])));
  const float db = amax / 127.0f;
  const float id = db != 0.0f ? 1.0f / db : 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) {
    // nearbyint: round half to even (the default mode), as vcvtps2dq.
    const int32_t qi = static_cast<int32_t>(std::nearbyint(to_f(xb[i]) * id));
    q[i] = static_cast<int8_t>(qi);
    s[i / 16] += qi;
  }
  return db;
}

#if defined(__AVX512F__)
template <typename T>
float quantize_block_avx512(const T* xb, int8_t* q, int32_t s[2], bool halves) {
  using namespace pagedllm_simd;
  const __m512 v0 = load16(xb), v1 = load16(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float db = amax / 127.0f;
  const float id = db != 0.0f ? 1.0f / db : 0.0f;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  s[0] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));  // all in s[0]
  if (halves) {  // split into the two halves
    s[1] = _mm512_reduce_add_epi32(q1);
    s[0] -= s[1];
  }
  return db;
}

// 16 blocks of 32 of x at once, without `halves`: quantize_block_avx512's arithmetic, the
// 16 horizontal maxima and sums taken together by one reduce16 each and the divisions 16
// lanes wide (IEEE division rounds alike at any width; max and integer sums are exact in
// any order), so the same bits. One block at a time is a chain of latencies (a reduction,
// two divisions, a reduction) that the core overlaps poorly: ~3.6% of a 128-token Q4_1
// prefill on the Intel Xeon measured.
template <typename T>
void quantize_16_blocks_avx512(const T* x, int8_t* q, float* d, int32_t* sum, float* dsum) {
  using namespace pagedllm_simd;
  auto max = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  auto add_epi32 = [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  __m512 v[16];
  for (int b = 0; b < 16; ++b) {
    v[kSlotOfLane[b]] = _mm512_max_ps(_mm512_abs_ps(load16(x + b * kBlock)),
                                      _mm512_abs_ps(load16(x + b * kBlock + 16)));
  }
  const __m512 db = _mm512_div_ps(reduce16(v, max), _mm512_set1_ps(127.0f));
  // 1 / d, or 0 where d is 0 (unordered counts as nonzero, as `db != 0.0f` does).
  const __mmask16 nonzero = _mm512_cmp_ps_mask(db, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  alignas(64) float id[16];
  _mm512_store_ps(id, _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0f), db));
  for (int b = 0; b < 16; ++b) {
    const __m512 scale = _mm512_set1_ps(id[b]);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + b * kBlock), scale));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + b * kBlock + 16), scale));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtepi32_epi8(q1));
    v[kSlotOfLane[b]] = _mm512_castsi512_ps(_mm512_add_epi32(q0, q1));
  }
  const __m512i sums = _mm512_castps_si512(reduce16(v, add_epi32));
  _mm512_storeu_ps(d, db);
  _mm512_storeu_si512(sum, sums);
  _mm512_storeu_ps(dsum, _mm512_mul_ps(db, _mm512_cvtepi32_ps(sums)));
}
#endif

// Quantize x [K] (float32 or bfloat16) into the row's buffers; the same bits on every
// path. off16: Q6_K and Q2_K only, else nullptr.
template <typename T>
void quantize_row(Path path, const T* x, int64_t k, int8_t* q, float* d, int32_t* sum,
                  float* dsum, int32_t* off16) {
  int64_t b = 0;
#if defined(__AVX512F__)
  if (path == Path::kAvx512 && off16 == nullptr) {
    for (; b + 16 <= k / kBlock; b += 16)
      quantize_16_blocks_avx512(x + b * kBlock, q + b * kBlock, d + b, sum + b, dsum + b);
  }
#endif
  for (; b < k / kBlock; ++b) {
    const T* xb = x + b * kBlock;
    int8_t* qb = q + b * kBlock;
    int32_t s[2] = {0, 0};  // sums over the two halves of 16
    float db;
#if defined(__AVX512F__)
    if (path == Path::kAvx512) {
      db = quantize_block_avx512(xb, qb, s, off16 != nullptr);
    } else
#endif
#if defined(PAGEDLLM_QUANT_AVX2)
    if (path == Path::kAvx2) {
      db = avx2::quantize_block(xb, qb, s, off16 != nullptr);
    } else
#endif
    {
      db = quantize_block_portable(xb, qb, s);
    }
    d[b] = db;
    sum[b] = s[0] + s[1];
    dsum[b] = db * static_cast<float>(sum[b]);
    if (off16 != nullptr) {
      off16[2 * b] = -32 * s[0];
      off16[2 * b + 1] = -32 * s[1];
    }
  }
}

// Q4 byte pairing: element j of 32 (K-types: of 64, `half` 32) in the nibbles of the
// group's vectors `qs`, column c; `plane`, if any, adds Q5's fifth bit (layout above).
inline int32_t q4_at(const uint8_t* qs, const uint8_t* plane, int64_t c, int64_t j,
                     int64_t half) {
  const int64_t l = j % half, high = j / half;  // the byte of the element, which nibble
  const int64_t at = (l / 4) * 64 + c * 4 + l % 4;
  int32_t w = high ? (qs[at] >> 4) : (qs[at] & 0x0f);
  if (plane != nullptr) {
    const int64_t v = l / 4;  // the element's vector: plane v / 4, bit v % 4 (+ 4: high)
    w |= ((plane[(v / 4) * 64 + c * 4 + l % 4] >> (v % 4 + 4 * high)) & 1) << 4;
  }
  return w;
}

// The unsigned weight of column c, element i of block `blk` (portable path).
inline int32_t weight_at(const uint8_t* blk, const Layout& L, int64_t c, int64_t i) {
  switch (L.type) {
    case QType::kQ8_0: return blk[(i / 4) * 64 + c * 4 + i % 4];
    case QType::kQ4_0: case QType::kQ4_1: return q4_at(blk, nullptr, c, i, 16);
    case QType::kQ5_0: case QType::kQ5_1: return q4_at(blk, blk + 256, c, i, 16);
    case QType::kQ4_K: case QType::kQ5_K: {  // i: an element of the super-block, in [0, 256)
      const int64_t chunk = i / 64;
      const uint8_t* plane = L.type == QType::kQ5_K ? blk + kQ5KPlanes + chunk * 128 : nullptr;
      return q4_at(blk + chunk * 512, plane, c, i % 64, 32);
    }
    case QType::kQ2_K: {  // i: an element of the super-block
      const int64_t r = i % 16;
      return (blk[(i / 16) * 64 + c * 4 + r % 4] >> (2 * (r / 4))) & 3;
    }
    case QType::kQ6_K: {
      const uint8_t* b = blk + (i / 32) * kQ6KBlock;
      const int64_t j = i % 32, l = j % 16;  // j: in the block; l: its byte
      const uint8_t top = b[256 + (j / 16) * 64 + c * 4 + l % 4];
      return q4_at(b, nullptr, c, j, 16) | (((top >> (2 * (l / 4))) & 3) << 4);
    }
  }
  return 0;
}

// Portable: one (row, column) over all blocks, the same float operations in the same
// order as the SIMD path.
inline float dot_portable(const QuantRows& x, int64_t m, const uint8_t* wg,
                          int64_t block_bytes, const Layout& L, int64_t c) {
  const int8_t* q = x.q + m * x.k;
  const int64_t per = L.elems / kBlock;  // activation blocks per weight block
  float acc = 0.0f;
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = wg + (b / per) * block_bytes;
    const int64_t sub = b % per;  // K-types: the sub-block of 32
    const int64_t i = m * x.nb + b;
    // lower and upper 16 weights (Q6_K: from its offset term, as the SIMD path)
    int32_t dot[2] = {0, 0};
    if (L.type == QType::kQ6_K) {
      dot[0] = x.off16[2 * i];
      dot[1] = x.off16[2 * i + 1];
    }
    for (int64_t e = 0; e < kBlock; ++e)
      dot[e / 16] += weight_at(blk, L, c, sub * kBlock + e) * q[b * kBlock + e];
    const int32_t dot32 = dot[0] + dot[1];
    switch (L.type) {
      case QType::kQ6_K:
        for (int64_t h = 0; h < 2; ++h) {
          const int8_t sc = static_cast<int8_t>(blk[kQ6KScales + 32 + (2 * sub + h) * 16 + c]);
          const float dw = half_at(blk + kQ6KScales, c) * static_cast<float>(sc);
          acc = std::fma(dw * x.d[i], static_cast<float>(dot[h]), acc);
        }
        break;
      case QType::kQ2_K:
        for (int64_t h = 0; h < 2; ++h) {
          const uint8_t sc = blk[kQ2KScales + 64 + (2 * sub + h) * 16 + c];
          const float dw = half_at(blk + kQ2KScales, c) * static_cast<float>(sc & 0x0F);
          const float mw = half_at(blk + kQ2KScales + 32, c) * static_cast<float>(sc >> 4);
          const float ds = x.d[i] * static_cast<float>(x.off16[2 * i + h] / -32);
          acc = std::fma(dw * x.d[i], static_cast<float>(dot[h]), acc);
          acc = std::fma(-mw, ds, acc);
        }
        break;
      case QType::kQ4_K: case QType::kQ5_K: {
        const uint8_t* s = blk + L.qs_bytes;
        const float dw = half_at(s, c) * static_cast<float>(s[64 + sub * 16 + c]);
        const float mw = half_at(s + 32, c) * static_cast<float>(s[192 + sub * 16 + c]);
        acc = std::fma(dw * x.d[i], static_cast<float>(dot32), acc);
        acc = std::fma(-mw, x.dsum[i], acc);
        break;
      }
      case QType::kQ4_1: case QType::kQ5_1: {
        const float dd = half_at(blk + L.qs_bytes, c) * x.d[i];
        acc = std::fma(dd, static_cast<float>(dot32), acc);
        acc = std::fma(half_at(blk + L.qs_bytes + 32, c), x.dsum[i], acc);
        break;
      }
      default: {
        const float dd = half_at(blk + L.qs_bytes, c) * x.d[i];
        acc = std::fma(dd, static_cast<float>(dot32 - L.offset * x.sum[i]), acc);
      }
    }
  }
  return acc;
}

// Portable: rows [m0, m1) x groups [g0, g1).
template <typename T>
void run_portable(const QuantRows& x, int64_t m0, int64_t m1, const uint8_t* w,
                  int64_t block_bytes, const Layout& L, const float* bias, T* out,
                  int64_t ldo, int64_t n, bool accumulate, int64_t g0, int64_t g1) {
  const int64_t blocks = x.nb / (L.elems / kBlock);  // weight blocks per group
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t cols = std::min(kGroup, n - g * kGroup);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t c = 0; c < cols; ++c) {
        const float acc = dot_portable(x, m, w + g * blocks * block_bytes, block_bytes, L, c);
        store_out(out + m * ldo, g * kGroup + c, acc + bias[g * kGroup + c], accumulate);
      }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Rows [0, R) (from `m`) of G adjacent column groups (from `wg`, group_bytes apart; `cols`
// columns left from the first one's), over all blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).
// G = 2 shares each broadcast of x between two groups: measured on an Intel Xeon (2 cores,
// SmolLM2's shapes at 128 rows, every output's bits unchanged) 5-15% faster than one group
// at a time; the float part of each output is the same chain whatever G. lead > 0:
// prefetch each block's lines that many bytes ahead (a streaming call, run_simd).
template <QType Q, int R, int G, typename T>
void micro(const QuantRows& x, int64_t m, const uint8_t* wg, int64_t group_bytes,
           int64_t block_bytes, const float* bias, T* out, int64_t ldo, int64_t cols,
           bool accumulate, int64_t lead) {
  constexpr bool q5 = Q == QType::kQ5_0 || Q == QType::kQ5_1;
  constexpr int64_t qs_bytes = Q == QType::kQ8_0 ? 512 : (q5 ? 320 : 256);
  constexpr int32_t offset = Q == QType::kQ8_0 ? 128 :
                             (Q == QType::kQ4_0 ? 8 : (Q == QType::kQ5_0 ? 16 : 0));
  __m512 acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    if (lead > 0) {
      const char* ahead = reinterpret_cast<const char*>(wg + b * block_bytes + lead);
      for (int64_t l = 0; l < block_bytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T1);
    }
    __m512i dot[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) dot[g][r] = _mm512_setzero_si512();
    if constexpr (Q == QType::kQ8_0) {
      for (int v = 0; v < 8; ++v) {
        __m512i wv[G];
        for (int g = 0; g < G; ++g)
          wv[g] = _mm512_loadu_si512(wg + g * group_bytes + b * block_bytes + 64 * v);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = bcast4(x.q + (m + r) * x.k + b * kBlock + 4 * v);
          for (int g = 0; g < G; ++g) dot[g][r] = _mm512_dpbusd_epi32(dot[g][r], wv[g], xv);
        }
      }
    } else {
      __m512i plane[G];
      for (int g = 0; g < G; ++g)
        plane[g] = q5 ? _mm512_loadu_si512(wg + g * group_bytes + b * block_bytes + 256)
                      : _mm512_setzero_si512();
#pragma GCC unroll 4  // shift_bits' counts as constants
      for (int v = 0; v < 4; ++v) {
        __m512i lo[G], hi[G];
        for (int g = 0; g < G; ++g)
          unpack_q4<q5>(_mm512_loadu_si512(wg + g * group_bytes + b * block_bytes + 64 * v),
                        plane[g], v, lo[g], hi[g]);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + (m + r) * x.k + b * kBlock;
          const __m512i xlo = bcast4(xq + 4 * v), xhi = bcast4(xq + 16 + 4 * v);
          for (int g = 0; g < G; ++g) {
            dot[g][r] = _mm512_dpbusd_epi32(dot[g][r], lo[g], xlo);
            dot[g][r] = _mm512_dpbusd_epi32(dot[g][r], hi[g], xhi);
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const uint8_t* blk = wg + g * group_bytes + b * block_bytes;
      const __m512 dw = load_halves(blk + qs_bytes);
      if constexpr (Q == QType::kQ4_1 || Q == QType::kQ5_1) {
        const __m512 mw = load_halves(blk + qs_bytes + 32);
        for (int r = 0; r < R; ++r) {
          const int64_t i = (m + r) * x.nb + b;
          const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i]));
          acc[g][r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dot[g][r]), acc[g][r]);
          acc[g][r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.dsum[i]), acc[g][r]);
        }
      } else {
        for (int r = 0; r < R; ++r) {
          const int64_t i = (m + r) * x.nb + b;
          const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i]));
          const __m512i adj =
              _mm512_sub_epi32(dot[g][r], _mm512_set1_epi32(offset * x.sum[i]));
          acc[g][r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(adj), acc[g][r]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    store_rows<R>(acc[g], bias + g * kGroup, out + m * ldo + g * kGroup, ldo,
                  std::min<int64_t>(kGroup, cols - g * kGroup), accumulate);
}

// Q4_K, Q5_K: rows [0, R) (from `m`) of one column group, over all super-blocks.
template <QType Q, int R, typename T>
void micro_q4k(const QuantRows& x, int64_t m, const uint8_t* wg, int64_t block_bytes,
               const float* bias, T* out, int64_t ldo, int64_t cols, bool accumulate) {
  constexpr bool q5 = Q == QType::kQ5_K;
  constexpr int64_t scales = q5 ? kQ5KScales : kQ4KScales;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < x.nb / 8; ++sb) {
    const uint8_t* blk = wg + sb * block_bytes;
    const __m512 d = load_halves(blk + scales), dmin = load_halves(blk + scales + 32);
    for (int chunk = 0; chunk < 4; ++chunk) {
      __m512i dot[2][R];  // sub-blocks 2 chunk (low nibbles) and 2 chunk + 1 (high)
      for (int r = 0; r < R; ++r) dot[0][r] = dot[1][r] = _mm512_setzero_si512();
      __m512i planes[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      if constexpr (q5) q5k_planes(blk, chunk, planes);
#pragma GCC unroll 8  // shift_bits' counts as constants
      for (int v = 0; v < 8; ++v) {
        __m512i lo, hi;
        unpack_q4<q5>(_mm512_loadu_si512(blk + chunk * 512 + 64 * v), planes[v / 4], v, lo, hi);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + (m + r) * x.k + sb * 256 + chunk * 64;
          dot[0][r] = _mm512_dpbusd_epi32(dot[0][r], lo, bcast4(xq + 4 * v));
          dot[1][r] = _mm512_dpbusd_epi32(dot[1][r], hi, bcast4(xq + 32 + 4 * v));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const int64_t sub = 2 * chunk + h;
        const __m512 dw = _mm512_mul_ps(d, load_bytes16(blk + scales + 64 + 16 * sub));
        const __m512 mw = _mm512_mul_ps(dmin, load_bytes16(blk + scales + 192 + 16 * sub));
        for (int r = 0; r < R; ++r) {
          const int64_t i = (m + r) * x.nb + sb * 8 + sub;
          const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[i]));
          acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(dot[h][r]), acc[r]);
          acc[r] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(x.dsum[i]), acc[r]);  // -mw dsum + acc
        }
      }
    }
  }
  store_rows<R>(acc, bias, out + m * ldo, ldo, cols, accumulate);
}

// Q6_K: rows [0, R) (from `m`) of one column group, over all super-blocks. Each block
// of 32 is a Q4_0 block (the low 4 bits) plus two planes with the top 2 bits.
template <int R, typename T>
void micro_q6k(const QuantRows& x, int64_t m, const uint8_t* wg, int64_t block_bytes,
               const float* bias, T* out, int64_t ldo, int64_t cols, bool accumulate) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < x.nb / 8; ++sb) {
    const uint8_t* sblk = wg + sb * block_bytes;
    const __m512 d = load_halves(sblk + kQ6KScales);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* blk = sblk + j * kQ6KBlock;
      const __m512i top_lo = _mm512_loadu_si512(blk + 256), top_hi = _mm512_loadu_si512(blk + 320);
      // sub-blocks 2j (low nibbles: x[0, 16)) and 2j + 1 (x[16, 32)), from -32 sum16 q_x
      __m512i dot[2][R];
      for (int r = 0; r < R; ++r) {
        const int32_t* off = x.off16 + 2 * ((m + r) * x.nb + sb * 8 + j);
        dot[0][r] = _mm512_set1_epi32(off[0]);
        dot[1][r] = _mm512_set1_epi32(off[1]);
      }
#pragma GCC unroll 4  // shift_bits' counts as constants
      for (int v = 0; v < 4; ++v) {
        const __m512i raw = _mm512_loadu_si512(blk + 64 * v);
        // bits 2v, 2v + 1 of the planes -> bits 4, 5 of the weight byte
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(raw, low4),
                                           _mm512_and_si512(shift_bits(top_lo, 4 - 2 * v), bits45));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4),
                                           _mm512_and_si512(shift_bits(top_hi, 4 - 2 * v), bits45));
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + (m + r) * x.k + sb * 256 + j * 32;
          dot[0][r] = _mm512_dpbusd_epi32(dot[0][r], lo, bcast4(xq + 4 * v));
          dot[1][r] = _mm512_dpbusd_epi32(dot[1][r], hi, bcast4(xq + 16 + 4 * v));
        }
      }
      __m512 dw[2];
      for (int h = 0; h < 2; ++h) {
        const __m128i sc = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(sblk + kQ6KScales + 32 + 16 * (2 * j + h)));
        dw[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(x.d[(m + r) * x.nb + sb * 8 + j]);
        for (int h = 0; h < 2; ++h)  // the lower sub-block first
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw[h], dx), _mm512_cvtepi32_ps(dot[h][r]),
                                   acc[r]);
      }
    }
  }
  store_rows<R>(acc, bias, out + m * ldo, ldo, cols, accumulate);
}

// Q2_K: rows [0, R) (from `m`) of one column group, over all super-blocks. Per
// activation block j, its sub-blocks 2j (x[0, 16)) and 2j + 1 (x[16, 32)): one 64-byte
// vector each, whose 2-bit fields s (a shift and a mask) pair with x[16h + 4s, + 4).
template <int R, typename T>
void micro_q2k(const QuantRows& x, int64_t m, const uint8_t* wg, int64_t block_bytes,
               const float* bias, T* out, int64_t ldo, int64_t cols, bool accumulate) {
  const __m512i low2 = _mm512_set1_epi8(0x03);
  const __m128i low4 = _mm_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < x.nb / 8; ++sb) {
    const uint8_t* blk = wg + sb * block_bytes;
    const __m512 d = load_halves(blk + kQ2KScales), dmin = load_halves(blk + kQ2KScales + 32);
    for (int j = 0; j < 8; ++j) {
      __m512i dot[2][R];
      for (int r = 0; r < R; ++r) dot[0][r] = dot[1][r] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i raw = _mm512_loadu_si512(blk + (2 * j + h) * 64);
#pragma GCC unroll 4  // shift_bits' counts as constants
        for (int s = 0; s < 4; ++s) {
          const __m512i w = _mm512_and_si512(shift_bits(raw, -2 * s), low2);
          for (int r = 0; r < R; ++r) {
            const int8_t* xq = x.q + (m + r) * x.k + sb * 256 + j * 32 + 16 * h;
            dot[h][r] = _mm512_dpbusd_epi32(dot[h][r], w, bcast4(xq + 4 * s));
          }
        }
      }
      __m512 dw[2], mw[2];
      for (int h = 0; h < 2; ++h) {
        const __m128i sc = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(blk + kQ2KScales + 64 + 16 * (2 * j + h)));
        dw[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(sc, low4))));
        mw[h] = _mm512_mul_ps(
            dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(sc, 4), low4))));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m + r) * x.nb + sb * 8 + j;
        const float dx = x.d[i];
        for (int h = 0; h < 2; ++h) {  // the lower sub-block first
          const float ds = dx * static_cast<float>(x.off16[2 * i + h] / -32);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw[h], _mm512_set1_ps(dx)),
                                   _mm512_cvtepi32_ps(dot[h][r]), acc[r]);
          acc[r] = _mm512_fnmadd_ps(mw[h], _mm512_set1_ps(ds), acc[r]);  // -mw ds + acc
        }
      }
    }
  }
  store_rows<R>(acc, bias, out + m * ldo, ldo, cols, accumulate);
}

// G groups at once: the block types of `micro` only (G = 1 for the others).
template <QType Q, int R, int G, typename T>
void micro_any(const QuantRows& x, int64_t m, const uint8_t* wg, int64_t group_bytes,
               int64_t block_bytes, const float* bias, T* out, int64_t ldo, int64_t cols,
               bool accumulate, int64_t lead) {
  cols = std::min(cols, G * kGroup);
  if constexpr (Q == QType::kQ4_K || Q == QType::kQ5_K) {
    micro_q4k<Q, R, T>(x, m, wg, block_bytes, bias, out, ldo, cols, accumulate);
  } else if constexpr (Q == QType::kQ6_K) {
    micro_q6k<R, T>(x, m, wg, block_bytes, bias, out, ldo, cols, accumulate);
  } else if constexpr (Q == QType::kQ2_K) {
    micro_q2k<R, T>(x, m, wg, block_bytes, bias, out, ldo, cols, accumulate);
  } else {
    micro<Q, R, G, T>(x, m, wg, group_bytes, block_bytes, bias, out, ldo, cols, accumulate,
                      lead);
  }
}

template <QType Q, typename T>
void run_simd(const QuantRows& x, int64_t m0, int64_t m1, const uint8_t* w,
              int64_t block_bytes, const float* bias, T* out, int64_t ldo, int64_t n,
              bool accumulate, int64_t g0, int64_t g1) {
  using Fn = void (*)(const QuantRows&, int64_t, const uint8_t*, int64_t, int64_t,
                      const float*, T*, int64_t, int64_t, bool, int64_t);
  static constexpr Fn kMicro[2][kRows + 1] = {
      {nullptr, micro_any<Q, 1, 1, T>, micro_any<Q, 2, 1, T>, micro_any<Q, 3, 1, T>,
       micro_any<Q, 4, 1, T>, micro_any<Q, 5, 1, T>, micro_any<Q, 6, 1, T>,
       micro_any<Q, 7, 1, T>, micro_any<Q, 8, 1, T>},
      {nullptr, micro_any<Q, 1, 2, T>, micro_any<Q, 2, 2, T>, micro_any<Q, 3, 2, T>,
       micro_any<Q, 4, 2, T>, micro_any<Q, 5, 2, T>, micro_any<Q, 6, 2, T>,
       micro_any<Q, 7, 2, T>, micro_any<Q, 8, 2, T>}};
  constexpr bool super =
      Q == QType::kQ2_K || Q == QType::kQ4_K || Q == QType::kQ5_K || Q == QType::kQ6_K;
  const int64_t blocks = super ? x.nb / 8 : x.nb;  // weight blocks per group
  const int64_t group_bytes = blocks * block_bytes;
  const int64_t pair = groups_per_step(Path::kAvx512, Q, m1 - m0);
  // The next group's weights are prefetched into L2, a slice before each micro-kernel
  // call of this group, so they stream in while it computes. Measured on SmolLM2's
  // shapes (Q4_1, every layer's weights in turn, 2 threads, Zen 4): M = 16 -8%, M = 64
  // -8%, M = 128 -3%. With one call per group (M <= kRows) that slice would be the whole
  // group at once (M = 1: +5%), so these calls prefetch ahead inside `micro` (`lead`,
  // below) or not at all. (The AVX2 kernels prefetch a streamed weight a fixed distance
  // ahead of each block on every CPU, quant_avx2.h's kStreamPrefetch, measured on Zen 3.)
  const int64_t calls = (m1 - m0 + kRows - 1) / kRows;
  // One call per group streams the weight: `micro` then prefetches its blocks `lead`
  // bytes ahead where pagedllm_simd::stream_prefetch_bytes says (the K-types' kernels
  // leave it to the hardware).
  const int64_t lead = calls == 1 ? pagedllm_simd::stream_prefetch_bytes() : 0;
  for (int64_t g = g0; g < g1;) {
    const int64_t span = std::min(pair, g1 - g);  // groups in this step
    const uint8_t* wg = w + g * group_bytes;
    const int64_t next_bytes = std::min(span, g1 - g - span) * group_bytes;
    const char* next = reinterpret_cast<const char*>(wg + span * group_bytes);
    const int64_t lines_per_call = calls > 1 ? (next_bytes / 64 + calls - 1) / calls : 0;
    int64_t at = 0;  // bytes of the next step's groups prefetched so far
    for (int64_t m = m0; m < m1; m += kRows) {
      for (int64_t i = 0; i < lines_per_call && at < next_bytes; ++i, at += 64)
        _mm_prefetch(next + at, _MM_HINT_T1);
      kMicro[span - 1][std::min<int64_t>(kRows, m1 - m)](
          x, m, wg, group_bytes, block_bytes, bias + g * kGroup, out + g * kGroup, ldo,
          n - g * kGroup, accumulate, lead);
    }
    g += span;
  }
}
#endif

// Rows [m0, m1) x groups [g0, g1) on `path` (AMX: on the calling thread's amx::Session,
// whose scratch is `spread`).
template <typename T>
void run(Path path, const QuantRows& x, int64_t m0, int64_t m1, const uint8_t* w,
         int64_t block_bytes, const Layout& L, const float* bias, T* out, int64_t ldo, int64_t n,
         bool accumulate, int64_t g0, int64_t g1, uint8_t* spread) {
  auto go = [&](auto kernel) {
    kernel(x, m0, m1, w, block_bytes, bias, out, ldo, n, accumulate, g0, g1);
  };
  // kernels[type] of one path, in QType's order
#define PAGEDLLM_BY_TYPE(run_q)                                                          \
  switch (L.type) {                                                                     \
    case QType::kQ8_0: return go(run_q<QType::kQ8_0, T>);                                \
    case QType::kQ4_0: return go(run_q<QType::kQ4_0, T>);                                \
    case QType::kQ4_1: return go(run_q<QType::kQ4_1, T>);                                \
    case QType::kQ5_0: return go(run_q<QType::kQ5_0, T>);                                \
    case QType::kQ5_1: return go(run_q<QType::kQ5_1, T>);                                \
    case QType::kQ2_K: return go(run_q<QType::kQ2_K, T>);                                \
    case QType::kQ4_K: return go(run_q<QType::kQ4_K, T>);                                \
    case QType::kQ5_K: return go(run_q<QType::kQ5_K, T>);                                \
    case QType::kQ6_K: return go(run_q<QType::kQ6_K, T>);                                \
  }
#if defined(PAGEDLLM_QUANT_AMX)
  if (path == Path::kAmx && amx::supports(L.type)) {
    auto tiles = [&](auto kernel) {
      kernel(x, m0, m1, w, block_bytes, bias, out, ldo, n, accumulate, g0, g1, spread);
    };
    switch (L.type) {
      case QType::kQ8_0: return tiles(amx::run<QType::kQ8_0, T>);
      case QType::kQ4_0: return tiles(amx::run<QType::kQ4_0, T>);
      case QType::kQ4_1: return tiles(amx::run<QType::kQ4_1, T>);
      case QType::kQ5_0: return tiles(amx::run<QType::kQ5_0, T>);
      case QType::kQ5_1: return tiles(amx::run<QType::kQ5_1, T>);
      case QType::kQ4_K: return tiles(amx::run<QType::kQ4_K, T>);
      case QType::kQ5_K: return tiles(amx::run<QType::kQ5_K, T>);
      default: break;
    }
  }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // (AMX builds have AVX512-VNNI: the types without AMX kernels run here.)
  if (path == Path::kAvx512 || path == Path::kAmx) PAGEDLLM_BY_TYPE(run_simd)
#endif
#if defined(PAGEDLLM_QUANT_AVX2)
  if (path == Path::kAvx2) PAGEDLLM_BY_TYPE(avx2::run)
#endif
#undef PAGEDLLM_BY_TYPE
  run_portable(x, m0, m1, w, block_bytes, L, bias, out, ldo, n, accumulate, g0, g1);
}

template <typename T>
void gemm_quant_impl(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     const float* bias, bool accumulate, Path path) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t nb = k / kBlock, groups = weight.size(0), block_bytes = weight.size(2);
  const int64_t weight_blocks = weight.size(1);
  const Layout L = layout_of(block_bytes);
  // x quantized: q [M, K] int8 | d [M, nb] | sum [M, nb] | dsum [M, nb] |
  // off16 [M, nb, 2], one buffer; for the AMX kernels, whose tiles take 16 rows at a
  // time, M rounded up to 16 with the rows past it zero (dots and scales of 0).
  const int64_t rows = path == Path::kAmx ? (m + 15) / 16 * 16 : m;
  at::Tensor buf = at::empty({rows * k + 20 * rows * nb + 4}, x.options().dtype(at::kByte));
  int8_t* q = reinterpret_cast<int8_t*>(buf.data_ptr<uint8_t>());
  float* d = reinterpret_cast<float*>(q + rows * k + (-(rows * k) & 3));
  int32_t* sum = reinterpret_cast<int32_t*>(d + rows * nb);
  float* dsum = reinterpret_cast<float*>(sum + rows * nb);
  int32_t* off16 = reinterpret_cast<int32_t*>(dsum + rows * nb);
  TORCH_CHECK(reinterpret_cast<uint8_t*>(off16 + 2 * rows * nb) <=
                  buf.data_ptr<uint8_t>() + buf.numel(),
              "gemm_quant: scratch overflow");
  if (rows > m) {
    std::memset(q + m * k, 0, (rows - m) * k);
    std::memset(d + m * nb, 0, (rows - m) * nb * sizeof(float));
    std::memset(sum + m * nb, 0, (rows - m) * nb * sizeof(int32_t));
    std::memset(dsum + m * nb, 0, (rows - m) * nb * sizeof(float));
  }
  // The AMX path quantizes x as the AVX-512 one.
  const Path quantize_path = path == Path::kAmx ? Path::kAvx512 : path;
  const T* xp = x.data_ptr<T>();
  const int64_t ldx = x.stride(0);
  const bool halves = L.type == QType::kQ6_K || L.type == QType::kQ2_K;
  const QuantRows xq{q, d, sum, dsum, off16, k, nb};
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  const int64_t ldo = out.stride(0);
  // Small calls take microseconds, less than waking the other threads.
  const bool parallel = groups * weight_blocks * block_bytes * (m + 4) > (1 << 18);
  // Each block of rows has its own claims, so no thread waits for another between
  // blocks. The AMX kernels spread a group's weights once per block: theirs are larger.
  const int64_t row_block = path == Path::kAmx ? kAmxRowBlock : kRowBlock;
  const int64_t row_blocks = (m + row_block - 1) / row_block;
  ClaimCounters next_group(row_blocks);
#pragma omp parallel if (parallel)
  {
#if defined(PAGEDLLM_QUANT_AMX)
    std::optional<amx::Session> session;
    if (path == Path::kAmx && amx::supports(L.type)) session.emplace(L.type, nb);
    uint8_t* spread = session ? session->spread() : nullptr;
#else
    uint8_t* spread = nullptr;
#endif
    // x's rows are quantized in the same parallel region as the GEMM (one fork and join
    // per call instead of two: ~120 calls in a 30-layer prefill), all before any
    // micro-kernel reads them (the loop's closing barrier).
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r)
      quantize_row(quantize_path, xp + r * ldx, k, q + r * k, d + r * nb, sum + r * nb, dsum + r * nb,
                   halves ? off16 + 2 * r * nb : nullptr);
    const int64_t threads = omp_get_num_threads();
    if (m <= kStreamRows) {
      claim_runs(next_group[0], groups, threads, kMinRunGroups, [&](int64_t g0, int64_t g1) {
        run(path, xq, 0, m, wp, block_bytes, L, bias, op, ldo, n, accumulate, g0, g1, spread);
      });
    } else {
      // Compute-bound: runs of groups claimed in turn, shrinking to one step of the
      // micro-kernel, so a thread that runs slower (a VM's vCPU, a busy SMT sibling) is
      // not waited for at the end; counted in steps, so no run leaves a group alone
      // where pairs are taken.
      const int64_t step = groups_per_step(path, L.type, m);
      const int64_t steps = (groups + step - 1) / step;
      for (int64_t b = 0; b < row_blocks; ++b) {
        const int64_t m0 = b * row_block, m1 = std::min(m, m0 + row_block);
        claim_runs(next_group[b], steps, threads, 1, [&](int64_t s0, int64_t s1) {
          run(path, xq, m0, m1, wp, block_bytes, L, bias, op, ldo, n, accumulate, s0 * step,
              std::min(groups, s1 * step), spread);
        });
      }
    }
  }
}

// out = x . dequant(W)^T + bias on one path's kernels (gemm_quant's checks passed).
void gemm_quant_on(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                   const float* bias, bool accumulate, Path kernels) {
  if (x.size(0) == 0) return;
#if defined(PAGEDLLM_QUANT_AMX_BF16)
  if (kernels == Path::kAmxBf16) {
    auto tiles = [&](auto kernel) {
      kernel(x.data_ptr<c10::BFloat16>(), x.stride(0), x.size(0), x.size(1),
             weight.data_ptr<uint8_t>(), weight.size(0), weight.size(2), bias,
             out.data_ptr<c10::BFloat16>(), out.stride(0), out.size(1), accumulate);
    };
    switch (layout_of(weight.size(2)).type) {
      case QType::kQ8_0: return tiles(amx_bf16::run<QType::kQ8_0>);
      case QType::kQ4_0: return tiles(amx_bf16::run<QType::kQ4_0>);
      case QType::kQ4_1: return tiles(amx_bf16::run<QType::kQ4_1>);
      case QType::kQ5_0: return tiles(amx_bf16::run<QType::kQ5_0>);
      case QType::kQ5_1: return tiles(amx_bf16::run<QType::kQ5_1>);
      case QType::kQ4_K: return tiles(amx_bf16::run<QType::kQ4_K>);
      case QType::kQ5_K: return tiles(amx_bf16::run<QType::kQ5_K>);
      case QType::kQ6_K: return tiles(amx_bf16::run<QType::kQ6_K>);
      default: TORCH_CHECK(false, "gemm_quant: no amx_bf16 kernel for this block type");
    }
  }
#endif
  if (x.scalar_type() == at::kBFloat16) {
    gemm_quant_impl<c10::BFloat16>(out, x, weight, bias, accumulate, kernels);
  } else {
    gemm_quant_impl<float>(out, x, weight, bias, accumulate, kernels);
  }
}

#if defined(PAGEDLLM_QUANT_AMX_BF16)  // (gemm_quant's only use: built without, unused)
// The rows of a call on one path: one run [start, start + count), or (index defined)
// scattered rows, gathered into one call (the bfloat16 tiles dequantize the weights once
// per call, the int8 tiles spread Q4 nibbles once per call: ~5 ms a 30-layer step each).
struct RowSet {
  int64_t start = 0, count = 0;
  at::Tensor index;
};

RowSet row_set(const std::vector<int64_t>& rows) {
  RowSet set;
  set.count = static_cast<int64_t>(rows.size());
  if (set.count == 0) return set;
  set.start = rows.front();
  if (rows.back() - rows.front() + 1 != set.count)
    set.index = at::tensor(at::ArrayRef<int64_t>(rows), at::kLong);
  return set;
}

// gemm_quant_on over the rows of `set` only.
void gemm_quant_rows(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                     const float* bias, bool accumulate, Path kernels, const RowSet& set) {
  if (set.count == 0) return;
  if (!set.index.defined()) {
    gemm_quant_on(out.narrow(0, set.start, set.count), x.narrow(0, set.start, set.count),
                  weight, bias, accumulate, kernels);
    return;
  }
  const at::Tensor xs = x.index_select(0, set.index);
  const at::Tensor os = accumulate ? out.index_select(0, set.index)
                                   : at::empty({set.count, out.size(1)}, out.options());
  gemm_quant_on(os, xs, weight, bias, accumulate, kernels);
  out.index_copy_(0, set.index, os);
}
#endif

}  // namespace

void gemm_quant(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, bool accumulate, c10::string_view path,
                const std::optional<at::Tensor>& prompt_rows) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "gemm_quant: x is a bfloat16 or float32 [M, K] with contiguous rows");
  TORCH_CHECK(x.size(1) % kBlock == 0, "gemm_quant: K must be a multiple of 32");
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && weight.scalar_type() == at::kByte &&
                  weight.size(1) * layout_of(weight.size(2)).elems == x.size(1),
              "gemm_quant: weight is packed uint8 [ceil(N / 16), K / block, block_bytes]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type() &&
                  out.size(1) <= weight.size(0) * kGroup &&
                  out.size(1) > (weight.size(0) - 1) * kGroup,
              "gemm_quant: out is [M, N] of x's dtype with contiguous rows");
  TORCH_CHECK(bias.has_value() && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                  bias->numel() == out.size(1),
              "gemm_quant: bias must be a contiguous float32 [N] (zeros for none)");
  TORCH_CHECK(!prompt_rows.has_value() ||
                  (prompt_rows->scalar_type() == at::kBool && prompt_rows->dim() == 1 &&
                   prompt_rows->is_contiguous() && prompt_rows->size(0) == x.size(0)),
              "gemm_quant: prompt_rows is a contiguous bool [M]");
  const QType type = layout_of(weight.size(2)).type;
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  const float* bp = bias->data_ptr<float>();  // read with masks past N: never beyond it
  const int64_t m = x.size(0);
#if defined(PAGEDLLM_QUANT_AMX_BF16)
  // The prompt rows on the bfloat16 tiles, the others on the int8 kernels (each row's
  // path is its own: quant_amx_bf16.h).
  if (prompt_rows.has_value() && path == "auto" && bf16_x && amx_bf16::supports(type) &&
      amx_bf16::prompt_rows_chosen()) {
    std::vector<int64_t> rows[2];  // [0]: the other rows, [1]: the prompt rows
    const bool* is_prompt = prompt_rows->data_ptr<bool>();
    for (int64_t r = 0; r < m; ++r) rows[is_prompt[r]].push_back(r);
    gemm_quant_rows(out, x, weight, bp, accumulate, Path::kAmxBf16, row_set(rows[1]));
    const Path int8 = path_of("int8", static_cast<int64_t>(rows[0].size()), type, bf16_x);
    gemm_quant_rows(out, x, weight, bp, accumulate, int8, row_set(rows[0]));
    return;
  }
#endif
  gemm_quant_on(out, x, weight, bp, accumulate, path_of(path, m, type, bf16_x));
}

bool quant_amx_usable() { return amx_usable(); }

bool quant_amx_bf16_usable() {
#if defined(PAGEDLLM_QUANT_AMX_BF16)
  return amx_bf16::usable();
#else
  return false;
#endif
}

bool quant_splits_prompt_rows() {
#if defined(PAGEDLLM_QUANT_AMX_BF16)
  return amx_bf16::prompt_rows_chosen();
#else
  return false;
#endif
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def(
      "gemm_quant(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, "
      "bool accumulate=False, str path='auto', Tensor? prompt_rows=None) -> ()");
  m.def("quant_amx_usable() -> bool", &pagedllm_ops::quant_amx_usable);
  m.def("quant_amx_bf16_usable() -> bool", &pagedllm_ops::quant_amx_bf16_usable);
  m.def("quant_splits_prompt_rows() -> bool", &pagedllm_ops::quant_splits_prompt_rows);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("gemm_quant", &pagedllm_ops::gemm_quant); }
