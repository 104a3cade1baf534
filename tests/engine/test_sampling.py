"""Sampling through the engine on a tiny random Llama: seeds, n > 1 over the prefix
cache, best_of, output kinds, aborts."""

from __future__ import annotations

import pytest

from pagedllm import LLM, LLMEngine, EngineArgs, RequestOutputKind, SamplingParams
from tests.utils import hf_greedy, random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    cfg = tiny_llama_config(vocab_size=VOCAB)
    # Larger weights than the default init: flatter distributions make seeds matter.
    return save_tiny_model(tmp_path_factory.mktemp("tiny_sampling"), cfg, seed=5)


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_seed_reproducible_alone_in_a_batch_and_under_preemption(tiny_path, llm):
    prompts = random_prompts(6, VOCAB, 4, 30, seed=21)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=12)
    alone = llm.generate(token_prompts(prompts[:1]), seeded, use_tqdm=False)
    mixed = [SamplingParams(temperature=0.8, max_tokens=12), SamplingParams(temperature=0),
             SamplingParams(seed=9, max_tokens=5, top_p=0.8), SamplingParams(min_p=0.05)]
    batch = llm.generate(token_prompts(prompts[1:3] + prompts[:1] + prompts[3:5]),
                         mixed[:2] + [seeded] + mixed[2:], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone[0].outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=4321, max_tokens=12)
    again = llm.generate(token_prompts(prompts[:1]), other_seed, use_tqdm=False)
    assert again[0].outputs[0].token_ids != alone[0].outputs[0].token_ids
    # A cache far too small for six requests: preempted ones replay their generator.
    small = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
                num_kv_blocks=14)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12) for i in range(6)]
    expected = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    preempted = small.generate(token_prompts(prompts), params, use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert ([o.outputs[0].token_ids for o in preempted]
            == [o.outputs[0].token_ids for o in expected])


def test_n_samples_share_the_prompt_through_the_prefix_cache(llm):
    prompt = random_prompts(1, VOCAB, 41, 41, seed=22)[0]
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    out = llm.generate(token_prompts([prompt]),
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 3 and all(len(s) == 10 for s in samples)
    # Children 1 and 2 find the first child's 10 full blocks (40 tokens) cached.
    assert kv.prefix_cache_hits - hits_before == 2 * 40
    assert out.num_cached_tokens == 40
    # Child i is seeded with seed + i: a single request with that seed reproduces it.
    single = llm.generate(token_prompts([prompt]),
                          SamplingParams(temperature=1.0, seed=8, max_tokens=10),
                          use_tqdm=False)[0]
    assert tuple(single.outputs[0].token_ids) == samples[1]


def test_greedy_n_equals_the_reference(tiny_path, llm):
    prompts = random_prompts(2, VOCAB, 5, 20, seed=23)
    outs = llm.generate(token_prompts(prompts), SamplingParams(n=2, temperature=0,
                                                               max_tokens=8), use_tqdm=False)
    ref = hf_greedy(tiny_path, prompts, 8)
    for out, expected in zip(outs, ref):
        assert [c.token_ids for c in out.outputs] == [expected, expected]


def test_best_of_returns_the_most_likely_samples(llm):
    prompt = random_prompts(1, VOCAB, 12, 12, seed=24)[0]
    out = llm.generate(token_prompts([prompt]),
                       SamplingParams(n=2, best_of=4, temperature=1.0, seed=50, max_tokens=6),
                       use_tqdm=False)[0]
    # The four candidates are what seeds 50..53 produce on their own.
    singles = llm.generate(token_prompts([prompt] * 4),
                           [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=6,
                                           logprobs=0) for i in range(4)], use_tqdm=False)
    ranked = sorted((o.outputs[0] for o in singles), key=lambda c: c.cumulative_logprob,
                    reverse=True)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].cumulative_logprob == pytest.approx(ranked[0].cumulative_logprob)
    assert all(c.logprobs is None for c in out.outputs)  # not requested


def run_engine(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds_with_n(tiny_path, kind):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_path), dtype="float32",
                                                   block_size=4), skip_tokenizer_init=True)
    prompt = random_prompts(1, VOCAB, 9, 9, seed=25)[0]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, logprobs=1,
                            output_kind=kind)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    outputs = run_engine(engine)
    final_params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, logprobs=1,
                                  output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("f", {"prompt_token_ids": prompt}, final_params)
    (final,) = run_engine(engine)
    assert [o.finished for o in outputs][-1] and not any(o.finished for o in outputs[:-1])
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1
    elif kind == RequestOutputKind.CUMULATIVE:
        assert [len(c.token_ids) for c in outputs[-1].outputs] == [5, 5]
        assert ([c.token_ids for c in outputs[-1].outputs]
                == [c.token_ids for c in final.outputs])
    else:
        for index in range(2):
            tokens, logprobs = [], []
            for out in outputs:
                for c in out.outputs:
                    if c.index == index:
                        tokens += c.token_ids
                        logprobs += c.logprobs
            assert tokens == final.outputs[index].token_ids
            # ("f" hit the prefix cache of "r": same tokens, logprobs to rounding.)
            expected = final.outputs[index].logprobs
            assert [list(e) for e in logprobs] == [list(e) for e in expected]
            assert [e[t].logprob for e, t in zip(logprobs, tokens)] == pytest.approx(
                [e[t].logprob for e, t in zip(expected, tokens)], abs=1e-5)


def test_abort_parent_aborts_every_sample(tiny_path):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_path), dtype="float32",
                                                   block_size=4), skip_tokenizer_init=True)
    engine.add_request("p", {"prompt_token_ids": list(range(10))},
                       SamplingParams(n=3, max_tokens=50))
    engine.step()  # child 0 prefills; children 1 and 2 are still held back
    (out,) = engine.abort_request("p")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests()
    kv = engine.engine_core.scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == engine.engine_core.num_blocks - 1
