"""KV cache groups for sliding-window layers end to end (float32, greedy).

Three tiny models with a 20-token window and sequences up to ~100 tokens: Mistral (a
window on every layer: one window group), Gemma 2 (alternating: a full and a window
group) and Gemma 3 (window, full, window: one full and two window groups). With 16-token
blocks a window layer must hold at most cdiv(20, 16) + 1 = 3 blocks per decoding request,
and the outputs must equal transformers' and those of the cache that keeps every block
(the layout forced to one full-attention group), also when preemption (swap or
recompute) and prefix-cache hits happen.
"""

from __future__ import annotations

import pytest
import transformers as tf

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_groups import cdiv
from pagedllm.worker import kv_layout
from tests.utils import hf_greedy, random_prompts, save_tiny_model, scale_saved_weights

VOCAB = 256
WINDOW = 20
BLOCK_SIZE = 16
MAX_NEW = 70
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              sliding_window=WINDOW, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)

MODELS = {
    "mistral": (lambda: tf.MistralConfig(**COMMON, num_hidden_layers=2), (WINDOW,)),
    "gemma2": (lambda: tf.Gemma2Config(**COMMON, num_hidden_layers=2, head_dim=16,
                                       query_pre_attn_scalar=16), (None, WINDOW)),
    "gemma3": (lambda: tf.Gemma3TextConfig(
        **COMMON, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        (None, WINDOW, WINDOW)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    make_config, windows = MODELS[request.param]
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), make_config())
    # Sharp attention: which keys the window keeps changes the continuation.
    scale_saved_weights(path, {"q_proj": 8.0, "k_proj": 8.0, "v_proj": 4.0})
    return path, windows


@pytest.fixture(scope="module")
def prompts():
    prompts = random_prompts(4, VOCAB, 5, 30, seed=3)
    # Two that share a 40-token prefix: the second hits the first's cached blocks.
    shared = random_prompts(1, VOCAB, 40, 40, seed=4)[0]
    return prompts + [shared + [1, 2], shared + [3]]


def _generate(path, prompts, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True,
              block_size=BLOCK_SIZE, max_model_len=256, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _record_held_blocks(llm: LLM) -> list[list[int]]:
    """After every schedule(): per decoding request, the blocks it holds per group."""
    scheduler = llm.llm_engine.engine_core.scheduler
    kv, schedule, held = scheduler.kv_cache_manager, scheduler.schedule, []

    def recording_schedule():
        out = schedule()
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            if num_tokens == 1:
                held.append([sum(not b.is_null for b in kv.get_blocks(req_id, g))
                             for g in range(kv.num_groups)])
        return out

    scheduler.schedule = recording_schedule
    return held


@pytest.fixture(scope="module")
def expected(model, prompts):
    path, _ = model
    return hf_greedy(path, prompts, MAX_NEW)


def test_window_groups_hold_the_bound_and_match_transformers(model, prompts, expected):
    path, windows = model
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK_SIZE,
              max_model_len=256)
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.group_windows == windows
    held = _record_held_blocks(llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    bound = cdiv(WINDOW, BLOCK_SIZE) + 1
    for g, window in enumerate(windows):
        most = max(h[g] for h in held)
        if window is None:
            assert most == cdiv(40 + 2 + MAX_NEW - 1, BLOCK_SIZE)  # keeps every block
        else:
            assert most == bound  # reached, never exceeded


def test_outputs_equal_the_cache_that_keeps_every_block(model, prompts, expected,
                                                        monkeypatch):
    path, windows = model
    # Preemption on a cache too small for the batch, and prefix-cache hits.
    small = dict(num_kv_blocks=1 + 8 * len(windows), max_num_seqs=4)
    swap, llm = _generate(path, prompts, preemption_mode="swap", swap_space=0.01, **small)
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_swaps_out > 0 and scheduler.num_swaps_in > 0
    # (Prompts admitted for their first chunks, as without scheduler_reserve_full_isl,
    # preempt each other mid-prefill: recomputes that hit the prefix cache.)
    recompute, llm = _generate(path, prompts, enable_chunked_prefill=True,
                               max_num_batched_tokens=24, scheduler_reserve_full_isl=False,
                               **small)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert kv.prefix_cache_hits > 0
    # The layout of a cache without groups: every layer full attention (its kernels
    # still mask by the window).
    monkeypatch.setattr(kv_layout, "model_sliding_windows",
                        lambda config: [None] * config.model.hf_config.num_hidden_layers)
    keep_all, llm = _generate(path, prompts)
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.group_windows == (None,)
    assert swap == recompute == keep_all == expected


def test_window_groups_halve_gemma2_block_bytes(tmp_path, monkeypatch):
    """Gemma 2's two groups each hold half of the layers: a block is half the bytes, so
    the same kv_cache_space holds twice the blocks (and as many tokens of full layers)."""
    path = save_tiny_model(tmp_path, MODELS["gemma2"][0]())
    kw = dict(kv_cache_space=1 / 1024, max_num_seqs=256)
    _, grouped = _generate(path, [[1, 2, 3]], **kw)
    monkeypatch.setattr(kv_layout, "model_sliding_windows",
                        lambda config: [None] * config.model.hf_config.num_hidden_layers)
    _, plain = _generate(path, [[1, 2, 3]], **kw)
    # Blocks that fit the space (the null block included).
    assert grouped.llm_engine.engine_core.num_blocks == \
        2 * plain.llm_engine.engine_core.num_blocks == 256


def test_disable_sliding_window_caps_the_length(model, tmp_path):
    """vLLM's disable_sliding_window: max_model_len at the smallest window, where a
    window sees everything: one full-attention KV group, the same tokens as with the
    window groups (prompts and outputs within the window)."""
    path, windows = model
    prompts = random_prompts(3, VOCAB, 4, 12, seed=9)
    params = SamplingParams(temperature=0, max_tokens=WINDOW - 12, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True,
                  block_size=BLOCK_SIZE, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    windowed, _ = run(max_model_len=256)
    full, llm = run(max_model_len=256, disable_sliding_window=True)
    assert full == windowed
    assert llm.llm_engine.config.model.max_model_len == WINDOW
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.group_windows == (None,)
    # One group: what needs one (a KV store) runs.
    run(disable_sliding_window=True, kv_transfer_config={
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
