"""torch profiler traces of the engine's steps (profiler_dir, as vLLM's
VLLM_TORCH_PROFILER_DIR): LLM.start_profile() / stop_profile() write one Chrome trace per
worker holding the steps' operators; misuse is a ValueError. The server's routes:
tests/entrypoints/test_server_options.py."""

from __future__ import annotations

import gzip
import json
import os

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


def _forwards(path: str) -> int:
    """The forward passes in a trace: one fused layer-stack call each (tiny Llama)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return sum(event.get("name") == "pagedllm_cpu::llama_decoder_stack"
                   for event in json.load(f)["traceEvents"])


def test_vllms_profiler_config(tiny_path, tmp_path):
    """--profiler-config: vLLM's defaults (gzipped trace, the ops' time table beside it,
    stacks), and delay_iterations / max_iterations choosing the steps recorded."""
    traces = tmp_path / "traces"
    params = SamplingParams(temperature=0, max_tokens=10)  # 10 steps: prompt + 9 decodes
    config = {"profiler": "torch", "torch_profiler_dir": str(traces)}
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              profiler_config=config)
    llm.start_profile()
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    (path,) = llm.stop_profile()
    assert path.startswith(str(traces)) and path.endswith(".trace.json.gz")
    assert _forwards(path) == 10
    table = path.removesuffix(".trace.json.gz") + ".txt"
    assert "pagedllm_cpu::llama_decoder_stack" in open(table).read()
    llm.shutdown()
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              profiler_config={**config, "delay_iterations": 2, "max_iterations": 3,
                               "torch_profiler_use_gzip": False,
                               "torch_profiler_dump_cuda_time_total": False})
    llm.start_profile()
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    (path,) = llm.stop_profile()
    assert path.endswith(".trace.json") and _forwards(path) == 3
    assert not os.path.exists(path.removesuffix(".trace.json") + ".txt")
    # Stopped before the delay ran out: nothing was recorded, no trace.
    llm.start_profile()
    llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=1),
                 use_tqdm=False)
    assert llm.stop_profile() == []


def test_profiler_config_options_and_refusals(tmp_path):
    from pagedllm.engine.profiler_options import profiler_options

    base = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    directory, options = profiler_options({**base, "wait_iterations": 1,
                                           "warmup_iterations": 2}, None)
    # vLLM's schedule: the same steps recorded (3 skipped, then 5 by default).
    assert directory == str(tmp_path)
    assert (options.delay_iterations, options.max_iterations) == (3, 5)
    assert profiler_options(None, "/x")[0] == "/x"
    _, options = profiler_options({**base, "torch_profiler_activities": ["CPU"],
                                   "torch_profiler_record_shapes": True}, str(tmp_path))
    assert options.activities == ("CPU",) and options.record_shapes and options.with_stack
    for values, match in [
        ({"profiler": "cuda"}, "'cuda' is not built"),
        ({**base, "proton_mode": "x"}, "Proton profiler is not built"),
        ({**base, "capture_torch_profiler": True}, "CUDA graph capture"),
        ({"torch_profiler_dir": "/x"}, "only applicable when profiler is 'torch'"),
        ({"profiler": "torch"}, "torch_profiler_dir must be set"),
        ({**base, "delay_iterations": -1}, "integer >= 0"),
        ({**base, "torch_profiler_with_stack": "yes"}, "must be a bool"),
        ({**base, "torch_profiler_activities": ["GPU"]}, "torch_profiler_activities"),
        ({**base, "delay_iterations": 1, "warmup_iterations": 1}, "not both"),
        ({**base, "frobnicate": 1}, "unknown key 'frobnicate'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            profiler_options(values, None)
    with pytest.raises(ConfigError, match="disagree"):
        profiler_options(base, "/elsewhere")
