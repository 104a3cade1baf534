"""OPT parity with transformers: position offset 2, both LayerNorm placements,
project_in/out (word_embed_proj_dim != hidden_size), q/k/v fused on load."""

from __future__ import annotations

import pytest
from transformers import OPTConfig

from tests.models.parity import VOCAB, assert_parity, make_case, rewrite_checkpoint

CONFIGS = {
    # opt-125m style: pre-LayerNorm with a final LayerNorm; plus a projected embedding.
    "pre_ln_proj": dict(do_layer_norm_before=True, word_embed_proj_dim=32),
    # opt-350m style: post-LayerNorm, no final LayerNorm, projected embedding.
    "post_ln_proj": dict(do_layer_norm_before=False, word_embed_proj_dim=48),
    # Parameter-free LayerNorms and an untied head.
    "no_affine_untied": dict(layer_norm_elementwise_affine=False, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                    num_attention_heads=4, max_position_embeddings=128, bos_token_id=None,
                    eos_token_id=None, pad_token_id=None, **CONFIGS[request.param])
    return make_case(tmp_path_factory.mktemp(f"opt_{request.param}"), cfg)


def test_parity(case):
    assert_parity(case, attention_backend="cpu")


def test_chunked_prefill_parity(case):
    assert_parity(case, logprob_chunk_size=7, max_num_batched_tokens=10,
                  attention_backend="torch_ref")


def test_facebook_checkpoint_layout(case, tmp_path):
    # facebook/opt-* checkpoints name the decoder "decoder.*", without "model.".
    path = rewrite_checkpoint(case.path, tmp_path / "opt", lambda n: n.removeprefix("model."))
    assert_parity(case, path=path)
