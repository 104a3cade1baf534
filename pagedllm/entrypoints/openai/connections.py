"""Connections that carry no request: closed before they use up the server's files.

uvicorn keeps a connection for as long as its client likes until a request has arrived
on it: a client that connects and sends nothing, or half a request line, holds an open
file for ever. 1,100 such connections from one client (not one request among them)
used up the common limit of 1,024 open files: the server accepted nothing more, /health
included, for as long as the client held them. The rules here (nginx has the same ones:
client_header_timeout, send_timeout; llama.cpp's server a read and a write timeout):

- A connection that sends nothing is closed after --keep-alive-timeout (5 s), as
  uvicorn closes one idle after a response.
- A request's line and headers must arrive within --read-timeout of the connection
  starting to wait for them (on connecting, or when the previous response ended); past
  it the client gets a 408 and the connection is closed. The body has its own
  --read-timeout once the headers are in (BodyLimitMiddleware in server.py: its 408
  comes from the app).
- A response whose client reads nothing for --write-timeout is cut off: the connection
  is aborted, which aborts its request too.
- A request's line and headers may take --h11-max-incomplete-event-size bytes and
  --h11-max-header-count headers (vLLM's flags); past either the client gets a 431 and
  the connection is closed, before any middleware or route sees the request.
- When the open connections pass --max-connections, the connection that has waited
  longest for a request is closed to make room: a client that sends its request at once
  waits milliseconds, an idle or trickling one is the oldest, so a flood of idle
  connections pushes out its own. The default keeps 256 files of the process's limit
  for the engine; `raise_open_file_limit` first lifts the soft limit to the hard one
  (as vLLM does), so a default machine's 1,024 is rarely the limit.

Only uvicorn's h11 protocol is used (ours, below), whichever parser is installed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from http import HTTPStatus
from typing import Any

from pagedllm.entrypoints.openai.serving_common import error_body

logger = logging.getLogger(__name__)

# Open files kept for the engine's side of the process (model files, pipes, the
# tokenizer's) when --max-connections is not given.
RESERVED_FILES = 256
# Each kind of warning (connections closed to make room, failed accepts) is logged at
# most this often.
LOG_EVERY_S = 10.0
# A request's line and headers: h11's own default size (vLLM's is 4 MiB: every
# connection may then buffer that much before its request is even parsed), vLLM's count.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024
DEFAULT_MAX_HEADER_COUNT = 256


def raise_open_file_limit() -> int:
    """Lift the soft limit on open files to the hard one; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may refuse: keep what we have
            pass
    return soft


