"""The prefix cache's host tier (kv_offloading_size, vLLM's OffloadingConnector;
core/kv_offload.py, worker/kv_offload.py).

A request whose prefix left the KV cache loads it from the tier instead of recomputing
it, and its outputs are exactly those of an engine that computed everything (float32:
tokens and logprobs equal), computing only what it did not load or hit. Every full block
computed is saved, generated ones included; a tier smaller than what comes recycles its
least recently used slots and stays correct. The scheduler's bookkeeping alone:
tests/core/test_kv_offload.py."""

from __future__ import annotations

import pytest
import transformers as tf

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.errors import ConfigError
from tests.utils import random_prompts, save_tiny_model

VOCAB = 256
BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
# Far more than the tiny model's blocks (a few KB each): nothing is evicted.
ROOMY_GIB = 0.01


@pytest.fixture(scope="module")
def reference(kv_tiny_path, kv_prompts):
    return _run(_llm(kv_tiny_path, None), kv_prompts)


def _llm(path, size: float | None = ROOMY_GIB, **kw) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK,
               max_model_len=128, kv_offloading_size=size, **kw)


def _run(llm: LLM, prompts, params=PARAMS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in sorted(d.items())]
                                      for d in o.outputs[0].logprobs or ()],
             o.outputs[0].finish_reason) for o in outs]


def _core(llm: LLM):
    return llm.llm_engine.engine_core


def _tier(llm: LLM):
    return _core(llm).scheduler.kv_store


def _computed(llm: LLM) -> int:
    """Tokens computed, taken from the prefix cache and loaded from the tier."""
    sched = _core(llm).scheduler
    return (sched.num_scheduled_tokens_total + sched.kv_cache_manager.prefix_cache_hits
            + sched.kv_store.hits)


def test_prefixes_evicted_from_the_cache_load_from_the_tier(kv_tiny_path, kv_prompts, reference):
    llm = _llm(kv_tiny_path)
    assert _run(llm, kv_prompts) == reference
    tier = _tier(llm)
    assert tier.hits == 0 and tier.num_saved > 0
    assert _core(llm).reset_prefix_cache()  # the KV cache forgets; the tier does not
    kv = _core(llm).scheduler.kv_cache_manager
    scheduled, hits = _core(llm).scheduler.num_scheduled_tokens_total, kv.prefix_cache_hits
    assert _run(llm, kv_prompts) == reference
    # Every prompt block but the one of its last token came from the tier (the 7th
    # prompt's shared beginning from the cache, once the 1st had loaded it).
    loaded = sum((len(p) - 1) // BLOCK * BLOCK for p in kv_prompts)
    assert tier.hits + kv.prefix_cache_hits - hits == loaded and tier.hits >= loaded - 12
    assert _core(llm).scheduler.num_scheduled_tokens_total - scheduled \
        == sum(len(p) + PARAMS.max_tokens - 1 for p in kv_prompts) - loaded
    assert _computed(llm) == 2 * sum(len(p) + PARAMS.max_tokens - 1 for p in kv_prompts)


def test_a_small_cache_evicts_and_the_tier_brings_prefixes_back(kv_tiny_path, kv_prompts,
                                                                reference):
    # 10 usable blocks: each batch of kv_prompts evicts the last one's cached blocks.
    llm = _llm(kv_tiny_path, num_kv_blocks=11, max_num_seqs=1)
    for _ in range(2):
        assert _run(llm, kv_prompts) == reference
    assert _tier(llm).hits > 0


def test_generated_blocks_are_saved_too(kv_tiny_path, kv_prompts):
    """A conversation's next turn holds the last turn's answer: its blocks load too."""
    llm = _llm(kv_tiny_path)
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": kv_prompts[1]}], params, use_tqdm=False)
    turn = kv_prompts[1] + list(first[0].outputs[0].token_ids) + [5, 6, 7]
    expected = _run(_llm(kv_tiny_path, None), [turn])
    assert _core(llm).reset_prefix_cache()
    assert _run(llm, [turn]) == expected
    # The prompt's and the answer's full blocks (the answer's last token was never fed
    # back, so its block is not full of computed tokens unless it ends one).
    computed = len(kv_prompts[1]) + 13 - 1
    assert _tier(llm).hits == computed // BLOCK * BLOCK


def test_a_full_tier_recycles_the_least_recently_used(kv_tiny_path):
    a, b, c = random_prompts(3, VOCAB, 9, 9, seed=11)
    expected = _run(_llm(kv_tiny_path, None), [a, b, c])
    # Six blocks' worth of slots (every layer's K and V); each request computes 9 + 6 - 1
    # tokens: three full blocks.
    per_block = _core(_llm(kv_tiny_path)).executor.kv_bytes_per_block()
    llm = _llm(kv_tiny_path, 6 * per_block / (1 << 30) * 1.01)
    core, tier = _core(llm), _tier(llm)
    assert tier.num_slots == 6
    assert _run(llm, [a]) + _run(llm, [b]) == expected[:2]
    assert len(tier.slots) == 6 and not tier.free
    assert core.reset_prefix_cache()
    assert _run(llm, [a]) == expected[:1]  # loads a's blocks: now the most recent
    assert tier.hits == 8 and tier.num_evicted == 0
    assert _run(llm, [c]) == expected[2:]  # takes b's slots
    assert tier.num_evicted == 3
    assert core.reset_prefix_cache()
    assert _run(llm, [b, a]) == expected[1::-1]
    assert tier.hits == 16  # a's two prompt blocks again; b's are gone


@pytest.mark.parametrize("engine_kw", [
    # 8 tokens a step, 14 usable blocks: chunked prefill and preemption.
    dict(max_num_batched_tokens=8, num_kv_blocks=15, long_prefill_token_threshold=0),
    dict(max_num_batched_tokens=8, num_kv_blocks=15, preemption_mode="swap"),
    dict(async_scheduling=True),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                             "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
])
def test_outputs_keep_with_chunks_preemption_async_and_speculation(
        kv_tiny_path, kv_prompts, reference, engine_kw):
    llm = _llm(kv_tiny_path, **engine_kw)
    assert _run(llm, kv_prompts) == reference
    assert _core(llm).reset_prefix_cache()
    assert _run(llm, kv_prompts) == reference
    assert _tier(llm).hits > 0


def test_a_draft_models_blocks_come_back_with_the_targets(kv_tiny_path):
    """The target as its own draft accepts every greedy proposal in float32 only while
    the draft's K/V is exact: after loading from the tier too."""
    prompts = [[(7 * i) % 50 + 3 for i in range(40)], [9, 8, 7, 6] * 9]
    spec = {"model": str(kv_tiny_path), "num_speculative_tokens": 3}
    llm = _llm(kv_tiny_path, speculative_config=spec, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = _run(_llm(kv_tiny_path, None), prompts, params)
    assert _run(llm, prompts, params) == expected
    assert _core(llm).reset_prefix_cache()
    sched = _core(llm).scheduler
    drafts = sched.num_draft_tokens
    assert _run(llm, prompts, params) == expected
    assert _tier(llm).hits > 0 and sched.num_draft_tokens > drafts
    assert sched.num_accepted_tokens == sched.num_draft_tokens


def test_reset_external_sleep_and_new_weights_empty_the_tier(kv_tiny_path, kv_prompts, reference):
    llm = _llm(kv_tiny_path, enable_sleep_mode=True)
    tier = _tier(llm)
    _run(llm, kv_prompts[:2])
    assert _core(llm).reset_prefix_cache(reset_external=True)
    assert not tier.slots
    _run(llm, kv_prompts[:2])
    assert tier.slots and tier.hits == 0
    llm.sleep(1)
    assert not tier.slots
    llm.wake_up()
    assert _run(llm, kv_prompts[:2]) == reference[:2] and tier.hits == 0
    from safetensors.torch import load_file
    llm.update_weights(load_file(str(kv_tiny_path / "model.safetensors")))
    assert not tier.slots


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(pipeline_parallel_size=2)])
def test_ranks_and_stages_keep_their_part(kv_tiny_path, kv_prompts, reference, parallel):
    """Each tensor-parallel rank keeps its heads, each pipeline stage its layers. (Two
    ranks sum their partial products in another order than one: the logprobs are
    compared with the parallel engine's own.)"""
    llm = _llm(kv_tiny_path, **parallel)
    expected = _run(llm, kv_prompts[:3])
    assert [o[0] for o in expected] == [o[0] for o in reference[:3]]
    assert _core(llm).reset_prefix_cache()
    assert _run(llm, kv_prompts[:3]) == expected
    assert _tier(llm).hits > 0


