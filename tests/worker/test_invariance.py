"""The start-up caveat of configurations that are not batch invariant."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker import invariance
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


def _with_model_cache(config, dtype, block_size=16):
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, dtype=dtype),
        cache=dataclasses.replace(config.cache, block_size=block_size))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_bf16_and_f32_are_invariant_at_any_block_size(config, dtype, block_size):
    assert batch_invariance_caveat(_with_model_cache(config, dtype, block_size), True) is None


def test_bfloat16_without_a_native_gemm_is_named(config, monkeypatch):
    """A CPU with neither AVX512-BF16 nor AVX2 multiplies bfloat16 with torch's GEMM."""
    monkeypatch.setattr(invariance, "has_native_bf16_gemm", lambda: False)
    assert "bfloat16 linear layers" in batch_invariance_caveat(config, True)
    assert batch_invariance_caveat(_with_model_cache(config, "float32"), True) is None


def test_float16_is_named(config):
    assert "float16 linear layers" in batch_invariance_caveat(
        _with_model_cache(config, "float16"), True)


def test_mixture_of_experts_adds_no_caveat(config):
    """Its experts run the native GEMM (tests/engine/test_batch_invariance.py checks the
    outputs): only what applies to any model is named."""
    hf = copy.deepcopy(config.model.hf_config)
    hf.num_local_experts = 4
    moe = dataclasses.replace(config, model=dataclasses.replace(config.model, hf_config=hf))
    assert batch_invariance_caveat(moe, True) is None
    assert "float16 linear layers" in batch_invariance_caveat(
        _with_model_cache(moe, "float16"), True)
