// Rows of a GGUF block-quantized weight in the repacked layout (cpu_quant.cpp describes
// it), dequantized: the embedding lookup of a quantized token table. out [T, K] (float32,
// bfloat16 or float16) = the rows `ids` of dequant(W), with the float32 operations of
// kernels/cpu/quant.py's dequantize_rows (gguf-py's, in its order) then one rounding to
// out's dtype, so it equals that function followed by `.to(dtype)` bit for bit. The
// Python version costs ~15 torch ops (~0.1-0.15 ms a decode step, ~1 ms a 128-token
// prefill on SmolLM2); this one a few microseconds per row.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>

#include "quant_layout.h"

namespace pagedllm_ops {
namespace {

using namespace quant;

// One (group, block) of column `col`: its L.elems weights into w (float32), with
// gguf-py's operations. Layouts: cpu_quant.cpp's header and quant_layout.h.
// Q4_0 / Q4_1 / Q5_0 / Q5_1: byte 4v + i of the column's qs holds element 4v + i (low
// nibble) and 16 + 4v + i (high); Q5's plane (the 64 bytes before the scales) byte i,
// bit 4 nibble + v: the fifth bit of element 16 nibble + 4v + i.
void q4_block(const uint8_t* b, int64_t col, const Layout& L, float* w) {
  const bool q5 = L.type == QType::kQ5_0 || L.type == QType::kQ5_1;
  const bool has_min = L.type == QType::kQ4_1 || L.type == QType::kQ5_1;
  const float d = half_at(b + L.qs_bytes, col);
  const float m = has_min ? half_at(b + L.qs_bytes + 32, col) : 0.f;
  for (int v = 0; v < 4; ++v) {
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = b[v * 64 + col * 4 + i];
      for (int nibble = 0; nibble < 2; ++nibble) {
        int q = nibble ? byte >> 4 : byte & 0x0F;
        if (q5) q |= ((b[L.qs_bytes - 64 + col * 4 + i] >> (4 * nibble + v)) & 1) << 4;
        const int e = 16 * nibble + 4 * v + i;
        // gguf-py: Q4_1 / Q5_1 q * d + m (two roundings), else (q - offset) * d
        w[e] = has_min ? static_cast<float>(q) * d + m
                       : static_cast<float>(q - L.offset) * d;
      }
    }
  }
}

// Q8_0: qs [8 vectors][16 columns][4] holding q + 128, then d.
void q8_block(const uint8_t* b, int64_t col, const Layout& L, float* w) {
  const float d = half_at(b + L.qs_bytes, col);
  for (int v = 0; v < 8; ++v)
    for (int i = 0; i < 4; ++i)
      w[4 * v + i] = static_cast<float>(static_cast<int8_t>(b[v * 64 + col * 4 + i] ^ 0x80)) * d;
}

// Q4_K / Q5_K: byte 4 dw + i of chunk c holds element 64c + 4 dw + i (low nibble) and
// 64c + 32 + 4 dw + i (high); Q5_K's plane (c, p) byte i, bit 4 nibble + s: the fifth
// bit of element 64c + 32 nibble + 16p + 4s + i.
void q4k_block(const uint8_t* b, int64_t col, const Layout& L, float* w) {
  const int64_t at = L.qs_bytes;  // d, dmin, sc, m
  const float d = half_at(b + at, col), dmin = half_at(b + at + 32, col);
  float d_sub[8], dm_sub[8];
  for (int s = 0; s < 8; ++s) {
    d_sub[s] = d * static_cast<float>(b[at + 64 + s * 16 + col]);
    dm_sub[s] = dmin * static_cast<float>(b[at + 192 + s * 16 + col]);
  }
  const bool q5 = L.type == QType::kQ5_K;
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = b[c * 512 + (l / 4) * 64 + col * 4 + l % 4];
      for (int nibble = 0; nibble < 2; ++nibble) {
        int q = nibble ? byte >> 4 : byte & 0x0F;
        const int p = l / 16, s4 = (l / 4) % 4, i = l % 4;
        if (q5)
          q |= ((b[kQ4KScales + c * 128 + p * 64 + col * 4 + i] >> (4 * nibble + s4)) & 1) << 4;
        const int e = 64 * c + 32 * nibble + l, sub = e / 32;
        w[e] = d_sub[sub] * static_cast<float>(q) - dm_sub[sub];
      }
    }
  }
}

