"""truncate_prompt_tokens (vLLM's): a request keeps its prompt's last k tokens."""

from __future__ import annotations

import pytest

from pagedllm import LLM, PoolingParams, SamplingParams
from tests.utils import save_tiny_model, tiny_llama_config

VOCAB = 128
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny_truncate"),
                           tiny_llama_config(vocab_size=VOCAB), seed=5)
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=4,
               max_model_len=MAX_MODEL_LEN)


def test_generation_sees_only_the_last_tokens(llm):
    prompt = list(range(3, 23))
    greedy = dict(temperature=0, max_tokens=6)
    cut = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(truncate_prompt_tokens=7, **greedy), use_tqdm=False)[0]
    last = llm.generate([{"prompt_token_ids": prompt[-7:]}], SamplingParams(**greedy),
                        use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-7:]
    assert cut.outputs[0].token_ids == last.outputs[0].token_ids
    # -1: the last max_model_len tokens; a prompt no longer than k is kept whole.
    long = list(range(1, 100))
    out = llm.generate([{"prompt_token_ids": long}],
                       SamplingParams(truncate_prompt_tokens=-1, max_tokens=1),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-MAX_MODEL_LEN:]
    whole = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(truncate_prompt_tokens=50, **greedy), use_tqdm=False)
    assert whole[0].prompt_token_ids == prompt


def test_embedding_sees_only_the_last_tokens(llm):
    prompt = list(range(3, 23))
    cut = llm.embed([{"prompt_token_ids": prompt}], PoolingParams(truncate_prompt_tokens=5),
                    use_tqdm=False)[0]
    last = llm.embed([{"prompt_token_ids": prompt[-5:]}], use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-5:]
    assert cut.outputs.embedding == last.outputs.embedding


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "3"])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
        SamplingParams(truncate_prompt_tokens=value)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1"):
        PoolingParams(truncate_prompt_tokens=value)


def test_more_than_max_model_len_is_refused(llm):
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(65\) is greater "
                                         r"than max_model_len \(64\)"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                     SamplingParams(truncate_prompt_tokens=65), use_tqdm=False)
