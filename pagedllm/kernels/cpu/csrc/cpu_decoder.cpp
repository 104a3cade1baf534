// The decoder layers of Llama-shaped models in one native call: the same ops, in the same
// order, as LlamaDecoderLayer.forward runs on CPU (models/llama.py), so the outputs are
// bit-identical; what goes away is the Python between them. At one token per step a
// layer's kernels take ~190 us and the ~15 Python-level calls around them another
// ~60 us; SmolLM2-135M has 30 layers per token.
//
// Per layer, `weights` holds kWeightsPerLayer optional tensors (see the enum); a linear
// runs the native bfloat16 or float32 GEMM when it has a native-packed weight (cpu_gemm.cpp),
// the quantized GEMM
// when that weight is GGUF blocks (uint8, cpu_quant.cpp), oneDNN's packed GEMM otherwise
// (models/layers/linear.py: cpu_linear).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "ops.h"

namespace pagedllm_ops {
namespace {

// Slots of one linear in the weight list: oneDNN-packed, native-packed (bfloat16,
// float32, or uint8 GGUF blocks), bias, native (float32) bias, then up to two more
// (GGUF blocks, float32 bias) shards: a fused projection whose GGUF shards differ in type
// (LinearBase.native_shards: Q4_K_M files store v as Q6_K beside Q4_K q and k) multiplies
// them one by one into their columns of the output.
constexpr int64_t kLinearSlots = 8, kMaxShards = 3;

// Slots of one layer in the weight list.
enum Slot : int64_t {
  kInputNorm,
  kQkv,
  kO = kQkv + kLinearSlots,
  kPostNorm = kO + kLinearSlots,
  kGateUp,
  kDown = kGateUp + kLinearSlots,
  kKvCache = kDown + kLinearSlots,
  kWeightsPerLayer,
};

// The native weight and float32 bias slots of shard s of the linear at `base`.
constexpr int64_t shard_weight(int64_t base, int64_t s) { return base + (s == 0 ? 1 : 2 + 2 * s); }
constexpr int64_t shard_bias(int64_t base, int64_t s) { return base + (s == 0 ? 3 : 3 + 2 * s); }

using Weights = c10::List<std::optional<at::Tensor>>;

constexpr int64_t kMlpRows = 1024;

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 c10::string_view(""));
}

// The step's prompt rows (bool [T]: rows that are prompt tokens of their request), which
// the quantized GEMM may run on other kernels than the rest (quant_amx_bf16.h); none:
// every row as one.
using PromptRows = std::optional<at::Tensor>;

// out (+)= x . W^T + bias through the native GEMM of W's packing (uint8 GGUF blocks;
// bfloat16, float16 or float32 panels, multiplied in x's dtype: float32 x may meet
// 16-bit panels, models/layers/linear.py: pack_native).
void native_gemm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const at::Tensor& bias, bool accumulate, const PromptRows& prompt) {
  if (weight.scalar_type() == at::kByte) {
    gemm_quant(out, x, weight, bias, accumulate, "auto", prompt);
  } else if (x.scalar_type() == at::kFloat) {
    gemm_f32(out, x, weight, bias, accumulate);
  } else {
    gemm_bf16(out, x, weight, bias, accumulate);
  }
}

// x [T, in] -> [T, out] through the linear whose slots start at `base`.
at::Tensor linear(const at::Tensor& x, const Weights& w, int64_t base,
                  const PromptRows& prompt) {
  if (!w.get(shard_weight(base, 0)).has_value())
    return packed_linear(x, *w.get(base), w.get(base + 2));
  // Native: every shard's float32 bias is there (zeros for none) and gives its width.
  int64_t shards = 0, n = 0;
  for (; shards < kMaxShards && w.get(shard_weight(base, shards)).has_value(); ++shards)
    n += w.get(shard_bias(base, shards))->size(0);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  for (int64_t s = 0, start = 0; s < shards; ++s) {
    const at::Tensor bias = *w.get(shard_bias(base, s));
    native_gemm(shards == 1 ? out : out.narrow(1, start, bias.size(0)), x,
                *w.get(shard_weight(base, s)), bias, /*accumulate=*/false, prompt);
    start += bias.size(0);
  }
  return out;
}

