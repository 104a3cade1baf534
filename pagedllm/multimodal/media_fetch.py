"""Images named by URL: fetched over HTTP(S), or read from local files, only where the
server's flags allow (vLLM's --allowed-media-domains and --allowed-local-media-path).

A URL in a request makes the server open a connection or a file on the client's behalf,
so by default neither happens (data URLs only). `--allowed-media-domains` lists the
hosts that may be fetched from ("*": any host, the address space behind the server
included: vLLM's default, taken here only when asked for); every redirect is checked
against the same list. `--allowed-local-media-path DIR` lets file:// URLs read files
under DIR, symbolic links resolved first, so none leads out of it. A fetch has a time
limit (the whole fetch, not only each read) and reads at most `max_bytes`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urljoin, urlsplit

from pagedllm.errors import ConfigError, InvalidRequestError

MAX_MEDIA_BYTES = 32 << 20
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaPolicy:
    """Where image URLs may point (the server's flags)."""

    allowed_domains: frozenset[str] | None = None
    """Hosts http(s) URLs may name ("*" in it: any); None: no remote fetching."""
    allowed_local_path: str | None = None
    """The directory file:// URLs may read under (resolved); None: no local files."""
    timeout_s: float = 5.0
    max_bytes: int = MAX_MEDIA_BYTES

    @classmethod
    def from_flags(cls, domains: list[str] | None, local_path: str | None,
                   ) -> MediaPolicy:
        allowed = (frozenset(d.strip().lower() for d in domains if d.strip())
                   if domains else None)
        if local_path is not None:
            if not os.path.isdir(local_path):
                raise ConfigError(f"allowed_local_media_path {local_path!r} is not a "
                                  f"directory")
            local_path = os.path.realpath(local_path)
        return cls(allowed or None, local_path)


def fetch_media(url: str, policy: MediaPolicy) -> bytes:
    """The bytes an http(s):// or file:// URL names, as `policy` allows; an
    InvalidRequestError naming the reason otherwise."""
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return _fetch_http(url, policy)
    if scheme == "file":
        return _read_file(url, policy)
    raise InvalidRequestError(f"image_url: scheme {scheme or '(none)'!r} is not supported "
                              f"(data:, http(s):// or file:// URLs)")


def _check_host(url: str, policy: MediaPolicy) -> None:
    if policy.allowed_domains is None:
        raise InvalidRequestError("image_url: this server fetches no remote images (start "
                                  "it with --allowed-media-domains); send a data URL")
    host = (urlsplit(url).hostname or "").lower()
    if "*" not in policy.allowed_domains and host not in policy.allowed_domains:
        raise InvalidRequestError(f"image_url: host {host!r} is not one of the server's "
                                  f"--allowed-media-domains")


def _fetch_http(url: str, policy: MediaPolicy) -> bytes:
    import httpx

    # httpx's timeout bounds each read; the deadline bounds the whole fetch, so a host
    # that trickles bytes cannot hold the offload thread.
    deadline = time.monotonic() + policy.timeout_s
    with httpx.Client(timeout=policy.timeout_s, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            _check_host(url, policy)
            try:
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    if response.status_code != 200:
                        raise InvalidRequestError(f"image_url: fetching it answered HTTP "
                                                  f"{response.status_code}")
                    return _read_capped(response.iter_bytes(), policy.max_bytes,
                                        deadline)
            except httpx.HTTPError as e:
                raise InvalidRequestError(f"image_url: cannot fetch it: "
                                          f"{type(e).__name__}: {e}") from None
    raise InvalidRequestError(f"image_url: more than {MAX_REDIRECTS} redirects")


def _read_capped(chunks: Iterable[bytes], max_bytes: int,
                 deadline: float = math.inf) -> bytes:
    data = bytearray()
    for chunk in chunks:
        data += chunk
        if len(data) > max_bytes:
            raise InvalidRequestError(f"image_url: the image is larger than {max_bytes} "
                                      f"bytes")
        if time.monotonic() > deadline:
            raise InvalidRequestError("image_url: fetching it took too long")
    return bytes(data)


def _read_file(url: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_path
    if root is None:
        raise InvalidRequestError("image_url: this server reads no local files (start it "
                                  "with --allowed-local-media-path)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequestError("image_url: a file:// URL names no host")
    path = os.path.realpath(unquote(parts.path))
    if os.path.commonpath([root, path]) != root:
        raise InvalidRequestError("image_url: the file is outside the server's "
                                  "--allowed-local-media-path")
    try:
        with open(path, "rb") as f:
            return _read_capped(iter(lambda: f.read(1 << 20), b""), policy.max_bytes)
    except OSError as e:
        raise InvalidRequestError(f"image_url: cannot read the file: {e.strerror}") from None
