"""torch profiler traces of the engine's steps (profiler_dir, as vLLM's
VLLM_TORCH_PROFILER_DIR): LLM.start_profile() / stop_profile() write one Chrome trace per
worker holding the steps' operators; misuse is a ValueError. The server's routes:
tests/entrypoints/test_server_options.py."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ConfigError
from tests.utils import save_tiny_model, tiny_llama_config


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_profile"),
                           tiny_llama_config(vocab_size=256), seed=2)


def test_a_trace_of_the_steps(tiny_path, tmp_path):
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              profiler_dir=str(tmp_path / "traces"))
    llm.start_profile()
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    (path,) = llm.stop_profile()
    assert len(out[0].outputs[0].token_ids) == 4
    assert path.startswith(str(tmp_path / "traces")) and path.endswith(".trace.json")
    with open(path) as f:
        names = {event.get("name", "") for event in json.load(f)["traceEvents"]}
    # The steps' operators are in it: torch's, and the native kernels' (the fused layer
    # stack of every forward pass, where the CPU runs it).
    assert any(name.startswith("aten::") for name in names)
    assert any(name.startswith("pagedllm_cpu::") for name in names)
    # Misuse names what is wrong.
    with pytest.raises(ValueError, match="not recording: start_profile first"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(ValueError, match="already recording"):
        llm.start_profile()
    second = llm.stop_profile()
    assert second != [path]  # a new file each time


def test_profiling_is_off_without_a_directory(tiny_path, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    with pytest.raises(ConfigError, match="profiling is off"):
        llm.start_profile()


def test_vllms_environment_variable_turns_it_on(tiny_path, tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    llm.start_profile()
    (path,) = llm.stop_profile()
    assert path.startswith(str(tmp_path))
