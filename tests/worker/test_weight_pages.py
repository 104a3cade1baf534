"""Packed CPU weights moved into one huge-page arena (worker/weight_pages.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.kernels.cpu.features import has_native_bf16_gemm
from pagedllm.worker import weight_pages
from pagedllm.worker.memory import HUGE_PAGE
from pagedllm.worker.weight_pages import move_to_huge_pages, native_weights


class _Linear(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.native_weight = weight
        self.native_bias = torch.zeros(weight.shape[0])


class _Embedding(nn.Module):
    def __init__(self, blocks: torch.Tensor) -> None:
        super().__init__()
        self.quant_weight = blocks


class _Mixed(nn.Module):
    """A fused projection of mixed GGUF types: one weight per shard."""

    def __init__(self, shards: list[torch.Tensor]) -> None:
        super().__init__()
        self.native_shards = tuple((s, torch.zeros(3)) for s in shards)


def _model() -> nn.Module:
    embed_blocks = torch.randint(0, 256, (5, 3, 34), dtype=torch.uint8)
    model = nn.Module()
    model.embed = _Embedding(embed_blocks)
    model.head = _Linear(embed_blocks)  # tied: the head reads the embedding's blocks
    model.proj = _Linear(torch.randn(2, 7, 48, 2).to(torch.bfloat16))
    model.mixed = _Mixed([torch.randint(0, 256, (1, 2, 20), dtype=torch.uint8),
                          torch.randint(0, 256, (1, 2, 210), dtype=torch.uint8)])
    model.empty = _Linear(torch.empty(0))  # released weights are skipped
    return model


def test_weights_move_into_one_arena_unchanged(monkeypatch):
    monkeypatch.setattr(weight_pages, "huge_pages_available", lambda: True)
    model = _model()
    before = [t.clone() for t in native_weights(model)]
    assert len(before) == 4  # the tied blocks once

    moved = move_to_huge_pages(model)

    after = native_weights(model)
    assert moved == sum(t.numel() * t.element_size() for t in before)
    assert [t.dtype for t in after] == [t.dtype for t in before]
    for old, new in zip(before, after):
        assert new.shape == old.shape and new.is_contiguous() and torch.equal(new, old)
    # One storage, starting on a huge page; every tensor on a cache line.
    assert len({t.untyped_storage().data_ptr() for t in after}) == 1
    assert min(t.data_ptr() for t in after) % HUGE_PAGE == 0
    assert all(t.data_ptr() % 64 == 0 for t in after)
    # A tied weight stays one tensor; shards keep their biases.
    assert model.head.native_weight is model.embed.quant_weight
    assert model.mixed.native_shards[1][1].shape == (3,)
    assert model.empty.native_weight.numel() == 0


def test_views_of_one_memory_in_other_shapes_move_whole(monkeypatch):
    """Two tensors on the same memory with different layouts are two weights (each
    keeps its shape), not one."""
    monkeypatch.setattr(weight_pages, "huge_pages_available", lambda: True)
    blocks = torch.randint(0, 256, (4, 2, 34), dtype=torch.uint8)
    model = nn.Module()
    model.a = _Linear(blocks)
    model.b = _Linear(blocks.view(2, 4, 34))
    move_to_huge_pages(model)
    assert model.a.native_weight.shape == (4, 2, 34)
    assert model.b.native_weight.shape == (2, 4, 34)
    assert torch.equal(model.a.native_weight, blocks)
    assert torch.equal(model.b.native_weight, blocks.view(2, 4, 34))


def test_nothing_moves_without_huge_pages(monkeypatch):
    monkeypatch.setattr(weight_pages, "huge_pages_available", lambda: False)
    model = _model()
    before = native_weights(model)
    assert move_to_huge_pages(model) == 0
    assert all(a is b for a, b in zip(native_weights(model), before))


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_engine_runs_the_bundled_model_from_the_arena(quantization):
    """The default model's native weights (GGUF blocks, or bfloat16 panels) all live in
    the arena once the engine is up, and greedy decoding still gives its known text."""
    if not weight_pages.huge_pages_available():
        pytest.skip("the kernel gives no transparent huge pages here")
    if quantization == "none" and not has_native_bf16_gemm():
        pytest.skip("bfloat16 weights go to torch's GEMM (no native panels) without "
                    "AVX512-BF16 or AVX2")
    from pagedllm import LLM, SamplingParams

    llm = LLM(quantization=quantization, dtype="bfloat16")
    model = llm.llm_engine.engine_core.executor.runner.model
    weights = native_weights(model)
    assert len(weights) >= 121  # 30 layers x 4 linears + the LM head
    assert len({t.untyped_storage().data_ptr() for t in weights}) == 1
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].text
    assert out.startswith(" Paris")
