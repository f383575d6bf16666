"""An engine's CPU tier served to its peers (P2P hits, docs/architecture.md): the stream server of the remote
store's data path (shared/stream_server.py), reading from the CPU tier, gets only.

`PeerServer` runs it on the engine's NATS loop (never on vLLM's threads: a peer never stalls this instance's
forward) and hands out single-use tickets to the workers that ask on this worker's peer subject,
`kvmesh.p2p.<domain>.<instance>.<worker>.<caller path>`: NATS lets only engines of the same sharing domain ask
there, each in its own name (shared/nats_permissions.py). Bounds: `p2p_max_connections` connections at once
(each sends one chunk at a time, so at most that many chunks in flight), a transfer slower than the stream
server's timeout costs its connection.

A get holds the chunk's slot for the send (`LocalCPUBackend.acquire`): an eviction meanwhile frees nothing, so a
peer receives the chunk's bytes as they were, or a miss, never another chunk's. A chunk only the CPU tier holds
has no checksum yet (the write-behind computes it for the stores): it is computed on the first way out and kept
with the chunk (`LocalCPUBackend.note_checksum`), so the peer checks every chunk it receives like one from a
store.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from kvmesh.services.engine.tiers.cpu import ChunkRef, LocalCPUBackend
from kvmesh.shared import bus, protocol
from kvmesh.shared.chunk_file import checksum
from kvmesh.shared.keys import ChunkKey
from kvmesh.shared.protocol import ChunkMeta, Subjects
from kvmesh.shared.stream_server import StreamServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Held:
    meta: ChunkMeta  # its checksum set
    ref: ChunkRef

    def data(self) -> memoryview:
        return self.ref.slot.chunk_buffer(self.meta.nbytes).view


class CpuTierSource:
    """The CPU tier as a stream server's ChunkSource (shared/stream_server.py); `stats` counts what it served
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


class PeerServer:
    """This worker's CPU tier on a stream for the peers of its sharing domain (`domain`, its name)."""

    def __init__(self, cpu: LocalCPUBackend, stats: collections.Counter[str], instance_id: str, worker_id: str,
                 domain: str, bind_host: str, advertised_host: str, port: int = 0, *, max_connections: int = 16,
                 transfer_timeout: float = 30.0) -> None:
        self.instance_id = instance_id
        self.worker_id = worker_id
        self.domain = domain
        self.advertised_host = advertised_host
        self.server = StreamServer(CpuTierSource(cpu, stats), bind_host, port, transfer_timeout,
                                   max_connections=max_connections)
        self._wildcard = Subjects.peer_stream(domain, instance_id, worker_id, ">")
        self._subscription: Subscription | None = None

    @property
    def endpoint(self) -> str:
        """Where peers connect ("host:port"), once started."""
        return f"{self.advertised_host}:{self.server.port}"

    async def start(self, nc: NatsClient) -> None:
        """Listen (once), then answer stream requests on this worker's peer subject (again after a restart of
        the agent: `stop` leaves the listener)."""
        if not self.server.listening:
            await self.server.start()
            log.info("serving the CPU tier to peers of domain %s on %s", self.domain, self.endpoint)
        self._subscription = await bus.serve_from(nc, self._wildcard, protocol.StreamRequest, self._offer)

    async def _offer(self, request: protocol.StreamRequest, subject: str) -> object:
        caller = Subjects.producer_of(subject, self._wildcard)
        if caller is None or caller.role != "engine":
            return protocol.Ack(ok=False, error=f"not a peer stream subject: {subject}")
        return protocol.StreamOffer(host=self.advertised_host, port=self.server.port,
                                    ticket=self.server.issue_ticket(caller.path))

    async def stop(self) -> None:
        if self._subscription is not None:
            try:
                await self._subscription.unsubscribe()
            except Exception:
                pass
            self._subscription = None
        await self.server.stop()