def default_max_connections(open_file_limit: int) -> int:
    return max(open_file_limit - RESERVED_FILES, open_file_limit // 2)


def _raw_response(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, written directly:
    h11 sends a response only after it has parsed a request."""
    body = json.dumps(error_body(message, status)).encode()
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            f"content-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class ConnectionGuard:
    """One server's limits, and its connections waiting for a request (oldest first)."""

    def __init__(self, read_timeout: float, write_timeout: float,
                 max_connections: int, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 max_header_count: int = DEFAULT_MAX_HEADER_COUNT) -> None:
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.max_connections = max_connections
        self.max_header_bytes = max_header_bytes
        self.max_header_count = max_header_count
        self.waiting: dict[Any, None] = {}  # insertion order: when each began to wait
        # Closed here but not yet gone (the loop reports it on its next turn): not
        # counted, or a burst of connections would close one waiting connection each.
        self.closing: set[Any] = set()
        self.num_evicted = 0
        self._logged_at: dict[str, float] = {}  # per kind of warning

    def _log_due(self, kind: str) -> bool:
        """Whether a `kind` warning may be logged now (at most one per LOG_EVERY_S)."""
        now = time.monotonic()
        if now - self._logged_at.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
            return False
        self._logged_at[kind] = now
        return True

    def make_room(self, newcomer: Any, num_open: int) -> bool:
        """Close the connection waiting longest if `num_open` passes the limit; False
        when every other connection has a request in flight (the newcomer must go)."""
        if num_open - len(self.closing) <= self.max_connections:
            return True
        victim = next((p for p in self.waiting if p is not newcomer), None)
        if victim is None:
            return False
        self.waiting.pop(victim)
        self.closing.add(victim)
        victim.transport.close()
        self.num_evicted += 1
        if self._log_due("evicted"):
            logger.warning("%d open connections passed --max-connections %d: closed the "
                           "ones waiting longest for a request (%d so far)",
                           num_open - len(self.closing) + 1, self.max_connections,
                           self.num_evicted)
        return True

    def quiet_accept_errors(self, loop: asyncio.AbstractEventLoop) -> None:
        """Log running out of files to accept with one line every LOG_EVERY_S: asyncio
        logs each failed accept with a traceback, a whole backlog's worth (uvicorn's:
        2,048) at a time, while connections arrive faster than the guard closes them."""
        default = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if not context.get("message", "").startswith("socket.accept() out of system"):
                if default is not None:
                    default(loop, context)
                else:
                    loop.default_exception_handler(context)
                return
            if self._log_due("accept"):
                logger.warning("cannot accept connections: %s (raise the open-file limit, "
                               "ulimit -n, or lower --max-connections, now %d)",
                               context.get("exception"), self.max_connections)

        loop.set_exception_handler(handler)

    def protocol_class(self) -> type[asyncio.Protocol]:
        """uvicorn's h11 protocol under this guard's rules (uvicorn.Config's `http`)."""
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol

        guard = self

        class GuardedH11Protocol(H11Protocol):
            _read_timer: asyncio.TimerHandle | None = None
            _write_timer: asyncio.TimerHandle | None = None

            def connection_made(  # type: ignore[override]
                    self, transport: asyncio.Transport) -> None:
                super().connection_made(transport)
                self.app = _header_count_limited(self.app, guard.max_header_count)
                self._await_request()
                # Idle before the first byte as uvicorn allows after a response; the
                # first byte cancels it (data_received).
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler)
                if not guard.make_room(self, len(self.connections)):
                    transport.write(_raw_response(
                        503, f"The server has {len(self.connections) - 1} open connections, "
                        f"every one with a request in flight (--max-connections "
                        f"{guard.max_connections})."))
                    guard.closing.add(self)
                    transport.close()

            def send_400_response(self, msg: str) -> None:
                # uvicorn's answer to any request h11 cannot parse; one that outgrew
                # the size limit gets a 431 that says which.
                if len(self.conn.trailing_data[0]) > guard.max_header_bytes:
                    self.transport.write(_raw_response(
                        431, f"The request's line and headers are larger than the "
                        f"{guard.max_header_bytes} bytes this server accepts "
                        f"(--h11-max-incomplete-event-size)."))
                    self.transport.close()
                    return
                super().send_400_response(msg)

            def _await_request(self) -> None:
                guard.waiting[self] = None
                self._cancel_read_timer()
                self._read_timer = self.loop.call_later(guard.read_timeout,
                                                        self._read_timed_out)

            def _cancel_read_timer(self) -> None:
                if self._read_timer is not None:
                    self._read_timer.cancel()
                    self._read_timer = None

            def _request_in_flight(self) -> bool:
                """A request's headers are in and its response not yet sent (the app
                has it; its body has BodyLimitMiddleware's deadline). Not so for the
                rest of a body that was answered before it was read."""
                return self.cycle is not None and not self.cycle.response_complete

            def handle_events(self) -> None:
                super().handle_events()
                if self._request_in_flight():
                    guard.waiting.pop(self, None)
                    self._cancel_read_timer()

            def on_response_complete(self) -> None:
                # Before uvicorn's: it parses a pipelined request at once, which ends the
                # wait again.
                if not self.transport.is_closing():
                    self._await_request()
                super().on_response_complete()

            def _read_timed_out(self) -> None:
                self._read_timer = None
                if self.transport.is_closing() or self._request_in_flight():
                    return
                if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                    # Part of a request's line or headers came.
                    self.transport.write(_raw_response(
                        408, f"The request's headers did not arrive within "
                        f"{guard.read_timeout:g} s (--read-timeout)."))
                self.transport.close()

            def pause_writing(self) -> None:
                super().pause_writing()
                if self._write_timer is None:
                    self._write_timer = self.loop.call_later(guard.write_timeout,
                                                             self._write_timed_out)

            def resume_writing(self) -> None:
                super().resume_writing()
                if self._write_timer is not None:
                    self._write_timer.cancel()
                    self._write_timer = None

            def _write_timed_out(self) -> None:
                self._write_timer = None
                logger.info("closed a connection whose client read nothing for %g s "
                            "(--write-timeout)", guard.write_timeout)
                # close() would wait for the buffer to drain, which this client never
                # lets happen.
                self.transport.abort()

            def connection_lost(self, exc: Exception | None) -> None:
                guard.waiting.pop(self, None)
                guard.closing.discard(self)
                self._cancel_read_timer()
                if self._write_timer is not None:
                    self._write_timer.cancel()
                    self._write_timer = None
                super().connection_lost(exc)

        return GuardedH11Protocol

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config's arguments for this guard's protocol."""
        return {"http": self.protocol_class(),
                "h11_max_incomplete_event_size": self.max_header_bytes}


def _header_count_limited(app: Any, limit: int) -> Any:
    """`app` behind a 431 for a request with more than `limit` headers (the request's
    headers are parsed by then, within the size limit; what is refused is every
    middleware's and route's linear walk over thousands of them)."""
    async def limited(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or len(scope["headers"]) <= limit:
            return await app(scope, receive, send)
        body = json.dumps(error_body(
            f"The request has {len(scope['headers'])} headers, more than the {limit} "
            f"this server accepts (--h11-max-header-count).", 431)).encode()
        await send({"type": "http.response.start", "status": 431,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
    return limited
