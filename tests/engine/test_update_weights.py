"""LLM.update_weights: a trainer's new weights into a running engine (all of them, or
some over the files'), giving what a model saved with those weights gives; cached
prefixes dropped; a bad name leaves the model as it was; refused where it cannot work."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pagedllm import LLM, SamplingParams
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _config():
    return tiny_llama_config(vocab_size=VOCAB, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("updates")
    return {seed: save_tiny_model(root / f"seed{seed}", _config(), seed=seed)
            for seed in (1, 2)}


def _weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _outputs(llm) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, VOCAB, 20, 40, seed=3)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _llm(path) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=16,
               num_kv_blocks=64)


def test_new_weights_give_the_new_models_outputs(paths, tmp_path):
    llm = _llm(paths[1])
    first = _outputs(llm)
    target = _outputs(_llm(paths[2]))
    assert first != target
    llm.update_weights(_weights(paths[2]))  # every weight, as a dict
    assert _outputs(llm) == target
    # Back, as (name, tensor) pairs in bfloat16 (cast to the model's dtype)...
    llm.update_weights([(name, t.to(torch.bfloat16)) for name, t in
                        _weights(paths[1]).items()])
    bf16 = save_tiny_model(tmp_path / "bf16", _config(), seed=1, dtype=torch.bfloat16)
    assert _outputs(llm) == _outputs(LLM(str(bf16), dtype="float32",
                                         skip_tokenizer_init=True, num_kv_blocks=64))
    # ...and some only: the LM head of the second model over the files' others.
    llm.update_weights({"lm_head.weight": _weights(paths[2])["lm_head.weight"]})
    mixed = _weights(paths[1]) | {"lm_head.weight": _weights(paths[2])["lm_head.weight"]}
    mixed_llm = _llm(paths[1])
    mixed_llm.update_weights(mixed)
    assert _outputs(llm) == _outputs(mixed_llm)


def test_prefix_cache_is_dropped(paths):
    llm = _llm(paths[1])
    prompt = [{"prompt_token_ids": list(range(1, 40))}]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.update_weights(_weights(paths[2]))
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_a_bad_update_changes_nothing(paths):
    llm = _llm(paths[1])
    before = _outputs(llm)
    with pytest.raises(ValueError, match="unexpected weight 'model.nope.weight'"):
        llm.update_weights({"model.nope.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="expected shape"):
        llm.update_weights({"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="must be \\(name, tensor\\) pairs"):
        llm.update_weights([("lm_head.weight", [1, 2])])
    assert _outputs(llm) == before


def test_update_wakes_a_sleeping_engines_weights(paths):
    llm = LLM(str(paths[1]), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              enable_sleep_mode=True)
    target = _outputs(_llm(paths[2]))
    llm.sleep(level=2)
    llm.update_weights(_weights(paths[2]))  # the weights wake with the new values
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _outputs(llm) == target


def test_tensor_parallel_workers_each_take_their_shard(paths):
    llm = LLM(str(paths[1]), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              tensor_parallel_size=2)
    try:
        llm.update_weights(_weights(paths[2]))
        assert _outputs(llm) == _outputs(_llm(paths[2]))
    finally:
        llm.shutdown()
