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
