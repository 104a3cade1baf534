"""SamplingParams.logprob_token_ids (vLLM's): each generated position returns the
logprobs of exactly these tokens, in their order, besides the chosen token's, in place
of the most likely ones. Checked against the whole distribution of the same step
(logprobs over the whole vocabulary) on the tiny Llama."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidRequestError
from tests.utils import save_tiny_model, tiny_llama_config

VOCAB = 256
LABELS = [200, 7, 131, 42]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny"), tiny_llama_config())
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_logprobs=-1,
               num_kv_blocks=64)


def _run(llm, params, prompts=([5, 6, 7, 8],)):
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_label_logprobs_are_the_distributions(llm, temperature):
    kw = dict(max_tokens=5, temperature=temperature, seed=3)
    full, labelled = _run(llm, [SamplingParams(logprobs=VOCAB, **kw),
                                SamplingParams(logprob_token_ids=LABELS, **kw)],
                          prompts=([5, 6, 7, 8], [5, 6, 7, 8]))
    assert labelled.token_ids == full.token_ids
    for step_full, step, token in zip(full.logprobs, labelled.logprobs, labelled.token_ids):
        # The chosen token and the labels, in the labels' order after the chosen one.
        assert list(step)[-len(LABELS):] == LABELS
        assert set(step) == {token, *LABELS}
        for t in step:
            assert step[t].logprob == pytest.approx(step_full[t].logprob, abs=1e-5)
            assert step[t].rank == step_full[t].rank


def test_batched_with_other_requests_alike(llm):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = [SamplingParams(max_tokens=4, temperature=0, logprob_token_ids=LABELS),
              SamplingParams(max_tokens=4, temperature=0, logprobs=3),
              SamplingParams(max_tokens=4, temperature=0, logprob_token_ids=[1, 2])]
    together = _run(llm, params, prompts)
    alone = [_run(llm, p, [q])[0] for p, q in zip(params, prompts)]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
        assert [{t: (lp.logprob, lp.rank) for t, lp in s.items()} for s in a.logprobs] == \
               [{t: (lp.logprob, lp.rank) for t, lp in s.items()} for s in b.logprobs]
    assert list(together[2].logprobs[0])[-2:] == [1, 2]
    assert len(together[1].logprobs[0]) in (3, 4)  # top-3 (and the chosen one)


def test_speculation_leaves_label_rows_alone(tmp_path):
    path = save_tiny_model(tmp_path, tiny_llama_config())
    spec = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1})
    plain = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0, logprob_token_ids=LABELS)
    prompt = [[5, 6, 5, 6, 5, 6, 5, 6]]
    a, b = _run(spec, params, prompt)[0], _run(plain, params, prompt)[0]
    assert a.token_ids == b.token_ids
    assert [list(s) for s in a.logprobs] == [list(s) for s in b.logprobs]


def test_what_it_refuses(llm):
    for bad, match in (([], "1 to 128"), ([1, 1], "repeat"), ([-1], "token ids"),
                       ([True], "token ids"), (list(range(129)), "1 to 128")):
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams(logprob_token_ids=bad)
    with pytest.raises(InvalidRequestError, match="logprobs must be their count"):
        SamplingParams(logprob_token_ids=[1, 2], logprobs=5)
    assert SamplingParams(logprob_token_ids=[1, 2]).logprobs == 2
    with pytest.raises(InvalidRequestError, match="out of vocabulary"):
        _run(llm, SamplingParams(max_tokens=1, logprob_token_ids=[VOCAB]))
