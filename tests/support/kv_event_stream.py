"""A subscriber of the controller's KV event stream, as a router would write one with vLLM's own classes: a ZMQ
SUB socket on every topic, vLLM's `KVEventBatch` msgpack decoder, and replays (a DEALER on the ROUTER socket) to
fill a gap in the sequence numbers or to catch up after joining late. `holdings` is what the events alone say:
(holder, medium) -> block hashes; `blocks` what the BlockStored events that describe a block (its parent, token
ids...) said of it last, by (holder, hash)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from typing import AsyncIterator
from urllib.parse import unquote

import msgspec
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END_SEQ = -1
IDLE_REPLAY_S = 1.0  # a subscriber that hears nothing this long asks for a replay from where it is


class StreamSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay = self._ctx.socket(zmq.DEALER)
        self._replay.connect(replay_endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.next_seq = 0
        self.holdings: dict[tuple[str, str], set[int | bytes]] = defaultdict(set)
        self.blocks: dict[tuple[str, int | bytes], BlockStored] = {}
        self.cleared: list[str] = []  # holders an AllBlocksCleared named, in order
        self.media: dict[str, set[str]] = defaultdict(set)  # holder -> media its events named
        self.models: dict[str, str] = {}  # holder -> the model its topic names
        self.topics: set[bytes] = set()  # as published
        self.replays = 0
        self.received = 0

    def view(self) -> dict[tuple[str, str], set[int | bytes]]:
        return {where: set(hashes) for where, hashes in self.holdings.items() if hashes}

    async def replay(self) -> None:
        """Ask for every buffered message from `next_seq` on and apply them."""
        self.replays += 1
        await self._replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            _, topic, seq_bytes, payload = await self._replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                return
            if seq >= self.next_seq:
                self._apply(topic, seq, payload)

    async def run(self) -> None:
        while True:
            try:
                topic, seq_bytes, payload = await asyncio.wait_for(self._sub.recv_multipart(), IDLE_REPLAY_S)
            except asyncio.TimeoutError:
                # Quiet: what was published before this SUB's subscription reached the publisher (ZMQ's slow
                # joiner) is only in the replay buffer, and nothing later reveals the gap
                await self.replay()
                continue
            self.received += 1
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:  # missed some (joined late, or dropped): the replay socket has them
                await self.replay()
            if seq == self.next_seq:
                self._apply(topic, seq, payload)

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, (seq, self.next_seq)
        self.next_seq = seq + 1
        # as llm-d's indexer splits vLLM's topics: exactly three parts, holder and model percent-encoded
        kind, holder, model = (unquote(part, errors="strict") for part in topic.decode().split("@"))
        assert kind == "kv", topic
        self.topics.add(topic)
        self.models[holder] = model
        batch = self._decoder.decode(payload)
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.token_ids:  # a described block: one per event, as the engine's own events give it
                    assert len(event.block_hashes) == 1 and len(event.token_ids) <= event.block_size, event
                    self.blocks[(holder, event.block_hashes[0])] = event
                else:  # a set of blocks nothing more is known of
                    assert event.parent_block_hash is None and event.lora_name is None, event
                    assert event.extra_keys is None, event
                self.media[holder].add(str(event.medium))
                self.holdings[(holder, str(event.medium))].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.media[holder].add(str(event.medium))
                self.holdings[(holder, str(event.medium))].difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared), event
                self.cleared.append(holder)
                for where in [where for where in self.holdings if where[0] == holder]:
                    self.holdings[where].clear()

    def close(self) -> None:
        self._sub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()


@contextlib.asynccontextmanager
async def subscribed(endpoint: str, replay_endpoint: str, replay_first: bool = False
                     ) -> AsyncIterator[StreamSubscriber]:
    """A subscriber reading in a task; `replay_first`: it catches up from seq 0 at once (a late joiner)."""
    subscriber = StreamSubscriber(endpoint, replay_endpoint)
    if replay_first:
        await subscriber.replay()
    task = asyncio.create_task(subscriber.run())
    try:
        yield subscriber
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        subscriber.close()
