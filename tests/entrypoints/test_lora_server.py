"""LoRA adapters over HTTP: --lora-modules names them as models (listed with their
parent), a request's `model` picks one (the same tokens as LLM.generate with that
LoRARequest), unknown names are 404, and --allow-runtime-lora-updating loads and
unloads adapters while serving."""

from __future__ import annotations

import httpx
import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.config import default_model_path
from pagedllm.loader.hf_config import load_hf_config
from tests.entrypoints.utils import MODEL_NAME, RemoteServer
from tests.utils import save_tiny_lora

PROMPT = "The capital of France is"
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
             "--kv-cache-space", "0.1"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    hf_config = load_hf_config(default_model_path())
    targets = ("q_proj", "v_proj", "down_proj")
    return (save_tiny_lora(root / "a", hf_config, rank=8, std=0.05, targets=targets),
            save_tiny_lora(root / "b", hf_config, rank=4, std=0.05, targets=targets, seed=3))


@pytest.fixture(scope="module")
def server(adapters):
    srv = RemoteServer(LORA_ARGS + ["--lora-modules", f"smol-a={adapters[0]}",
                                    "--allow-runtime-lora-updating"])
    yield srv
    srv.stop()


def _complete(server, model, **kw):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _token_logprobs(response) -> list[float]:
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_adapters_are_models(server, adapters):
    cards = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL_NAME, None),
                                                       ("smol-a", MODEL_NAME)]
    assert cards[1]["root"] == str(adapters[0])
    base = _complete(server, MODEL_NAME, logprobs=1)
    adapted = _complete(server, "smol-a", logprobs=1)
    assert base.status_code == adapted.status_code == 200
    assert adapted.json()["model"] == "smol-a" and base.json()["model"] == MODEL_NAME
    # The same tokens as offline with the same adapter (same kernels: batch invariant).
    llm = LLM(enable_lora=True, max_lora_rank=8, kv_cache_space=0.1)
    sp = SamplingParams(max_tokens=8, temperature=0)
    offline = llm.generate(PROMPT, sp, use_tqdm=False,
                           lora_request=LoRARequest("a", 1, str(adapters[0])))
    assert adapted.json()["choices"][0]["text"] == offline[0].outputs[0].text
    # The adapter takes effect: its token logprobs differ from the base model's (a random
    # adapter this small need not change the 8 greedy tokens themselves).
    assert _token_logprobs(adapted) != _token_logprobs(base)
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "smol-a", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "smol-a"
    missing = _complete(server, "no-such-adapter")
    assert missing.status_code == 404 and "no-such-adapter" in missing.json()["error"]["message"]


def test_runtime_loading(server, adapters):
    url = server.url
    load = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "smol-b", "lora_path": str(adapters[1])})
    assert load.status_code == 200, load.text
    first = _complete(server, "smol-b", logprobs=1)
    assert first.status_code == 200
    assert _token_logprobs(first) != _token_logprobs(_complete(server, "smol-a", logprobs=1))
    for body, message in (({"lora_name": "smol-b", "lora_path": str(adapters[1])},
                           "already in use"),
                          ({"lora_name": MODEL_NAME, "lora_path": str(adapters[1])},
                           "already in use"),
                          ({"lora_name": "bad", "lora_path": "/nonexistent"},
                           "no adapter_config.json")):
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
        assert bad.status_code == 400 and message in bad.json()["error"]["message"], bad.text
    assert httpx.post(f"{url}/v1/unload_lora_adapter",
                      json={"lora_name": "smol-b"}).status_code == 200
    assert _complete(server, "smol-b").status_code == 404
    assert httpx.post(f"{url}/v1/unload_lora_adapter",
                      json={"lora_name": "smol-b"}).status_code == 404
    # Loaded again (a new id): the same outputs as before.
    assert httpx.post(f"{url}/v1/load_lora_adapter", timeout=60, json={
        "lora_name": "smol-b", "lora_path": str(adapters[1])}).status_code == 200
    assert _complete(server, "smol-b").json()["choices"][0]["text"] == \
        first.json()["choices"][0]["text"]
    assert "smol-b" in [c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]]


def test_an_adapter_broken_after_loading_fails_its_requests_only(server, adapters,
                                                                 tmp_path):
    """An adapter loaded (checked) at runtime whose weights file is then overwritten:
    its request gets a 400 naming the adapter, and the server keeps serving."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(adapters[1], broken)
    load = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "smol-broken", "lora_path": str(broken)})
    assert load.status_code == 200, load.text
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    failed = _complete(server, "smol-broken")
    assert failed.status_code == 400, failed.text
    assert "LoRA adapter 'smol-broken' could not be loaded" in failed.json()["error"][
        "message"]
    streamed = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": "smol-broken", "prompt": PROMPT, "max_tokens": 4, "stream": True})
    assert "could not be loaded" in streamed.text and streamed.text.endswith(
        "data: [DONE]\n\n")
    assert _complete(server, MODEL_NAME).status_code == 200
    assert _complete(server, "smol-a").status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_lora_flags_need_enable_lora(adapters):
    with pytest.raises(RuntimeError, match="need --enable-lora"):
        RemoteServer(["--lora-modules", f"a={adapters[0]}"], startup_timeout_s=120)


def test_runtime_loading_is_off_by_default(adapters):
    srv = RemoteServer(LORA_ARGS + ["--lora-modules", f"smol-a={adapters[0]}"])
    try:
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter",
                       json={"lora_name": "x", "lora_path": str(adapters[1])})
        assert r.status_code == 404
    finally:
        srv.stop()
