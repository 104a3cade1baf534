"""Sleep mode (enable_sleep_mode, as vLLM's): an idle engine releases its KV cache (level
1) or its weights too (level 2, read again from the files on waking), gives its memory
back, refuses requests while asleep, and once awake gives the same outputs as before.
The server's routes: tests/entrypoints/test_server_options.py."""

from __future__ import annotations

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ConfigError, EngineSleepingError
from pagedllm.worker.memory import attention_layers
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # Wide enough that its weights (~50 MB) and cache (~130 MB) show in the RSS.
    cfg = tiny_llama_config(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048,
                            num_attention_heads=8, num_key_value_heads=8,
                            num_hidden_layers=2)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_sleep"), cfg, seed=1)


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in random_prompts(4, VOCAB, 20, 40, seed=5)]


def _runner(llm):
    return llm.llm_engine.engine_core.executor.runner


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _sleepy_llm(path, num_kv_blocks: int) -> tuple[LLM, list[list[int]]]:
    """An engine with sleep mode, and its greedy outputs of _prompts() while awake."""
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=16,
              num_kv_blocks=num_kv_blocks, enable_sleep_mode=True)
    return llm, _outputs(llm)


def _outputs(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def _fill_cache(llm) -> None:
    """Write every KV block once, so the (lazily mapped) cache is all resident."""
    for cache in _runner(llm).kv_caches:
        cache.fill_(1.0)


def test_level_1_releases_the_cache_and_wakes_the_same(tiny_path):
    llm, before = _sleepy_llm(tiny_path, 1024)
    runner = _runner(llm)
    cache_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    _fill_cache(llm)
    rss = _rss()
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert runner.kv_caches == [] and all(
        layer.kv_cache is None for layer in attention_layers(runner.model))
    assert rss - _rss() > 0.8 * cache_bytes  # given back to the OS
    with pytest.raises(EngineSleepingError, match="asleep: wake it up first"):
        llm.generate(_prompts(), GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    again = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == before
    # The cache was emptied: nothing of the first run is a prefix-cache hit.
    assert all(o.num_cached_tokens == 0 for o in again)


def test_level_2_releases_the_weights_and_reads_them_again(tiny_path):
    llm, before = _sleepy_llm(tiny_path, 64)
    runner = _runner(llm)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    rss = _rss()
    llm.sleep(level=2)
    assert runner.model is None
    assert rss - _rss() > 0.5 * weight_bytes
    # The cache alone cannot wake before the weights it is laid out by.
    with pytest.raises(ValueError, match="wake the weights up before the KV cache"):
        llm.wake_up(tags=["kv_cache"])
    llm.wake_up(tags=["weights"])
    assert runner.model is not None and llm.is_sleeping()
    with pytest.raises(EngineSleepingError):
        llm.generate(_prompts(), GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _outputs(llm) == before


def test_what_sleep_refuses(tiny_path):
    plain = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    with pytest.raises(ConfigError, match="enable_sleep_mode=True"):
        plain.sleep()
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              enable_sleep_mode=True)
    with pytest.raises(ValueError, match="sleep level must be 1 .* or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="wake_up tags must be among"):
        llm.wake_up(tags=["everything"])
    # Busy: a request still in the engine (added, never stepped).
    llm.llm_engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, GREEDY)
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        llm.sleep()
    assert not llm.is_sleeping()
    llm.llm_engine.abort_request("r")
    llm.sleep()
    llm.wake_up()  # waking an awake part is a no-op too
    llm.wake_up()
    assert llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)
