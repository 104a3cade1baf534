"""KV cache events (kv_events_config; core/kv_events.py, engine/kv_events.py).

A consumer that applies the published events in order must hold exactly the engine's
set of cached block hashes, through evictions and resets; every stored block's tokens
must hash to its hash; the replay socket must resend what a subscriber missed. The
payloads are decoded here with msgspec structs written from vLLM's documented format (as
a router would), not with the engine's own classes. The server's flag:
tests/entrypoints/test_server_options.py (test_reset_prefix_cache)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_hash import hash_block_tokens
from pagedllm.engine.kv_events import rank_endpoint
from pagedllm.errors import ConfigError
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256
BLOCK = 4


class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(Batch)


def low64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_kv_events"),
                           tiny_llama_config(vocab_size=VOCAB), seed=11)


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv_sockets")
    return f"ipc://{d}/pub", f"ipc://{d}/replay"


@pytest.fixture(scope="module")
def llm(tiny_path, endpoints):
    # 24 usable blocks of 4 tokens: the rounds below evict.
    return LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
               block_size=BLOCK, num_kv_blocks=25, max_model_len=64,
               kv_events_config={"enable_kv_cache_events": True, "topic": "kv",
                                 "endpoint": endpoints[0],
                                 "replay_endpoint": endpoints[1], "buffer_steps": 100_000})


def replay(endpoint: str, start: int) -> list[tuple[int, Batch]]:
    """Ask the replay socket for the batches from `start` on."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(10_000), "no replay answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return out
            out.append((seq, DECODE.decode(payload)))
    finally:
        sock.close(linger=0)


def cached_hashes(llm) -> set[int]:
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    return {low64(h) for h in pool.cached_block_hash_to_block if len(h) == 32}


def receive(sub, quiet_s: float = 1.0) -> list[tuple[int, Batch]]:
    """Everything the subscriber gets until nothing comes for `quiet_s`."""
    out = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    return out


def test_events_rebuild_the_cache_and_hash_their_tokens(llm, endpoints):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoints[0])
    time.sleep(0.3)  # the subscription reaches the PUB socket
    shared = random_prompts(1, VOCAB, 13, 13, seed=1)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for round_ in range(4):  # more K/V than the cache holds: blocks are evicted
        tails = random_prompts(4, VOCAB, 2, 15, seed=round_ + 2)
        llm.generate([{"prompt_token_ids": shared + t} for t in tails], params)
    batches = receive(sub)
    seqs = [s for s, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

    live: set[int] = set()
    tokens_of: dict[int, tuple[int | None, list[int]]] = {}
    stored = removed = 0
    for _, batch in batches:
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size == BLOCK and event.medium == "GPU"
                assert event.lora_id is None and event.lora_name is None
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                parent = event.parent_block_hash
                assert parent is None or parent in live  # the request holds its parent
                for i, h in enumerate(event.block_hashes):
                    assert h not in live
                    live.add(h)
                    tokens_of[h] = (parent, event.token_ids[i * BLOCK:(i + 1) * BLOCK])
                    parent = h
                    stored += 1
            else:
                assert isinstance(event, BlockRemoved), event
                for h in event.block_hashes:
                    live.remove(h)
                    removed += 1
    assert stored > 24 and removed > 0  # evictions happened
    assert live == cached_hashes(llm)

    assert llm.llm_engine.engine_core.reset_prefix_cache()
    (_, cleared), = receive(sub)
    assert cleared.events == [AllBlocksCleared()] and cached_hashes(llm) == set()
    sub.close(linger=0)

    # Every block's tokens hash to its hash along the announced chain (no extra keys
    # here: no LoRA, images or generated tokens from other kernels in this model).
    full: dict[int, bytes] = {}
    for h, (parent, toks) in tokens_of.items():
        chain = [(h, toks)]
        while parent is not None:
            chain.append((parent, tokens_of[parent][1]))
            parent = tokens_of[parent][0]
        digest = None
        for _, t in reversed(chain):
            digest = hash_block_tokens(digest, t)
        assert low64(digest) == h
        full[h] = digest
    assert len(full) == stored


def test_consumer_state_equals_the_cache_midway(llm, endpoints):
    """Replayed from a sequence number on, the events since a reset give the cache."""
    assert llm.llm_engine.engine_core.reset_prefix_cache()
    start = replay(endpoints[1], 0)[-1][0]  # the reset's batch
    prompts = random_prompts(6, VOCAB, 5, 30, seed=9)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    batches = replay(endpoints[1], start)
    assert [s for s, _ in batches] == list(range(start, start + len(batches)))
    assert isinstance(batches[0][1].events[-1], AllBlocksCleared)
    live: set[int] = set()
    for _, batch in batches[1:]:
        for event in batch.events:
            if isinstance(event, BlockStored):
                live.update(event.block_hashes)
            else:
                live.difference_update(event.block_hashes)
    assert live and live == cached_hashes(llm)


def test_the_host_tier_reports_its_blocks_as_cpu(tiny_path, tmp_path):
    """kv_offloading_size: the tier's saves and recycled slots are events of medium
    "CPU" (vLLM's offloading), so a consumer holds both tiers' hashes apart; a reset
    with reset_external clears both."""
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK,
              num_kv_blocks=25, max_model_len=64, kv_offloading_size=4e-6,
              kv_events_config={"enable_kv_cache_events": True, "topic": "kv",
                                "endpoint": f"ipc://{tmp_path}/pub"})
    tier = llm.llm_engine.engine_core.scheduler.kv_store
    assert tier.num_slots < 30  # (a few blocks' worth: slots are recycled)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"ipc://{tmp_path}/pub")
    time.sleep(0.3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for seed in range(3):
        llm.generate([{"prompt_token_ids": p} for p in random_prompts(4, VOCAB, 5, 20,
                                                                       seed=seed)], params)
    live: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for _, batch in receive(sub):
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert not live[event.medium] & set(event.block_hashes)
                live[event.medium].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= live[event.medium]
                live[event.medium].difference_update(event.block_hashes)
    assert tier.num_evicted > 0
    assert live["CPU"] == {low64(h) for h in tier.slots}
    assert live["GPU"] == cached_hashes(llm)
    assert llm.llm_engine.engine_core.reset_prefix_cache(reset_external=True)
    events = [e for _, b in receive(sub) for e in b.events]
    assert events == [AllBlocksCleared(), AllBlocksCleared()]
    sub.close(linger=0)


def test_replay_ignores_malformed_requests(llm, endpoints):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoints[1])
    sock.send_multipart([b"", b"short"])  # not 8 bytes: ignored
    sock.send_multipart([b"", b"x", b"y"])  # 4 frames at the router: ignored
    sock.close(linger=0)
    batches = replay(endpoints[1], 1 << 40)  # nothing that late: only the end marker
    assert batches == []
    assert replay(endpoints[1], 0)


