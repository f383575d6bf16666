"""P2P hits: other instances' CPU tiers as the last tier of the walk (`PeerTier`, enable_p2p).

When the CPU tier and the stores miss, `contains` asks the controller once which live worker of another instance
of this sharing domain holds the longest prefix of the keys in its CPU tier (`PeerLookup`; the controller
answers from the admissions every worker reports, services/controller/peers.py). `get_into` then streams those
chunks from that worker's CPU tier over TCP (services/engine/mesh/peer_server.py), on a connection negotiated on
NATS with a single-use ticket, exactly as from the remote store: the bytes are verified against the checksum the
peer sends, and the storage manager checks every chunk's meta against its span (key, tokens, format, dtype,
shape) before anything is scattered. Keys carry the model, KV format, rank and domain, so a peer holding the key
holds this rank's shard in this layout.

The tier is read-only: nothing is ever put there (the write-behind skips it), and it answers no pin, unpin or
clear (a peer's chunks are the peer's). A peer that dies or goes silent mid-transfer costs its chunk (a miss: the
load ends there and vLLM recomputes the rest) and is not asked again for `retry_interval` seconds.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient

from kvmesh.services.engine.tiers.base import ChunkBuffer, StoreLink, byte_view
from kvmesh.services.engine.tiers.remote_stream import StreamPool, on_stream
from kvmesh.shared import bus, protocol
from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.keys import ChunkKey
from kvmesh.shared.protocol import PEER, ChunkMeta, StatsReply, Subjects
from kvmesh.shared.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

MAX_HOLDERS = 65_536  # keys whose holder the last lookups named, kept for the loads that follow them
MAX_PEERS = 256  # peers with kept connections (a restarted peer is a new worker id: the oldest are closed)


@dataclass(frozen=True)
class PeerWorker:
    instance_id: str
    worker_id: str


@dataclass
class _Peer:
    link: StoreLink
    pool: StreamPool


class PeerTier:
    """The walk's peer tier for the engine worker `worker_id` at `caller` (its producer path), in sharing domain
    `domain` (its name: NATS lets it ask peers of that domain only)."""

    location = PEER
    store_ids: list[str] = []  # no store behind it

    def __init__(self, nc: NatsClient, domain: str, worker_id: str, caller: str, stats: collections.Counter[str], *,
                 request_timeout: float = 2.0, min_transfer_rate: float = 100e6, retry_interval: float = 1.0,
                 max_connections: int = 4) -> None:
        self.nc = nc
        self.domain = domain
        self.worker_id = worker_id
        self.caller = caller
        self.stats = stats  # the storage manager's counters (metrics: lmcache:num_p2p_*)
        self.request_timeout = request_timeout
        self.min_transfer_rate = min_transfer_rate
        self.retry_interval = retry_interval
        self.max_connections = max_connections
        self._name = f"{socket.gethostname()}:{os.getpid()}"
        self._holders: collections.OrderedDict[ChunkKey, PeerWorker] = collections.OrderedDict()
        self._promised: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()  # by a PD producer
        self._peers: collections.OrderedDict[PeerWorker, _Peer] = collections.OrderedDict()
        self._rlog = RateLimitedLog(log)

    # ---- where: the controller's answer, or the producer's word -----------------------------------------------
    async def contains(self, keys: list[ChunkKey]) -> int:
        """How many leading `keys` one live peer holds (0 when none does, or the controller does not answer).
        Keys a PD producer was named for (`promise`) are taken as its, with no question to the controller."""
        if not keys:
            return 0
        promised = 0
        while promised < len(keys) and keys[promised] in self._promised:
            promised += 1
        if promised:
            return promised
        try:
            reply = await bus.request(self.nc, Subjects.peer_lookup(self.caller),
                                      protocol.PeerLookup(worker_id=self.worker_id, keys=list(keys)),
                                      protocol.PeerLookupReply, self.request_timeout)
        except KVMeshError as exc:
            self.stats["p2p_lookup_failed"] += 1
            self._rlog.warning("lookup", "P2P lookup at the controller failed (%s): no peer hit", exc)
            return 0
        held = max(0, min(reply.num_chunks, len(keys)))
        if held and reply.instance_id and reply.worker_id:
            self._remember(keys[:held], PeerWorker(reply.instance_id, reply.worker_id))
        else:
            held = 0
        return held

    def promise(self, keys: list[ChunkKey], holder: PeerWorker) -> None:
        """A PD producer holds `keys` (its request's, named by the consumer's request: adapter/pd.py); a lookup
        answers them at once, and a load reads them from it. Its word is checked as any peer's bytes are."""
        self._remember(keys, holder)
        for key in keys:
            self._promised[key] = None
            self._promised.move_to_end(key)
        while len(self._promised) > MAX_HOLDERS:
            self._promised.popitem(last=False)

    def assume_holder(self, keys: list[ChunkKey], holder: PeerWorker) -> None:
        """Read `keys` from `holder` (a move between instances names the source worker: no lookup)."""
        self._remember(keys, holder)

    def _remember(self, keys: list[ChunkKey], holder: PeerWorker) -> None:
        for key in keys:
            self._holders[key] = holder
            self._holders.move_to_end(key)
        while len(self._holders) > MAX_HOLDERS:
            self._holders.popitem(last=False)

    # ---- bytes: a stream of the holder's CPU tier -------------------------------------------------------------
    async def get_into(self, key: ChunkKey, buffer: ChunkBuffer) -> ChunkMeta | None:
        holder = self._holders.get(key)
        if holder is None:  # never named by a lookup (or forgotten): a miss
            return None
        return await self.get_from(holder, key, buffer)

    async def get_from(self, holder: PeerWorker, key: ChunkKey, buffer: ChunkBuffer) -> ChunkMeta | None:
        """`key`'s chunk from `holder`'s CPU tier into `buffer` (checksum verified); None on a miss or failure."""
        peer = self._peer(holder)
        view = byte_view(buffer.view)
        timeout = self.request_timeout + len(view) / self.min_transfer_rate
        reply = await on_stream(peer.pool, peer.link, timeout, lambda connection: connection.get_into(key, view))
        if reply is None or not reply.found or reply.meta is None:
            self._holders.pop(key, None)
            self._promised.pop(key, None)
            self.stats["p2p_read_failed" if reply is None or reply.error else "p2p_read_missed"] += 1
            if reply is not None and reply.error:
                self._rlog.warning("get", "peer %s/%s: get %s: %s", holder.instance_id, holder.worker_id, key.hex(),
                                   reply.error)
            return None
        return reply.meta

    def _peer(self, holder: PeerWorker) -> _Peer:
        peer = self._peers.get(holder)
        if peer is not None:
            self._peers.move_to_end(holder)
        else:
            label = f"peer {holder.instance_id} (worker {holder.worker_id})"
            subject = Subjects.peer_stream(self.domain, holder.instance_id, holder.worker_id, self.caller)

            async def negotiate() -> protocol.StreamOffer:  # the ticket binds the stream to this worker
                refused_before = getattr(self.nc, "permission_violations", 0)
                try:
                    return await bus.request(self.nc, subject, protocol.StreamRequest(client=self._name),
                                             protocol.StreamOffer, self.request_timeout)
                except BaseException:  # unanswered, timed out or given up on: was it NATS saying no (another domain)?
                    if getattr(self.nc, "permission_violations", 0) > refused_before:
                        self.stats["p2p_refused"] += 1
                    raise

            peer = _Peer(StoreLink(holder.worker_id, label, log, self.caller, self.retry_interval),
                         StreamPool(negotiate, self._name, self.max_connections))
            self._peers[holder] = peer
            while len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)[1].pool.close()
        return peer

    # ---- a peer's chunks are the peer's: no writes, no commands ----------------------------------------------
    async def put(self, meta: ChunkMeta, buffer: ChunkBuffer) -> bool:
        return False

    async def pin(self, keys: list[ChunkKey], num_tokens: list[int], ttl_secs: float | None = None) -> int:
        return 0

    async def unpin(self, keys: list[ChunkKey], num_tokens: list[int]) -> int:
        return 0

    async def clear(self) -> int:
        return 0

    async def touch(self, keys: list[ChunkKey]) -> None:
        return None

    async def remove(self, keys: list[ChunkKey]) -> int:
        return 0

    async def stats(self) -> list[StatsReply]:
        return []

    async def close(self) -> None:
        """Close the kept stream connections (the NATS connection is the caller's)."""
        for peer in self._peers.values():
            peer.pool.close()
        self._peers.clear()
