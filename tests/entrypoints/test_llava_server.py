"""Images on the chat API (OpenAI's image_url parts with data URLs) of a served LLaVA:
the reply equals the offline engine's, streams agree, and every bad image is a 400
naming what is wrong while the server keeps serving."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.entrypoints.utils import RemoteServer
from tests.utils import random_image, save_tiny_llava


def _data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _message(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "w5 w7"}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return save_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """Image files for file:// URLs, also served over HTTP on 127.0.0.1."""
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def server(llava_dir, media_dir):
    srv = RemoteServer([str(llava_dir), "--dtype", "float32", "--max-model-len", "128",
                        "--limit-mm-per-prompt", '{"image": 2}',
                        "--allowed-media-domains", "127.0.0.1",
                        "--allowed-local-media-path", str(media_dir)])
    yield srv
    srv.stop()


def test_images_by_http_and_file_urls(server, media_dir):
    """--allowed-media-domains / --allowed-local-media-path: an image fetched from an
    allowed host, or read from a file under the allowed directory, gives the reply its
    data URL gives; another host, or a file elsewhere, is a 400."""
    import functools
    import http.server
    import threading

    random_image(3).save(media_dir / "cat.png", "PNG")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(media_dir))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        port = web.server_address[1]
        replies = []
        for url in (_data_url(random_image(3)), f"http://127.0.0.1:{port}/cat.png",
                    f"file://{media_dir}/cat.png"):
            r = _chat(server, _message(_image(url), TEXT))
            assert r.status_code == 200, r.text
            replies.append(r.json()["choices"][0]["message"]["content"])
        assert replies[0] == replies[1] == replies[2]
        for url, message in [(f"http://localhost:{port}/cat.png", "allowed-media-domains"),
                             ("file:///etc/hostname", "allowed-local-media-path")]:
            r = _chat(server, _message(_image(url), TEXT))
            assert r.status_code == 400 and message in r.json()["error"]["message"]
    finally:
        web.shutdown()


def _chat(server, messages, **fields) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True} | fields
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_reply_matches_the_offline_engine(server, llava_dir):
    images = [random_image(0), random_image(1, width=20, height=50)]
    messages = _message(_image(_data_url(images[0])), _image(_data_url(images[1], "JPEG")),
                        TEXT)
    r = _chat(server, messages)
    assert r.status_code == 200, r.text
    body = r.json()
    llm = LLM(model=str(llava_dir), dtype="float32", max_model_len=128)
    offline_messages = _message(_image(_data_url(images[0])),
                                _image(_data_url(images[1], "JPEG")), TEXT)
    expect = llm.chat(offline_messages, SamplingParams(max_tokens=8, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert body["choices"][0]["message"]["content"] == expect.outputs[0].text
    # Each image counts its whole placeholder run.
    assert body["usage"]["prompt_tokens"] == len(expect.prompt_token_ids)

    streamed = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed.append(json.loads(line[6:])["choices"][0]["delta"].get("content")
                                or "")
    assert "".join(streamed) == expect.outputs[0].text


def test_text_only_messages_still_work(server):
    r = _chat(server, [{"role": "user", "content": "w5 w7"}])
    assert r.status_code == 200, r.text


def _png_declaring(width: int, height: int) -> str:
    """A tiny file (a 1-bit blank canvas compresses to almost nothing) whose header
    declares width x height pixels."""
    from PIL import Image

    return _data_url(Image.new("1", (width, height)))


@pytest.mark.parametrize("parts,match", [
    ((_image("data:image/png;base64,@@@not base64@@@"), TEXT), "not valid base64"),
    ((_image("data:image/png;base64," + base64.b64encode(b"plain text").decode()), TEXT),
     "cannot decode the image"),
    ((_image("http://169.254.169.254/latest/meta-data"), TEXT),
     "is not one of the server's --allowed-media-domains"),
    ((_image("data:image/png,rawbytes"), TEXT), "must be base64"),
    (({"type": "image_url", "image_url": {}}, TEXT), "needs {'url'"),
    (({"type": "input_audio", "input_audio": {}}, TEXT), "'input_audio' is not supported"),
    ((_image(_png_declaring(8000, 6000)), TEXT), "more than the"),
    ((*[_image(_data_url(random_image(i))) for i in range(3)], TEXT), "at most 2"),
])
def test_bad_images_are_400(server, parts, match):
    r = _chat(server, _message(*parts))
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    good = _chat(server, _message(_image(_data_url(random_image(0))), TEXT))
    assert good.status_code == 200, good.text


def test_images_with_truncation_are_400(server):
    r = _chat(server, _message(_image(_data_url(random_image(0))), TEXT),
              truncate_prompt_tokens=4)
    assert r.status_code == 400
    assert "truncate_prompt_tokens cannot" in r.json()["error"]["message"]


def test_text_models_refuse_image_parts():
    from pagedllm.entrypoints.openai.protocol import ChatMessage
    from pagedllm.errors import InvalidRequestError

    message = ChatMessage(role="user", content=_message(_image("data:,"), TEXT)[0]["content"])
    with pytest.raises(InvalidRequestError, match="only text content parts are supported "
                                                  "by this model, got 'image_url'"):
        message.template_dict()


def test_responses_api_takes_input_image(server):
    """/v1/responses' input_image parts reach the model as the chat API's image_url."""
    url = _data_url(random_image(3))
    chat = _chat(server, _message(_image(url), TEXT), ignore_eos=False)
    r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url},
            {"type": "input_text", "text": "w5 w7"}]}],
        "max_output_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    text = r.json()["output"][0]["content"][0]["text"]
    assert chat.status_code == 200
    assert text == chat.json()["choices"][0]["message"]["content"]


def test_tokenize_counts_each_image_run(server):
    """/tokenize gives the prompt as the engine runs it: each image its 16 rows."""
    messages = _message(_image(_data_url(random_image(0))), TEXT)
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    chat = _chat(server, messages, max_tokens=1)
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_string_contents_cannot_carry_images(llava_dir):
    """--chat-template-content-format string on a multimodal model is a start-up error:
    its template reads parts, the images among them."""
    with pytest.raises(RuntimeError, match="string cannot carry images"):
        RemoteServer([str(llava_dir), "--dtype", "float32", "--max-model-len", "128",
                      "--chat-template-content-format", "string"], startup_timeout_s=120)
