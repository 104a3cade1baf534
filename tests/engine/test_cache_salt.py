"""cache_salt (vLLM's): only prompts with the same salt share prefix-cache blocks, and
a salt never changes what is generated."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_hash import update_block_hashes
from pagedllm.errors import InvalidRequestError
from pagedllm.request import Request
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256
BLOCK = 4


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny_salt"),
                           tiny_llama_config(vocab_size=VOCAB), seed=3)
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK)


def _run(llm: LLM, ids: list[int], salt: str | None, **params) -> tuple[list[int], int]:
    prompt = {"prompt_token_ids": ids} | ({"cache_salt": salt} if salt else {})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, **params),
                       use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_only_the_same_salt_shares_cached_blocks(llm):
    ids = random_prompts(1, VOCAB, 33, 33, seed=4)[0]  # 8 full blocks and one token
    full = (len(ids) - 1) // BLOCK * BLOCK
    tokens, cached = _run(llm, ids, "tenant-a")
    assert cached == 0
    # The same salt hits every full block; another salt, or none, hits nothing.
    assert _run(llm, ids, "tenant-a") == (tokens, full)
    assert _run(llm, ids, "tenant-b") == (tokens, 0)
    assert _run(llm, ids, None) == (tokens, 0)
    assert _run(llm, ids, None) == (tokens, full)
    assert _run(llm, ids, "tenant-b") == (tokens, full)
    # n > 1: the siblings keep the salt (they share the first sample's blocks).
    out = llm.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-c"}],
                       SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == full
    assert _run(llm, ids, "tenant-c")[1] == full


def test_every_block_hash_of_a_salted_prompt_differs():
    ids = list(range(3 * BLOCK))
    hashes = {}
    for salt in (None, "a", "b"):
        request = Request("r", ids, SamplingParams(), None, cache_salt=salt)
        hashes[salt] = update_block_hashes(request, BLOCK)
    assert len(hashes[None]) == 3
    for i in range(3):
        assert len({hashes[s][i] for s in hashes}) == 3


@pytest.mark.parametrize("salt,message", [("", "non-empty"), (7, "non-empty"),
                                          ("x" * 129, "at most 128")])
def test_a_bad_salt_is_refused_by_name(llm, salt, message):
    with pytest.raises(InvalidRequestError, match=f"cache_salt.*{message}"):
        llm.generate([{"prompt_token_ids": [1, 2, 3], "cache_salt": salt}],
                     SamplingParams(max_tokens=1), use_tqdm=False)
