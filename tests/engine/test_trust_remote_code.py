"""trust_remote_code: a model directory whose config and tokenizer classes are its own
code (`auto_map`) is refused without it, naming the option (transformers is never left
to prompt on a terminal), and runs with it: config and tokenizer of the directory's
classes, the model pagedllm's own Llama, the same tokens as the plain directory, also
where the config crosses into other processes (the server's engine core, its tensor
parallel workers)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.errors import ModelLoadError
from pagedllm.loader import load_tokenizer
from tests.entrypoints.utils import RemoteServer
from tests.utils import TINY_WORDS, save_tiny_model, tiny_llama_config, word_tokenizer

REMOTE_CONFIG = '''
from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote_llama"
'''

REMOTE_TOKENIZER = '''
from transformers import PreTrainedTokenizerFast


class TinyRemoteTokenizer(PreTrainedTokenizerFast):
    pass
'''

PROMPT = "w5 w17 w3 w200 w42"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _edit_json(path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(plain, remote): the tiny Llama with a word tokenizer, and a copy whose config
    and tokenizer classes are the directory's own modules."""
    root = tmp_path_factory.mktemp("remote_code")
    plain = save_tiny_model(root / "plain", tiny_llama_config())
    word_tokenizer(TINY_WORDS).save_pretrained(plain)
    remote = root / "remote"
    shutil.copytree(plain, remote)
    (remote / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    (remote / "tokenization_tiny.py").write_text(REMOTE_TOKENIZER)
    _edit_json(remote / "config.json", model_type="tiny_remote_llama",
               auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig"})
    _edit_json(remote / "tokenizer_config.json", tokenizer_class="TinyRemoteTokenizer",
               auto_map={"AutoTokenizer": [None, "tokenization_tiny.TinyRemoteTokenizer"]})
    return plain, remote


def test_refused_without_trust_remote_code(model_dirs):
    _, remote = model_dirs
    with pytest.raises(ModelLoadError, match="config of .*--trust-remote-code"):
        EngineArgs(model=str(remote)).create_engine_config()
    with pytest.raises(ModelLoadError, match="tokenizer of .*--trust-remote-code"):
        load_tokenizer(str(remote))


def test_runs_the_directorys_classes_with_the_plain_models_tokens(model_dirs):
    plain, remote = model_dirs
    llm = LLM(model=str(remote), trust_remote_code=True)
    engine = llm.llm_engine
    assert type(engine.config.model.hf_config).__name__ == "TinyRemoteConfig"
    assert type(llm.get_tokenizer()).__name__ == "TinyRemoteTokenizer"
    remote_out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    llm.shutdown()
    reference = LLM(model=str(plain))
    plain_out = reference.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    reference.shutdown()
    assert remote_out.token_ids == plain_out.token_ids
    assert remote_out.text == plain_out.text


def test_served_with_tensor_parallel_workers(model_dirs):
    """The config is pickled to the engine core process and to each worker process:
    both import the directory's module (HF_MODULES_CACHE on their path)."""
    plain, remote = model_dirs
    reference = LLM(model=str(plain))
    expected = reference.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].text
    reference.shutdown()
    server = RemoteServer([str(remote), "--trust-remote-code", "--tensor-parallel-size",
                           "2", "--disable-log-stats"])
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
    finally:
        server.stop()
