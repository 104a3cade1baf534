"""A max_model_len past the model's max_position_embeddings (allowed for rotary models,
as llama.cpp allows a larger context): every position the engine runs has its rotary
angles. The table held max_position_embeddings rows, and the native kernels read past
it without a bounds check: garbage angles, then NaN logits some tokens later (a few
dozen past the end, depending on what memory followed the table)."""

from __future__ import annotations

import math

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.layers.rotary import RotaryEmbedding, get_rope
from tests.utils import save_scripted_llama, tiny_llama_config


def test_tables_cover_what_is_asked_and_keep_their_rows():
    cfg = tiny_llama_config()
    rope = get_rope(cfg, 16)
    assert rope.num_positions == cfg.max_position_embeddings == 256
    cos, sin = (t.clone() for t in rope.tables(torch.device("cpu"), torch.float32))
    rope.cover(1000)
    cos2, sin2 = rope.tables(torch.device("cpu"), torch.float32)
    assert rope.num_positions == 1000
    assert torch.equal(cos2[:256], cos) and torch.equal(sin2[:256], sin)
    expected = get_rope(cfg, 16, max_position=1000).tables(torch.device("cpu"), torch.float32)
    assert torch.equal(cos2, expected[0]) and torch.equal(sin2, expected[1])
    rope.cover(10)  # never shrinks
    assert rope.num_positions == 1000
    assert isinstance(rope, RotaryEmbedding)


def test_generation_past_max_position_embeddings_stays_finite(tmp_path):
    # The scripted model recites a b a b ... at any position (its layers add nothing),
    # so every token past position 256 is known.
    path = save_scripted_llama(tmp_path, {"go": "a", "a": "b", "b": "a"})
    llm = LLM(model=str(path), dtype="float32", max_model_len=1024, num_kv_blocks=128)
    out = llm.generate([{"prompt_token_ids": [2]}],
                       SamplingParams(temperature=0, max_tokens=700, ignore_eos=True,
                                      logprobs=0), use_tqdm=False)[0].outputs[0]
    assert out.text.split() == ["a", "b"] * 350
    assert all(math.isfinite(next(iter(lp.values())).logprob) for lp in out.logprobs)
