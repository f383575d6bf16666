"""The remote store as a mesh service: one process per key partition, one asyncio event loop on its main thread.

NATS subjects `Subjects.store(store_id, op, caller)`, subscribed as `Subjects.store_op(store_id, op)`: the caller's
path ends the subject (`engine.<instance>.<worker>`, `operator`). Request -> reply, each handled on the loop in
arrival order:
    stream    StreamRequest -> StreamOffer     where the TCP stream listens + a single-use ticket (stream_server.py),
                                               bound to the caller: the connection's puts are its puts
    put       PutRequest    -> Ack             inline `data` only (small chunks, tools); bulk puts use the stream;
                                               a put records the caller's claim (also on a chunk already held)
    get       GetRequest    -> GetReply        inline `data` when it fits NATS max_payload; else use the stream
    contains  ChunkKeys     -> ContainsReply   how many leading keys are held
    touch     ChunkKeys     -> Ack             an engine's hits: these chunks count as just used
    pin/unpin ChunkKeys     -> CommandReply    contiguous prefix; num_chunks, num_tokens (ttl_secs optional)
    remove    ChunkKeys     -> CommandReply    num_chunks, num_tokens removed (pinned ones too), whoever put them
    clear     ClearRequest  -> CommandReply    the caller's claims; forgets what nobody claims or pins any more;
                                               num_chunks, num_tokens: the chunks the caller no longer claims
    wipe      WipeRequest   -> CommandReply    the operator only: every unpinned chunk; num_chunks, num_tokens
    stats     StatsRequest  -> StatsReply
contains, touch, pin, unpin, remove, clear, wipe and stats are the shared IndexOps (shared/store_kit/store_ops.py), the
same as the disk store's. Pins and claims are kept in memory, and beside the chunk files with `persist_dir`
(store.py).
Also health (`serve_health(service="remote_store")` on the store's path), and AdmissionBatch / SyncChunk on
`Subjects.events(<store's path>)` (location RemoteBackend, producer_id = store_id) through AdmissionReporter. The
stream server's connection tasks run on the same loop; worker threads only fault buffers and do file I/O
(store.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient

from kvmesh.shared import protocol

from kvmesh.services.remote_store.options import RemoteStoreOptions
from kvmesh.services.remote_store.redis_watch import run_redis_watch
from kvmesh.services.remote_store.store import MemoryStore, PutRefused
from kvmesh.services.remote_store.stream_server import StoreStreamServer
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.admissions import AdmissionReporter
from kvmesh.shared.messaging.bus import NatsAuth
from kvmesh.shared.messaging.credentials import domains_map
from kvmesh.shared.store_kit.store_endpoint import StoreEndpoint
from kvmesh.shared.store_kit.store_ops import Handler, IndexOps
from kvmesh.shared.tls import server_context
from kvmesh.shared.wire.redis_url import parse_redis_url

log = logging.getLogger(__name__)


def stream_addresses(options: RemoteStoreOptions) -> tuple[str, str]:
    """(listen host, advertised host) of the stream."""
    route = bus.route_address(options.nats_url)
    listen = options.stream_host or route or "0.0.0.0"
    wildcard = listen in ("0.0.0.0", "::", "")
    advertise = options.advertise_host or (route or socket.gethostname() if wildcard else listen)
    return listen, advertise


class RemoteStoreService:
    """A MemoryStore served over NATS and a TCP stream. `start()` loads and subscribes; `stop()` undoes both."""

    def __init__(self, options: RemoteStoreOptions) -> None:
        self.options = options
        self.reporter = AdmissionReporter(options.store_id, protocol.store_path(options.store_id), protocol.REMOTE,
                                          held_keys=self._held_keys, register=self._registration,
                                          heartbeat_interval=options.heartbeat_interval,
                                          min_sync_interval=options.bounds.min_sync_interval)
        self.store = MemoryStore(options.capacity_bytes, options.partition, options.num_partitions,
                                 options.persist_dir, options.fsync, cache_policy=options.cache_policy,
                                 on_admit=self.reporter.admit, on_evict=self.reporter.evict,
                                 prefault_bytes=options.prefault_bytes,
                                 fault_ahead_bytes=options.fault_ahead_bytes)
        self.store.retained_share = options.bounds.retained_share
        listen, self.advertise_host = stream_addresses(options)
        self.stream = StoreStreamServer(self.store, listen, options.stream_port, options.transfer_timeout,
                                        max_connections=options.max_stream_connections,
                                        hello_timeout=options.stream_hello_timeout,
                                        hello_max_bytes=options.stream_hello_max_bytes,
                                        idle_timeout=options.stream_idle_timeout,
                                        max_chunk_bytes=options.max_chunk_bytes,
                                        tls=stream_tls(options))
        self.ops = IndexOps(options.store_id, self.store.index, free=self.store.free, details=self._stats_details,
                            persist=self.store.save_now, bounds=options.bounds)
        self.endpoint = StoreEndpoint("remote_store", options.store_id, options.bounds.request_queue_bytes,
                                      max_lanes=options.bounds.max_lanes)
        self._started_at = time.time()

    @property
    def nc(self) -> NatsClient | None:
        return self.endpoint.nc

    async def start(self, nc: NatsClient | None = None) -> None:
        options = self.options
        nc = await self.endpoint.connect(nc, options.nats_url, options.auth)
        # after connecting (a KVMesh-started NATS provisions the store's credentials, beside which the map is),
        # before opening: the map tells whether a chunk the claims file does not name can be kept
        self.store.domains = self.ops.domains = domains_map(
            options.domains_file, options.nats_url, protocol.Principal.store(options.store_id).path)
        await self.store.open()
        await self.stream.start()
        handlers = [Handler("stream", protocol.StreamRequest, self._on_stream),
                    Handler("put", protocol.PutRequest, self._on_put),
                    Handler("get", protocol.GetRequest, self._on_get), *self.ops.handlers()]
        await self.endpoint.serve(handlers, self.reporter, self._health_details, self.ops.domains)
        await nc.flush()
        log.info("remote store %s (partition %d of %d, %.2f GB, %s eviction) serving on NATS %s, stream %s:%d%s",
                 options.store_id, options.partition, options.num_partitions, options.capacity_bytes / 1024**3,
                 options.cache_policy,
                 options.nats_url, self.advertise_host, self.stream.port,
                 f", persisting in {options.persist_dir}" if options.persist_dir else "")

    async def stop(self) -> None:
        await self.endpoint.stop_serving()
        await self.stream.stop()
        await self.store.close()
        await self.endpoint.close()
        log.info("remote store %s stopped", self.options.store_id)

    # ---- what the controller sees ------------------------------------------------------------------------
    def _held_keys(self) -> list[bytes]:
        return self.store.index.keys()

    def _registration(self) -> protocol.RegisterStore:
        o = self.options
        return protocol.RegisterStore(store_id=o.store_id, location=protocol.REMOTE, partition=o.partition,
                                      num_partitions=o.num_partitions, capacity_bytes=o.capacity_bytes,
                                      started_at=self._started_at)

    def _health_details(self) -> dict[str, Any]:
        index = self.store.index
        return {"partition": self.options.partition, "num_partitions": self.options.num_partitions,
                "num_chunks": len(index), "used_bytes": index.used_bytes,
                "capacity_bytes": self.options.capacity_bytes,
                "stream": f"{self.advertise_host}:{self.stream.port}",
                protocol.USAGE_DETAIL: self.ops.usage(self.store.counters.get_hits).as_detail()}

    # ---- handlers ----------------------------------------------------------------------------------------
    async def _on_stream(self, request: protocol.StreamRequest, caller: str) -> protocol.StreamOffer:
        o = self.options
        return protocol.StreamOffer(host=self.advertise_host, port=self.stream.port,
                                    ticket=self.stream.issue_ticket(caller), store_id=o.store_id,
                                    partition=o.partition, num_partitions=o.num_partitions,
                                    tls=self.stream.tls is not None)

    async def _on_put(self, request: protocol.PutRequest, caller: str) -> protocol.Ack:
        if request.data is None:
            return protocol.Ack(ok=False, error="the remote store takes bytes inline or on its stream (ask on "
                                                "the `stream` subject); shared memory is for same-host stores")
        error = self.options.bounds.inline_too_large(len(request.data))
        if error is not None:
            self.store.counters.refused_puts += 1
            return protocol.Ack(ok=False, error=f"remote store {self.options.store_id}: {error}")
        try:
            await self.store.put_bytes(request.meta, request.data, caller)
        except PutRefused as exc:
            return protocol.Ack(ok=False, error=str(exc))
        self.store.retain(request, caller)
        return protocol.Ack()

    async def _on_get(self, request: protocol.GetRequest, caller: str) -> protocol.GetReply:
        chunk = self.store.acquire(request.key, caller)
        if chunk is None:
            return protocol.GetReply(found=False)
        try:
            assert self.nc is not None
            if chunk.meta.nbytes + protocol.INLINE_HEADROOM > self.nc.max_payload:
                return protocol.GetReply(found=False, meta=chunk.meta, error=(
                    f"chunk of {chunk.meta.nbytes} bytes does not fit NATS max_payload {self.nc.max_payload}: "
                    "get it on the stream"))
            return protocol.GetReply(found=True, meta=chunk.meta, data=bytes(chunk.data()))
        finally:
            self.store.release(chunk)

    def _stats_details(self) -> dict[str, Any]:
        return {**self.store.details(), "stream": f"{self.advertise_host}:{self.stream.port}",
                "stream_connections": self.stream.connection_count, **self.endpoint.counters(),
                **self.stream.counters}


async def run_remote_store(options: RemoteStoreOptions, stop: asyncio.Event) -> None:
    """Serve until `stop` is set (the body given to shared.ops.service.run_until_signalled); with `redis_url`, the
    Redis mode instead (redis_watch.py)."""
    if options.redis_url is not None:
        await run_redis_watch(parse_redis_url(options.redis_url), options.store_id, options.redis_key_prefix,
                              options.nats_url, options.auth, options.redis_timeout, options.heartbeat_interval,
                              stop)
        return
    service = RemoteStoreService(options)
    try:
        await service.start()
        await stop.wait()
    finally:
        await service.stop()


def stream_tls(options: RemoteStoreOptions) -> ssl.SSLContext | None:
    """The stream port's TLS context (--stream-tls-cert / --stream-tls-key), None for a plaintext port."""
    if options.stream_tls_cert is None or options.stream_tls_key is None:
        return None
    return server_context(options.stream_tls_cert, options.stream_tls_key)
