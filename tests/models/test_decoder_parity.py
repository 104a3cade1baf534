"""Parity with transformers for the rotary decoder families: Llama (rope scalings, biases,
tied head), Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, Mixtral and Qwen3-MoE.

Each case is a tiny random model whose distinct feature binds: its weights are scaled so
attention is sharp (positions and windows matter), soft-caps are exceeded and routing is
decisive, and `test_feature_binds` checks that transformers' own outputs change when the
feature is switched off. Greedy tokens must equal transformers' and chosen-token logprobs
agree within 1e-3, plainly and with chunked prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import transformers as tf

from tests.models.parity import (MAX_NEW, VOCAB, TinyCase, assert_parity)
from tests.utils import hf_greedy_no_eos, random_prompts, save_tiny_model, scale_saved_weights

COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
# q/k x8 each: attention scores of order 1-10 instead of ~0.05; lm_head x10: peaked logits.
SHARP = {"q_proj": 8.0, "k_proj": 8.0, "lm_head": 10.0}
# Tied heads: scaling the embeddings would make every model repeat its last token; the
# layers' outputs are scaled up instead so the continuation depends on the context.
SHARP_TIED = {"q_proj": 8.0, "k_proj": 8.0, "v_proj": 4.0, "o_proj": 4.0, "up_proj": 4.0,
              "down_proj": 4.0}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@dataclass
class Spec:
    make_config: Callable[[], Any]
    scales: dict[str, float] = field(default_factory=lambda: dict(SHARP))
    # Config overrides that switch the case's feature off (transformers must then differ).
    ablations: list[dict[str, Any]] = field(default_factory=list)


def _llama(**kw) -> Any:
    return tf.LlamaConfig(**{**COMMON, **SMALL, "tie_word_embeddings": False, **kw})


SPECS: dict[str, Spec] = {
    "llama_rope_linear": Spec(
        lambda: _llama(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                        "rope_theta": 10000.0}),
        ablations=[{"rope_parameters": DEFAULT_ROPE}]),
    # HF recomputes dynamic-NTK frequencies only past max_position_embeddings (256): within
    # it they are plain rope's, so there is nothing to ablate.
    "llama_rope_dynamic": Spec(
        lambda: _llama(rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                        "rope_theta": 10000.0})),
    # Legacy `rope_scaling` + `rope_theta` keys, as in Llama 3.x config.json files.
    "llama_rope_llama3": Spec(
        lambda: _llama(rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        ablations=[{"rope_parameters": DEFAULT_ROPE}]),
    "llama_rope_yarn": Spec(
        lambda: _llama(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 64}),
        ablations=[{"rope_parameters": DEFAULT_ROPE}]),
    "llama_tied_bias": Spec(
        lambda: _llama(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
        scales={**SHARP_TIED, "model.norm.weight": 10.0}),
    # head_dim 96 (not hidden / heads); every prompt longer than some is past the window.
    "mistral_sliding_window": Spec(
        lambda: tf.MistralConfig(**COMMON, **SMALL, head_dim=96, sliding_window=7),
        ablations=[{"sliding_window": None}]),
    # Sliding window on layers >= max_window_layers only.
    "qwen2_bias_window": Spec(
        lambda: tf.Qwen2Config(**COMMON, **SMALL, use_sliding_window=True, sliding_window=6,
                               max_window_layers=1, tie_word_embeddings=False),
        ablations=[{"layer_types": ["full_attention"] * 2}]),
    # q/k norm, head_dim 128, MQA (one KV head).
    "qwen3_qk_norm_mqa": Spec(
        lambda: tf.Qwen3Config(**{**COMMON, **SMALL, "num_key_value_heads": 1},
                               head_dim=128, tie_word_embeddings=False)),
    # head_dim 256 with query_pre_attn_scalar 64; both soft-caps bind; layer 0 slides.
    "gemma2": Spec(
        lambda: tf.Gemma2Config(**COMMON, **SMALL, head_dim=256, query_pre_attn_scalar=64,
                                sliding_window=6, attn_logit_softcapping=3.0,
                                final_logit_softcapping=0.3),
        scales=SHARP_TIED,
        ablations=[{"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
                   {"layer_types": ["full_attention"] * 2}]),
    # head_dim 80, local rope base for the sliding layer, scaled global rope for the full one.
    "gemma3": Spec(
        lambda: tf.Gemma3TextConfig(
            **{**COMMON, **SMALL, "num_hidden_layers": 3}, head_dim=80,
            query_pre_attn_scalar=80, sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0,
                                   "rope_theta": 1000000.0}}),
        scales=SHARP_TIED,
        ablations=[{"layer_types": ["full_attention"] * 3}]),
    # Fused qkv / gate_up checkpoint, half the head dims rotated, longrope short factors.
    "phi3_partial_longrope": Spec(
        lambda: tf.Phi3Config(
            **{**COMMON, **SMALL, "hidden_size": 128}, sliding_window=12,
            original_max_position_embeddings=128, tie_word_embeddings=False,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5,
                             "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0],
                             "long_factor": [2.0] * 8}),
        scales={"qkv_proj": 6.0, "lm_head": 10.0},
        ablations=[{"sliding_window": None}]),
    "mixtral_4x_top2": Spec(
        lambda: tf.MixtralConfig(**COMMON, **{**SMALL, "intermediate_size": 96},
                                 num_local_experts=4, num_experts_per_tok=2),
        scales={**SHARP, "block_sparse_moe.gate": 10.0}),
    # Qwen3's q/k norms; layer 0 sparse (top 2 of 4, renormalized), layer 1 dense.
    "qwen3_moe_4x_top2": Spec(
        lambda: tf.Qwen3MoeConfig(**COMMON, **SMALL, head_dim=16, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=48,
                                  norm_topk_prob=True, mlp_only_layers=[1]),
        scales={**SHARP, "mlp.gate.": 10.0},
        ablations=[{"norm_topk_prob": False}, {"mlp_only_layers": []}]),
}


def _hf_model(path, **overrides) -> torch.nn.Module:
    cfg = tf.AutoConfig.from_pretrained(path)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return tf.AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory) -> TinyCase:
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_model(path, spec.make_config(), seed=0)
    scale_saved_weights(path, spec.scales)
    hf_model = _hf_model(path)
    prompts = random_prompts(6, VOCAB, 3, 41, seed=1)
    reference = [hf_greedy_no_eos(hf_model, p, MAX_NEW) for p in prompts]
    case = TinyCase(path, hf_model, prompts, reference)
    case.spec = spec
    return case


def test_parity(case):
    assert_parity(case, attention_backend="torch_ref")


def test_chunked_prefill_parity(case):
    # 10 tokens per step: most prompts are split across steps; the logprob pass attends
    # 7-token chunks over their cached context.
    assert_parity(case, logprob_chunk_size=7, max_num_batched_tokens=10,
                  attention_backend="cpu")


def test_feature_binds(case):
    ids = torch.tensor([max(case.prompts, key=len) + case.reference[0]])
    with torch.no_grad():
        base = torch.log_softmax(case.hf_model(ids).logits, -1)
        for overrides in case.spec.ablations:
            ablated = torch.log_softmax(_hf_model(case.path, **overrides)(ids).logits, -1)
            assert (ablated - base).abs().max() > 0.05, overrides
