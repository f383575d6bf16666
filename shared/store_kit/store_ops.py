"""The ops every chunk store answers the same way from its ChunkIndex, whatever holds its bytes (disk store,
remote store), and what one op of a store is (`Handler`); `StoreEndpoint` (shared/store_kit/store_endpoint.py) serves
them on NATS. Runs on the store's one asyncio event loop, like the store itself.

`IndexOps` answers contains / touch / pin / unpin / remove / clear / wipe / stats from the store's ChunkIndex, so
these ops mean the same thing at every store; the store supplies only what differs (how bytes are freed).

Who calls matters for every op but stats (see shared/store_kit/chunk_index.py): the caller's principal
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

from kvmesh.shared import protocol
from kvmesh.shared.messaging.sharing_domains import DomainMap
from kvmesh.shared.protocol import principal_of
from kvmesh.shared.store_kit.chunk_claims import Cleared
from kvmesh.shared.store_kit.chunk_index import ChunkIndex, IndexEntry
from kvmesh.shared.store_kit.store_bounds import StoreBounds
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)

E = TypeVar("E", bound=IndexEntry)

# pin / unpin / remove / clear / wipe requests handled at once per op: each waits for the state files to hold
# its change, and the ones waiting together share one write (more wait in NATS's queue meanwhile)
STATE_OPS_AT_ONCE = 64


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

    def usage(self, hits: int) -> protocol.TierUsage:
        """The store's holdings for its health answer (the controller's /usage); `hits`: its gets that found
        their chunk, which the store's reader counts."""
        index = self.index
        return protocol.TierUsage(num_chunks=len(index), used_bytes=index.used_bytes,
                                  capacity_bytes=index.capacity_bytes, pinned_chunks=index.pinned_count,
                                  hits=hits, evictions=index.evictions, retains_refused=index.retains_refused)



def _distinct(keys: list[ChunkKey]) -> list[ChunkKey]:
    """`keys` without repeats, in first-seen order (so a contiguous prefix stays one)."""
    return list(dict.fromkeys(keys))

