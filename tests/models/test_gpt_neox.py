"""GPT-NeoX parity with transformers: partial rotary, parallel and sequential residual,
head-major query_key_value, separate embed_out head."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig

from tests.models.parity import VOCAB, assert_parity, make_case, rewrite_checkpoint

CONFIGS = {
    # Pythia style: a quarter of each head rotated, parallel residual.
    "parallel": dict(use_parallel_residual=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.25}),
    # Sequential residual, half the head rotated, a different base, tied head.
    "sequential": dict(use_parallel_residual=False, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                        "partial_rotary_factor": 0.5}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                        **CONFIGS[request.param])
    return make_case(tmp_path_factory.mktemp(f"neox_{request.param}"), cfg)


def test_parity(case):
    assert_parity(case, attention_backend="cpu")


def test_chunked_prefill_parity(case):
    assert_parity(case, logprob_chunk_size=7, max_num_batched_tokens=10,
                  attention_backend="torch_ref")


def test_pythia_checkpoint_layout(case, tmp_path):
    # Older checkpoints carry mask and rotary buffers next to the weights (ignored).
    extra = {}
    for i in range(2):
        prefix = f"gpt_neox.layers.{i}.attention"
        extra[f"{prefix}.bias"] = torch.ones(1, 1, 8, 8)
        extra[f"{prefix}.masked_bias"] = torch.tensor(-1e9)
        extra[f"{prefix}.rotary_emb.inv_freq"] = torch.ones(2)
    # And a head saved as lm_head (transformers 5's in-memory name) instead of embed_out.
    path = rewrite_checkpoint(case.path, tmp_path / "neox",
                              lambda n: n.replace("embed_out.", "lm_head."), extra)
    assert_parity(case, path=path)
