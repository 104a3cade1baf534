"""Clients that connect and then send, or read, too slowly (connections.py).

A connection that carried no request was kept for as long as its client liked: 1,100
idle connections from one client used up the common limit of 1,024 open files and the
server accepted nothing more, /health included. Now an idle connection is closed after
--keep-alive-timeout, a request's headers and then its body must each arrive within
--read-timeout (408), a response nobody reads is cut off after --write-timeout (and its
request aborted), and past --max-connections the connection waiting longest for a
request makes room. A request's line and headers are limited in size and number
(--h11-max-incomplete-event-size, --h11-max-header-count): 431 past either.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from pagedllm.entrypoints.openai.connections import ConnectionGuard
from pagedllm.entrypoints.openai.serve_config import ServeConfig
from pagedllm.errors import ConfigError
from tests.entrypoints.utils import MODEL_NAME, RemoteServer

READ_TIMEOUT_S = 4
WRITE_TIMEOUT_S = 3
MAX_CONNECTIONS = 8
IDLE_TIMEOUT_S = 1
MAX_HEADER_BYTES = 8192
MAX_HEADERS = 64
SERVER_ARGS = ["--max-model-len", "512", "--num-kv-blocks", "512",
               "--max-num-seqs", "16", "--keep-alive-timeout", str(IDLE_TIMEOUT_S),
               "--read-timeout", str(READ_TIMEOUT_S),
               "--write-timeout", str(WRITE_TIMEOUT_S),
               "--max-connections", str(MAX_CONNECTIONS),
               "--h11-max-incomplete-event-size", str(MAX_HEADER_BYTES),
               "--h11-max-header-count", str(MAX_HEADERS)]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS)
    yield srv
    srv.stop()


def _connect(server: RemoteServer, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it did."""
    chunks = []
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks), time.monotonic()


def _status_and_body(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _request_head(path: str, length: int, method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _closed_now(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.settimeout(30)


def _completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Once upon a time", **fields}


def test_slow_or_idle_senders_are_closed_with_a_408_and_others_are_served(server):
    """Four stalled clients at once: one sends nothing, one half a request line, one its
    headers a byte at a time (each byte in time, the whole not), one a tenth of its
    body. The first is closed silently after the idle timeout, the others get a 408
    naming --read-timeout after it; meanwhile a fresh client is served at once."""
    started = time.monotonic()
    idle = _connect(server)
    partial = _connect(server)
    partial.sendall(b"POST /v1/completions HT")
    trickle = _connect(server)
    body_short = _connect(server)
    body_short.sendall(_request_head("/v1/completions", 100) + b'{"prompt":')
    stop = threading.Event()

    def trickle_headers() -> None:
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            if stop.wait(0.2):
                return
            try:
                trickle.send(bytes([byte]))
            except OSError:
                return

    sender = threading.Thread(target=trickle_headers)
    sender.start()
    try:
        r = httpx.get(server.url + "/health", timeout=5)
        assert r.status_code == 200
        results = {}
        for name, sock in (("idle", idle), ("partial", partial), ("trickle", trickle),
                           ("body_short", body_short)):  # in the order they close
            results[name] = _read_until_closed(sock)
    finally:
        stop.set()
        sender.join()
        for sock in (idle, partial, trickle, body_short):
            sock.close()
    raw, closed_at = results["idle"]
    assert raw == b""
    assert IDLE_TIMEOUT_S - 0.5 < closed_at - started < READ_TIMEOUT_S - 0.5
    for name in ("partial", "trickle", "body_short"):
        raw, closed_at = results[name]
        status, headers, body = _status_and_body(raw)
        assert status == 408, (name, raw)
        assert headers["connection"] == "close", name
        assert "--read-timeout" in body["error"]["message"], (name, body)
        assert body["error"]["code"] == 408
        assert READ_TIMEOUT_S - 0.5 < closed_at - started < READ_TIMEOUT_S + 15, name
    assert "request body did not arrive" in _status_and_body(
        results["body_short"][0])[2]["error"]["message"]
    assert "headers did not arrive" in _status_and_body(
        results["partial"][0])[2]["error"]["message"]


def test_the_next_request_on_a_kept_alive_connection_has_the_same_deadline(server):
    sock = _connect(server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        answered = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost:")  # and no more
        raw, closed_at = _read_until_closed(sock)
    finally:
        sock.close()
    assert _status_and_body(raw)[0] == 408
    assert READ_TIMEOUT_S - 0.5 < closed_at - answered < READ_TIMEOUT_S + 15


def test_a_request_that_runs_past_the_read_timeout_is_not_cut_off(server):
    """The deadline is for receiving the request: generating 8 x 480 tokens takes
    longer than that here, streamed or not, and both complete."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        started = time.monotonic()
        r = client.post("/v1/completions", json=_completion(n=8, max_tokens=480,
                                                            ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8 * 480
        assert time.monotonic() - started > READ_TIMEOUT_S  # really ran past it
        started = time.monotonic()
        events = []
        with client.stream("POST", "/v1/completions",
                           json=_completion(n=8, max_tokens=480, ignore_eos=True,
                                            stream=True)) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        assert events[-1] == "[DONE]"
        assert time.monotonic() - started > READ_TIMEOUT_S


def _finished(server: RemoteServer, reason: str) -> float:
    """pagedllm:request_success_total for one finish reason."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagedllm:request_success_total{")
               and f'finished_reason="{reason}"' in line)


def test_a_client_that_reads_nothing_is_cut_off_and_its_request_aborted(server):
    """A streamed chat request (n=16, 400 tokens each with 20 top logprobs: ~8 MB of
    events, more than the socket buffers hold) whose client never reads: once the
    buffers are full the server waits --write-timeout, then drops the connection, which
    aborts the request before its tokens are all generated."""
    body = json.dumps({"model": MODEL_NAME, "n": 16, "max_tokens": 400, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "Tell me a story."}],
                       "logprobs": True, "top_logprobs": 20, "stream": True}).encode()
    aborted, by_length = _finished(server, "abort"), _finished(server, "length")
    sock = _connect(server, rcvbuf=4096)
    try:
        sock.sendall(_request_head("/v1/chat/completions", len(body)) + body)
        deadline = time.monotonic() + 240
        time.sleep(1)
        while server.stats()["num_running"] or server.stats()["num_waiting"]:
            assert time.monotonic() < deadline, "the unread request was never aborted"
            time.sleep(0.5)
        raw, _ = _read_until_closed(sock)
    finally:
        sock.close()
    assert raw.startswith(b"HTTP/1.1 200"), raw[:500]
    assert _finished(server, "abort") > aborted
    assert _finished(server, "length") == by_length  # not one of its 16 ran to the end
    assert b"data: [DONE]" not in raw
    assert "--write-timeout" in server.read_log()


