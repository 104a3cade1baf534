"""logprobs and prompt_logprobs equal transformers' log-softmax (float32, raw logits:
before temperature and penalties) on a tiny random Llama, across chunked prefill."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    cfg = tiny_llama_config(vocab_size=VOCAB)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_logprobs"), cfg, seed=3)


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_path):
    # 16-token steps: the longer prompts are prefilled in chunks (prompt logprobs too).
    return LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
               max_num_batched_tokens=16, block_size=4)


def reference(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len, V]: row i is the distribution of the token after token_ids[:i + 1]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entry(entry: dict, ref_row: torch.Tensor, chosen: int, k: int) -> None:
    """One position's dict: the chosen token with its rank, plus the top-k."""
    assert chosen in entry and len(entry) in (k, k + 1)
    for token_id, lp in entry.items():
        assert abs(lp.logprob - float(ref_row[token_id])) < ATOL, (token_id, lp)
    assert entry[chosen].rank == 1 + int((ref_row > ref_row[chosen]).sum())
    top = sorted((lp.rank, t) for t, lp in entry.items() if t != chosen or lp.rank <= k)
    assert [rank for rank, _ in top][:k] == list(range(1, k + 1))
    expected_top = ref_row.topk(k).values
    got_top = torch.tensor([entry[t].logprob for _, t in top][:k])
    torch.testing.assert_close(got_top, expected_top, atol=ATOL, rtol=0)


def test_sample_logprobs_match_transformers(llm, hf_model):
    prompts = random_prompts(4, VOCAB, 5, 30, seed=11)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=8, logprobs=5,
                             repetition_penalty=1.3) for i in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=8))  # no logprobs
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt in zip(outs[:3], prompts):
        completion = out.outputs[0]
        ref = reference(hf_model, prompt + completion.token_ids)
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_entry(entry, ref[len(prompt) - 1 + j], token, 5)
        chosen = sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))
        assert completion.cumulative_logprob == pytest.approx(chosen, abs=1e-6)
        assert out.prompt_logprobs is None
    assert outs[3].outputs[0].logprobs is None
    assert outs[3].outputs[0].cumulative_logprob is None


def test_logprobs_zero_returns_the_chosen_token_only(llm, hf_model):
    prompt = random_prompts(1, VOCAB, 6, 6, seed=12)[0]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=4, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    ref = reference(hf_model, prompt + out.token_ids)
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert list(entry) == [token] and entry[token].rank == 1
        assert abs(entry[token].logprob - float(ref[len(prompt) - 1 + j, token])) < ATOL


@pytest.mark.parametrize("length", [3, 17, 45])
def test_prompt_logprobs_match_transformers(llm, hf_model, length):
    prompt = random_prompts(1, VOCAB, length, length, seed=length)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    # Twice: the second run must not take prompt positions from the prefix cache.
    for _ in range(2):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        ref = reference(hf_model, prompt)
        assert len(out.prompt_logprobs) == length and out.prompt_logprobs[0] is None
        for i in range(1, length):
            check_entry(out.prompt_logprobs[i], ref[i - 1], prompt[i], 3)


def test_logprobs_survive_preemption(tiny_path, hf_model):
    # 13 usable 4-token blocks for four 20-token prompts + 10 outputs: requests are
    # preempted and recomputed; their prompt is then scored twice but recorded once.
    small = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
                num_kv_blocks=14)
    prompts = random_prompts(4, VOCAB, 20, 20, seed=13)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, prompt_logprobs=1)
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], params,
                          use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        completion = out.outputs[0]
        ref = reference(hf_model, prompt + completion.token_ids)
        assert len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            check_entry(out.prompt_logprobs[i], ref[i - 1], prompt[i], 1)
        assert len(completion.logprobs) == 10
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_entry(entry, ref[len(prompt) - 1 + j], token, 2)


