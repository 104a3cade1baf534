// Rows of a GGUF block-quantized weight in the repacked layout (cpu_quant.cpp describes
// it), dequantized: the embedding lookup of a quantized token table. out [T, K] (float32,
// bfloat16 or float16) = the rows `ids` of dequant(W), with the float32 operations of
// kernels/cpu/quant.py's dequantize_rows (gguf-py's, in its order) then one rounding to
// out's dtype, so it equals that function followed by `.to(dtype)` bit for bit. The
// Python version costs ~15 torch ops (~0.1-0.15 ms a decode step, ~1 ms a 128-token
// prefill on SmolLM2); this one a few microseconds per row.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>

namespace pagedllm_ops {
namespace {

constexpr int64_t kGroup = 16;  // output columns (weight rows) per group of the layout

float half_at(const uint8_t* p) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(p[0] | (p[1] << 8)),
                                      c10::Half::from_bits()));
}

// One (group, block) of column `col`: its `elems` weights into w (float32).
// Q4_0 / Q4_1 / Q5_0 / Q5_1 (32 weights): qs [4 vectors][16 columns][4], byte 4v + i
// of the column holds element 4v + i (low nibble) and 16 + 4v + i (high nibble);
// Q5: the plane [16 columns][4] at 256, byte i bit 4 nibble + v = the fifth bit of
// element 16 nibble + 4v + i; then d [16] f16, and m [16] f16 for Q4_1 / Q5_1.
void q4_block(const uint8_t* b, int64_t col, int shift, bool q5, bool has_min, float* w) {
  const int64_t scales = q5 ? 320 : 256;
  const float d = half_at(b + scales + 2 * col);
  const float m = has_min ? half_at(b + scales + 32 + 2 * col) : 0.f;
  for (int v = 0; v < 4; ++v) {
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = b[v * 64 + col * 4 + i];
      for (int nibble = 0; nibble < 2; ++nibble) {
        int q = nibble ? byte >> 4 : byte & 0x0F;
        if (q5) q |= ((b[256 + col * 4 + i] >> (4 * nibble + v)) & 1) << 4;
        const int e = 16 * nibble + 4 * v + i;
        // gguf-py: Q4_1 / Q5_1 q * d + m (two roundings), else (q - offset) * d
        w[e] = has_min ? static_cast<float>(q) * d + m : static_cast<float>(q - shift) * d;
      }
    }
  }
}

// Q8_0 (32 weights): qs [8 vectors][16 columns][4] holding q + 128, then d [16] f16.
void q8_block(const uint8_t* b, int64_t col, float* w) {
  const float d = half_at(b + 512 + 2 * col);
  for (int v = 0; v < 8; ++v)
    for (int i = 0; i < 4; ++i)
      w[4 * v + i] = static_cast<float>(static_cast<int8_t>(b[v * 64 + col * 4 + i] ^ 0x80)) * d;
}

// Q4_K / Q5_K (256 weights): qs [4 chunks][8 dwords][16 columns][4], byte 4 dw + i of
// chunk c holds element 64c + 4 dw + i (low nibble) and 64c + 32 + 4 dw + i (high); Q5_K:
// planes [4 chunks][2][16 columns][4] at 2048, byte i of plane (c, p) bit 4 nibble + s =
// the fifth bit of element 64c + 32 nibble + 16p + 4s + i; then d [16], dmin [16] f16,
// sc [8][16] and m [8][16] (6-bit, one per sub-block of 32).
void q4k_block(const uint8_t* b, int64_t col, bool q5, float* w) {
  const int64_t at = q5 ? 2560 : 2048;
  const float d = half_at(b + at + 2 * col), dmin = half_at(b + at + 32 + 2 * col);
  float d_sub[8], dm_sub[8];
  for (int s = 0; s < 8; ++s) {
    d_sub[s] = d * static_cast<float>(b[at + 64 + s * 16 + col]);
    dm_sub[s] = dmin * static_cast<float>(b[at + 192 + s * 16 + col]);
  }
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = b[c * 512 + (l / 4) * 64 + col * 4 + l % 4];
      for (int nibble = 0; nibble < 2; ++nibble) {
        int q = nibble ? byte >> 4 : byte & 0x0F;
        const int p = l / 16, s4 = (l / 4) % 4, i = l % 4;
        if (q5) q |= ((b[2048 + c * 128 + p * 64 + col * 4 + i] >> (4 * nibble + s4)) & 1) << 4;
        const int e = 64 * c + 32 * nibble + l, sub = e / 32;
        w[e] = d_sub[sub] * static_cast<float>(q) - dm_sub[sub];
      }
    }
  }
}