def test_past_max_connections_the_longest_waiting_connection_makes_room(server):
    """Twenty connections that sent part of a request, against a limit of eight: the
    oldest twelve are closed as the newer ones arrive, the newest eight stay, and a
    client with a request is still served (its connection pushes out one more)."""
    socks = []
    try:
        for _ in range(20):
            socks.append(_connect(server))
            socks[-1].sendall(b"GET /health HTTP/1.1\r\n")  # and no more for now
        time.sleep(0.3)  # well inside the read timeout
        closed = [_closed_now(s) for s in socks]
        assert closed == [True] * 12 + [False] * 8, closed
        r = httpx.get(server.url + "/health", timeout=5)
        assert r.status_code == 200
        time.sleep(0.2)
        assert _closed_now(socks[12]) and not any(_closed_now(s) for s in socks[13:])
    finally:
        for s in socks:
            s.close()


def test_when_every_connection_has_a_request_in_flight_a_new_one_gets_a_503(server):
    body = json.dumps(_completion(max_tokens=480, ignore_eos=True, stream=True)).encode()
    busy = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in busy:
            sock.sendall(_request_head("/v1/completions", len(body)) + body)
        for sock in busy:  # each request is in the app's hands: its response began
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
        extra = _connect(server)
        try:
            raw, _ = _read_until_closed(extra)
        finally:
            extra.close()
    finally:
        for sock in busy:
            sock.close()
    status, _, error = _status_and_body(raw)
    assert status == 503
    assert f"--max-connections {MAX_CONNECTIONS}" in error["error"]["message"]
    deadline = time.monotonic() + 60  # the closed streams' requests are aborted
    while server.stats()["num_running"] or server.stats()["num_waiting"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)


class _FakeTransport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _FakeProtocol:
    def __init__(self) -> None:
        self.transport = _FakeTransport()


def test_make_room_closes_the_oldest_waiting_connection_once_per_connection_over():
    guard = ConnectionGuard(read_timeout=60, write_timeout=60, max_connections=2)
    old, mid, new = _FakeProtocol(), _FakeProtocol(), _FakeProtocol()
    for p in (old, mid, new):
        guard.waiting[p] = None
    assert guard.make_room(new, num_open=2)  # at the limit: nothing closed
    assert not old.transport.closed
    assert guard.make_room(new, num_open=3)
    assert old.transport.closed and not mid.transport.closed
    # The one closed is still open until the loop reports it lost: not counted again.
    assert guard.make_room(new, num_open=3) and not mid.transport.closed
    guard.waiting.pop(mid)  # mid's request is in flight: nothing left to close
    assert not guard.make_room(new, num_open=4)


