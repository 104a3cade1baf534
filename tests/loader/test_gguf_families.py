"""GGUF files of the families llama.cpp writes beyond Llama's and Qwen2's: Qwen3 and
Qwen3-MoE (`qwen3` / `qwen3moe`: q/k norms, experts), and Mixtral (`llama` with
experts). The experts' 3-D tensors are split into Hugging Face's per-expert weights.
Tiny models written here as llama.cpp's converter would (Q8_0 projections, F32 norms
and router; Mixtral's q/k rows permuted), read back against the tensors written, and
run by the engine: dequantized, token for token the same as the HF directory of the
same weights; natively quantized (every projection, each expert's included, through the
quantized GEMM), close to it."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.loader.gguf import GGUFWeights
from tests.loader.test_gguf import add_decoder_hparams, llamacpp_row_order
from tests.utils import pagedllm_sequence_logprobs, random_prompts

QT = gguf.GGMLQuantizationType
VOCAB = 256
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm.weight": "attn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight"}
EXPERTS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
           "down_proj": "ffn_down_exps.weight"}
# Mixtral's HF names of the same parts.
MIXTRAL = {"block_sparse_moe.gate.weight": "mlp.gate.weight", "w1": "gate_proj",
           "w3": "up_proj", "w2": "down_proj"}
NUM_EXPERTS = 4


def _config(arch: str):
    from transformers import MixtralConfig, Qwen3Config, Qwen3MoeConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, rope_theta=10000.0)
    if arch == "qwen3":
        return Qwen3Config(**kw)
    if arch == "llama":  # Mixtral: no q/k norms, head size hidden / heads
        kw.pop("head_dim")
        return MixtralConfig(**kw, num_local_experts=NUM_EXPERTS, num_experts_per_tok=2)
    return Qwen3MoeConfig(**kw, num_experts=NUM_EXPERTS, num_experts_per_tok=2,
                          moe_intermediate_size=64, norm_topk_prob=True)


def _gguf_name(name: str) -> str:
    """The GGUF name of an HF tensor outside the experts (Mixtral's names mapped to
    Qwen3-MoE's first: llama.cpp names both alike)."""
    if name in GLOBAL:
        return GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    rest = MIXTRAL.get(rest, rest)
    return f"blk.{layer}.{LAYER[rest]}"


def _expert_name(arch: str, layer: int, expert: int, part: str) -> str:
    """HF's name of one expert's gate_proj / up_proj / down_proj."""
    if arch == "llama":
        mixtral = {v: k for k, v in MIXTRAL.items()}[part]
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{mixtral}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"


def _quantize(w: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray]:
    """(stored data, what reading it back gives: float32 of w's shape)."""
    if qtype == QT.F32:
        return w.astype(np.float32), w.astype(np.float32)
    data = gguf.quants.quantize(w, qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape)


def write_family_gguf(path: Path, hf_dir: Path, arch: str, seed: int = 0,
                      ) -> dict[str, torch.Tensor]:
    """A tiny random Qwen3 (arch "qwen3"), Qwen3-MoE ("qwen3moe") or Mixtral ("llama")
    as llama.cpp writes it at `path`, and the same weights as an HF directory at
    `hf_dir`; returns them (HF checkpoint names: one tensor per expert; dequantized,
    float32)."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = _config(arch)
    torch.manual_seed(seed)
    # The checkpoint's names (transformers fuses the experts in memory, not on disk).
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(hf_dir)
    state = load_file(str(hf_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    for k in state:  # sharper than the init (greedy choices are no near-ties); norms != 1
        state[k] = (1 + 0.1 * rng.standard_normal(state[k].shape)).astype(np.float32) \
            if "norm" in k else state[k] * 4
    writer = gguf.GGUFWriter(str(path), arch)
    add_decoder_hparams(writer, cfg)
    if arch == "llama":
        writer.add_expert_count(NUM_EXPERTS)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    else:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(NUM_EXPERTS)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    stored: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, w: np.ndarray, qtype: QT, heads: int | None = None
            ) -> np.ndarray:
        """Write w (its rows permuted as llama.cpp does for `heads` heads); what reading
        it back in HF's row order gives."""
        order = None if heads is None else llamacpp_row_order(w.shape[0], heads)
        data, back = _quantize(w if order is None else w[order], qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=None if qtype == QT.F32 else qtype)
        return back if order is None else back[np.argsort(order)]

    for name, w in state.items():
        if ".experts." in name:
            continue
        qtype = QT.F32 if w.ndim == 1 or name.endswith(".gate.weight") else QT.Q8_0
        heads = None
        if arch == "llama" and ".q_proj." in name:
            heads = cfg.num_attention_heads
        elif arch == "llama" and ".k_proj." in name:
            heads = cfg.num_key_value_heads
        stored[name] = torch.from_numpy(np.array(add(_gguf_name(name), w, qtype, heads)))
    if arch != "qwen3":
        for layer in range(cfg.num_hidden_layers):
            for part, gguf_part in EXPERTS.items():
                names = [_expert_name(arch, layer, e, part) for e in range(NUM_EXPERTS)]
                back = add(f"blk.{layer}.{gguf_part}", np.stack([state[n] for n in names]),
                           QT.Q8_0)
                stored.update({n: torch.from_numpy(np.array(back[e]))
                               for e, n in enumerate(names)})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file({k: v.contiguous() for k, v in stored.items()},
              str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return stored


@pytest.fixture(scope="module", params=["qwen3", "qwen3moe", "llama"])
def written(request, tmp_path_factory):
    """(GGUF path, HF directory of the same weights, the weights)."""
    tmp = tmp_path_factory.mktemp(request.param)
    path = tmp / f"tiny-{request.param}.gguf"
    stored = write_family_gguf(path, tmp / "hf", request.param)
    return path, tmp / "hf", stored


def test_stream_is_the_written_weights(written, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    path, _, stored = written
    weights = dict(GGUFWeights(str(path)).iter_weights(torch.float32))
    assert weights.keys() == stored.keys()
    for name, tensor in stored.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)


def test_engine_matches_the_hf_directory(written):
    path, hf_dir, _ = written
    prompts = random_prompts(4, VOCAB, 3, 12, seed=1)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def run(model: str, **kw) -> list[list[int]]:
        llm = LLM(model=model, dtype="float32", skip_tokenizer_init=True, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert run(str(path), quantization="none") == run(str(hf_dir))


def test_native_quantized_is_close(written):
    """Q8_0 projections through the quantized GEMM (int8 activations, as llama.cpp):
    each position's teacher-forced logprobs (the whole vocabulary) within 0.1 of the
    dequantized model's; for the MoE at 90% of positions. Measured on the MoE: 71 of 74
    positions within 0.055, three apart by 0.14, 0.39 and 0.70 (jumps, as when the
    ~1% different hidden state tips the router to another expert), the argmax the same
    at 72."""
    path, _, _ = written
    native = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True)
    assert native.llm_engine.config.model.quantization == "gguf"
    model = native.llm_engine.engine_core.executor.runner.model
    moe = "qwen3moe" in path.name or "llama" in path.name
    if moe:  # the experts run their Q8_0 blocks too, no plain copy kept
        experts = model.model.layers[0].mlp.experts
        for linear in (experts.w13, experts.w2):
            assert all(q is not None for q in linear.quantized)
            assert linear.weight.numel() == 0
    plain = LLM(model=str(path), dtype="float32", skip_tokenizer_init=True,
                quantization="none")
    diffs = []
    for ids in random_prompts(6, VOCAB, 8, 16, seed=2):
        a = pagedllm_sequence_logprobs(native, ids)
        b = pagedllm_sequence_logprobs(plain, ids)
        diffs += (a - b).abs().max(dim=-1).values.tolist()
    close = sum(d < 0.1 for d in diffs) / len(diffs)
    assert close >= (0.9 if moe else 1.0), sorted(diffs)[-5:]
