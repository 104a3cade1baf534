"""generation_config.json as vLLM reads it (--generation-config auto, the default): its
sampling fields are the defaults of requests that leave them unset, its eos_token_id
list ends generation; "vllm" ignores the file; overrides go on top. A scripted model
(tests/utils.py:save_scripted_llama) recites a b c d e, so where it stops is exact."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.loader.generation_config import (load_generation_config,
                                               override_sampling_defaults)
from tests.entrypoints.utils import RemoteServer
from tests.utils import save_scripted_llama

SCRIPT = {"a": "b", "b": "c", "c": "d", "d": "e"}
GENERATION = {"temperature": 0.25, "top_k": 3, "top_p": 0.5, "repetition_penalty": 1.1,
              "max_new_tokens": 1, "do_sample": True, "bos_token_id": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_scripted_llama(tmp_path_factory.mktemp("scripted"), SCRIPT,
                               "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    # Ends at "c" as at the tokenizer's EOS "</s>" (Llama 3's <|eot_id|>, say).
    (path / "generation_config.json").write_text(json.dumps(
        GENERATION | {"eos_token_id": [vocab["</s>"], vocab["c"]]}))
    return path


def test_loader_reads_the_set_fields(model_dir):
    defaults, eos = load_generation_config(str(model_dir))
    assert defaults == {"temperature": 0.25, "top_k": 3, "top_p": 0.5,
                        "repetition_penalty": 1.1, "max_tokens": 1}
    assert len(eos) == 2
    assert load_generation_config(str(model_dir / "nowhere")) == ({}, [])
    assert override_sampling_defaults(defaults, {"max_new_tokens": 9})["max_tokens"] == 9
    with pytest.raises(ValueError, match="'num_beams' is not one of"):
        override_sampling_defaults(defaults, {"num_beams": 2})


def test_offline_defaults_and_eos(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32")
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.top_p, default.repetition_penalty,
            default.max_tokens) == (0.25, 3, 0.5, 1.1, 1)
    out = llm.generate(["a"], use_tqdm=False)[0].outputs[0]
    assert (out.text.split(), out.finish_reason) == (["b"], "length")
    # The generation config's second EOS ends the reply ("c" stays in the ids).
    vocab = llm.get_tokenizer().get_vocab()
    out = llm.generate(["a"], SamplingParams(max_tokens=8, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [vocab["b"], vocab["c"]]
    assert (out.finish_reason, out.stop_reason) == ("stop", vocab["c"])
    out = llm.generate(["a"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8
    # min_tokens holds it back as it holds back EOS: the next best token comes instead.
    out = llm.generate(["a"], SamplingParams(max_tokens=3, min_tokens=3, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert vocab["c"] not in out.token_ids[:3]


def test_vllm_mode_and_overrides(model_dir):
    plain = LLM(model=str(model_dir), dtype="float32", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    out = plain.generate(["a"], SamplingParams(max_tokens=8, temperature=0),
                         use_tqdm=False)[0].outputs[0]
    assert out.text.split() == ["b", "c", "d", "e"]
    assert out.finish_reason == "stop"  # the tokenizer's own EOS
    tuned = LLM(model=str(model_dir), dtype="float32",
                override_generation_config={"temperature": 0.0, "max_new_tokens": 4})
    default = tuned.get_default_sampling_params()
    assert (default.temperature, default.max_tokens, default.top_k) == (0.0, 4, 3)
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(model=str(model_dir), generation_config="/no/such/dir")


def test_server_applies_the_defaults(model_dir):
    server = RemoteServer([str(model_dir), "--dtype", "float32", "--max-model-len", "32",
                           "--num-kv-blocks", "32"])
    try:
        import httpx

        def chat(**fields):
            body = {"messages": [{"role": "user", "content": "a"}]} | fields
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        # No max_tokens: the generation config's max_new_tokens (1).
        choice = chat()
        assert (choice["message"]["content"].split(), choice["finish_reason"]) == \
            (["b"], "length")
        choice = chat(max_tokens=8, temperature=0)
        assert (choice["message"]["content"].split(), choice["finish_reason"]) == \
            (["b", "c"], "stop")
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": "a", "max_tokens": 8, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 8  # past both EOS tokens
    finally:
        server.stop()
