"""compile=True (worker/compile.py): the inductor graphs produce the eager path's greedy
tokens. Compiling the tiny Llama's two graphs takes ~30 s on a 2-core machine."""

from __future__ import annotations

import gc

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.worker.compile import CompiledForward
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_eager(tmp_path):
    path = save_tiny_model(tmp_path / "tiny", tiny_llama_config())
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 256, 5, 20, seed=1)]
    # Unequal lengths: prefill and batched decodes run the dynamic-T graph, the last
    # decodes of the longest request alone run the T = 1 graph.
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 6, 10)]
    outputs = {}
    for compile in (False, True):
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=4,
                  num_kv_blocks=64, compile=compile)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[compile] = [o.outputs[0].token_ids for o in outs]
        forward = llm.llm_engine.engine_core.executor.runner._forward
        if compile:
            assert isinstance(forward, CompiledForward)
            assert forward._seen == {True, False}  # both graphs were compiled and run
        del llm, forward
        gc.collect()
    assert [len(t) for t in outputs[False]] == [4, 6, 10]
    assert outputs[True] == outputs[False]
