"""GPT-2 parity with transformers: learned positions, Conv1D checkpoints, tied head."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

from tests.models.parity import VOCAB, assert_parity, make_case, rewrite_checkpoint

N_POSITIONS = 128

CONFIGS = {
    "tied": dict(),
    # Per-layer 1 / (layer_idx + 1) score scaling, untied head, exact GELU.
    "inverse_layer_idx": dict(scale_attn_by_inverse_layer_idx=True,
                              reorder_and_upcast_attn=True, tie_word_embeddings=False,
                              activation_function="gelu"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=N_POSITIONS,
                     bos_token_id=None, eos_token_id=None, **CONFIGS[request.param])
    return make_case(tmp_path_factory.mktemp(f"gpt2_{request.param}"), cfg)


def test_parity(case):
    llm = assert_parity(case, attention_backend="cpu")
    # Learned positions: the context cannot outgrow the position table.
    assert llm.llm_engine.engine_core.config.scheduler.max_model_len == N_POSITIONS


def test_chunked_prefill_parity(case):
    assert_parity(case, logprob_chunk_size=7, max_num_batched_tokens=10,
                  attention_backend="torch_ref")


def test_openai_checkpoint_layout(case, tmp_path):
    # openai-community/gpt2 names carry no "transformer." prefix and include the causal
    # mask buffers h.N.attn.bias / masked_bias.
    def rename(name):
        return name.removeprefix("transformer.")

    mask = torch.tril(torch.ones(1, 1, N_POSITIONS, N_POSITIONS))
    extra = {f"h.{i}.attn.{b}": mask.clone() for i in range(2)
             for b in ("bias", "masked_bias")}
    path = rewrite_checkpoint(case.path, tmp_path / "gpt2", rename, extra)
    assert_parity(case, path=path)


def test_max_model_len_capped_by_position_table(case):
    from pagedllm import LLM

    with pytest.raises(ValueError, match="learned position embeddings cover 128"):
        LLM(str(case.path), dtype="float32", skip_tokenizer_init=True,
            max_model_len=N_POSITIONS + 1)
