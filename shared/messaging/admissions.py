"""Admission/eviction reporting to the controller: one implementation for the CPU tier, disk and remote stores.

A producer (engine worker or store) records `admit(key)` / `evict(key)` as its index changes. `AdmissionReporter`
flushes them as `AdmissionBatch` messages on the producer's events subject, numbered 1, 2, 3, ... so the
controller sees a gap when one is lost. An engine may `describe` a chunk before admitting it (its parent, token
ids and extras digests, shared/wire/kv_events.py): the admission's batch then carries the description, for the
controller's KV event stream; batches with descriptions are cut to stay well under NATS's max_payload. It answers `SyncRequest` (and a controller's hello) by publishing its
registration and every held key as `SyncChunk` parts, stamped with the sequence number they reflect. Calls to
admit/evict are cheap and thread-safe; the NATS work happens on the reporter's event loop.

Anyone on the bus can ask for a sync (a 59-byte hello costs every producer a full sync), so asks are coalesced:
at most one announcement runs and at most one more is queued, whatever the number of asks, and two start at
least `min_sync_interval` seconds apart. An ask inside the interval is served when it ends, never dropped: a
controller that really restarted still gets its sync.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from typing import Callable, Iterable

from nats.aio.client import Client as NatsClient

from kvmesh.shared import protocol
from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.messaging import bus
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.kv_events import ChunkDescription, description_item

log = logging.getLogger(__name__)

SYNC_KEYS_PER_PART = 50_000  # 50k keys * ~18 bytes ~ 0.9 MiB: under NATS's default max_payload
MAX_KEYS_PER_BATCH = 20_000
DESCRIBED_BYTES_PER_BATCH = 256 * 1024  # descriptions' token ids per batch (a 256-token chunk's are 1 KiB)
MAX_DESCRIBED_KEYS = 16_384  # descriptions waiting for their chunk's admission (older ones are forgotten)


class AdmissionReporter:
    """Batches admission/eviction events of one (producer, location) and serves full syncs.

    `path` is the producer's path (`Principal.producer(producer_id)`): every subject it publishes on ends in it.
    `held_keys` returns a snapshot of every key currently held; it is called on sync requests.
    `register` publishes the producer's registration message (sent on start and on controller hello).
    """

    def __init__(self, producer_id: str, path: str, location: str, held_keys: Callable[[], Iterable[ChunkKey]],
                 register: Callable[[], object], flush_interval: float = 0.05,
                 heartbeat_interval: float = 2.0, min_sync_interval: float = 1.0) -> None:
        self.producer_id = producer_id
        self.path = path
        self.location = location
        self._held_keys = held_keys
        self._registration = register
        self._flush_interval = flush_interval
        self._heartbeat_interval = heartbeat_interval
        self._min_sync_interval = min_sync_interval
        self._lock = threading.Lock()
        self._pending: list[tuple[bool, ChunkKey]] = []  # (admitted?, key) in order
        # key -> what its admission's batch carries; an insertion-ordered dict, oldest first
        self._descriptions: dict[ChunkKey, ChunkDescription] = {}
        self._seq = 0
        self._flush_lock = asyncio.Lock()
        self._nc: NatsClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._announce_wanted = False  # an ask arrived since the running (or last) announcement began
        self._announcer: asyncio.Task[None] | None = None
        self._last_announced = -math.inf  # monotonic time the last announcement began
        self.syncs_published = 0
        self.sync_asks = 0

    def admit(self, key: ChunkKey) -> None:
        with self._lock:
            self._pending.append((True, key))

    def evict(self, key: ChunkKey) -> None:
        with self._lock:
            self._pending.append((False, key))

    def describe(self, key: ChunkKey, description: ChunkDescription) -> None:
        """What `key`'s next admission's batch carries besides the key (noted before the admission)."""
        with self._lock:
            self._descriptions.pop(key, None)
            self._descriptions[key] = description
            if len(self._descriptions) > MAX_DESCRIBED_KEYS:
                del self._descriptions[next(iter(self._descriptions))]

    async def start(self, nc: NatsClient) -> None:
        """Subscribe to sync requests and controller hellos; register; start flushing and heartbeating."""
        self._nc = nc
        await bus.serve(nc, protocol.Subjects.sync(self.path), protocol.SyncRequest, self._on_sync_request)
        await bus.serve(nc, protocol.Subjects.CONTROLLER_HELLO, protocol.ControllerHello, self._on_hello)
        await self.announce()
        self._tasks = [asyncio.create_task(self._flush_loop()), asyncio.create_task(self._heartbeat_loop())]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks + ([self._announcer] if self._announcer is not None else []))
        self._tasks, self._announcer = [], None
        try:
            await self.flush()
        except Exception as exc:
            log.debug("%s: final flush failed: %s", self.producer_id, exc)

    async def flush(self) -> None:
        """Publish what is pending as one or more numbered batches."""
        async with self._flush_lock:
            await self._flush_unlocked()

    async def _flush_unlocked(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            described = {key: self._descriptions.pop(key) for admitted, key in pending
                         if admitted and key in self._descriptions} if self._descriptions else {}
        if not pending or self._nc is None:
            return
        for part in _parts(pending, described):
            # Within a batch only each key's last state matters (admit then evict = evicted).
            last_state: dict[ChunkKey, bool] = {}
            for admitted, key in part:
                last_state[key] = admitted
            self._seq += 1
            admitted_keys = [k for k, held in last_state.items() if held]
            batch = protocol.AdmissionBatch(
                producer_id=self.producer_id, location=self.location, seq=self._seq, admitted=admitted_keys,
                evicted=[k for k, held in last_state.items() if not held],
                described=[description_item(k, described[k]) for k in admitted_keys if k in described])
            await bus.publish(self._nc, protocol.Subjects.events(self.path), batch)

    async def publish_full_sync(self) -> None:
        """Every held key, in parts, stamped with the sequence number they reflect."""
        if self._nc is None:
            return
        async with self._flush_lock:
            await self._flush_unlocked()
            seq = self._seq
            keys = list(self._held_keys())
        sync_id = uuid.uuid4().hex
        parts = [keys[i:i + SYNC_KEYS_PER_PART] for i in range(0, len(keys), SYNC_KEYS_PER_PART)] or [[]]
        for index, part in enumerate(parts):
            await bus.publish(self._nc, protocol.Subjects.events(self.path), protocol.SyncChunk(
                producer_id=self.producer_id, location=self.location, sync_id=sync_id, seq=seq,
                part=index, final=index == len(parts) - 1, keys=part))
        self.syncs_published += 1
        log.info("%s: published a full sync of %d keys (%s)", self.producer_id, len(keys), self.location)

    async def announce(self) -> None:
        """Publish the registration (again: it changed, or a controller asked) and a full sync, now."""
        self._last_announced = time.monotonic()
        await bus.publish(self._nc, protocol.Subjects.register(self.path), self._registration())
        await self.publish_full_sync()

    @property
    def announcing(self) -> bool:
        """An announcement asked for is running or waiting for the interval to end."""
        return self._announcer is not None and not self._announcer.done()

    def announce_soon(self) -> None:
        """Announce once the minimum interval since the last one has passed; asks meanwhile are merged into it."""
        self.sync_asks += 1
        self._announce_wanted = True
        if self._announcer is None or self._announcer.done():
            self._announcer = asyncio.get_running_loop().create_task(self._announce_when_due())

    async def _announce_when_due(self) -> None:
        while self._announce_wanted:
            wait = self._last_announced + self._min_sync_interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # the rate limit: one full sync per interval at most
            self._announce_wanted = False  # asks from here on get the next announcement
            try:
                await self.announce()
            except Exception as exc:
                log.warning("%s: announcing to the controller failed: %s", self.producer_id, exc)

    async def _on_sync_request(self, request: protocol.SyncRequest) -> protocol.Ack:
        # With the registration: a controller that missed it (or never saw this producer) asks this way.
        log.debug("%s: controller asked for a full sync (%s)", self.producer_id, request.reason)
        self.announce_soon()
        return protocol.Ack()

    async def _on_hello(self, hello: protocol.ControllerHello) -> None:
        log.debug("%s: controller %s started; registering again", self.producer_id, hello.controller_id)
        self.announce_soon()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self._flush_interval)
            try:
                await self.flush()
            except Exception as exc:
                log.debug("%s: flush failed: %s", self.producer_id, exc)

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                assert self._nc is not None
                await bus.publish(self._nc, protocol.Subjects.heartbeat(self.path), protocol.Heartbeat(
                    producer_id=self.producer_id, last_seq=self._seq, time=time.time()))
            except Exception as exc:
                log.debug("%s: heartbeat failed: %s", self.producer_id, exc)
            await asyncio.sleep(self._heartbeat_interval)


def _parts(pending: list[tuple[bool, ChunkKey]], described: dict[ChunkKey, ChunkDescription]
           ) -> Iterable[list[tuple[bool, ChunkKey]]]:
    """`pending` cut into batches of at most MAX_KEYS_PER_BATCH keys and DESCRIBED_BYTES_PER_BATCH of
    descriptions' token ids."""
    if not described:
        for start in range(0, len(pending), MAX_KEYS_PER_BATCH):
            yield pending[start:start + MAX_KEYS_PER_BATCH]
        return
    part: list[tuple[bool, ChunkKey]] = []
    size = 0
    for event in pending:
        description = described.get(event[1]) if event[0] else None
        cost = len(description.token_ids) + 64 if description is not None else 0
        if part and (len(part) >= MAX_KEYS_PER_BATCH or size + cost > DESCRIBED_BYTES_PER_BATCH):
            yield part
            part, size = [], 0
        part.append(event)
        size += cost
    if part:
        yield part
