// The native CPU ops (cpu_ops.cpp, cpu_attention.cpp), callable from other C++ code
// (cpu_decoder.cpp) without a trip through Python or the dispatcher. Semantics: the
// docstrings of the TORCH_LIBRARY schemas and of pagedllm/kernels/cpu/ops.py and build.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

namespace pagedllm_ops {

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
              double eps, double offset);
void rotary_embedding(const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t head_size, int64_t rotary_dim,
                      bool is_neox);
void silu_and_mul(const at::Tensor& out, const at::Tensor& x);
// accumulate: out += round(x . W^T + bias) (rounded again), else out = round(...).
void gemm_bf16(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
               const std::optional<at::Tensor>& bias, bool accumulate = false);
// float32 (cpu_gemm.cpp): out = x . W^T + bias from W packed [ceil(N / 48), K, 48], one
// fused multiply-add chain per output in K order; accumulate: out += that. In the AVX2
// build W may also be bfloat16 packed as for gemm_bf16 (the same bits as its float32).
void gemm_f32(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
              const at::Tensor& bias, bool accumulate = false);
// GGUF-quantized weight (cpu_quant.cpp): out = round(x . dequant(W)^T + bias); bias is a
// float32 [N] (zeros for none); accumulate as gemm_bf16; path: "auto" (the widest
// compiled), "int8", "amx", "avx512", "avx2" or "portable" (the same bits), or
// "amx_bf16" (the dequantized weights' bits); prompt_rows (bool [M]): the rows `auto`
// may run on the bfloat16 tiles (quant_amx_bf16.h).
void gemm_quant(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, bool accumulate = false,
                c10::string_view path = "auto",
                const std::optional<at::Tensor>& prompt_rows = std::nullopt);
// LoRA (cpu_lora.cpp): out[i] = round(out[i] + (x[i] A^T) B^T) for each row i of `rows`
// (none: every row), A^T [K, R] and B^T [R, N] float32.
void lora_apply(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a_t,
                const at::Tensor& b_t, const std::optional<at::Tensor>& rows);
void paged_attention(const at::Tensor& out, const at::Tensor& query,
                     const std::optional<at::Tensor>& key,
                     const std::optional<at::Tensor>& value, const at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t sliding_window, int64_t q_tile,
                     double k_scale = 1.0, double v_scale = 1.0);

}  // namespace pagedllm_ops
