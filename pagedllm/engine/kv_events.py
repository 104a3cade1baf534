"""Publishing KV cache events over ZeroMQ, in vLLM's wire format.

Each engine step's events (core/kv_events.py) become one batch: a msgpack array
`[ts, [event, ...], data_parallel_rank]`, each event an array tagged with its kind,
`["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]`,
`["BlockRemoved", hashes, medium]`, `["AllBlocksCleared"]`, hashes as the low 64 bits of
the sha256 block hash (vLLM's integer block hashes). A batch goes out on a PUB socket as
three frames: the topic, its sequence number (8 bytes, big-endian) and the payload. A
consumer that missed some (ZeroMQ drops for a subscriber past the high-water mark, or
one that joined late) asks the replay socket for the batches from a sequence number on.
The medium is "GPU", vLLM's name for the engine's own KV pool, whatever the device: a
router reads it as "the engine's cache", not as hardware; the prefix cache's host tier
(kv_offloading_size) reports its blocks as "CPU", as vLLM's offloading does.

The engine's thread encodes and sends each batch itself (microseconds; a PUB socket
never waits: ZeroMQ drops for a subscriber past the high-water mark). A publishing
thread woken every step cost batch64 12-15% on a 2-core machine, where any extra
runnable thread takes a core from the engine's compute threads; only replays have a
thread, asleep in ZeroMQ until a request comes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from pagedllm.config import KVEventsConfig
from pagedllm.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                     KVCacheEvent)
from pagedllm.errors import ConfigError

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class WireEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event as it goes on the wire (an array whose first item is the class name)."""


class WireBlockStored(WireEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class WireBlockRemoved(WireEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class WireAllBlocksCleared(WireEvent, tag="AllBlocksCleared"):
    pass


class WireEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes) -> int:
    """The integer consumers see: the digest's last 8 bytes, big-endian (vLLM's)."""
    return int.from_bytes(block_hash[-8:], "big")


def to_wire(event: KVCacheEvent) -> WireEvent:
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return WireBlockStored(
            block_hashes=[external_hash(h) for h in event.block_hashes],
            parent_block_hash=external_hash(parent) if parent is not None else None,
            token_ids=list(event.token_ids), block_size=event.block_size,
            lora_id=event.lora_id, medium=event.medium, lora_name=event.lora_name)
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(block_hashes=[external_hash(h) for h in event.block_hashes],
                                medium=event.medium)
    assert isinstance(event, AllBlocksCleared), event
    return WireAllBlocksCleared()


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Replica `rank`'s endpoint: the port + rank (tcp) or a '_dp{rank}' suffix."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + rank}"
    raise ConfigError(f"kv_events_config endpoint {endpoint!r}: data parallel replicas "
                      f"need a tcp://host:port, ipc:// or inproc:// endpoint")


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport is bound, else connected."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class ZmqEventPublisher:
    """A PUB socket the engine's thread sends on, and a ROUTER for replays that a thread
    of its own serves (ZeroMQ sockets are not thread-safe: one owner each)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.rank = data_parallel_rank
        self.topic = config.topic.encode()
        self.num_dropped = 0
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()  # the buffer, between publish and replays
        endpoint = rank_endpoint(config.endpoint, self.rank)  # refused before any socket
        replay_endpoint = rank_endpoint(config.replay_endpoint, self.rank)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        replay = None
        try:
            self._pub.set_hwm(config.hwm)
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            for sock in (self._pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._ctx.term()
            raise ConfigError(f"kv_events_config: cannot open {endpoint!r} / "
                              f"{replay_endpoint!r}: {e}") from e
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._thread = None
        if replay is not None:
            # Blocked in ZeroMQ (the GIL released) until a request comes: no wake-ups
            # that would take a core from the engine's threads.
            self._thread = threading.Thread(target=self._serve_replays, args=(replay,),
                                            name="kv-events-replay", daemon=True)
            self._thread.start()
        logger.info("KV cache events published on %s%s", endpoint,
                    f" (replays on {replay_endpoint})" if replay_endpoint else "")

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send one step's events (a few microseconds: encoding them, and a send that
        never waits: past the high-water mark ZeroMQ drops for that subscriber)."""
        batch = WireEventBatch(ts=time.time(), events=[to_wire(e) for e in events],
                               data_parallel_rank=self.rank)
        payload = self._encoder.encode(batch)
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.num_dropped += 1
            if self.num_dropped & (self.num_dropped - 1) == 0:  # 1, 2, 4, 8, ...
                logger.warning("KV event batch %d not sent (%s); %d so far", seq, e,
                               self.num_dropped)
        with self._lock:
            self._buffer.append((seq, payload))

    def _serve_replays(self, replay: zmq.Socket) -> None:
        try:
            while True:
                self._serve_replay(replay, replay.recv_multipart())
        except zmq.ContextTerminated:
            pass
        finally:
            replay.close(linger=0)

    def _serve_replay(self, replay: zmq.Socket, frames: list[bytes]) -> None:
        """Answer one replay request: the buffered batches from its start on, then the
        end marker."""
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("malformed KV event replay request (%d frames) ignored",
                           len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
        for seq, payload in batches:
            replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def shutdown(self) -> None:
        """Close the sockets (terminating the context ends the replay thread's wait)."""
        self._pub.close(linger=0)
        self._ctx.term()
        if self._thread is not None:
            self._thread.join(2.0)


class NullEventPublisher:
    """Events recorded and dropped (publisher "null")."""

    def publish(self, events: list[KVCacheEvent]) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_publisher(config: KVEventsConfig, data_parallel_rank: int) -> Any:
    if config.publisher == "zmq":
        return ZmqEventPublisher(config, data_parallel_rank)
    return NullEventPublisher()
