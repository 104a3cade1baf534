// The repacked layout of GGUF block-quantized weights (kernels/cpu/quant.py: repack),
// shared by the quantized GEMM (cpu_quant.cpp, whose header comment describes the layout
// of Q8_0 / Q4_* / Q5_*, and its AVX2 kernels, quant_avx2.h) and the row lookup
// (cpu_quant_rows.cpp); and the GEMM's quantized activations (QuantRows).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace pagedllm_ops {
namespace quant {

constexpr int64_t kGroup = 16;  // output columns per group
constexpr int64_t kBlock = 32;  // K per block

enum class QType { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ2_K, kQ4_K, kQ5_K, kQ6_K };

struct Layout {
  QType type;
  int64_t qs_bytes;  // bytes of weights per (group, block), before the scales
  int32_t offset;    // what the unsigned weights are shifted by (Q4_1, Q5_1, Q4_K, Q5_K: 0,
                     // they have m)
  int64_t elems;     // weights of K per block (K-types: a super-block of 8 x 32)
};

// Q4_K (group, super-block), 2368 bytes: qs [4 chunks][8][16 columns][4 bytes], where
// chunk c holds sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles), as ggml's bytes
// [32c, 32c + 32) do | d [16] f16 | dmin [16] f16 | sc [8][16] u8 | m [8][16] u8 (the
// 6-bit scales and mins unpacked): w = (d sc) q - dmin m per sub-block of 32.
constexpr int64_t kQ4KScales = 2048;
// Q5_K (group, super-block), 2880 bytes: Q4_K's qs (the low 4 bits) | qh [4 chunks][2]
// [16 columns][4 bytes]: plane h of chunk c holds the fifth bits of its vectors
// [4h, 4h + 4) as Q5_0's plane holds those of its 4 vectors (bit v % 4: low nibble, bit
// 4 + v % 4: high nibble) | then Q4_K's d, dmin, sc, m.
constexpr int64_t kQ5KScales = 2560;
constexpr int64_t kQ5KPlanes = 2048;  // where qh starts (after the qs)
// Q6_K (group, super-block), 3360 bytes: 8 blocks of 32 weights, each 384 bytes: the low
// 4 bits as Q4_0's qs [4][16 columns][4 bytes] | the top 2 bits of its low nibbles [16
// columns][4 bytes] | of its high nibbles, the same (byte i of a column: bits 2v, 2v + 1
// belong to vector v's byte i) | d [16] f16 | sc [16][16 columns] i8: w = (d sc) (q - 32)
// per sub-block of 16, q = 0..63.
constexpr int64_t kQ6KScales = 3072;
constexpr int64_t kQ6KBlock = 384;
// Q2_K (group, super-block), 1344 bytes (the file's 84 x 16): qs [16 sub-blocks][16
// columns][4 bytes], where byte i of sub-block t holds elements 16t + 4s + i at bits 2s,
// 2s + 1 (so a shift by 2s and a mask give vpdpbusd the 4 weights x[16t + 4s, + 4) pair
// with) | d [16] f16 | dmin [16] f16 | scales [16][16 columns] u8 as stored (low nibble
// sc, high nibble m): w = (d sc) q - dmin m per sub-block of 16, q = 0..3.
constexpr int64_t kQ2KScales = 1024;

inline Layout layout_of(int64_t block_bytes) {
  switch (block_bytes) {
    case 288: return {QType::kQ4_0, 256, 8, kBlock};
    case 320: return {QType::kQ4_1, 256, 0, kBlock};
    case 352: return {QType::kQ5_0, 320, 16, kBlock};
    case 384: return {QType::kQ5_1, 320, 0, kBlock};
    case 544: return {QType::kQ8_0, 512, 128, kBlock};
    case 1344: return {QType::kQ2_K, kQ2KScales, 0, 8 * kBlock};
    case 2368: return {QType::kQ4_K, kQ4KScales, 0, 8 * kBlock};
    case 2880: return {QType::kQ5_K, kQ5KScales, 0, 8 * kBlock};
    case 3360: return {QType::kQ6_K, kQ6KScales, 32, 8 * kBlock};
    default: TORCH_CHECK(false, "quantized weight: unknown block size ", block_bytes,
                         " (Q4_0: 288, Q4_1: 320, Q5_0: 352, Q5_1: 384, Q8_0: 544, Q2_K: 1344,"
                         " Q4_K: 2368, Q5_K: 2880, Q6_K: 3360)");
  }
}

// One row of x quantized: q [K] int8, per block d (float), sum of q (int32), d * sum
// (float, the min term of Q4_1 / Q5_1 / the K-types) and -32 x the sums of q over its
// two halves of 16 (int32: Q6_K's offset term, the value its sub-block dots start at, so
// that a broadcast from memory replaces a subtraction per row and sub-block).
struct QuantRows {
  const int8_t* q;
  const float* d;
  const int32_t* sum;
  const float* dsum;
  const int32_t* off16;  // [nb][2] per row
  int64_t k, nb;
};

// out[n] = v rounded to T; with `accumulate`, out[n] + that, rounded again (what
// out.add_(linear(x)) gives).
template <typename T>
inline void store_out(T* out, int64_t n, float v, bool accumulate) {
  T r = static_cast<T>(v);
  if (accumulate) r = static_cast<T>(static_cast<float>(out[n]) + static_cast<float>(r));
  out[n] = r;
}

// The float16 of column c in a [16 columns] f16 segment at p.
inline float half_at(const uint8_t* p, int64_t c) {
  c10::Half h;
  std::memcpy(&h, p + 2 * c, 2);
  return static_cast<float>(h);
}

}  // namespace quant
}  // namespace pagedllm_ops
