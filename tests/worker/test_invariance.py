"""The start-up caveat of configurations that are not batch invariant."""

from __future__ import annotations

import dataclasses

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker.invariance import batch_invariance_caveat
from tests.utils import save_tiny_model, tiny_llama_config


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("llama"), tiny_llama_config())
    return EngineArgs(model=str(path), dtype="bfloat16",
                      device="cpu").create_engine_config()


def _with(config, **device):
    return dataclasses.replace(config, device=dataclasses.replace(config.device, **device))


def test_native_cpu_path_is_invariant(config):
    assert config.device.attention_backend == "cpu"
    assert batch_invariance_caveat(config, native_kernels=True) is None


@pytest.mark.parametrize("change, native, fragment", [
    (dict(compile=True), True, "torch.compile"),
    (dict(attention_backend="torch_ref"), True, "torch_ref attention backend"),
    ({}, False, "native CPU kernels are not loaded"),
])
def test_other_paths_say_why(config, change, native, fragment):
    assert fragment in batch_invariance_caveat(_with(config, **change), native)


def test_float32_is_named(config):
    f32 = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="float32"))
    assert "only bfloat16" in batch_invariance_caveat(f32, True)


def test_bf16_block_size_not_a_multiple_of_16(config):
    odd = dataclasses.replace(config, cache=dataclasses.replace(config.cache, block_size=8))
    assert "multiples of 16" in batch_invariance_caveat(odd, True)
