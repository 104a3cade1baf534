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
