"""What every chunk store does the same way on NATS, whatever holds its bytes (disk store, remote store).

Runs on the store's one asyncio event loop, like the store itself:
  * `IndexOps` answers contains / touch / pin / unpin / remove / clear / stats from the store's ChunkIndex, so these ops
    mean the same thing at every store; the store supplies only what differs (how bytes are freed, ...).
  * `StoreEndpoint` is the store's presence on NATS: its connection (its own, or one lent by a test), one
    subscription per op on `Subjects.store(store_id, op)`, its AdmissionReporter, health answers (on
    `Subjects.health(store_id)` and the ping-all subject); `stop_serving()` then `close()` undo it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from kvmesh.shared import bus, protocol
from kvmesh.shared.admissions import AdmissionReporter
from kvmesh.shared.chunk_index import ChunkIndex, IndexEntry
from kvmesh.shared.keys import ChunkKey
from kvmesh.shared.service import serve_health

log = logging.getLogger(__name__)

E = TypeVar("E", bound=IndexEntry)


@dataclass(frozen=True)
class Handler:
    """One op of a store: requests of `request_type` on `Subjects.store(store_id, op)`, answered by `handle`."""

    op: str
    request_type: type[Any]
    handle: Callable[[Any], Awaitable[Any]]
    max_concurrent: int = 1  # 1: one request at a time, in arrival order; more for ops that wait on I/O


def _nothing(*_: Any) -> None:
    pass


class IndexOps(Generic[E]):
    """contains / pin / unpin / remove / clear / stats of one store, answered from its ChunkIndex.

    What differs between stores comes in as callables: `free(removed)` releases what chunks that left the
    index used (files, buffers); `settle(keys)` waits for puts of these keys still in flight before a pin (so a
    pin right after a put covers it); `changed()` runs after every op that may have changed pins (the disk
    store persists them); `details()` is the store's own part of the stats.

    Counts: pin and unpin answer the stored token counts of the chunks they pinned or unpinned; remove and
    clear count the chunks they forgot and the puts in flight they discarded (puts that may already have been
    answered ok, and that the removal undoes).
    """

    def __init__(self, store_id: str, index: ChunkIndex[E], free: Callable[[list[tuple[ChunkKey, E]]], None],
                 details: Callable[[], dict[str, Any]],
                 settle: Callable[[list[ChunkKey]], Awaitable[None]] | None = None,
                 changed: Callable[[], None] = _nothing) -> None:
        self.store_id = store_id
        self.index = index
        self._free = free
        self._details = details
        self._settle = settle
        self._changed = changed

    def handlers(self) -> list[Handler]:
        keys = protocol.ChunkKeys
        return [Handler("contains", keys, self.contains), Handler("touch", keys, self.touch),
                Handler("pin", keys, self.pin),
                Handler("unpin", keys, self.unpin), Handler("remove", keys, self.remove),
                Handler("clear", protocol.ClearRequest, self.clear),
                Handler("stats", protocol.StatsRequest, self.stats)]

    async def contains(self, request: protocol.ChunkKeys) -> protocol.ContainsReply:
        return protocol.ContainsReply(prefix=self.index.contains_prefix(request.keys))

    async def touch(self, request: protocol.ChunkKeys) -> protocol.Ack:
        """Hits an engine served: these chunks count as just used (the eviction policy decides what that means)."""
        for key in request.keys:
            self.index.touch(key)
        return protocol.Ack()

    async def pin(self, request: protocol.ChunkKeys) -> protocol.CommandReply:
        if request.ttl_secs is not None and not request.ttl_secs > 0:
            return protocol.CommandReply(ok=False, error=f"ttl_secs must be > 0 (or absent), got {request.ttl_secs}")
        if self._settle is not None:
            await self._settle(request.keys)
        pinned = self.index.pin(request.keys, request.ttl_secs)
        self._changed()
        return protocol.CommandReply(ok=True, num_tokens=self.index.tokens_of(pinned), num_chunks=len(pinned))

    async def unpin(self, request: protocol.ChunkKeys) -> protocol.CommandReply:
        unpinned = self.index.unpin(request.keys)
        self._changed()
        return protocol.CommandReply(ok=True, num_tokens=self.index.tokens_of(unpinned), num_chunks=len(unpinned))

    async def remove(self, request: protocol.ChunkKeys) -> protocol.CommandReply:
        removed: list[tuple[ChunkKey, E]] = []
        discarded: list[E] = []
        for key in request.keys:
            in_flight = self.index.in_flight(key)
            entry = self.index.remove(key)  # discards the put in flight too
            if entry is not None:
                removed.append((key, entry))
            if in_flight is not None:
                discarded.append(in_flight)
        return self._removed(removed, discarded)

    async def clear(self, request: protocol.ClearRequest) -> protocol.CommandReply:
        discarded = [entry for _, entry in self.index.in_flight_items()]
        reply = self._removed(self.index.clear(), discarded)
        log.info("store %s: cleared %d chunks (%d tokens); %d pinned kept", self.store_id, reply.num_chunks,
                 reply.num_tokens, self.index.pinned_count)
        return reply

    def _removed(self, removed: list[tuple[ChunkKey, E]], discarded: list[E]) -> protocol.CommandReply:
        self._free(removed)
        self._changed()
        gone = [entry for _, entry in removed] + discarded
        return protocol.CommandReply(ok=True, num_tokens=sum(entry.num_tokens for entry in gone), num_chunks=len(gone))

    async def stats(self, request: protocol.StatsRequest | None = None) -> protocol.StatsReply:
        index = self.index
        return protocol.StatsReply(store_id=self.store_id, num_chunks=len(index), used_bytes=index.used_bytes,
                                   capacity_bytes=index.capacity_bytes, pinned_chunks=index.pinned_count,
                                   details={"cache_policy": index.policy_name, **self._details()})


class StoreEndpoint:
    """A store's connection, subscriptions, admission reporter and health answers (see the module docstring).

    `service` names the kind of store ("disk_store", "remote_store"): in health replies and the connection name.
    """

    def __init__(self, service: str, store_id: str) -> None:
        self.service = service
        self.store_id = store_id
        self.nc: NatsClient | None = None
        self.reporter: AdmissionReporter | None = None
        self._own_nc = False
        self._subscriptions: list[Subscription] = []

    async def connect(self, nc: NatsClient | None, url: str, auth: bus.NatsAuth | None = None) -> NatsClient:
        """`nc` if given (lent: `close` leaves it open), else a connection of our own.

        Our own waits up to `bus.SERVICE_CONNECT_WAIT` for a NATS still starting and raises MeshUnavailable,
        naming the URL, when none answers or it rejects `auth`.
        """
        if nc is None:
            nc = await bus.connect(url, f"{self.service}:{self.store_id}", auth,
                                   first_connect_wait=bus.SERVICE_CONNECT_WAIT)
            self._own_nc = True
        self.nc = nc
        return nc

    async def serve(self, handlers: list[Handler], reporter: AdmissionReporter,
                    health_details: Callable[[], dict[str, Any]]) -> None:
        """Subscribe the handlers, start the reporter (registration, full sync), then answer health: a store
        that answers health is registered and serving."""
        assert self.nc is not None, "connect() first"
        for handler in handlers:
            self._subscriptions.append(await bus.serve(
                self.nc, protocol.Subjects.store(self.store_id, handler.op), handler.request_type, handler.handle,
                max_concurrent=handler.max_concurrent))
        self.reporter = reporter
        await reporter.start(self.nc)
        await serve_health(self.nc, self.service, self.store_id, details=health_details)

    async def stop_serving(self) -> None:
        """Take no more requests (the store may then finish its work and close)."""
        for subscription in self._subscriptions:
            try:
                await subscription.unsubscribe()
            except Exception as exc:
                log.debug("%s %s: unsubscribe failed: %s", self.service, self.store_id, exc)
        self._subscriptions = []

    async def close(self) -> None:
        """After the store closed: publish the last admissions, then close our own connection."""
        await self.stop_serving()
        if self.reporter is not None:
            await self.reporter.stop()
            self.reporter = None
        if self.nc is not None and self._own_nc:
            try:
                await self.nc.drain()
            except Exception as exc:
                log.debug("%s %s: NATS drain failed: %s", self.service, self.store_id, exc)