def test_config(tiny_path, tmp_path):
    base = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ConfigError, match="unknown kv_events_config keys"):
        LLM(str(tiny_path), kv_events_config={"enable_kv_cache_events": True, "port": 1},
            **base)
    with pytest.raises(ConfigError, match="need enable_prefix_caching"):
        LLM(str(tiny_path), kv_events_config={"enable_kv_cache_events": True},
            enable_prefix_caching=False, **base)
    with pytest.raises(ConfigError, match="publisher must be one of"):
        LLM(str(tiny_path), kv_events_config={"enable_kv_cache_events": True,
                                              "publisher": "kafka"}, **base)
    with pytest.raises(ConfigError, match="hwm must be an integer"):
        LLM(str(tiny_path), kv_events_config={"enable_kv_cache_events": True,
                                              "hwm": 0}, **base)
    # Not enabled: nothing is recorded.
    off = LLM(str(tiny_path), kv_events_config={"endpoint": "tcp://*:1"}, **base)
    assert off.llm_engine.engine_core.scheduler.kv_cache_manager.events is None
    # An endpoint taken by another socket is the engine's start-up error.
    port_holder = zmq.Context.instance().socket(zmq.PUB)
    port = port_holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match="kv_events_config: cannot open"):
            LLM(str(tiny_path), kv_events_config={
                "enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}, **base)
    finally:
        port_holder.close(linger=0)
    # publisher "null": recorded and dropped, no socket.
    null = LLM(str(tiny_path), kv_events_config={"enable_kv_cache_events": True,
                                                 "publisher": "null"}, **base)
    null.generate([{"prompt_token_ids": list(range(40))}],
                  SamplingParams(max_tokens=2, temperature=0))
    assert null.llm_engine.engine_core.scheduler.kv_cache_manager.events == []


def test_rank_endpoint():
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert rank_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert rank_endpoint(None, 3) is None
    with pytest.raises(ConfigError, match="data parallel replicas"):
        rank_endpoint("tcp://*", 1)
