"""What every chunk store does the same way on NATS, whatever holds its bytes (disk store, remote store).

Runs on the store's one asyncio event loop, like the store itself:
  * `IndexOps` answers contains / touch / pin / unpin / remove / clear / wipe / stats from the store's ChunkIndex,
    so these ops mean the same thing at every store; the store supplies only what differs (how bytes are freed).
  * `StoreEndpoint` is the store's presence on NATS: its connection (its own, or one lent by a test), one
    subscription per op on `Subjects.store_op(store_id, op)` (the op from every caller: the subject's last tokens
    are the caller's path, which NATS permissions let only that caller publish on), its AdmissionReporter, health
    answers (on `Subjects.health(<store's path>)` and the ping-all subject); `stop_serving()` then `close()` undo
    it.

Who calls matters for every op but stats (see shared/chunk_index.py): the caller's principal
(`engine.<instance>`) is in one sharing domain (the store's DomainMap, from the administrator's domains file,
never from the message), and sees only that domain's chunks (another's is a miss); a put records the caller's
claim and never lands in another domain's chunk; `pin` / `unpin` take and drop the principal's own pins only;
`remove` and `clear` take back its own claims only (a chunk goes with its last claim); `wipe` is the operator's
alone.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from kvmesh.shared import bus, protocol
from kvmesh.shared.admissions import AdmissionReporter
from kvmesh.shared.credentials import DomainMap, credentials_for
from kvmesh.shared.chunk_index import ChunkIndex, Cleared, IndexEntry, principal_of
from kvmesh.shared.keys import ChunkKey
from kvmesh.shared.service import serve_health
from kvmesh.shared.store_bounds import StoreBounds

log = logging.getLogger(__name__)

E = TypeVar("E", bound=IndexEntry)

# pin / unpin / remove / clear / wipe requests handled at once per op: each waits for the state files to hold
# its change, and the ones waiting together share one write (more wait in NATS's queue meanwhile)
STATE_OPS_AT_ONCE = 64

# Ops whose requests carry chunk bytes inline: served on the store's bulk connection (StoreEndpoint)
BULK_OPS = frozenset({"put"})


@dataclass(frozen=True)
class Handler:
    """One op of a store: requests of `request_type` on `Subjects.store_op(store_id, op)`, answered by
    `handle(request, caller)`, `caller` being the caller's path (`engine.<instance>.<worker>`, `operator`...)."""

    op: str
    request_type: type[Any]
    handle: Callable[[Any, str], Awaitable[Any]]
    max_concurrent: int = 1  # 1: one request at a time, in arrival order; more for ops that wait on I/O

    @classmethod
    def anyone(cls, op: str, request_type: type[Any], handle: Callable[[Any], Awaitable[Any]],
               max_concurrent: int = 1) -> "Handler":
        """An op answered the same whoever asks."""

        async def handle_anyone(request: Any, _caller: str) -> Any:
            return await handle(request)

        return cls(op, request_type, handle_anyone, max_concurrent)


async def _nothing() -> None:
    pass