def test_running_out_of_files_to_accept_is_logged_once_not_per_connection(caplog):
    """asyncio reports each failed accept, up to the backlog's worth at a time; the guard
    logs one line for them every LOG_EVERY_S and passes anything else on."""
    guard = ConnectionGuard(read_timeout=60, write_timeout=60, max_connections=100)
    loop = asyncio.new_event_loop()
    passed_on = []
    loop.set_exception_handler(lambda _, context: passed_on.append(context["message"]))
    try:
        guard.quiet_accept_errors(loop)
        with caplog.at_level(logging.WARNING):
            for _ in range(50):
                loop.call_exception_handler({
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(24, "Too many open files")})
            loop.call_exception_handler({"message": "something else"})
    finally:
        loop.close()
    warnings = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
    assert len(warnings) == 1
    assert "--max-connections, now 100" in warnings[0].getMessage()
    assert passed_on == ["something else"]


def test_a_body_refused_by_its_length_closes_the_connection_at_once(server):
    """A Content-Length past --max-body-bytes gets its 413 before any body is read, with
    `Connection: close`, and the server closes the connection then: the unread body
    would otherwise hold it (read by nobody) for as long as its client trickled."""
    sock = _connect(server)
    try:
        sock.sendall(_request_head("/v1/completions", 3 << 20) + b'{"prompt": "')
        started = time.monotonic()
        raw, closed_at = _read_until_closed(sock)
    finally:
        sock.close()
    status, headers, body = _status_and_body(raw)
    assert status == 413 and headers["connection"] == "close"
    assert "--max-body-bytes" in body["error"]["message"]
    assert closed_at - started < READ_TIMEOUT_S - 0.5  # not by the read timeout


def _get_with_headers(server: RemoteServer, headers: list[str]) -> bytes:
    """The raw answer to GET /health with these extra header lines, read until the
    server closes the connection (the request asks it to)."""
    sock = _connect(server)
    try:
        head = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        sock.sendall((head + "".join(h + "\r\n" for h in headers) + "\r\n").encode())
        return _read_until_closed(sock)[0]
    finally:
        sock.close()


def test_too_many_headers_get_a_431_naming_the_flag(server):
    # The Host and Connection lines count: MAX_HEADERS in all pass, one more does not.
    ok = _get_with_headers(server, [f"X-H{i}: v" for i in range(MAX_HEADERS - 2)])
    assert ok.startswith(b"HTTP/1.1 200")
    raw = _get_with_headers(server, [f"X-H{i}: v" for i in range(MAX_HEADERS - 1)])
    status, headers, body = _status_and_body(raw)
    assert status == 431 and headers["connection"] == "close"
    assert f"{MAX_HEADERS + 1} headers" in body["error"]["message"]
    assert "--h11-max-header-count" in body["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_headers_past_the_size_limit_get_a_431_naming_the_flag(server):
    fits = _get_with_headers(server, ["X-Big: " + "a" * (MAX_HEADER_BYTES - 200)])
    assert fits.startswith(b"HTTP/1.1 200")
    # Sent whole or in pieces, the server stops buffering at the limit (below h11's
    # default of 16 KiB, so the flag is what refuses it).
    for pieces in (1, 16):
        sock = _connect(server)
        try:
            data = ("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
                    + "a" * (MAX_HEADER_BYTES + 4096)).encode()
            step = len(data) // pieces
            for i in range(0, len(data), step):
                with contextlib.suppress(OSError):  # closed by the server midway
                    sock.sendall(data[i:i + step])
            raw, _ = _read_until_closed(sock)
        finally:
            sock.close()
        status, headers, body = _status_and_body(raw)
        assert status == 431 and headers["connection"] == "close"
        assert f"{MAX_HEADER_BYTES} bytes" in body["error"]["message"]
        assert "--h11-max-incomplete-event-size" in body["error"]["message"]
    # A request h11 cannot parse for another reason keeps uvicorn's 400.
    sock = _connect(server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        raw, _ = _read_until_closed(sock)
    finally:
        sock.close()
    assert raw.startswith(b"HTTP/1.1 400")


@pytest.mark.parametrize("field,value", [("keep_alive_timeout", 0.0),
                                         ("read_timeout", -1.0),
                                         ("write_timeout", float("nan")),
                                         ("max_connections", 0),
                                         ("h11_max_header_count", 0),
                                         ("h11_max_incomplete_event_size", 0)])
def test_connection_limits_must_be_positive(field, value):
    with pytest.raises(ConfigError, match=field):
        ServeConfig(**{field: value})
