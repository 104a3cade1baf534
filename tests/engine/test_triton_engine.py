"""The engine end to end on the `triton` attention backend: greedy tokens of a tiny
random Llama identical to the `torch_ref` backend's, with chunked prefill and
prefix-cache hits. On a GPU when there is one, else on CPU under Triton's interpreter.

NOTE: TRITON_INTERPRET must be set before pagedllm.attention.triton is first imported
(the engine imports it when the backend is chosen), hence the assignment above the
imports; on a GPU machine it stays unset.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the triton backend needs the `triton` package")

from pagedllm import LLM, SamplingParams  # noqa: E402
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config  # noqa: E402

MAX_NEW = 8
VOCAB = 256


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"),
                           tiny_llama_config(vocab_size=VOCAB))


def _run(model_path, backend: str) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and cached-token counts of prompts sharing a 32-token prefix (two
    full 16-token blocks), after one request has put that prefix in the cache; 12-token
    steps split every prompt into chunks that attend to the cached ones."""
    # num_kv_blocks: the interpreter copies every tensor argument, so keep the cache small.
    # (device "auto": CUDA where there is one.)
    llm = LLM(str(model_path), dtype="float32", skip_tokenizer_init=True,
              attention_backend=backend, block_size=16, num_kv_blocks=48,
              max_num_batched_tokens=12)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    shared = random_prompts(1, VOCAB, 32, 32, seed=7)[0]
    llm.generate([{"prompt_token_ids": shared + [1]}], params, use_tqdm=False)
    prompts = [shared + p for p in random_prompts(3, VOCAB, 1, 21, seed=1)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_triton_engine_matches_torch_ref(tiny_llama):
    from pagedllm.attention.triton.ops import kernels_interpreted

    if not torch.cuda.is_available() and not kernels_interpreted():
        pytest.skip("pagedllm.attention.triton was imported before TRITON_INTERPRET=1")
    expected, _ = _run(tiny_llama, "torch_ref")
    actual, num_cached = _run(tiny_llama, "triton")
    assert num_cached == [32, 32, 32]
    assert actual == expected


def _family_configs() -> dict[str, object]:
    import transformers as tf

    from tests.models.parity import VOCAB as FAMILY_VOCAB

    common = dict(vocab_size=FAMILY_VOCAB, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    return {
        # tanh soft-cap through the kernel, a sliding layer, head size 256.
        "gemma2": tf.Gemma2Config(**common, max_position_embeddings=256, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                  query_pre_attn_scalar=64, sliding_window=6,
                                  attn_logit_softcapping=3.0, final_logit_softcapping=0.3),
        # ALiBi slopes through the kernel, 6 heads (not a power of two).
        "bloom": tf.BloomConfig(**common, n_layer=2, hidden_size=96, n_head=6),
    }


@pytest.mark.parametrize("family", ["gemma2", "bloom"])
def test_triton_engine_matches_transformers_with_softcap_and_alibi(family, tmp_path):
    """Soft-cap (Gemma 2) and ALiBi (Bloom) run inside the Triton kernel, not a torch
    fallback: greedy tokens equal transformers'."""
    from pagedllm.attention.triton.ops import kernels_interpreted
    from tests.models.parity import generate, make_case

    if not torch.cuda.is_available() and not kernels_interpreted():
        pytest.skip("pagedllm.attention.triton was imported before TRITON_INTERPRET=1")
    case = make_case(tmp_path / family, _family_configs()[family], num_prompts=2)
    llm, outputs = generate(case.path, case.prompts, attention_backend="triton",
                            num_kv_blocks=48, max_num_batched_tokens=16)
    layer = llm.llm_engine.engine_core.executor.runner.model
    assert type(_first_attention_impl(layer)).__name__ == "TritonAttention"
    assert outputs == case.reference


def _first_attention_impl(model: torch.nn.Module) -> object:
    from pagedllm.attention.layer import Attention

    for module in model.modules():
        if isinstance(module, Attention):
            return module.impl
    raise AssertionError("no Attention layer")
