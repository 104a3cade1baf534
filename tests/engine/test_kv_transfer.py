"""KV blocks shared between engines through a directory (kv_transfer_config;
core/kv_store.py, worker/kv_transfer.py, engine/kv_transfer.py).

A consumer that loads a producer's blocks must give exactly the outputs of an engine
that computed everything itself (float32: tokens and logprobs equal), computing only
what it did not load; the producer's files must be exactly its full prompt blocks, named
by their prefix-cache hashes, recomputed here from the tokens. A block whose file is
damaged fails the requests that hold it, or (policy "recompute") is computed instead.
The server flag, its metrics and the proxy: tests/entrypoints/test_disagg_prefill.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import transformers as tf

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_hash import hash_block_tokens
from pagedllm.errors import ConfigError
from tests.utils import save_tiny_model

VOCAB = 256
BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def reference(kv_tiny_path, kv_prompts):
    return _run(_llm(kv_tiny_path), kv_prompts)


def _llm(path, store: Path | None = None, role: str = "kv_both", **kw) -> LLM:
    transfer = None
    if store is not None:
        transfer = {"kv_connector": "ExampleConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shared_storage_path": str(store),
                                                  "min_free_disk_gb": 0}}
        transfer |= kw.pop("transfer", {})
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK,
               max_model_len=128, kv_transfer_config=transfer, **kw)


def _run(llm: LLM, prompts, params=PARAMS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in sorted(d.items())]
                                      for d in o.outputs[0].logprobs],
             o.outputs[0].finish_reason) for o in outs]


def _core(llm: LLM):
    return llm.llm_engine.engine_core


def _files(store: Path) -> dict[str, Path]:
    """Block hash (hex) -> its rank-0 file."""
    return {p.name.split(".")[0]: p for p in store.rglob("*.r0.kv")}


def _prompt_block_hashes(prompt: list[int]) -> list[str]:
    hashes, parent = [], None
    for i in range(len(prompt) // BLOCK):
        parent = hash_block_tokens(parent, prompt[i * BLOCK:(i + 1) * BLOCK])
        hashes.append(parent.hex())
    return hashes


def test_a_consumer_gets_the_producers_outputs_from_the_blocks_it_loads(
        kv_tiny_path, kv_prompts, reference, tmp_path):
    producer = _llm(kv_tiny_path, tmp_path, "kv_producer")
    assert _run(producer, kv_prompts) == reference
    # Exactly the full prompt blocks, by hash (a prompt's last partial block and the
    # generated tokens' blocks are not saved).
    expected = {h for p in kv_prompts for h in _prompt_block_hashes(p)}
    assert set(_files(tmp_path)) == expected
    pstore = _core(producer).scheduler.kv_store
    assert pstore.hits == 0 and pstore.num_saved == len(expected)

    consumer = _llm(kv_tiny_path, tmp_path, "kv_consumer")
    assert _run(consumer, kv_prompts) == reference
    core = _core(consumer)
    store, kv = core.scheduler.kv_store, core.scheduler.kv_cache_manager
    # What it loaded it did not compute: every token was computed, a local prefix
    # hit, or loaded, once.
    total = sum(len(p) + PARAMS.max_tokens - 1 for p in kv_prompts)
    assert store.hits > 0 and store.num_saved == 0
    assert core.scheduler.num_scheduled_tokens_total + kv.prefix_cache_hits + store.hits \
        == total
    # A prompt of exactly k blocks loads k - 1: its last token is computed for logits.
    exact = kv_prompts[0][:16]
    fresh = _llm(kv_tiny_path, tmp_path, "kv_consumer")
    _run(fresh, [exact])
    assert _core(fresh).scheduler.kv_store.hits == 12
    assert set(_files(tmp_path)) == expected  # a consumer writes nothing


def test_chunked_prefill_and_preemption_keep_the_outputs(kv_tiny_path, kv_prompts, reference,
                                                         tmp_path):
    _run(_llm(kv_tiny_path, tmp_path, "kv_producer"), kv_prompts[:4])
    # 8 tokens a step and 14 usable blocks: kv_prompts come in chunks, requests are
    # preempted and recomputed (loading again what the store has).
    llm = _llm(kv_tiny_path, tmp_path, "kv_both", max_num_batched_tokens=8,
               num_kv_blocks=15, long_prefill_token_threshold=0)
    assert _run(llm, kv_prompts) == reference
    core = _core(llm)
    assert core.scheduler.num_preemptions > 0 and core.scheduler.kv_store.hits > 0
    # kv_both saved what the producer had not.
    assert set(_files(tmp_path)) == {h for p in kv_prompts for h in _prompt_block_hashes(p)}


def _damage(store: Path, prompt: list[int], block: int, how: str) -> None:
    path = _files(store)[_prompt_block_hashes(prompt)[block]]
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:-10])
    elif how == "header":  # another block's name inside
        path.write_bytes(data[:8] + bytes(32) + data[40:])
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncate", "header"])
def test_a_block_that_fails_to_load_fails_the_requests_holding_it(
        kv_tiny_path, kv_prompts, reference, tmp_path, how, caplog):
    _run(_llm(kv_tiny_path, tmp_path, "kv_producer"), kv_prompts)
    _damage(tmp_path, kv_prompts[1], 1, how)
    llm = _llm(kv_tiny_path, tmp_path, "kv_consumer")
    with caplog.at_level("WARNING", logger="pagedllm.worker.kv_transfer"):
        out = _run(llm, kv_prompts[:3])
    assert "KV store: cannot load" in caplog.text
    assert [o[2] for o in out] == ["length", "abort", "length"]
    assert out[0] == reference[0] and out[2] == reference[2]
    assert _core(llm).scheduler.kv_store.num_load_failures == 1
    # The block is kept out of lookups from then on: the request runs again, computing it.
    assert _run(llm, [kv_prompts[1]]) == [reference[1]]


def test_recompute_policy_computes_what_failed_to_load(kv_tiny_path, kv_prompts, reference,
                                                       tmp_path):
    _run(_llm(kv_tiny_path, tmp_path, "kv_producer"), kv_prompts)
    _damage(tmp_path, kv_prompts[1], 2, "truncate")
    llm = _llm(kv_tiny_path, tmp_path, "kv_consumer",
               transfer={"kv_load_failure_policy": "recompute"})
    assert _run(llm, kv_prompts) == reference
    assert _core(llm).scheduler.num_preemptions == 1


def test_a_file_removed_after_the_lookup_is_a_failed_load(kv_tiny_path, kv_prompts, reference,
                                                          tmp_path):
    """A lookup sees the file, another process removes it before the step runs."""
    _run(_llm(kv_tiny_path, tmp_path, "kv_producer"), kv_prompts[:1])
    llm = _llm(kv_tiny_path, tmp_path, "kv_consumer",
               transfer={"kv_load_failure_policy": "recompute"})
    executor = _core(llm).executor
    execute = executor.execute_model

    def remove_then_execute(so, *args, **kw):
        for stem, _ in so.kv_blocks_to_load[:1]:
            os.unlink(tmp_path / "pagedllm-kv" / f"{stem}.r0.kv")
        return execute(so, *args, **kw)

    executor.execute_model = remove_then_execute
    assert _run(llm, kv_prompts[:1]) == reference[:1]
    assert _core(llm).scheduler.num_preemptions == 1


def test_saving_pauses_when_the_disk_is_short_of_room(kv_tiny_path, kv_prompts, reference,
                                                      tmp_path):
    llm = _llm(kv_tiny_path, tmp_path, "kv_producer",
               transfer={"kv_connector_extra_config": {
                   "shared_storage_path": str(tmp_path), "min_free_disk_gb": 1e9}})
    assert _run(llm, kv_prompts) == reference
    assert _files(tmp_path) == {} and _core(llm).scheduler.kv_store.disk_full


def test_new_weights_use_a_new_folder(kv_tiny_path, kv_prompts, reference, tmp_path):
    llm = _llm(kv_tiny_path, tmp_path, "kv_both")
    _run(llm, kv_prompts[:2])
    store = _core(llm).scheduler.kv_store
    before = store.namespace
    from safetensors.torch import load_file
    llm.update_weights(load_file(str(kv_tiny_path / "model.safetensors")))
    assert store.namespace != before
    hits = store.hits
    assert _run(llm, kv_prompts[:2]) == reference[:2]
    assert store.hits == hits  # nothing found in the new folder...
    assert any(p.parent.parent.name == store.namespace for p in tmp_path.rglob("*.kv"))


def test_engines_of_other_layouts_do_not_share_blocks(kv_tiny_path, kv_prompts, tmp_path):
    _run(_llm(kv_tiny_path, tmp_path, "kv_producer"), kv_prompts[:2])
    other = _llm(kv_tiny_path, tmp_path, "kv_consumer", kv_cache_dtype="fp8_e4m3")
    _run(other, kv_prompts[:2])
    assert _core(other).scheduler.kv_store.hits == 0


def test_tensor_parallel_ranks_store_their_heads(kv_tiny_path, kv_prompts, reference, tmp_path):
    # (Two ranks sum their partial products in another order than one: the logprobs
    # of tp=2 are compared with tp=2's own.)
    producer = _llm(kv_tiny_path, tmp_path, "kv_producer", tensor_parallel_size=2)
    expected = _run(producer, kv_prompts[:3])
    assert [o[0] for o in expected] == [o[0] for o in reference[:3]]
    files = sorted(p.name.split(".")[1] for p in tmp_path.rglob("*.kv"))
    assert files and files.count("r0") == files.count("r1") == len(files) // 2
    consumer = _llm(kv_tiny_path, tmp_path, "kv_consumer", tensor_parallel_size=2)
    assert _run(consumer, kv_prompts[:3]) == expected
    assert _core(consumer).scheduler.kv_store.hits > 0


def test_what_cannot_share_blocks_is_refused(kv_tiny_path, tmp_path):
    def make(transfer=None, **kw):
        t = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
        return LLM(str(kw.pop("path", kv_tiny_path)), dtype="float32",
                   skip_tokenizer_init=True, kv_transfer_config=t | (transfer or {}), **kw)

    for transfer, match in (
            ({"kv_connector": "NixlConnector"}, "kv_connector must be one of"),
            ({"kv_role": "kv_sender"}, "kv_role must be one of"),
            ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy must be one of"),
            ({"kv_connector_extra_config": {"path": "/x"}},
             r"unknown kv_connector_extra_config keys \['path'\]"),
            ({"kv_connector_extra_config": {"min_free_disk_gb": -1}}, "min_free_disk_gb"),
            ({"kv_ports": 1}, r"unknown kv_transfer_config keys \['kv_ports'\]")):
        with pytest.raises(ConfigError, match=match):
            make(transfer)
    with pytest.raises(ConfigError, match="enable_prefix_caching off"):
        make(enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        make(pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="a draft model"):
        make(speculative_config={"model": str(kv_tiny_path), "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="must be a dict"):
        LLM(str(kv_tiny_path), skip_tokenizer_init=True, kv_transfer_config="on")
    windowed = save_tiny_model(tmp_path / "mistral", tf.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        bos_token_id=None, eos_token_id=None, pad_token_id=None))
    with pytest.raises(ConfigError, match="sliding-window layers"):
        make(path=windowed)
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ConfigError, match="cannot create"):
        make({"kv_connector_extra_config": {"shared_storage_path": str(blocked)}})
    # vLLM's old name and its unused fields are taken.
    make({"kv_connector": "SharedStorageConnector", "engine_id": "e", "kv_port": 14579,
          "kv_buffer_device": "cpu"})


def test_async_scheduling(kv_tiny_path, kv_prompts, reference, tmp_path):
    """Loads and saves with a step launched while the one before runs; a block whose
    load failed is held by a request already in the next step: it fails even under
    "recompute" (its token of that step is on its way)."""
    producer = _llm(kv_tiny_path, tmp_path, "kv_producer", async_scheduling=True)
    assert _run(producer, kv_prompts) == reference
    consumer = _llm(kv_tiny_path, tmp_path, "kv_consumer", async_scheduling=True)
    assert _run(consumer, kv_prompts) == reference
    assert _core(consumer).scheduler.kv_store.hits > 0
    _damage(tmp_path, kv_prompts[3], 1, "truncate")
    llm = _llm(kv_tiny_path, tmp_path, "kv_consumer", async_scheduling=True,
               transfer={"kv_load_failure_policy": "recompute"})
    out = _run(llm, kv_prompts[2:5])
    assert [o[2] for o in out] == ["length", "abort", "length"]
    assert [out[0], out[2]] == [reference[2], reference[4]]


def test_reset_external_clears_this_models_folder(kv_tiny_path, kv_prompts, reference, tmp_path):
    llm = _llm(kv_tiny_path, tmp_path, "kv_both")
    _run(llm, kv_prompts[:2])
    store = _core(llm).scheduler.kv_store
    other = tmp_path / "pagedllm-kv" / "another-model" / "ab" / "ab.r0.kv"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"")
    assert llm.reset_prefix_cache() and len(_files(tmp_path)) > 1
    assert llm.reset_prefix_cache(reset_external=True)
    # At once out of the model's folder (renamed aside), then deleted on a thread.
    assert not (tmp_path / "pagedllm-kv" / store.namespace).exists()
    deadline = time.monotonic() + 30  # (no rglob while the thread deletes: it races)
    while (list((tmp_path / "pagedllm-kv").glob("*.deleting-*"))
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert list(_files(tmp_path).values()) == [other]  # another model's folder stays
    hits = store.hits
    assert _run(llm, kv_prompts[:2]) == reference[:2]
    assert store.hits == hits and len(_files(tmp_path)) > 1  # computed, saved again
