"""FlatLogprobs reads as the list of {token_id: Logprob} dicts it replaces; a request's
logprobs reach the reader once (the core and the output processor drop what they sent),
and delta outputs carry each position once."""

from __future__ import annotations

import pickle
import random

import pytest

from pagedllm import LLM
from pagedllm.outputs import FlatLogprobs, Logprob
from pagedllm.request import TokenLogprobs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.utils import save_tiny_model, tiny_llama_config


def _positions(seed: int, count: int) -> list[TokenLogprobs]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        top = rng.sample(range(50), rng.randint(0, 5))
        chosen = rng.choice(top) if top and rng.random() < 0.5 else rng.randrange(50)
        ids = [chosen, *top]
        out.append(TokenLogprobs(ids, [-rng.random() * 10 for _ in ids],
                                 [rng.randint(1, 50) for _ in ids]))
    return out


def _as_dict(entry: TokenLogprobs, texts: dict[int, str] | None) -> dict[int, Logprob]:
    out: dict[int, Logprob] = {}
    for t, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
        out.setdefault(t, Logprob(lp, rank, texts[t] if texts else None))
    return out


@pytest.mark.parametrize("decode", [False, True])
def test_flat_logprobs_read_as_a_list_of_dicts(decode):
    texts = {t: f"<{t}>" for t in range(50)} if decode else None
    entries = _positions(0, 300)
    flat = FlatLogprobs()
    for e in entries:
        flat.append(e.token_ids, e.logprobs, e.ranks,
                    [texts[t] for t in e.token_ids] if texts else None)
    expected = [_as_dict(e, texts) for e in entries]
    assert len(flat) == 300 and flat == expected and list(flat) == expected
    assert flat[-1] == expected[-1] and flat[7:19] == expected[7:19]
    assert flat[::-3] == expected[::-3]
    with pytest.raises(IndexError):
        flat[300]
    # A chosen token also among the top-k keeps its first (chosen) entry, as a dict.
    assert all(list(d) == list(e) for d, e in zip(flat, expected))
    assert pickle.loads(pickle.dumps(flat)) == expected


def test_a_head_view_does_not_see_later_positions():
    entries = _positions(1, 40)
    flat = FlatLogprobs()
    for e in entries[:25]:
        flat.append(e.token_ids, e.logprobs, e.ranks)
    view = flat.head()
    for e in entries[25:]:
        flat.append(e.token_ids, e.logprobs, e.ranks)
    assert len(view) == 25 and view == [_as_dict(e, None) for e in entries[:25]]
    assert len(flat) == 40
    with pytest.raises(AssertionError):
        view.append([1], [-1.0], [1])


def test_each_output_logprob_is_taken_once(tmp_path):
    """The output processor takes a request's logprobs as they come (the request keeps
    none), and the outputs hold each position once: deltas one after the other, each
    cumulative output every position so far (unchanged by later steps)."""
    path = save_tiny_model(tmp_path / "tiny", tiny_llama_config(vocab_size=256), seed=3)
    engine = LLM(str(path), dtype="float32", skip_tokenizer_init=True).llm_engine
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=4, n=2,
                                ignore_eos=True, output_kind=kind)
        engine.add_request(f"r-{kind.name}", [5, 6, 7, 8], params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
            assert all(not r.output_logprobs for r in engine.engine_core.scheduler.running)
        for index in (0, 1):
            parts = [c for o in outputs for c in o.outputs if c.index == index]
            if kind == RequestOutputKind.DELTA:
                logprobs = [d for c in parts for d in c.logprobs]
                tokens = [t for c in parts for t in c.token_ids]
            else:
                logprobs, tokens = list(parts[-1].logprobs), parts[-1].token_ids
                assert all(len(c.logprobs or ()) == len(c.token_ids) for c in parts)
                assert all(list(c.logprobs or ()) == logprobs[:len(c.token_ids)] for c in parts)
            assert len(tokens) == len(logprobs) == 12
            assert all(t in d and d[t].rank >= 1 for t, d in zip(tokens, logprobs))
        assert outputs[-1].finished
