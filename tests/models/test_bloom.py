"""Bloom parity with transformers: ALiBi over several heads (a non-power-of-two count
too), the embedding LayerNorm, head-major query_key_value, tied head."""

from __future__ import annotations

import pytest
from transformers import BloomConfig

from pagedllm.models.bloom import alibi_slopes
from tests.models.parity import VOCAB, assert_parity, make_case, rewrite_checkpoint

CONFIGS = {
    "8_heads": dict(hidden_size=64, n_head=8),
    # 6 heads: 4 power-of-two slopes plus 2 interleaved ones; post-LN residual.
    "6_heads_post_ln_residual": dict(hidden_size=96, n_head=6,
                                     apply_residual_connection_post_layernorm=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    cfg = BloomConfig(vocab_size=VOCAB, n_layer=2, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, **CONFIGS[request.param])
    return make_case(tmp_path_factory.mktemp(f"bloom_{request.param}"), cfg)


@pytest.mark.parametrize("num_heads", [1, 4, 6, 8, 12, 16])
def test_alibi_slopes_match_transformers(num_heads):
    import torch
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    expected = _get_alibi_slopes(num_heads, torch.device("cpu")).tolist()
    assert list(alibi_slopes(num_heads)) == expected


def test_parity(case):
    assert_parity(case, attention_backend="cpu")


def test_chunked_prefill_parity(case):
    assert_parity(case, logprob_chunk_size=7, max_num_batched_tokens=10,
                  attention_backend="torch_ref")


def test_bigscience_checkpoint_layout(case, tmp_path):
    # bigscience/bloom-* checkpoints name tensors without the "transformer." prefix.
    path = rewrite_checkpoint(case.path, tmp_path / "bloom",
                              lambda n: n.removeprefix("transformer."))
    assert_parity(case, path=path)
