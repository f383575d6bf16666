"""An engine's CPU tier served to its peers (P2P hits, docs/architecture.md): the stream server of the remote
store's data path (shared/wire/stream_server.py), reading from the CPU tier, gets only.

Threads: `PeerServer` runs the stream on an event loop thread of its own ("kvmesh-p2p-<worker>", off vLLM's
compute cores like the NATS loop): a peer pulling chunks never delays this worker's NATS traffic (heartbeats,
admissions, lookups, commands), nor vLLM's forward. On the engine's NATS loop it only hands out single-use
tickets to the workers that ask on this worker's peer subject, `kvmesh.p2p.<domain>.<instance>.<worker>.<caller
path>`: NATS lets only engines of the same sharing domain ask there, each in its own name
(shared/messaging/nats_permissions.py).

Bounds (engine config keys, docs/config.md; `ClientBounds`): connections that have not presented a ticket yet,
`p2p_max_pending_connections` in all and `p2p_max_pending_per_address` per source address (a new one closes the
oldest of its address, or of the address with the most), each with `p2p_hello_timeout_secs` to present it;
greeted connections, `p2p_max_connections` in all and `p2p_max_connections_per_peer` per peer instance (which also
bounds its unused tickets), closed after `p2p_idle_timeout_secs` without a request; per ticket, at most
`p2p_ticket_max_gb` sent at `p2p_ticket_max_mb_per_s` at most; a transfer slower than the stream server's timeout
costs its connection. The port listens on `p2p_host`, loopback unless it names another address.

A get holds the chunk's slot for the send (`LocalCPUBackend.acquire`): an eviction meanwhile frees nothing, so a
peer receives the chunk's bytes as they were, or a miss, never another chunk's. A chunk only the CPU tier holds
has no checksum yet (the write-behind computes it for the stores): it is computed on the first way out and kept
with the chunk (`LocalCPUBackend.note_checksum`), so the peer checks every chunk it receives like one from a
store.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Coroutine, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from kvmesh.services.engine.mesh.side_cpus import move_to_side_cpus
from kvmesh.services.engine.tiers.cpu import ChunkRef, LocalCPUBackend
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.protocol import ChunkMeta, Subjects
from kvmesh.shared.wire.chunk_file import checksum
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.stream_server import ClientBounds, OptionNames, StreamServer

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class _Held:
    meta: ChunkMeta  # its checksum set
    ref: ChunkRef

    def data(self) -> memoryview:
        return self.ref.slot.chunk_buffer(self.meta.nbytes).view


class CpuTierSource:
    """The CPU tier as a stream server's ChunkSource (shared/wire/stream_server.py); `stats` counts what it served
    (`p2p_served_chunks`, `p2p_served_bytes`, `p2p_served_misses`)."""

    def __init__(self, cpu: LocalCPUBackend, stats: collections.Counter[str] | None = None) -> None:
        self.cpu = cpu
        self.stats = stats if stats is not None else collections.Counter()

    def acquire(self, key: ChunkKey, caller: str) -> _Held | None:
        ref = self.cpu.acquire(key)
        if ref is None:
            self.stats["p2p_served_misses"] += 1
            return None
        meta = ref.meta
        if not meta.checksum:  # computed once: the tier keeps it for the next peer
            meta = dataclasses.replace(meta, checksum=checksum(ref.slot.chunk_buffer(meta.nbytes).view))
            self.cpu.note_checksum(ref, meta.checksum)
        self.stats["p2p_served_chunks"] += 1
        self.stats["p2p_served_bytes"] += meta.nbytes
        return _Held(meta, ref)

    def release(self, chunk: _Held) -> None:  # type: ignore[override]
        chunk.ref.release()


PEER_OPTION_NAMES = OptionNames(
    max_connections="p2p_max_connections", hello_timeout="p2p_hello_timeout_secs", hello_max_bytes="the hello cap",
    idle_timeout="p2p_idle_timeout_secs", max_pending="p2p_max_pending_connections",
    max_pending_per_address="p2p_max_pending_per_address", max_connections_per_caller="p2p_max_connections_per_peer",
    ticket_max_bytes="p2p_ticket_max_gb", ticket_bytes_per_s="p2p_ticket_max_mb_per_s")


class PeerServer:
    """This worker's CPU tier on a stream for the peers of its sharing domain (`domain`, its name), served on a
    loop thread of its own (`loop`) from `start` to `stop`."""

    def __init__(self, cpu: LocalCPUBackend, stats: collections.Counter[str], instance_id: str, worker_id: str,
                 domain: str, bind_host: str, advertised_host: str, port: int = 0, *, max_connections: int = 16,
                 transfer_timeout: float = 30.0, hello_timeout: float = 10.0, idle_timeout: float = 300.0,
                 client_bounds: ClientBounds = ClientBounds(), tls: ssl.SSLContext | None = None) -> None:
        """`tls`: a server context (shared/tls.py): the port takes TLS connections only, and its offers say so."""
        self.instance_id = instance_id
        self.worker_id = worker_id
        self.domain = domain
        self.advertised_host = advertised_host
        self.server = StreamServer(CpuTierSource(cpu, stats), bind_host, port, transfer_timeout,
                                   max_connections=max_connections, hello_timeout=hello_timeout,
                                   idle_timeout=idle_timeout, client_bounds=client_bounds, names=PEER_OPTION_NAMES,
                                   tls=tls)
        self._wildcard = Subjects.peer_stream(domain, instance_id, worker_id, ">")
        self._subscription: Subscription | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the stream's own loop, while started
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """Where peers connect ("host:port"), once started."""
        return f"{self.advertised_host}:{self.server.port}"

    async def start(self, nc: NatsClient) -> None:
        """Listen (once, on the stream's own loop thread), then answer stream requests on this worker's peer
        subject (again after a restart of the agent)."""
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._run, args=(self.loop,), daemon=True,
                                            name=f"kvmesh-p2p-{self.worker_id}")
            self._thread.start()
        if not self.server.listening:
            try:
                await self._on_stream_loop(self.server.start())
            except BaseException:
                await self._stop_loop()
                raise
            log.info("serving the CPU tier to peers of domain %s on %s", self.domain, self.endpoint)
        self._subscription = await bus.serve_from(nc, self._wildcard, protocol.StreamRequest, self._offer)

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        move_to_side_cpus()
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _on_stream_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self.loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def _offer(self, request: protocol.StreamRequest, subject: str) -> object:
        caller = Subjects.producer_of(subject, self._wildcard)
        if caller is None or caller.role != "engine":
            return protocol.Ack(ok=False, error=f"not a peer stream subject: {subject}")
        return protocol.StreamOffer(host=self.advertised_host, port=self.server.port,
                                    ticket=self.server.issue_ticket(caller.path), tls=self.server.tls is not None)

    async def stop(self) -> None:
        if self._subscription is not None:
            try:
                await self._subscription.unsubscribe()
            except Exception:
                pass
            self._subscription = None
        await self._stop_loop()

    async def _stop_loop(self) -> None:
        loop, thread, self.loop, self._thread = self.loop, self._thread, None, None
        if loop is None or thread is None:
            return
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.server.stop(), loop))
        finally:
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.to_thread(thread.join)
