"""The disk store as a NATS service: one process per host, one asyncio event loop (plus DiskStore's threads).

Subjects (`Subjects.store(store_id, op)`), request -> reply:
    put       PutRequest  -> Ack            accepted once the bytes are staged (see writer.py); ok=False + reason
    get       GetRequest  -> GetReply       bytes into the requester's shared memory, or inline `data`
    contains  ChunkKeys   -> ContainsReply  how many leading keys are held (complete files)
    prefetch  ChunkKeys   -> ContainsReply  warms the page cache for the held prefix
    remove    ChunkKeys   -> CommandReply   num_tokens / num_chunks removed
    clear     ClearRequest-> CommandReply   every unpinned chunk; num_tokens cleared
    pin/unpin ChunkKeys   -> CommandReply   contiguous prefix; num_tokens affected (ttl_secs optional)
    stats     StatsRequest-> StatsReply
Also: health (`serve_health(service="disk_store")`), and admission/eviction batches plus full syncs on
`Subjects.events(store_id)` through AdmissionReporter (location LocalDiskBackend, producer_id = store_id).
Gets are handled up to `reader_threads` at a time; every other op one request at a time, in arrival order.
The slow parts (copies, file I/O) run on DiskStore's threads so other ops and health keep answering meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from kvmesh.shared import bus, protocol
from kvmesh.shared.admissions import AdmissionReporter
from kvmesh.shared.service import serve_health
from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.store import INLINE_HEADROOM, DiskStore
from kvmesh.services.disk_store.writer import WriteFaults

log = logging.getLogger(__name__)


class DiskStoreService:
    """A DiskStore wired to NATS. `start()` opens the directory and subscribes; `stop()` undoes both."""

    def __init__(self, options: DiskStoreOptions, faults: WriteFaults | None = None,
                 heartbeat_interval: float = 2.0) -> None:
        self.options = options
        self.store = DiskStore(options, faults)
        self.nc: NatsClient | None = None
        self.reporter: AdmissionReporter | None = None
        self._subscriptions: list[Subscription] = []
        self._heartbeat_interval = heartbeat_interval
        self._own_nc = False

    async def start(self, nc: NatsClient | None = None) -> None:
        store, store_id = self.store, self.options.store_id
        await asyncio.get_running_loop().run_in_executor(None, store.open)
        if nc is None:
            nc = await bus.connect(self.options.nats_url, name=f"disk_store:{store_id}")
            self._own_nc = True
        self.nc = nc
        store.max_inline_bytes = max(0, nc.max_payload - INLINE_HEADROOM)
        self.reporter = AdmissionReporter(store_id, protocol.LOCAL_DISK, held_keys=store.index.keys,
                                          register=self._registration, heartbeat_interval=self._heartbeat_interval)
        store.on_admit, store.on_evict = self.reporter.admit, self.reporter.evict
        handlers: list[tuple[str, type, Any]] = [
            ("put", protocol.PutRequest, store.put), ("get", protocol.GetRequest, store.get),
            ("contains", protocol.ChunkKeys, store.contains), ("prefetch", protocol.ChunkKeys, store.prefetch),
            ("remove", protocol.ChunkKeys, store.remove), ("clear", protocol.ClearRequest, store.clear),
            ("pin", protocol.ChunkKeys, store.pin), ("unpin", protocol.ChunkKeys, store.unpin),
            ("stats", protocol.StatsRequest, store.stats),
        ]
        for op, request_type, handler in handlers:
            # Gets run concurrently (one per I/O thread), so engines sharing the store do not queue behind one
            # slow read; every other op is handled in arrival order.
            concurrency = self.options.reader_threads if op == "get" else 1
            self._subscriptions.append(await bus.serve(nc, protocol.Subjects.store(store_id, op), request_type,
                                                       handler, max_concurrent=concurrency))
        await self.reporter.start(nc)
        await serve_health(nc, "disk_store", store_id, details=store.details)
        log.info("disk store %s serving %s on %s", store_id, self.options.root, self.options.nats_url)

    def _registration(self) -> protocol.RegisterStore:
        return protocol.RegisterStore(store_id=self.options.store_id, location=protocol.LOCAL_DISK,
                                      capacity_bytes=self.options.capacity_bytes, started_at=self.store.started_at)

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            try:
                await subscription.unsubscribe()
            except Exception as exc:
                log.debug("unsubscribe failed: %s", exc)
        self._subscriptions = []
        await self.store.close()
        if self.reporter is not None:
            await self.reporter.stop()
        if self.nc is not None and self._own_nc:
            try:
                await self.nc.drain()
            except Exception as exc:
                log.debug("NATS drain failed: %s", exc)
        log.info("disk store %s stopped", self.options.store_id)


async def run_disk_store(options: DiskStoreOptions, stop: asyncio.Event) -> None:
    """Serve until `stop` is set (the body given to shared.service.run_until_signalled)."""
    service = DiskStoreService(options)
    await service.start()
    try:
        await stop.wait()
    finally:
        await service.stop()