// Q6_K: block j's qs byte 4v + i holds the low 4 bits of element 32j + 4v + i (low
// nibble) and of 32j + 16 + 4v + i (high); its plane n byte i, bits 2v and 2v + 1: the
// top two bits of element 32j + 16n + 4v + i; sc int8 per 16 weights after d.
void q6k_block(const uint8_t* b, int64_t col, const Layout&, float* w) {
  const float d = half_at(b + kQ6KScales, col);
  for (int j = 0; j < 8; ++j) {
    const uint8_t* kb = b + j * kQ6KBlock;
    for (int v = 0; v < 4; ++v) {
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = kb[v * 64 + col * 4 + i];
        for (int n = 0; n < 2; ++n) {
          const int top = (kb[256 + n * 64 + col * 4 + i] >> (2 * v)) & 3;
          const int q = (n ? byte >> 4 : byte & 0x0F) | (top << 4);
          const int e = 32 * j + 16 * n + 4 * v + i;
          const int8_t sc = static_cast<int8_t>(b[kQ6KScales + 32 + (e / 16) * 16 + col]);
          w[e] = (d * static_cast<float>(sc)) * static_cast<float>(q - 32);
        }
      }
    }
  }
}

// Q2_K: sub-block t byte i, bits 2s and 2s + 1: element 16t + 4s + i; per sub-block of
// 16 a scale byte (low nibble sc, high nibble m) after d and dmin.
void q2k_block(const uint8_t* b, int64_t col, const Layout&, float* w) {
  const float d = half_at(b + kQ2KScales, col), dmin = half_at(b + kQ2KScales + 32, col);
  for (int t = 0; t < 16; ++t) {
    const uint8_t sc = b[kQ2KScales + 64 + t * 16 + col];
    const float d_sub = d * static_cast<float>(sc & 0x0F);
    const float dm_sub = dmin * static_cast<float>(sc >> 4);
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = b[t * 64 + col * 4 + i];
      for (int s = 0; s < 4; ++s)  // gguf-py: (d sc) q - dmin m, two roundings
        w[16 * t + 4 * s + i] = d_sub * static_cast<float>((byte >> (2 * s)) & 3) - dm_sub;
    }
  }
}

template <typename T>
void rows_impl(const at::Tensor& out, const at::Tensor& packed, const Layout& L,
               const int64_t* ids, int64_t num) {
  using BlockFn = void (*)(const uint8_t*, int64_t, const Layout&, float*);
  const BlockFn block = L.type == QType::kQ8_0 ? q8_block
                        : L.type == QType::kQ6_K ? q6k_block
                        : L.type == QType::kQ2_K ? q2k_block
                        : (L.type == QType::kQ4_K || L.type == QType::kQ5_K) ? q4k_block
                                                                             : q4_block;
  const int64_t nb = packed.size(1), block_bytes = packed.size(2);
  const uint8_t* base = packed.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  const int64_t ldo = out.stride(0);
#pragma omp parallel for if (num * out.size(1) > (1 << 16))
  for (int64_t r = 0; r < num; ++r) {
    const int64_t group = ids[r] / kGroup, col = ids[r] % kGroup;
    float w[256];
    for (int64_t blk = 0; blk < nb; ++blk) {
      block(base + (group * nb + blk) * block_bytes, col, L, w);
      T* o = op + r * ldo + blk * L.elems;
      for (int64_t e = 0; e < L.elems; ++e) o[e] = static_cast<T>(w[e]);
    }
  }
}

}  // namespace

void quant_rows(const at::Tensor& out, const at::Tensor& packed, const at::Tensor& ids,
                int64_t num_rows) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "quant_rows: packed is a repacked uint8 [ceil(N / 16), K / block, block_bytes]");
  const Layout L = layout_of(packed.size(2));
  TORCH_CHECK(num_rows > (packed.size(0) - 1) * kGroup && num_rows <= packed.size(0) * kGroup,
              "quant_rows: num_rows does not match the packed groups");
  TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous() && ids.scalar_type() == at::kLong,
              "quant_rows: ids is a contiguous int64 [T]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == ids.size(0) && out.stride(1) == 1 &&
                  out.size(1) == packed.size(1) * L.elems,
              "quant_rows: out is [T, K] with contiguous rows");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < ids.size(0); ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < num_rows, "quant_rows: id ", ip[r], " is out of range [0, ",
                num_rows, ")");
  switch (out.scalar_type()) {
    case at::kFloat: return rows_impl<float>(out, packed, L, ip, ids.size(0));
    case at::kBFloat16: return rows_impl<c10::BFloat16>(out, packed, L, ip, ids.size(0));
    case at::kHalf: return rows_impl<c10::Half>(out, packed, L, ip, ids.size(0));
    default: TORCH_CHECK(false, "quant_rows: out must be float32, bfloat16 or float16");
  }
}

}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("quant_rows(Tensor(a!) out, Tensor packed, Tensor ids, int num_rows) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("quant_rows", &pagedllm_ops::quant_rows); }
