"""Hugging Face model ids resolve through a local HF cache (offline in tests)."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.errors import ModelLoadError
from pagedllm.loader.hub import looks_like_repo_id
from tests.utils import save_tiny_model, tiny_llama_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A cache in the hub's layout: models--org--tiny/{refs/main, snapshots/<commit>/}."""
    root = tmp_path_factory.mktemp("hf_cache")
    model = save_tiny_model(tmp_path_factory.mktemp("tiny_src"), tiny_llama_config())
    repo = root / "models--org--tiny"
    shutil.copytree(model, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root, model


def _greedy(llm: LLM) -> list[int]:
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                       SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_model_id_resolves_offline_from_the_cache(hub_cache):
    root, local = hub_cache
    by_id = LLM("org/tiny", download_dir=str(root), revision="main", dtype="float32",
                skip_tokenizer_init=True, num_kv_blocks=32)
    assert by_id.llm_engine.config.model.path.endswith(f"snapshots/{COMMIT}")
    by_path = LLM(str(local), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=32)
    assert _greedy(by_id) == _greedy(by_path)


def test_missing_id_or_revision_is_a_clear_error(hub_cache):
    root, _ = hub_cache
    with pytest.raises(ModelLoadError, match="'org/missing' is not a local path"):
        LLM("org/missing", download_dir=str(root), skip_tokenizer_init=True)
    with pytest.raises(ModelLoadError, match="revision 'v2'"):
        LLM("org/tiny", download_dir=str(root), revision="v2", skip_tokenizer_init=True)


@pytest.mark.parametrize("name, is_id", [("org/name", True), ("HuggingFaceTB/SmolLM2-135M", True),
                                         ("./org/name", False), ("/abs/path", False),
                                         ("a/b/c", False), ("model.gguf", False)])
def test_repo_id_shape(name, is_id):
    assert looks_like_repo_id(name) is is_id


def test_hub_options_reach_the_download(hub_cache, monkeypatch):
    """--hf-token, --tokenizer-revision and trust_remote_code (the repository's Python
    files) as huggingface_hub's snapshot_download gets them."""
    import huggingface_hub

    from pagedllm.errors import ConfigError

    root, local = hub_cache
    calls = []

    def fake_snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    llm = LLM("org/tiny", revision="v1", tokenizer_revision="tok-v2", hf_token="hf_secret",
              trust_remote_code=True, dtype="float32", skip_tokenizer_init=True,
              num_kv_blocks=32)
    (model_id, model_kw), (tok_id, tok_kw) = calls
    assert model_id == tok_id == "org/tiny"
    assert (model_kw["revision"], tok_kw["revision"]) == ("v1", "tok-v2")
    assert model_kw["token"] == tok_kw["token"] == "hf_secret"
    assert {"*.safetensors", "*.json", "*.py"} <= set(model_kw["allow_patterns"])
    assert "*.safetensors" not in tok_kw["allow_patterns"]  # a tokenizer's files only
    assert model_kw["ignore_patterns"] == ["original/**/*"]  # vLLM's default
    assert llm.llm_engine.config.model.tokenizer == str(local)
    calls.clear()
    LLM("org/tiny", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=32,
        ignore_patterns=["*.pt", "extra/*"])
    ((_, kw),) = calls
    assert "*.py" not in kw["allow_patterns"] and kw["token"] is None
    assert kw["ignore_patterns"] == ["*.pt", "extra/*"]
    # The HF config from another place (a Hugging Face id: its config files only).
    calls.clear()
    args = EngineArgs(model=str(local), hf_config_path="org/other-config")
    args.create_engine_config()
    ((config_id, config_kw),) = calls
    assert config_id == "org/other-config" and "*.safetensors" not in \
        config_kw["allow_patterns"]
    with pytest.raises(ConfigError, match="tokenizer_revision names a revision"):
        LLM(str(local), tokenizer_revision="v2", skip_tokenizer_init=True)


def test_the_hf_config_can_come_from_elsewhere(tmp_path):
    model = save_tiny_model(tmp_path / "model", tiny_llama_config(vocab_size=64), seed=1)
    other = tmp_path / "config"
    other.mkdir()
    config = json.loads((model / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 0.25}))
    llm = LLM(str(model), hf_config_path=str(other), dtype="float32",
              skip_tokenizer_init=True, num_kv_blocks=32)
    assert llm.llm_engine.config.model.hf_config.rms_norm_eps == 0.25
    assert llm.llm_engine.config.model.path == str(model)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ModelLoadError, match="does not exist"):
        EngineArgs(model=str(model), hf_config_path=str(tmp_path / "nowhere"),
                   ).create_engine_config()
