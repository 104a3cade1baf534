"""Greedy parity with transformers on the GPU: every model family of the CPU parity tests
(tests/models/) run by pagedllm on device "cuda" in float32 (default attention backend:
triton; CUDA graphs for decode steps where the model allows them) gives the same tokens
as transformers' forward + KV cache on the same GPU in float32; chosen-token logprobs
agree within the CPU tests' 1e-3.

The tiny models and their sharpened weights are the CPU tests' own (tests/models/), so a
feature that binds there (windows, soft-caps, ALiBi, rope scalings, routing) binds here.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tests.cuda.helpers import (CUDA_MARKS, TINY_ENGINE_KW, free_cuda, hf_greedy_no_eos_cuda,
                                hf_model_cuda, hf_sequence_logprobs_cuda, runner_of)
from tests.models import test_bloom as bloom_tests
from tests.models import test_decoder_parity as decoder_tests
from tests.models import test_gpt2 as gpt2_tests
from tests.models import test_gpt_neox as neox_tests
from tests.models import test_opt as opt_tests
from tests.models.parity import LOGPROB_ATOL, VOCAB
from tests.utils import (chosen_logprobs, pagedllm_sequence_logprobs, random_prompts,
                         save_tiny_model, scale_saved_weights)

pytestmark = CUDA_MARKS

MAX_NEW = 8
NUM_PROMPTS = 4


def _cases() -> dict[str, tuple[Callable[[], Any], dict[str, float] | None]]:
    """name -> (make_config, weight scales or None): the CPU parity tests' configs; of
    the families whose variants differ only in torch code (layer-norm placement, rotary
    fraction), the one variant that reaches the attention kernel differently."""
    import transformers as tf

    cases: dict[str, tuple[Callable[[], Any], dict[str, float] | None]] = {
        name: (spec.make_config, spec.scales) for name, spec in decoder_tests.SPECS.items()}
    no_special = dict(bos_token_id=None, eos_token_id=None)
    for name, kw in gpt2_tests.CONFIGS.items():
        cases[f"gpt2_{name}"] = (
            lambda kw=kw: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                        n_positions=gpt2_tests.N_POSITIONS, **no_special,
                                        **kw), None)
    for name in ("parallel",):  # a quarter of each head rotated
        kw = neox_tests.CONFIGS[name]
        cases[f"gpt_neox_{name}"] = (
            lambda kw=kw: tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, max_position_embeddings=128,
                                           **no_special, **kw), None)
    for name in ("pre_ln_proj",):  # position offset 2, projected embeddings
        kw = opt_tests.CONFIGS[name]
        cases[f"opt_{name}"] = (
            lambda kw=kw: tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                       ffn_dim=128, num_attention_heads=4,
                                       max_position_embeddings=128, pad_token_id=None,
                                       **no_special, **kw), None)
    for name in ("6_heads_post_ln_residual",):  # ALiBi over a non-power-of-two head count
        kw = bloom_tests.CONFIGS[name]
        cases[f"bloom_{name}"] = (
            lambda kw=kw: tf.BloomConfig(vocab_size=VOCAB, n_layer=2, pad_token_id=None,
                                         **no_special, **kw), None)
    return cases


CASES = _cases()


def _save_case(tmp_path, name: str):
    make_config, scales = CASES[name]
    path = save_tiny_model(tmp_path / name, make_config(), seed=0)
    if scales:
        scale_saved_weights(path, scales)
    return path


def _generate(path, prompts: list[list[int]], **engine_kw):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True,
              **{**TINY_ENGINE_KW, **engine_kw})
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_transformers_on_cuda(name, tmp_path):
    path = _save_case(tmp_path, name)
    prompts = random_prompts(NUM_PROMPTS, VOCAB, 3, 41, seed=1)
    hf = hf_model_cuda(path)
    reference = [hf_greedy_no_eos_cuda(hf, p, MAX_NEW) for p in prompts]
    del hf
    free_cuda()
    llm, outputs = _generate(path, prompts)
    try:
        runner = runner_of(llm)
        assert runner.device.type == "cuda"
        assert llm.llm_engine.config.device.attention_backend == "triton"
        assert outputs == reference
    finally:
        del llm
        free_cuda()


@pytest.mark.parametrize("name", ["llama_rope_llama3", "gemma2",
                                  "bloom_6_heads_post_ln_residual"])
def test_chosen_logprobs_match_transformers_on_cuda(name, tmp_path):
    """Logprobs of the generated tokens over the whole sequence, at once and in 7-token
    chunks that attend to the cached ones (the kernel's prefix path), within the CPU
    tests' 1e-3; soft-capped (Gemma 2) and ALiBi (Bloom) scores included."""
    path = _save_case(tmp_path, name)
    prompts = random_prompts(2, VOCAB, 3, 41, seed=1)
    hf = hf_model_cuda(path)
    llm, outputs = _generate(path, prompts)
    try:
        for prompt, out in zip(prompts, outputs):
            assert out == hf_greedy_no_eos_cuda(hf, prompt, MAX_NEW)
            seq = prompt + out
            theirs = chosen_logprobs(hf_sequence_logprobs_cuda(hf, seq), len(prompt), out)
            for chunk in (None, 7):
                ours = pagedllm_sequence_logprobs(llm, seq, chunk)
                assert torch.isfinite(ours).all()
                torch.testing.assert_close(chosen_logprobs(ours, len(prompt), out), theirs,
                                           atol=LOGPROB_ATOL, rtol=0,
                                           msg=lambda m, chunk=chunk: f"chunk {chunk}: {m}")
    finally:
        del llm, hf
        free_cuda()
