"""The fleet-wide KV event stream: every tier's holdings, as the controller's index learns them, in vLLM's KV
event wire format (shared/wire/kv_events.py) on a ZMQ PUB socket, with a ROUTER socket for replay.

Off unless `--kv-events-port` is given. It watches the HolderIndex (`IndexWatcher`): every change the
controller applies (an admission batch, a full sync, an eviction, a clear, a forgotten producer) is published,
on the event loop, right after it is made, so a subscriber that applies the events in order holds what the index
holds, holder by holder:

  * one ZMQ topic per holder, `kv@<holder>@<model>`: the holder is the producer id (an engine worker, one rank of
    one instance, for its CPU tier; a store's id for a disk or remote store, Redis included), the model the
    engine's registered model ("" for a store: it holds chunks of every model that uses it); both
    percent-encoded (`topic_part`: an engine worker's id `<instance>@<tag>` is `<instance>%40<tag>`), so the
    topic has exactly three "@"-separated parts, as llm-d's indexer expects of the `kv@<pod>@<model>` topics it
    configures vLLM's publisher with (it splits on "@");
  * `BlockStored` / `BlockRemoved` with `medium` the holder's location name, as /lookup names it
    (LocalCPUBackend, LocalDiskBackend, RemoteBackend); `block_hashes` the chunk keys (rank shard keys) as
    `external_hash` gives them, the same hashes the engine's in-vLLM CPU-tier events carry;
  * a chunk the controller has a description of (`Descriptions`: an engine worker's admission of a chunk it
    saved carries its parent key, token ids, LoRA name and extras digests, engines with
    `describe_admissions`) is one BlockStored as the engine's own events give it: [its hash], its parent's hash,
    its token ids, `block_size` the describing engine's chunk_size, `lora_name` and `extra_keys`. A store's
    admissions carry keys only, so a store's BlockStored is described from what an engine's admission of the
    same key told the controller before (the write-behind follows the CPU tier's admission), if the
    description is still remembered (`--kv-events-chunks`);
  * other chunks are batched: the hashes of one such BlockStored are a set, not a chain, `parent_block_hash` is
    None and `token_ids` is empty (never invented); `block_size` the engine's chunk_size, 0 for a store;
  * `AllBlocksCleared` on a holder's topic when the index drops everything that holder held (a /clear of it, a
    producer forgotten after --producer-expiry-secs, an id changing role): that holder's medium is empty.

Sequence numbers and replay follow vLLM's ZmqEventPublisher: each message is [topic, seq (8-byte big-endian),
payload], seq counting from 0 over the whole stream (all topics); a replay client sends [start seq (8 bytes)]
to the ROUTER socket (from a DEALER, or a REQ-style [b"", seq]) and gets every buffered message with seq >= start
as [b"", topic, seq, payload], then [b"", b"", -1 (8 bytes, signed), b""]. The buffer keeps the last
`--kv-events-buffer` messages, each of at most MAX_HASHES_PER_MESSAGE hashes. A restarted controller counts
from 0 again and republishes every holding as producers full-sync to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvmesh.services.controller.producer_records import Producer
from kvmesh.services.controller.producers import ProducerTable
from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, ChunkDescription,
                                          KVEventBatch, external_hash, parse_description, use_int_block_hashes)

log = logging.getLogger(__name__)

MAX_HASHES_PER_MESSAGE = 1024  # ~9 KiB a message: a full sync of a million keys is ~1000 messages
END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUB_HWM = 100_000  # messages queued per slow subscriber before ZMQ drops theirs (never blocks the loop)
# described BlockStored events share a message up to this many token ids (~10 KiB of msgpack: a message in the
# replay buffer stays about the size of a hashes-only one; one chunk of more tokens is a message of its own)
DESCRIBED_TOKENS_PER_MESSAGE = 2048
MAX_DESCRIBED_TOKENS = 1 << 16  # a description's token ids, whatever chunk_size an engine registered


class Descriptions:
    """Chunk key -> (its description, the describing engine's chunk_size): the last `capacity` described
    admissions, least recently described first out. Descriptions are untrusted input: one that is malformed,
    over the bounds, of a key its batch did not admit, or from anything but an engine worker is refused (counted).
    The controller cannot check token ids against a key (it does not know the key's other inputs): an engine
    that lies about a chunk it admitted misleads routers about that chunk, as its own in-vLLM events could."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map: OrderedDict[bytes, tuple[ChunkDescription, int]] = OrderedDict()
        self.refused = 0

    def __len__(self) -> int:
        return len(self._map)

    def get(self, key: bytes) -> tuple[ChunkDescription, int] | None:
        return self._map.get(key)

    def learn(self, producer: Producer, items: list[list[Any]], admitted: list[ChunkKey]) -> None:
        """Take a batch's descriptions (before its keys are indexed: they stay until its events are out, one
        NATS message's worth past `capacity` at most)."""
        self.trim()
        engine = producer.engine
        if engine is None or self.capacity <= 0:
            self.refused += len(items)
            return
        max_tokens = min(engine.chunk_size, MAX_DESCRIBED_TOKENS)
        admitted_keys = set(admitted)
        taken = 0
        for item in items[:len(admitted)]:  # at most one per admitted key
            parsed = parse_description(item, max_tokens)
            if parsed is None or parsed[0] not in admitted_keys:
                continue
            key, description = parsed
            self._map[key] = (description, engine.chunk_size)
            self._map.move_to_end(key)
            taken += 1
        self.refused += len(items) - taken

    def trim(self) -> None:
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)


def topic_part(name: str) -> str:
    """`name` with no "@": "%" -> "%25", then "@" -> "%40" (percent-encoding: urllib.parse.unquote reverses it
    exactly), so a topic is always three "@"-separated parts, as llm-d's indexer splits `kv@<pod>@<model>`."""
    return name.replace("%", "%25").replace("@", "%40")


def topic_of(holder: str, model: str) -> bytes:
    return f"kv@{topic_part(holder)}@{topic_part(model)}".encode()


class KVEventStream:
    """Publishes the index's changes. `start()` binds (before the feed ingests anything), `stop()` closes."""

    def __init__(self, table: ProducerTable, host: str, port: int, replay_port: int | None,
                 buffer_messages: int, described_chunks: int = 0) -> None:
        self.table = table
        self.descriptions = Descriptions(described_chunks)
        self.host, self.port, self.replay_port = host, port, replay_port
        self.as_int = use_int_block_hashes()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_messages)  # (seq, topic, payload)
        self._next_seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replayer: asyncio.Task[None] | None = None
        self.messages_published = 0
        self.hashes_published = 0
        self.replays_served = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://{_uri_host(self.host)}:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://{_uri_host(self.host)}:{self.replay_port}"

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = zmq.Socket(self._ctx, zmq.PUB)  # a plain socket: its sends are immediate, never awaited
        self._pub.set_hwm(PUB_HWM)
        self.port = _bind(self._pub, self.host, self.port)
        if self.replay_port is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_port = _bind(self._replay, self.host, self.replay_port)
            self._replayer = asyncio.create_task(self._serve_replays(), name="kv-events-replay")
        self.table.index.watcher = self
        self.table.on_described = self.descriptions.learn
        log.info("KV event stream on %s (replay: %s, %d messages kept)", self.endpoint,
                 self.replay_endpoint or "off", self._buffer.maxlen)

    async def stop(self) -> None:
        if self.table.index.watcher is self:
            self.table.index.watcher = None
        if self.table.on_described == self.descriptions.learn:
            self.table.on_described = None
        await cancel_and_wait([self._replayer])
        self._replayer = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- IndexWatcher ------------------------------------------------------------------------------------

    def changed(self, slot: int, stored: list[ChunkKey], removed: list[ChunkKey]) -> None:
        holder = self.table.holder_of(slot)
        if holder is None or self._pub is None:
            return
        engine = holder.engine
        topic = topic_of(holder.producer_id, engine.model if engine is not None else "")
        medium = holder.location
        block_size = engine.chunk_size if engine is not None else 0
        described: list[BlockStored] = []
        described_tokens = 0
        plain: list[ChunkKey] = []
        for key in stored:  # in admission order: a described chunk's parent comes before it
            known = self.descriptions.get(key) if len(self.descriptions) else None
            if known is None:
                if described:
                    self._publish_events(topic, described)
                    described, described_tokens = [], 0
                plain.append(key)
                continue
            if plain:
                self._publish_plain(topic, plain, True, medium, block_size)
                plain = []
            event = self._described_event(key, *known, medium)
            if described and described_tokens + len(event.token_ids) > DESCRIBED_TOKENS_PER_MESSAGE:
                self._publish_events(topic, described)
                described, described_tokens = [], 0
            described.append(event)
            described_tokens += len(event.token_ids)
        if described:
            self._publish_events(topic, described)
        self._publish_plain(topic, plain, True, medium, block_size)
        self._publish_plain(topic, removed, False, medium, block_size)
        self.descriptions.trim()

    def _publish_plain(self, topic: bytes, keys: list[ChunkKey], stored: bool, medium: str, block_size: int
                       ) -> None:
        """Keys in events of at most MAX_HASHES_PER_MESSAGE hashes each, with no parent or tokens."""
        for start in range(0, len(keys), MAX_HASHES_PER_MESSAGE):
            hashes = [external_hash(key, self.as_int) for key in keys[start:start + MAX_HASHES_PER_MESSAGE]]
            event = (BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                 block_size=block_size, lora_id=None, medium=medium, lora_name=None)
                     if stored else BlockRemoved(block_hashes=hashes, medium=medium))
            self._publish(topic, event)

    def _described_event(self, key: ChunkKey, description: ChunkDescription, chunk_size: int,
                         medium: str) -> BlockStored:
        parent = description.parent
        return BlockStored(
            block_hashes=[external_hash(key, self.as_int)],
            parent_block_hash=external_hash(parent, self.as_int) if parent is not None else None,
            token_ids=description.tokens(), block_size=chunk_size, lora_id=None, medium=medium,
            lora_name=description.lora_name,
            extra_keys=[description.extra_keys] if description.extra_keys is not None else None)

    def cleared(self, slot: int) -> None:
        holder = self.table.holder_of(slot)
        if holder is None or self._pub is None:
            return
        engine = holder.engine
        self._publish(topic_of(holder.producer_id, engine.model if engine is not None else ""), AllBlocksCleared())

    # ----------------------------------------------------------------------------------------------------

    def _publish(self, topic: bytes, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self._publish_events(topic, [event])

    def _publish_events(self, topic: bytes, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        assert self._pub is not None
        seq = self._next_seq
        self._next_seq += 1
        self.hashes_published += sum(len(event.block_hashes) for event in events
                                     if not isinstance(event, AllBlocksCleared))
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=list(events)))
        try:
            # PUB never blocks: at a subscriber's high-water mark ZMQ drops that subscriber's messages (it
            # sees a gap in seq and replays)
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        self._buffer.append((seq, topic, payload))
        self.messages_published += 1

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            client, request = frames[0], [frame for frame in frames[1:] if frame]
            if len(request) != 1 or len(request[0]) != 8:
                log.debug("KV event stream: a malformed replay request (%d frames) ignored", len(frames))
                continue
            start = int.from_bytes(request[0], "big")
            self.replays_served += 1
            try:
                for seq, topic, payload in list(self._buffer):  # a snapshot: publishing goes on meanwhile
                    if seq >= start:
                        await self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
                await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as exc:  # that client's loss; the next one is served
                log.warning("KV event stream: a replay from seq %d failed: %s", start, exc)


def _uri_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind `host`:`port` (0: a free port); the port bound."""
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{_uri_host(host)}")
    sock.bind(f"tcp://{_uri_host(host)}:{port}")
    return port
