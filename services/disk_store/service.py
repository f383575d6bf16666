"""The disk store as a NATS service: one process per host, one asyncio event loop (plus DiskStore's threads).

Subjects `Subjects.store(store_id, op, caller)`, subscribed as `Subjects.store_op(store_id, op)`: the caller's
path ends the subject (`engine.<instance>.<worker>`, `operator`). Request -> reply:
    put       PutRequest  -> Ack            accepted once the bytes are staged (see writer.py), with
                                            --durable-puts once the file is durable; ok=False + reason;
                                            records the caller's claim (also on a chunk already held)
    get       GetRequest  -> GetReply       bytes into the pool the caller lent (shared/wire/pool_wire.py), or inline `data`;
                                            a pooled get past its deadline or cancelled writes nothing
    cancel_get CancelGet  -> Ack            ok once that get of the caller's pool can never write any more
                                            (its write is over, or it will be refused); see reader.py
    contains  ChunkKeys   -> ContainsReply  how many leading keys are held (complete files)
    touch     ChunkKeys   -> Ack            an engine's hits: these chunks count as just used
    remove    ChunkKeys   -> CommandReply   num_tokens / num_chunks removed, whoever put them
    clear     ClearRequest-> CommandReply   the caller's claims; forgets what nobody claims or pins any more;
                                            num_tokens / num_chunks: the chunks the caller no longer claims
    wipe      WipeRequest -> CommandReply   the operator only: every unpinned chunk; num_tokens wiped
    pin/unpin ChunkKeys   -> CommandReply   contiguous prefix; num_tokens affected (ttl_secs optional)
    stats     StatsRequest-> StatsReply
contains, touch, pin, unpin, remove, clear, wipe and stats are the shared IndexOps (shared/store_kit/store_ops.py), the
same as the remote store's; put is DiskStore's own, get and cancel_get its ChunkReader's (reader.py). Claims
and pins persist in the directory (files.py): pin, unpin, remove, clear and wipe are answered once the files
hold their effect. Also: health (`serve_health(service="disk_store")` on the store's path), and admission/eviction
batches plus full syncs on `Subjects.events(<store's path>)` through AdmissionReporter (location
LocalDiskBackend, producer_id = store_id).
Gets are handled up to `reader_threads` at a time, cancel_get up to CANCELS_AT_ONCE; pin, unpin, remove, clear
and wipe up to STATE_OPS_AT_ONCE (each applies its change at once, in arrival order, then waits for the shared
write of the state files); every other op one request at a time, in arrival order.
The slow parts (copies, file I/O) run on DiskStore's threads so other ops and health keep answering meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from nats.aio.client import Client as NatsClient

from kvmesh.shared import protocol

from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.store import DiskStore
from kvmesh.services.disk_store.writer import WriteFaults
from kvmesh.shared.eviction import Clock
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.admissions import AdmissionReporter
from kvmesh.shared.messaging.credentials import domains_map
from kvmesh.shared.store_kit.store_endpoint import StoreEndpoint
from kvmesh.shared.store_kit.store_ops import Handler, IndexOps

log = logging.getLogger(__name__)

CANCELS_AT_ONCE = 16  # cancel_get requests handled at once (each may wait for one get's write)


class DiskStoreService:
    """A DiskStore wired to NATS. `start()` opens the directory and subscribes; `stop()` undoes both."""

    def __init__(self, options: DiskStoreOptions, faults: WriteFaults | None = None,
                 heartbeat_interval: float = 2.0, clock: Clock = time.monotonic) -> None:
        self.options = options
        self.store = DiskStore(options, faults, clock)
        self.ops = IndexOps(options.store_id, self.store.index, free=self.store.free, details=self._details,
                            settle=self.store.settle, persist=self.store.state.save_now, bounds=options.bounds)
        self.endpoint = StoreEndpoint("disk_store", options.store_id, options.bounds.request_queue_bytes,
                                      max_lanes=options.bounds.max_lanes)
        self._heartbeat_interval = heartbeat_interval
        self._follow: Callable[[], Awaitable[None]] | None = None  # moves the pool socket when the server changes

    @property
    def nc(self) -> NatsClient | None:
        return self.endpoint.nc

    async def start(self, nc: NatsClient | None = None) -> None:
        store, options = self.store, self.options
        nc = await self.endpoint.connect(nc, options.nats_url, options.auth)
        # after connecting (a KVMesh-started NATS provisions the store's credentials, beside which the map is),
        # before opening: the map tells whether a chunk the claims file does not name can be kept
        store.domains = self.ops.domains = domains_map(
            options.domains_file, options.nats_url, protocol.Principal.store(options.store_id).path)
        await asyncio.get_running_loop().run_in_executor(None, store.open)
        store.start_snapshots()
        store.reader.max_inline_bytes = max(0, nc.max_payload - protocol.INLINE_HEADROOM)
        reporter = AdmissionReporter(options.store_id, protocol.store_path(options.store_id), protocol.LOCAL_DISK,
                                     held_keys=store.index.keys,
                                     register=self._registration, heartbeat_interval=self._heartbeat_interval,
                                     min_sync_interval=options.bounds.min_sync_interval)
        store.index.on_admit, store.index.on_evict = reporter.admit, reporter.evict
        store.start_checks()  # the stat of the files taken from the snapshot (drops are reported)
        # Gets run concurrently (one per I/O thread), so engines sharing the store do not queue behind one slow
        # read; every other op is handled in arrival order.
        handlers = [Handler("put", protocol.PutRequest, store.put),
                    Handler("get", protocol.GetRequest, store.reader.get, max_concurrent=options.reader_threads),
                    # a cancel may wait for its get's write: several at once, so one slow read holds up no other
                    Handler("cancel_get", protocol.CancelGet, store.reader.cancel_get, max_concurrent=CANCELS_AT_ONCE),
                    *self.ops.handlers()]
        await store.pools.start(bus.server_scope(nc))
        if isinstance(nc, bus.MeshClient):  # a restarted NATS server has a new id: engines then look elsewhere
            self._follow = lambda: store.pools.follow(bus.server_scope(nc))
            nc.reconnect_hooks.append(self._follow)
        await self.endpoint.serve(handlers, reporter, self._health_details, self.ops.domains)
        log.info("disk store %s serving %s on %s", options.store_id, options.root, options.nats_url)

    def _details(self) -> dict[str, Any]:
        return {**self.store.details(), **self.endpoint.counters()}

    def _health_details(self) -> dict[str, Any]:
        return {**self._details(), protocol.USAGE_DETAIL: self.ops.usage(self.store.counters["hits"]).as_detail()}

    def _registration(self) -> protocol.RegisterStore:
        return protocol.RegisterStore(store_id=self.options.store_id, location=protocol.LOCAL_DISK,
                                      capacity_bytes=self.options.capacity_bytes, started_at=self.store.started_at)

    async def stop(self) -> None:
        if self._follow is not None and isinstance(self.nc, bus.MeshClient):
            self.nc.reconnect_hooks.remove(self._follow)
            self._follow = None
        await self.endpoint.stop_serving()
        await self.store.close()  # finishes accepted writes: their admissions still go out
        await self.endpoint.close()
        log.info("disk store %s stopped", self.options.store_id)


async def run_disk_store(options: DiskStoreOptions, stop: asyncio.Event) -> None:
    """Serve until `stop` is set (the body given to shared.ops.service.run_until_signalled)."""
    service = DiskStoreService(options)
    await service.start()
    try:
        await stop.wait()
    finally:
        await service.stop()
