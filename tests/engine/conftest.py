"""Engine-test fixtures shared across modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_llm():
    """The bundled SmolLM2-135M-Instruct with default settings (dtype auto)."""
    from pagedllm import LLM

    return LLM()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from pagedllm.config import default_model_path
    from pagedllm.loader import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def kv_tiny_path(tmp_path_factory):
    """A tiny random Llama (vocabulary 256) for the tests of blocks kept beyond the KV
    cache (test_kv_transfer.py, test_kv_offloading.py)."""
    from tests.utils import save_tiny_model, tiny_llama_config

    return save_tiny_model(tmp_path_factory.mktemp("tiny_kv"),
                           tiny_llama_config(vocab_size=256), seed=5)


@pytest.fixture(scope="module")
def kv_prompts():
    """Their prompts: two share a 12-token beginning; the others are unrelated. 9..30
    tokens."""
    from tests.utils import random_prompts

    ps = random_prompts(6, 256, 9, 30, seed=4)
    ps.append(ps[0][:12] + [7, 8, 9, 10, 11, 12, 13])
    return ps