class IndexOps(Generic[E]):
    """contains / touch / pin / unpin / remove / clear / wipe / stats of one store, answered from its ChunkIndex.

    What differs between stores comes in as callables: `free(removed)` releases what chunks that left the
    index used (files, buffers); `settle(keys)` waits for puts of these keys still in flight before a pin (so a
    pin right after a put covers it); `persist()` returns once the store's pins and claims files hold the index
    as it is (raises OSError if they could not be written; a no-op for a store that keeps them in memory only):
    pin, unpin, remove, clear and wipe are answered after it, so what they answered survives a crash. Those
    waiting at once share writes (STATE_OPS_AT_ONCE). `details()` is the store's own part of the stats.

    Counts (`CommandReply.num_tokens` / `num_chunks`): pin and unpin answer the stored token counts of the
    chunks they pinned or unpinned. wipe counts the chunks it forgot and the puts in flight it discarded (puts
    that may already have been answered ok, and that the wipe undoes). remove (the caller's principal) and clear
    (the caller path) count what left the caller's view: every chunk, held, pinned or in flight, whose claim it took back,
    whether or not another caller's claim or a pin keeps it in the store. So the controller's `/clear` of
    LocalDiskBackend for instance A (each rank clears its own claims, the reply is the minimum over the ranks)
    reports A's tokens, never B's, and the same whether or not B put the same chunks.

    Keys per request: at most `bounds.max_keys_per_request` (more: an error reply, counted in the stats details
    as `requests_too_many_keys`). touch, pin, unpin and remove act once per distinct key of a request (a key
    repeated a million times is one key: it pins once, and costs one lookup); contains answers the held prefix of
    the keys as sent.
    """

    def __init__(self, store_id: str, index: ChunkIndex[E], free: Callable[[list[tuple[ChunkKey, E]]], None],
                 details: Callable[[], dict[str, Any]],
                 settle: Callable[[list[ChunkKey]], Awaitable[None]] | None = None,
                 persist: Callable[[], Awaitable[None]] = _nothing, bounds: StoreBounds = StoreBounds(),
                 domains: DomainMap | None = None) -> None:
        self.store_id = store_id
        self.domains = domains if domains is not None else DomainMap(None)
        self.index = index
        self._free = free
        self._details = details
        self._settle = settle
        self._persist = persist
        self._bounds = bounds
        self.too_many_keys = 0  # requests refused for naming more than max_keys_per_request keys

    def handlers(self) -> list[Handler]:
        keys = protocol.ChunkKeys
        at_once = STATE_OPS_AT_ONCE
        return [Handler("contains", keys, self._bounded(self.contains)),
                Handler("touch", keys, self._bounded(self.touch)),
                Handler("pin", keys, self._bounded(self.pin), at_once),
                Handler("unpin", keys, self._bounded(self.unpin), at_once),
                Handler("remove", keys, self._bounded(self.remove), at_once),
                Handler("clear", protocol.ClearRequest, self.clear, at_once),
                Handler("wipe", protocol.WipeRequest, self.wipe, at_once),
                Handler.anyone("stats", protocol.StatsRequest, self.stats)]

    def domain_of(self, caller: str) -> str:
        """The sharing domain of `caller`'s principal (the store's domains map)."""
        return self.domains.domain_of(caller)

    def _bounded(self, handle: Callable[[protocol.ChunkKeys, str], Awaitable[Any]]
                 ) -> Callable[[protocol.ChunkKeys, str], Awaitable[Any]]:
        """`handle`, refusing a request with more keys than the bound before any of them is looked at."""

        async def bounded(request: protocol.ChunkKeys, caller: str) -> Any:
            error = self._bounds.too_many_keys(len(request.keys))
            if error is None:
                return await handle(request, caller)
            self.too_many_keys += 1
            log.warning("store %s: refused a request of %d keys (--max-keys-per-request %d)", self.store_id,
                        len(request.keys), self._bounds.max_keys_per_request)
            return protocol.Ack(ok=False, error=f"store {self.store_id}: {error}")

        return bounded

    async def contains(self, request: protocol.ChunkKeys, caller: str) -> protocol.ContainsReply:
        return protocol.ContainsReply(prefix=self.index.contains_prefix(request.keys, self.domain_of(caller)))

    async def touch(self, request: protocol.ChunkKeys, caller: str) -> protocol.Ack:
        """Hits an engine served: these chunks count as just used (the eviction policy decides what that means)."""
        domain = self.domain_of(caller)
        for key in _distinct(request.keys):
            self.index.touch(key, domain)
        return protocol.Ack()

    async def pin(self, request: protocol.ChunkKeys, caller: str) -> protocol.CommandReply:
        """One more pin of the caller's principal on the contiguous prefix of the keys held in its domain."""
        if request.ttl_secs is not None and not request.ttl_secs > 0:
            return protocol.CommandReply(ok=False, error=f"ttl_secs must be > 0 (or absent), got {request.ttl_secs}")
        keys = _distinct(request.keys)
        if self._settle is not None:
            await self._settle(keys)
        pinned = self.index.pin(keys, request.ttl_secs, owner=principal_of(caller), domain=self.domain_of(caller))
        return await self._persisted("pin", protocol.CommandReply(
            ok=True, num_tokens=self.index.tokens_of(pinned), num_chunks=len(pinned)))

    async def unpin(self, request: protocol.ChunkKeys, caller: str) -> protocol.CommandReply:
        """Drop one of the caller's principal's own pins from the contiguous prefix it pins (0: it pins none)."""
        unpinned = self.index.unpin(_distinct(request.keys), owner=principal_of(caller),
                                    domain=self.domain_of(caller))
        reply = protocol.CommandReply(ok=True, num_tokens=self.index.tokens_of(unpinned), num_chunks=len(unpinned))
        self._free(self.index.forget_orphans())  # chunks a clear left to their pins: the last pin went
        return await self._persisted("unpin", reply)

    async def remove(self, request: protocol.ChunkKeys, caller: str) -> protocol.CommandReply:
        """Take back the caller's principal's claims (every worker's) on the keys: a chunk goes with its last
        claim (a pinned one with its last pin). Counts what left the caller's view, as `clear` does: 0 for chunks
        it holds no claim on, whoever else holds them."""
        principal = principal_of(caller)
        removed: Cleared[E] = Cleared()
        for key in _distinct(request.keys):
            released = self.index.release(key, principal)
            removed.released += released.released
            removed.forgotten += released.forgotten
            removed.discarded += released.discarded
        self._free(removed.forgotten)
        return await self._persisted("remove", protocol.CommandReply(
            ok=True, num_tokens=removed.num_tokens, num_chunks=len(removed.released)))

    async def clear(self, request: protocol.ClearRequest, caller: str) -> protocol.CommandReply:
        """Take back `caller`'s claims; see the class docstring for what the reply counts."""
        cleared = self.index.clear(caller)
        forgotten = cleared.forgotten + self.index.forget_orphans()
        self._free(forgotten)
        log.info("store %s: %s cleared its claims on %d chunks (%d tokens); %d of them forgotten, %d puts in "
                 "flight discarded", self.store_id, caller, len(cleared.released), cleared.num_tokens,
                 len(forgotten), len(cleared.discarded))
        return await self._persisted("clear", protocol.CommandReply(
            ok=True, num_tokens=cleared.num_tokens, num_chunks=len(cleared.released)))

    async def wipe(self, request: protocol.WipeRequest, caller: str) -> protocol.CommandReply:
        """Forget every unpinned chunk and discard every put in flight, whoever put them: the operator's alone.
        Refused for any other caller, whatever the NATS permissions let through."""
        if caller != protocol.OPERATOR.path:
            log.warning("store %s: refused a wipe from %s", self.store_id, caller)
            return protocol.CommandReply(ok=False, error=(
                f"store {self.store_id}: wipe is the operator's alone, not {caller}'s (a caller clears its own "
                "chunks with `clear`)"))
        discarded = [entry for _, entry in self.index.in_flight_items()]
        reply = await self._removed("wipe", self.index.wipe(), discarded)
        log.info("store %s: wiped %d chunks (%d tokens); %d pinned kept", self.store_id, reply.num_chunks,
                 reply.num_tokens, self.index.pinned_count)
        return reply

    async def _removed(self, op: str, removed: list[tuple[ChunkKey, E]], discarded: list[E]) -> protocol.CommandReply:
        self._free(removed)
        gone = [entry for _, entry in removed] + discarded
        return await self._persisted(op, protocol.CommandReply(
            ok=True, num_tokens=sum(entry.num_tokens for entry in gone), num_chunks=len(gone)))

    async def _persisted(self, op: str, reply: protocol.CommandReply) -> protocol.CommandReply:
        """`reply` once the state files hold what `op` changed; else the same counts with ok=False and why."""
        try:
            await self._persist()
        except OSError as exc:
            log.error("store %s: %s done in memory, but its pins/claims could not be saved: %s", self.store_id,
                      op, exc)
            return dataclasses.replace(reply, ok=False, error=(
                f"store {self.store_id}: {op} done in memory, but its pins/claims could not be saved, so a "
                f"restart may undo it: {exc}"))
        return reply

    async def stats(self, request: protocol.StatsRequest | None = None) -> protocol.StatsReply:
        index = self.index
        return protocol.StatsReply(store_id=self.store_id, num_chunks=len(index), used_bytes=index.used_bytes,
                                   capacity_bytes=index.capacity_bytes, pinned_chunks=index.pinned_count,
                                   details={"cache_policy": index.policy_name, "claimants": len(index.claim_counts()),
                                            "requests_too_many_keys": self.too_many_keys, **self._details()})