// out += the linear of x (out.add_(linear(x)); the native GEMM adds in its epilogue, which
// saves a pass over the residual stream per add: ~0.9 ms of a 64-token decode step).
void add_linear(const at::Tensor& out, const at::Tensor& x, const Weights& w, int64_t base,
                const PromptRows& prompt) {
  const std::optional<at::Tensor> native = w.get(shard_weight(base, 0));
  if (native.has_value()) {
    TORCH_CHECK(!w.get(shard_weight(base, 1)).has_value(),
                "llama_decoder_layers: o_proj / down_proj come in one shard");
    native_gemm(out, x, *native, *w.get(shard_bias(base, 0)), /*accumulate=*/true, prompt);
    return;
  }
  out.add_(packed_linear(x, *w.get(base), w.get(base + 2)));
}

// The LoRA adapters of a step (lora/layers.py applies the same op in the Python
// layers): per adapter a, its token rows (none: every row), and per layer and adapted
// linear (qkv, o, gate_up, down) A^T [K, R] and B^T [R, N] (the scale folded in), or
// none where the adapter leaves that linear alone.
struct LoRAStep {
  const Weights& weights;  // [adapter][layer][linear][A^T, B^T]
  const c10::List<std::optional<at::Tensor>>& rows;  // [adapter]
  int64_t num_layers;

  bool empty() const { return rows.size() == 0; }

  std::optional<at::Tensor> a_t(size_t a, int64_t layer, int64_t which) const {
    return weights.get(2 * ((a * num_layers + layer) * 4 + which));
  }

  // Whether any adapter of the step adapts linear `which` of `layer`.
  bool adapts(int64_t layer, int64_t which) const {
    for (size_t a = 0; a < rows.size(); ++a)
      if (a_t(a, layer, which).has_value()) return true;
    return false;
  }

  // out [T, N] (linear `which` of `layer` on x [T, K]) += each adapter's delta on its rows.
  void apply(const at::Tensor& out, const at::Tensor& x, int64_t layer, int64_t which) const {
    for (size_t a = 0; a < rows.size(); ++a) {
      const std::optional<at::Tensor> at_ = a_t(a, layer, which);
      if (!at_.has_value()) continue;
      const size_t slot = 2 * ((a * num_layers + layer) * 4 + which) + 1;
      lora_apply(out, x, *at_, *weights.get(slot), rows.get(a));
    }
  }
};

// Linears of a layer, in LoRAStep's order.
enum LoRALinear : int64_t { kLoraQkv, kLoraO, kLoraGateUp, kLoraDown };

// linear(), then the step's LoRA adapters of that linear.
at::Tensor adapted_linear(const at::Tensor& x, const Weights& w, int64_t base,
                          const LoRAStep& lora, int64_t layer, int64_t which,
                          const PromptRows& prompt) {
  at::Tensor out = linear(x, w, base, prompt);
  if (!lora.empty()) lora.apply(out, x, layer, which);
  return out;
}

// add_linear(), the linear's output taking the step's LoRA adapters first (then
// out.add_(y), which is what the accumulating GEMM's epilogue computes without them).
void add_adapted_linear(const at::Tensor& out, const at::Tensor& x, const Weights& w,
                        int64_t base, const LoRAStep& lora, int64_t layer, int64_t which,
                        const PromptRows& prompt) {
  if (lora.empty() || !lora.adapts(layer, which)) return add_linear(out, x, w, base, prompt);
  at::Tensor y = linear(x, w, base, prompt);
  lora.apply(y, x, layer, which);
  out.add_(y);
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  at::Tensor out = at::empty_like(x);
  rms_norm(out, x, weight, eps, offset);
  return out;
}

