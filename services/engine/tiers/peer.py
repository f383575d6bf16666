"""P2P hits: other instances' CPU tiers as the last tier of the walk (`PeerTier`, enable_p2p).

When the CPU tier and the stores miss, `contains` asks the controller which live workers of other instances of
this sharing domain serve the keys from their CPU tiers (`PeerLookup`): each key's holder of record, the first
of them whose admission of it the controller applied (services/controller/peers.py). `get_into` then streams
those chunks from each key's holder over TCP (services/engine/agents/peer_server.py), on a connection negotiated
on NATS with a single-use ticket, exactly as from the remote store: the bytes are verified against the checksum
the peer sends, and the storage manager checks every chunk's meta against its span (key, tokens, format, dtype,
shape) before anything is scattered. Keys carry the model, KV format, rank and domain, so a peer holding the key
holds this rank's shard in this layout.

Who serves is never a message's word: a PD hint (adapter/pd.py, client input) only makes `contains` wait, at
most `hint_wait` seconds, while the controller does not name a holder for the keys yet and the hinted producer is
a live peer (its admissions are on their way); a hint naming anything else promises nothing. A peer whose chunk
fails its check (its checksum, or its meta: `distrust`) is excluded from the lookups of that chain (the keys it
was named for), so the controller names the next holder of record.

The tier is read-only: nothing is ever put there (the write-behind skips it), and it answers no pin, unpin or
clear (a peer's chunks are the peer's). A peer that dies or goes silent mid-transfer costs its chunk (a miss: the
load ends there and vLLM recomputes the rest) and is not asked again for `retry_interval` seconds.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import ssl
import time
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient

from kvmesh.services.engine.tiers.base import NO_RETENTION, ChunkBuffer, Retention, StoreLink, byte_view
from kvmesh.services.engine.tiers.remote_stream import StreamPool, on_stream
from kvmesh.shared import protocol
from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.messaging import bus
from kvmesh.shared.protocol import PEER, ChunkMeta, StatsReply, Subjects
from kvmesh.shared.rate_limited_log import RateLimitedLog
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)

MAX_HOLDERS = 65_536  # keys whose holder the last lookups named, kept for the loads that follow them
MAX_PEERS = 256  # peers with kept connections (a restarted peer is a new worker id: the oldest are closed)
MAX_EXCLUDED = 64  # the controller reads at most this many excluded workers of one lookup
HINT_POLL_S = 0.01  # while a hint's producer's admissions are on their way: how often the controller is asked


@dataclass(frozen=True)
class PeerWorker:
    instance_id: str
    worker_id: str


@dataclass
class _Peer:
    link: StoreLink
    pool: StreamPool


@dataclass(frozen=True)
class _Named:
    """A key's holder as a lookup named it, with the keys it was named for in that lookup (its chain's run)."""

    holder: PeerWorker
    run: tuple[ChunkKey, ...]


class PeerTier:
    """The walk's peer tier for the engine worker `worker_id` at `caller` (its producer path), in sharing domain
    `domain` (its name: NATS lets it ask peers of that domain only)."""

    location = PEER
    store_ids: list[str] = []  # no store behind it

    def __init__(self, nc: NatsClient, domain: str, worker_id: str, caller: str, stats: collections.Counter[str], *,
                 request_timeout: float = 2.0, min_transfer_rate: float = 100e6, retry_interval: float = 1.0,
                 max_connections: int = 4, hint_wait: float = 1.0, tls: ssl.SSLContext | None = None) -> None:
        self.nc = nc
        self.tls = tls  # a client context trusting the peers' CA: streams to peers are TLS only
        self.domain = domain
        self.worker_id = worker_id
        self.caller = caller
        self.stats = stats  # the storage manager's counters (metrics: lmcache:num_p2p_*)
        self.request_timeout = request_timeout
        self.min_transfer_rate = min_transfer_rate
        self.retry_interval = retry_interval
        self.max_connections = max_connections
        self.hint_wait = hint_wait
        self._name = f"{socket.gethostname()}:{os.getpid()}"
        self._holders: collections.OrderedDict[ChunkKey, _Named] = collections.OrderedDict()
        self._expected: collections.OrderedDict[ChunkKey, PeerWorker] = collections.OrderedDict()  # -> PD producer
        self._distrusted: collections.OrderedDict[ChunkKey, frozenset[str]] = collections.OrderedDict()
        self._peers: collections.OrderedDict[PeerWorker, _Peer] = collections.OrderedDict()
        self._rlog = RateLimitedLog(log)

    # ---- where: the controller's answer ---------------------------------------------------------------------
    async def contains(self, keys: list[ChunkKey]) -> int:
        """How many leading `keys` live peers serve (0 when none does, or the controller does not answer). Keys a
        PD hint named a producer for (`expect`) are asked again, for at most `hint_wait` seconds, while the
        controller names fewer of them and that producer is a live peer of this domain."""
        if not keys:
            return 0
        producer = self._expected.get(keys[0])
        expected = 0
        while expected < len(keys) and producer is not None and self._expected.get(keys[expected]) == producer:
            del self._expected[keys[expected]]  # one wait per hint: a later walk of these keys asks once
            expected += 1
        deadline = time.monotonic() + self.hint_wait
        while True:
            reply = await self._lookup(keys, producer.worker_id if producer is not None else "")
            if reply is None:
                return 0
            held = self._take(keys, reply)
            if held >= expected or not reply.producer_live or time.monotonic() >= deadline:
                if held < expected and reply.producer_live:
                    self._rlog.warning("hint", "PD producer %s/%s was named for %d chunks, the controller names "
                                       "holders for %d after %.1fs", producer.instance_id, producer.worker_id,
                                       expected, held, self.hint_wait)
                return held
            await asyncio.sleep(HINT_POLL_S)

    async def _lookup(self, keys: list[ChunkKey], producer: str) -> protocol.PeerLookupReply | None:
        exclude: set[str] = set()
        if self._distrusted:
            for key in keys:
                exclude |= self._distrusted.get(key, frozenset())
        try:
            return await bus.request(self.nc, Subjects.peer_lookup(self.caller),
                                     protocol.PeerLookup(worker_id=self.worker_id, keys=list(keys),
                                                         exclude=sorted(exclude)[:MAX_EXCLUDED], producer=producer),
                                     protocol.PeerLookupReply, self.request_timeout)
        except KVMeshError as exc:
            self.stats["p2p_lookup_failed"] += 1
            self._rlog.warning("lookup", "P2P lookup at the controller failed (%s): no peer hit", exc)
            return None

    def _take(self, keys: list[ChunkKey], reply: protocol.PeerLookupReply) -> int:
        """Remember the holder the reply names for each leading key; how many keys it named."""
        held = 0
        for instance_id, worker_id, count in reply.runs():
            count = min(count, len(keys) - held)
            if count <= 0 or not instance_id or not worker_id:
                break
            self._remember(keys[held:held + count], PeerWorker(instance_id, worker_id))
            held += count
        return held

    def expect(self, keys: list[ChunkKey], producer: PeerWorker) -> None:
        """A PD hint names `producer` (client input, adapter/pd.py) for `keys`: the next lookup of them waits a
        little for its admissions to reach the controller. It never names who serves them."""
        for key in keys:
            self._expected[key] = producer
            self._expected.move_to_end(key)
        while len(self._expected) > MAX_HOLDERS:
            self._expected.popitem(last=False)

    def assume_holder(self, keys: list[ChunkKey], holder: PeerWorker) -> None:
        """Read `keys` from `holder` (a move between instances: the controller names the source worker)."""
        self._remember(keys, holder)

    def _remember(self, keys: list[ChunkKey], holder: PeerWorker) -> None:
        named = _Named(holder, tuple(keys))
        for key in keys:
            self._holders[key] = named
            self._holders.move_to_end(key)
        while len(self._holders) > MAX_HOLDERS:
            self._holders.popitem(last=False)

    def distrust(self, key: ChunkKey, holder: PeerWorker | None = None) -> None:
        """The chunk of `key` that its named holder (`holder`, when given) sent failed a check: that holder is
        excluded from the lookups of every key it was named for with this one (its run of the chain)."""
        named = self._holders.get(key)
        if named is None or holder not in (None, named.holder):
            return
        self.stats["p2p_distrusted"] += 1
        self._rlog.warning("distrust", "peer %s/%s sent a chunk of %s that failed its check: not asked for that "
                           "chain again", named.holder.instance_id, named.holder.worker_id, key.hex())
        for run_key in named.run:
            self._distrusted[run_key] = self._distrusted.get(run_key, frozenset()) | {named.holder.worker_id}
            self._distrusted.move_to_end(run_key)
            if self._holders.get(run_key) is named:
                del self._holders[run_key]
        while len(self._distrusted) > MAX_HOLDERS:
            self._distrusted.popitem(last=False)

    # ---- bytes: a stream of the holder's CPU tier -------------------------------------------------------------
    async def get_into(self, key: ChunkKey, buffer: ChunkBuffer) -> ChunkMeta | None:
        named = self._holders.get(key)
        if named is None:  # never named by a lookup (or forgotten): a miss
            return None
        return await self.get_from(named.holder, key, buffer)

    async def get_from(self, holder: PeerWorker, key: ChunkKey, buffer: ChunkBuffer) -> ChunkMeta | None:
        """`key`'s chunk from `holder`'s CPU tier into `buffer` (checksum verified); None on a miss or failure."""
        peer = self._peer(holder)
        view = byte_view(buffer.view)
        timeout = self.request_timeout + len(view) / self.min_transfer_rate
        reply = await on_stream(peer.pool, peer.link, timeout, lambda connection: connection.get_into(key, view))
        if reply is None or not reply.found or reply.meta is None:
            self.stats["p2p_read_failed" if reply is None or reply.error else "p2p_read_missed"] += 1
            if reply is not None and reply.error:  # e.g. its checksum failed
                self._rlog.warning("get", "peer %s/%s: get %s: %s", holder.instance_id, holder.worker_id, key.hex(),
                                   reply.error)
                self.distrust(key, holder)
            self._holders.pop(key, None)
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
                         StreamPool(negotiate, self._name, self.max_connections, self.tls))
            self._peers[holder] = peer
            while len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)[1].pool.close()
        return peer

    # ---- a peer's chunks are the peer's: no writes, no commands ----------------------------------------------
    async def put(self, meta: ChunkMeta, buffer: ChunkBuffer,
                  retention: Retention = NO_RETENTION) -> bool:
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
