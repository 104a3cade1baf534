"""LoRA on each Llama-shaped family against transformers computing PEFT's unmerged LoRA
(float32 greedy tokens): Qwen2's qkv bias, Qwen3's q/k norm after the adapted q/k, Gemma
2's GELU MLP and soft-caps, Phi-3's fused qkv_proj / gate_up_proj targets, Mixtral's
attention (its experts are not targets)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.utils import (LLAMA_LORA_TARGETS, apply_lora_hooks, hf_greedy_no_eos,
                         random_prompts, save_tiny_lora, save_tiny_model)

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

FAMILIES = {
    "qwen2_bias": (lambda: tf.Qwen2Config(**COMMON, tie_word_embeddings=False),
                   LLAMA_LORA_TARGETS),
    "qwen3_qk_norm": (lambda: tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
                      LLAMA_LORA_TARGETS),
    "gemma2": (lambda: tf.Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16,
                                       sliding_window=6, attn_logit_softcapping=3.0,
                                       final_logit_softcapping=3.0), LLAMA_LORA_TARGETS),
    "phi3_fused": (lambda: tf.Phi3Config(**COMMON, tie_word_embeddings=False),
                   ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "mixtral_attention": (lambda: tf.MixtralConfig(**COMMON, num_local_experts=4,
                                                   num_experts_per_tok=2), ATTENTION),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(tmp_path, family):
    make_config, targets = FAMILIES[family]
    model = save_tiny_model(tmp_path / "model", make_config())
    adapter = save_tiny_lora(tmp_path / "adapter", model, targets=targets, std=0.3)
    prompts = random_prompts(2, VOCAB, 6, 14, seed=11)
    hf = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    base = [hf_greedy_no_eos(hf, p, 8) for p in prompts]
    handles = apply_lora_hooks(hf, adapter)
    want = [hf_greedy_no_eos(hf, p, 8) for p in prompts]
    for h in handles:
        h.remove()
    assert want != base  # the adapter matters
    llm = LLM(str(model), skip_tokenizer_init=True, dtype="float32", enable_lora=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outs] == want