class StoreEndpoint:
    """A store's connection, subscriptions, admission reporter and health answers (see the module docstring).

    `service` names the kind of store ("disk_store", "remote_store"): in health replies and the connection name.
    Each op's subscription queues at most `queue_bytes` of requests (--request-queue-mb); what arrives past it is
    dropped by nats-py and counted in `dropped`, so a flood costs the store no more memory than that.

    Two connections of its own (issue 24, finding 5): `bulk_nc` (named `<service>:<store_id>:bulk`) takes the
    ops that carry chunk bytes inline (BULK_OPS: put), `nc` everything else (gets, contains, pins, clears,
    stats, health, admissions). nats-server keeps a pending budget per connection (max_pending) and cuts off a
    connection whose reader falls behind it; a reader in Python can always be outrun by enough publishers of
    large messages, so a flood of inline puts can still get the bulk connection cut off (it reconnects by
    itself, and puts sent meanwhile fail), never the control one. A lent connection serves both.
    """

    def __init__(self, service: str, store_id: str, queue_bytes: int = bus.PENDING_BYTES_LIMIT) -> None:
        self.service = service
        self.store_id = store_id
        self.queue_bytes = queue_bytes
        self.nc: NatsClient | None = None
        self.bulk_nc: NatsClient | None = None
        self.reporter: AdmissionReporter | None = None
        self._own_nc = False
        self._subscriptions: list[Subscription] = []

    async def connect(self, nc: NatsClient | None, url: str, auth: bus.NatsAuth | None = None) -> NatsClient:
        """`nc` if given (lent: `close` leaves it open, and it carries bulk ops too), else two connections of our
        own, control and bulk (see the class docstring); the control one is returned.

        Our own waits up to `bus.SERVICE_CONNECT_WAIT` for a NATS still starting and raises MeshUnavailable,
        naming the URL, when none answers or it rejects `auth`. Without `auth`, a store started by hand next to a
        NATS that KVMesh started on this host adds its own user to it, as engines do.
        """
        if nc is None:
            auth = credentials_for(url, protocol.Principal.store(self.store_id), auth.or_none() if auth else None)
            nc = await bus.connect(url, f"{self.service}:{self.store_id}", auth,
                                   first_connect_wait=bus.SERVICE_CONNECT_WAIT)
            self._own_nc = True
            try:
                self.bulk_nc = await bus.connect(url, f"{self.service}:{self.store_id}:bulk", auth,
                                                 first_connect_wait=bus.SERVICE_CONNECT_WAIT)
            except BaseException:
                await nc.close()
                raise
        self.nc = nc
        return nc

    def connections(self) -> list[NatsClient]:
        """The store's connections: control first, then bulk if it has its own."""
        return [nc for nc in (self.nc, self.bulk_nc) if nc is not None]

    async def serve(self, handlers: list[Handler], reporter: AdmissionReporter,
                    health_details: Callable[[], dict[str, Any]]) -> None:
        """Subscribe the handlers, start the reporter (registration, full sync), then answer health: a store
        that answers health is registered and serving."""
        assert self.nc is not None, "connect() first"
        for handler in handlers:
            nc = self.bulk_nc if handler.op in BULK_OPS and self.bulk_nc is not None else self.nc
            self._subscriptions.append(await bus.serve_from(
                nc, protocol.Subjects.store_op(self.store_id, handler.op), handler.request_type,
                _from_caller(handler), max_concurrent=handler.max_concurrent, pending_bytes_limit=self.queue_bytes))
        self.reporter = reporter
        await reporter.start(self.nc)
        await serve_health(self.nc, self.service, self.store_id, protocol.store_path(self.store_id),
                           details=health_details)
        for nc in self.connections():  # the server has every subscription: a request sent from now on finds its op
            await nc.flush()

    @property
    def dropped(self) -> int:
        """Requests dropped so far because their op's queue was full (0 on a connection not made by bus.connect)."""
        return sum(counts[subscription] for nc in self.connections()
                   if (counts := getattr(nc, "dropped", None)) is not None for subscription in self._subscriptions)

    def counters(self) -> dict[str, int]:
        """For the store's stats details: requests dropped, full syncs published and the asks they served."""
        reporter = self.reporter
        return {"requests_dropped": self.dropped, "full_syncs": reporter.syncs_published if reporter else 0,
                "sync_asks": reporter.sync_asks if reporter else 0}

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
        if self._own_nc:
            for nc in self.connections():
                try:
                    await nc.drain()
                except Exception as exc:
                    log.debug("%s %s: NATS drain failed: %s", self.service, self.store_id, exc)


def _distinct(keys: list[ChunkKey]) -> list[ChunkKey]:
    """`keys` without repeats, in first-seen order (so a contiguous prefix stays one)."""
    return list(dict.fromkeys(keys))


def _from_caller(handler: Handler) -> Callable[[Any, str], Awaitable[Any]]:
    """`handler.handle` as a bus handler: the caller is the path the message's subject ends in."""

    def handle(request: Any, subject: str) -> Awaitable[Any]:
        return handler.handle(request, protocol.Subjects.caller_of_store_op(subject))

    return handle
