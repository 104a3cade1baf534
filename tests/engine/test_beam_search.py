"""LLM.beam_search equals a plain beam search over transformers' forward (tiny Llama,
small vocabulary so that EOS often ranks among the candidates)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, BeamSearchParams
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 32
EOS = 3


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    cfg = tiny_llama_config(vocab_size=VOCAB, max_position_embeddings=128, eos_token_id=EOS)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_beam"), cfg, seed=7)


def reference_beam_search(model, prompt: list[int], width: int, max_tokens: int,
                          length_penalty: float, ignore_eos: bool):
    """Each step expands every beam by its 2 * width most likely tokens; beams ending in
    EOS are complete; score = cum_logprob / len(tokens without final EOS) ** penalty."""
    def score(beam):
        tokens, cum = beam
        length = len(tokens) - (tokens[-1] == EOS)
        return cum / length ** length_penalty

    beams, completed = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, dim=-1).topk(2 * width)
            for token, logprob in zip(top.indices.tolist(), top.values.tolist()):
                beam = (tokens + [token], cum + logprob)
                (completed if token == EOS and not ignore_eos else candidates).append(beam)
        beams = sorted(candidates, key=score, reverse=True)[:width]
        if not beams:
            break
    return sorted(completed + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width, length_penalty, ignore_eos",
                         [(3, 1.0, False), (2, 0.5, True)])
def test_beam_search_matches_reference(tiny_path, width, length_penalty, ignore_eos):
    prompts = random_prompts(2, VOCAB, 5, 14, seed=31)
    prompts = [[t if t != EOS else EOS + 1 for t in p] for p in prompts]
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    params = BeamSearchParams(beam_width=width, max_tokens=6,
                              length_penalty=length_penalty, ignore_eos=ignore_eos)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    num_eos_beams = 0
    for out, prompt in zip(outs, prompts):
        ref = reference_beam_search(model, prompt, width, 6, length_penalty, ignore_eos)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in ref]
        for seq, (_, cum) in zip(out.sequences, ref):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
            ends_with_eos = seq.tokens[-1] == EOS and not ignore_eos
            assert seq.finish_reason == ("stop" if ends_with_eos else "length")
            num_eos_beams += ends_with_eos
    if not ignore_eos:
        assert num_eos_beams > 0  # the EOS path is exercised
    # Every step's requests are finished and their blocks free again.
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == llm.llm_engine.engine_core.num_blocks - 1


def test_a_beam_wider_than_max_logprobs_allows_is_refused(tiny_path):
    """Each step asks for 2 * beam_width logprobs: past max_logprobs (default 20) the
    search is refused up front, naming both; a larger max_logprobs allows it."""
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    with pytest.raises(ValueError, match="beam_width 11 needs 22 logprobs per step, more "
                                         "than the 20 max_logprobs allows"):
        llm.beam_search(prompt, BeamSearchParams(beam_width=11, max_tokens=2))
    wide = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
               max_logprobs=22)
    out = wide.beam_search(prompt, BeamSearchParams(beam_width=11, max_tokens=2))[0]
    assert len(out.sequences) == 11
