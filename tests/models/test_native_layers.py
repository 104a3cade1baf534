"""The native decoder-layer stack (models/native_layers.py, csrc/cpu_decoder.cpp) gives
bit-identical hidden states to the Python layers it replaces, on every kind of step
(prefill chunks, decodes, mixed, one token), in float32 and bfloat16, for the Llama-shaped
variants it accepts; the ones it does not accept keep the Python layers."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu.features import has_f32_gemm_over_16bit
from pagedllm.kernels.cpu.ops import load_cpu_kernels
from pagedllm.models.layers import linear as linear_module
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="native CPU ops not built")

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "llama": lambda: tiny_llama_config(),
    "llama_biases": lambda: tiny_llama_config(attention_bias=True, mlp_bias=True),
    "qwen2": lambda: tf.Qwen2Config(**SMALL),
    "mistral_window": lambda: tf.MistralConfig(**SMALL, sliding_window=7),
    "qwen3_qk_norm": lambda: tf.Qwen3Config(**SMALL, head_dim=16),
}
NATIVE = {"llama", "llama_biases", "qwen2", "mistral_window"}


def run_both_ways(llm: LLM) -> list[int]:
    """Wrap the runner's forward: each step runs through the Python layers, then the
    default path; the two must be equal. Returns the token count of each checked step."""
    runner = llm.llm_engine.engine_core.executor.runner
    inner, forward = runner.model.model, runner._forward
    steps = []

    def both(input_ids, positions, attn_metadata):
        inner.use_native_layers = False
        reference = forward(input_ids, positions, attn_metadata)
        inner.use_native_layers = True
        out = forward(input_ids, positions, attn_metadata)
        assert torch.equal(out, reference)
        steps.append(input_ids.shape[0])
        return out

    runner._forward = both
    return steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_native_layers_equal_python_layers(tmp_path, family, dtype):
    path = save_tiny_model(tmp_path / family, CONFIGS[family]())
    # A 24-token budget splits the prompts into chunks that share steps with decodes.
    llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    steps = run_both_ways(llm)
    prompts = random_prompts(3, 256, 5, 40, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # 1-token steps
    assert 1 in steps and 24 in steps
    native = llm.llm_engine.engine_core.executor.runner.model.model._native
    assert (native is not None) == (family in NATIVE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_layers_long_prefill(tmp_path, dtype):
    """A 1,100-token step: the native MLP runs it in row chunks, still equal."""
    path = save_tiny_model(tmp_path / "llama", tiny_llama_config(max_position_embeddings=2048))
    llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, enable_prefix_caching=False)
    steps = run_both_ways(llm)
    prompt = random_prompts(1, 256, 1100, 1100, seed=2)[0]
    llm.generate([{"prompt_token_ids": prompt}],
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert steps[0] == 1100


@pytest.mark.skipif(not has_f32_gemm_over_16bit(),
                    reason="needs the AVX2 build (AVX2, FMA, F16C; no AVX-512)")
@pytest.mark.parametrize("saved", [torch.bfloat16, torch.float16])
def test_16bit_checkpoint_in_float32(tmp_path, monkeypatch, saved):
    """A bfloat16 or float16 checkpoint run in float32 (dtype "auto" on AVX2): its linears
    and LM head are packed in the checkpoint's dtype (pack_native: half the bytes a decode
    step streams), the native stack agrees with the Python layers on them, and the tokens
    and logprobs are exactly those of float32 panels of the same values."""
    path = save_tiny_model(tmp_path / "llama", tiny_llama_config(), dtype=saved)
    prompts = random_prompts(3, 256, 5, 40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)

    def run() -> tuple[list, set]:
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True,
                  max_num_batched_tokens=24, enable_prefix_caching=False)
        steps = run_both_ways(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        assert 24 in steps and 1 in steps
        model = llm.llm_engine.engine_core.executor.runner.model
        dtypes = {m.native_weight.dtype for m in model.modules()
                  if getattr(m, "native_weight", None) is not None}
        return [(o.outputs[0].token_ids,
                 [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outs], dtypes

    halves, halves_dtypes = run()
    assert halves_dtypes == {saved}
    monkeypatch.setattr(linear_module, "has_f32_gemm_over_16bit", lambda: False)
    full, full_dtypes = run()
    assert full_dtypes == {torch.float32}
    assert halves == full
