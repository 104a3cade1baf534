"""Image URLs fetched only where the server's flags allow (multimodal/media_fetch.py):
--allowed-media-domains for http(s) (each redirect checked again, size and time
limits), --allowed-local-media-path for file:// (no way out of the directory, symbolic
links included). A local HTTP server stands in for the web. The served LLaVA fetching
an image: tests/entrypoints/test_llava_server.py."""

from __future__ import annotations

import http.server
import io
import os
import threading
import time

import pytest

from pagedllm.entrypoints.openai.serve_config import ServeConfig
from pagedllm.errors import ConfigError, InvalidRequestError
from pagedllm.multimodal.content import load_images
from pagedllm.multimodal.media_fetch import MediaPolicy, fetch_media
from tests.utils import random_image


def png_bytes(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    random_image(seed).save(buf, "PNG")
    return buf.getvalue()


PNG = png_bytes()


@pytest.fixture(scope="module")
def web():
    """http://127.0.0.1:PORT serving an image, redirects and errors."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            port = self.server.server_address[1]
            routes = {"/img.png": (200, PNG, None),
                      "/big": (200, b"x" * 5000, None),
                      "/here": (302, b"", "/img.png"),
                      "/away": (302, b"", f"http://localhost:{port}/img.png"),
                      "/loop": (302, b"", "/loop")}
            if self.path == "/slow":  # a byte every 0.1 s: no single read times out
                self.send_response(200)
                self.send_header("Content-Length", "100")
                self.end_headers()
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
                return
            status, body, location = routes.get(self.path, (404, b"no", None))
            self.send_response(status)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_only_from_allowed_hosts(web):
    local = MediaPolicy(frozenset({"127.0.0.1"}), max_bytes=4096)
    assert fetch_media(f"{web}/img.png", local) == PNG
    assert fetch_media(f"{web}/here", local) == PNG  # a redirect within the host
    cases = [(f"{web}/away", local, "host 'localhost' is not one of"),
             (f"{web}/loop", local, "more than 3 redirects"),
             (f"{web}/big", local, "larger than 4096 bytes"),
             (f"{web}/missing", local, "answered HTTP 404"),
             (f"{web}/slow", MediaPolicy(frozenset({"127.0.0.1"}), timeout_s=0.5),
              "took too long"),
             (f"{web}/img.png", MediaPolicy(), "fetches no remote images"),
             (f"{web}/img.png", MediaPolicy(frozenset({"example.com"})), "not one of"),
             ("http://127.0.0.1:1/x.png", local, "cannot fetch it"),
             ("ftp://127.0.0.1/x.png", local, "scheme 'ftp' is not supported")]
    for url, policy, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            fetch_media(url, policy)
    anywhere = MediaPolicy(frozenset({"*"}))
    assert fetch_media(f"{web}/away", anywhere) == PNG
    image, = load_images([f"{web}/img.png"], local)
    assert image.size == random_image(0).size and image.mode == "RGB"
    with pytest.raises(InvalidRequestError, match="must be a data URL"):
        load_images([f"{web}/img.png"])  # no policy (the offline engine)


def test_local_files_only_under_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a b.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"secret")
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    policy = MediaPolicy.from_flags(None, str(allowed))
    assert fetch_media(f"file://{allowed}/a%20b.png", policy) == PNG
    for url, message in [(f"file://{tmp_path}/secret.png", "outside"),
                         (f"file://{allowed}/../secret.png", "outside"),
                         (f"file://{allowed}/link.png", "outside"),
                         (f"file://{allowed}/none.png", "cannot read the file"),
                         (f"file://other-host{allowed}/a%20b.png", "names no host")]:
        with pytest.raises(InvalidRequestError, match=message):
            fetch_media(url, policy)
    with pytest.raises(InvalidRequestError, match="reads no local files"):
        fetch_media(f"file://{allowed}/a%20b.png", MediaPolicy())
    with pytest.raises(ConfigError, match="is not a directory"):
        ServeConfig(allowed_local_media_path=str(tmp_path / "secret.png"))
    assert ServeConfig(allowed_media_domains=["Example.COM "]).media_policy() \
        .allowed_domains == {"example.com"}