// x [T, hidden]: the embedded tokens in, the residual stream after the last layer out
// (updated in place), normed in place by final_norm when given (the model's last RMSNorm:
// one dispatch from Python fewer per step, ~0.1 ms at one token, as the Python after a
// decode step runs on caches the weights just flushed). kv_scales: (k_scale, v_scale) per
// layer, used by fp8 caches. prompt: the step's prompt rows (PromptRows) or none.
void llama_decoder_layers(const at::Tensor& x, const at::Tensor& positions,
                          const Weights& weights, at::IntArrayRef sliding_windows,
                          const at::Tensor& slot_mapping, const at::Tensor& block_table,
                          const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_size, int64_t rotary_dim,
                          bool is_neox, double scale, double eps, double norm_offset,
                          at::ArrayRef<double> kv_scales,
                          const std::optional<at::Tensor>& final_norm, double final_eps,
                          double final_offset, const LoRAStep& lora,
                          const PromptRows& prompt) {
  const int64_t num_layers = static_cast<int64_t>(sliding_windows.size());
  TORCH_CHECK(static_cast<int64_t>(kv_scales.size()) == 2 * num_layers,
              "llama_decoder_layers: expected a (k_scale, v_scale) pair per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kWeightsPerLayer,
              "llama_decoder_layers: expected ", kWeightsPerLayer, " weights per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "llama_decoder_layers: x is [T, hidden]");
  const int64_t tokens = x.size(0);
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t base = layer * kWeightsPerLayer;
    auto w = [&](int64_t slot) { return *weights.get(base + slot); };
    // Attention block: x += o_proj(attn(rope(qkv_proj(norm(x))))).
    const at::Tensor qkv = adapted_linear(norm(x, w(kInputNorm), eps, norm_offset), weights,
                                          base + kQkv, lora, layer, kLoraQkv, prompt);
    const at::Tensor q = qkv.narrow(1, 0, q_size);
    const at::Tensor k = qkv.narrow(1, q_size, kv_size);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
    rotary_embedding(q, k, positions, cos, sin, head_size, rotary_dim, is_neox);
    at::Tensor attn = at::empty({tokens, num_heads, head_size}, x.options());
    paged_attention(attn, q.view({tokens, num_heads, head_size}),
                    k.view({tokens, num_kv_heads, head_size}),
                    v.view({tokens, num_kv_heads, head_size}), w(kKvCache), slot_mapping,
                    block_table, seq_lens, query_start_loc, scale, sliding_windows[layer], 16,
                    kv_scales[2 * layer], kv_scales[2 * layer + 1]);
    add_adapted_linear(x, attn.view({tokens, q_size}), weights, base + kO, lora, layer,
                       kLoraO, prompt);
    // MLP block: x += down(silu(gate) * up), by row chunks on long prefills so the
    // [rows, 2 * intermediate] activations stay in cache between the GEMMs and the
    // element-wise op (measured: -5% MLP time at 2048 rows; rows are independent here).
    // A step with LoRA adapters takes one chunk (their rows index the whole step).
    const int64_t chunk = lora.empty() ? kMlpRows : std::max<int64_t>(tokens, 1);
    for (int64_t r0 = 0; r0 < tokens; r0 += chunk) {
      const int64_t rows = std::min(chunk, tokens - r0);
      const at::Tensor xs = x.narrow(0, r0, rows);
      const PromptRows ps = prompt ? PromptRows(prompt->narrow(0, r0, rows)) : std::nullopt;
      const at::Tensor gate_up = adapted_linear(norm(xs, w(kPostNorm), eps, norm_offset),
                                                weights, base + kGateUp, lora, layer,
                                                kLoraGateUp, ps);
      at::Tensor act = at::empty({xs.size(0), gate_up.size(1) / 2}, x.options());
      silu_and_mul(act, gate_up);
      add_adapted_linear(xs, act, weights, base + kDown, lora, layer, kLoraDown, ps);
    }
  }
  // In place: each row is read whole (its sum of squares) before it is written.
  if (final_norm.has_value()) rms_norm(x, x, *final_norm, final_eps, final_offset);
}