def test_prompt_logprobs_scored_in_pieces(llm, hf_model, monkeypatch):
    """A chunk's prompt logprobs are scored a few rows at a time (bounded memory); the
    pieces give the same entries as transformers."""
    from pagedllm.worker import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "MAX_LOGITS_ELEMENTS", 3 * VOCAB)  # 3 rows
    pieces = []
    real = prompt_logprobs.score_values

    def score(logits, token_ids, k, mode):
        pieces.append(len(token_ids))
        return real(logits, token_ids, k, mode)

    monkeypatch.setattr(prompt_logprobs, "score_values", score)
    prompt = random_prompts(1, VOCAB, 23, 23, seed=11)[0]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert sum(pieces) == len(prompt) - 1 and max(pieces) == 3 and len(pieces) >= 8
    ref = reference(hf_model, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        check_entry(out.prompt_logprobs[i], ref[i - 1], prompt[i], 2)


def test_prompt_logprobs_are_converted_chunk_by_chunk(llm, hf_model):
    """The output processor converts each prefill chunk's prompt logprobs as it arrives
    (a long prompt's would otherwise be one long stall of the server's event loop) and
    publishes them once the whole prompt is scored."""
    engine = llm.llm_engine
    prompt = random_prompts(1, VOCAB, 40, 40, seed=17)[0]
    engine.add_request("chunked", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    parent = engine.output_processor.parents["chunked"]
    sizes, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        if final is None:
            sizes.append(len(parent.prompt_logprobs_so_far))
            assert parent.prompt_logprobs is None  # nothing published before the end
    assert sizes[0] > 1 and sizes == sorted(sizes) and sizes[-1] < len(prompt)
    ref = reference(hf_model, prompt)
    assert len(final.prompt_logprobs) == len(prompt) and final.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        check_entry(final.prompt_logprobs[i], ref[i - 1], prompt[i], 2)


def test_logprobs_over_max_logprobs_are_refused(tiny_path):
    """As vLLM's max_logprobs (default 20; -1: the whole vocabulary, never more)."""
    default = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"Requested {name} of 21, which is greater "
                                             f"than max allowed: 20"):
            default.generate(prompt, SamplingParams(max_tokens=1, **{name: 21}))
    out = default.generate(prompt, SamplingParams(max_tokens=1, logprobs=20,
                                                  prompt_logprobs=20), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 20 and len(out.prompt_logprobs[1]) >= 20
    everything = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
                     block_size=4, max_logprobs=-1)
    out = everything.generate(prompt, SamplingParams(max_tokens=1, logprobs=VOCAB),
                              use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == VOCAB
    with pytest.raises(ValueError, match=f"greater than max allowed: {VOCAB}"):
        everything.generate(prompt, SamplingParams(max_tokens=1, logprobs=VOCAB + 1))


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs"])
def test_logprobs_mode(tiny_path, hf_model, mode):
    """vLLM's logprobs_mode: raw_logits reports transformers' logits themselves;
    processed_logprobs the log-softmax of what the token was drawn from (temperature
    0.5, top-k 4: the fifth entry is -inf). Prompt tokens have no processing: their
    entries are the logits, or the plain log-softmax."""
    from pagedllm.sample.ops import apply_top_k_top_p

    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
              logprobs_mode=mode)
    prompt = random_prompts(1, VOCAB, 12, 12, seed=21)[0]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.5, top_k=4, seed=3, max_tokens=6,
                                      logprobs=5, prompt_logprobs=2), use_tqdm=False)[0]
    ids = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()

    def same(entry, want):
        for token_id, lp in entry.items():
            if want[token_id] == float("-inf"):
                assert lp.logprob == float("-inf"), (token_id, lp)
            else:
                assert abs(lp.logprob - float(want[token_id])) < ATOL, (token_id, lp)

    for i, entry in enumerate(out.outputs[0].logprobs):
        row = logits[len(prompt) - 1 + i]
        if mode == "processed_logprobs":
            row = apply_top_k_top_p(row[None] / 0.5, torch.tensor([4]), None)[0]
            row = row.log_softmax(-1)
            assert sum(lp.logprob > float("-inf") for lp in entry.values()) == 4
        same(entry, row)
    for pos in range(1, len(prompt)):
        row = logits[pos - 1]
        same(out.prompt_logprobs[pos], row if mode == "raw_logits" else row.log_softmax(-1))