// Q6_K (256 weights): 8 blocks of 384 bytes: qs [4][16 columns][4] (byte 4v + i: the low
// 4 bits of element 32j + 4v + i, low nibble, and of 32j + 16 + 4v + i, high) and two
// planes [16 columns][4] (plane n, byte i, bits 2v and 2v + 1: the top two bits of
// element 32j + 16n + 4v + i); then d [16] f16 at 3072 and sc [16][16] int8 at 3104.
void q6k_block(const uint8_t* b, int64_t col, float* w) {
  const float d = half_at(b + 3072 + 2 * col);
  for (int j = 0; j < 8; ++j) {
    const uint8_t* kb = b + j * 384;
    for (int v = 0; v < 4; ++v) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = kb[v * 64 + col * 4 + i];
        for (int n = 0; n < 2; ++n) {
          const int top = (kb[256 + n * 64 + col * 4 + i] >> (2 * v)) & 3;
          const int q = (n ? byte >> 4 : byte & 0x0F) | (top << 4);
          const int e = 32 * j + 16 * n + 4 * v + i;
          const float d_sub = d * static_cast<float>(static_cast<int8_t>(b[3104 + (e / 16) * 16 + col]));
          w[e] = d_sub * static_cast<float>(q - 32);
        }
      }
    }
  }
}

template <typename T>
void rows_impl(const at::Tensor& out, const at::Tensor& packed, const int64_t* ids,
               int64_t num) {
  const int64_t nb = packed.size(1), block_bytes = packed.size(2);
  const int64_t elems = out.size(1) / nb;
  const uint8_t* base = packed.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  const int64_t ldo = out.stride(0);
#pragma omp parallel for if (num * out.size(1) > (1 << 16))
  for (int64_t r = 0; r < num; ++r) {
    const int64_t group = ids[r] / kGroup, col = ids[r] % kGroup;
    float w[256];
    for (int64_t blk = 0; blk < nb; ++blk) {
      const uint8_t* b = base + (group * nb + blk) * block_bytes;
      switch (block_bytes) {
        case 288: q4_block(b, col, 8, false, false, w); break;   // Q4_0
        case 320: q4_block(b, col, 0, false, true, w); break;    // Q4_1
        case 352: q4_block(b, col, 16, true, false, w); break;   // Q5_0
        case 384: q4_block(b, col, 0, true, true, w); break;     // Q5_1
        case 544: q8_block(b, col, w); break;                    // Q8_0
        case 2368: q4k_block(b, col, false, w); break;           // Q4_K
        case 2880: q4k_block(b, col, true, w); break;            // Q5_K
        default: q6k_block(b, col, w); break;                    // Q6_K (3360)
      }
      T* o = op + r * ldo + blk * elems;
      for (int64_t e = 0; e < elems; ++e) o[e] = static_cast<T>(w[e]);
    }
  }
}

int64_t block_elems(int64_t block_bytes) {
  switch (block_bytes) {
    case 288: case 320: case 352: case 384: case 544: return 32;
    case 2368: case 2880: case 3360: return 256;
    default: return 0;
  }
}

}  // namespace

void quant_rows(const at::Tensor& out, const at::Tensor& packed, const at::Tensor& ids,
                int64_t num_rows) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  block_elems(packed.size(2)) > 0,
              "quant_rows: packed is a repacked uint8 [ceil(N / 16), K / block, block_bytes]");
  TORCH_CHECK(num_rows > (packed.size(0) - 1) * kGroup && num_rows <= packed.size(0) * kGroup,
              "quant_rows: num_rows does not match the packed groups");
  TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous() && ids.scalar_type() == at::kLong,
              "quant_rows: ids is a contiguous int64 [T]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == ids.size(0) && out.stride(1) == 1 &&
                  out.size(1) == packed.size(1) * block_elems(packed.size(2)),
              "quant_rows: out is [T, K] with contiguous rows");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids.size(0); ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < num_rows, "quant_rows: id ", ip[r], " is out of range [0, ",
                num_rows, ")");
  switch (out.scalar_type()) {
    case at::kFloat: return rows_impl<float>(out, packed, ip, ids.size(0));
    case at::kBFloat16: return rows_impl<c10::BFloat16>(out, packed, ip, ids.size(0));
    case at::kHalf: return rows_impl<c10::Half>(out, packed, ip, ids.size(0));
    default: TORCH_CHECK(false, "quant_rows: out must be float32, bfloat16 or float16");
  }
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("quant_rows(Tensor(a!) out, Tensor packed, Tensor ids, int num_rows) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("quant_rows", &pagedllm_ops::quant_rows); }