// A model's side of llama_decoder_layers, bound once (models/native_layers.py builds it
// when the weights are packed and the KV caches bound): the weight list (~34 entries a
// layer, ~1000 for SmolLM2) and the per-layer lists would otherwise be converted from
// Python on every step: measured ~30 us warm, ~65 us after a 100 MB stream (a decode
// step's caches).
struct LlamaLayers : torch::CustomClassHolder {
  Weights weights;
  std::vector<int64_t> sliding_windows;
  std::vector<double> kv_scales;
  int64_t num_heads, num_kv_heads, head_size, rotary_dim;
  bool is_neox;
  double scale, eps, norm_offset;

  LlamaLayers(Weights weights, std::vector<int64_t> sliding_windows,
              std::vector<double> kv_scales, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_size, int64_t rotary_dim, bool is_neox, double scale, double eps,
              double norm_offset)
      : weights(std::move(weights)), sliding_windows(std::move(sliding_windows)),
        kv_scales(std::move(kv_scales)), num_heads(num_heads), num_kv_heads(num_kv_heads),
        head_size(head_size), rotary_dim(rotary_dim), is_neox(is_neox), scale(scale),
        eps(eps), norm_offset(norm_offset) {}
};

// llama_decoder_layers with the model's side taken from `layers`; the step's tensors
// (and the final norm) come with the call.
void llama_decoder_stack(const c10::intrusive_ptr<LlamaLayers>& layers, const at::Tensor& x,
                         const at::Tensor& positions, const at::Tensor& slot_mapping,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, const at::Tensor& cos,
                         const at::Tensor& sin, const std::optional<at::Tensor>& final_norm,
                         double final_eps, double final_offset, const Weights& lora_weights,
                         const c10::List<std::optional<at::Tensor>>& lora_rows,
                         const PromptRows& prompt_rows) {
  const LlamaLayers& l = *layers;
  const int64_t num_layers = static_cast<int64_t>(l.sliding_windows.size());
  const int64_t adapters = static_cast<int64_t>(lora_rows.size());
  TORCH_CHECK(static_cast<int64_t>(lora_weights.size()) == adapters * num_layers * 8,
              "llama_decoder_stack: expected 8 LoRA weights per layer and adapter");
  const LoRAStep lora{lora_weights, lora_rows, num_layers};
  llama_decoder_layers(x, positions, l.weights, l.sliding_windows, slot_mapping, block_table,
                       seq_lens, query_start_loc, cos, sin, l.num_heads, l.num_kv_heads,
                       l.head_size, l.rotary_dim, l.is_neox, l.scale, l.eps, l.norm_offset,
                       l.kv_scales, final_norm, final_eps, final_offset, lora, prompt_rows);
}

}  // namespace
}  // namespace pagedllm_ops

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.class_<pagedllm_ops::LlamaLayers>("LlamaLayers")
      .def(torch::init<pagedllm_ops::Weights, std::vector<int64_t>, std::vector<double>,
                       int64_t, int64_t, int64_t, int64_t, bool, double, double, double>());
  m.def(
      "llama_decoder_stack(__torch__.torch.classes.pagedllm_cpu.LlamaLayers layers, "
      "Tensor(a!) x, Tensor positions, Tensor slot_mapping, Tensor block_table, "
      "Tensor seq_lens, Tensor query_start_loc, Tensor cos, Tensor sin, "
      "Tensor? final_norm, float final_eps, float final_offset, Tensor?[] lora_weights, "
      "Tensor?[] lora_rows, Tensor? prompt_rows=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("llama_decoder_stack", &pagedllm_ops::llama_decoder_stack);
}