def test_the_flags_and_what_is_refused(kv_tiny_path, tmp_path):
    ns = build_parser().parse_args(["serve", str(kv_tiny_path), "--kv-offloading-size", "2"])
    kvt = engine_args_from(ns).create_engine_config().kv_transfer
    assert kvt.is_offloading and kvt.offload_bytes == 2 << 30 and kvt.kv_role == "kv_both"
    # vLLM's kv_transfer_config form of the same.
    kvt = EngineArgs(model=str(kv_tiny_path), kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}
    ).create_engine_config().kv_transfer
    assert kvt.is_offloading and kvt.offload_bytes == 1 << 20

    def make(**kw):
        return EngineArgs(model=str(kw.pop("path", kv_tiny_path)), **kw).create_engine_config()

    for kw, match in [
        (dict(kv_offloading_size=0), "kv_offloading_size must be a number of GiB > 0"),
        (dict(kv_offloading_size=-1.5), "> 0"),
        (dict(kv_offloading_size=1e7), "more than this machine's memory"),
        (dict(kv_offloading_size=1, kv_offloading_backend="lmcache"), "lmcache"),
        (dict(kv_offloading_size=1, enable_prefix_caching=False), "enable_prefix_caching"),
        (dict(kv_offloading_size=1, kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_role": "kv_both"}), "together"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make(**kw)
    for extra, match in [
        ({}, "cpu_bytes_to_use must be"), ({"cpu_bytes_to_use": "1G"}, "must be"),
        ({"cpu_bytes_to_use": True}, "must be"),
        ({"cpu_bytes_to_use": 10, "eviction_policy": "arc"}, "only 'lru'"),
        ({"cpu_bytes_to_use": 10, "shared_storage_path": "/tmp"}, "unknown"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make(kv_transfer_config={"kv_connector": "OffloadingConnector",
                                     "kv_role": "kv_both",
                                     "kv_connector_extra_config": extra})
    with pytest.raises(ConfigError, match="kv_role is kv_both"):
        make(kv_transfer_config={"kv_connector": "OffloadingConnector",
                                 "kv_role": "kv_producer",
                                 "kv_connector_extra_config": {"cpu_bytes_to_use": 10}})
    # Too small for one block; a model with sliding-window layers.
    with pytest.raises(ConfigError, match="hold no KV block"):
        _llm(kv_tiny_path, 1e-9)
    windowed = save_tiny_model(tmp_path / "mistral", tf.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        bos_token_id=None, eos_token_id=None, pad_token_id=None))
    with pytest.raises(ConfigError, match="kv_offloading_size: models with sliding-window"):
        _llm(windowed)
