"""The CPU tier (`LocalCPUBackend`): chunks resident in the engine's memory pool, evicted by the configured
`cache_policy` (LRU, LFU, FIFO, MRU: shared/eviction/) under the pool's size.

Each entry costs the policy its slot's own bytes: with a model's two size classes (memory_pool.py: chunks and
recurrent states), a chunk its chunk-sized slot, a state its state-sized one, so the byte count, /usage and the
`lmcache:*` gauges are the bytes really held. Making room for one class by evicting an entry of the other needs
its whole slab free: the policy's first idle victim then goes with the idle entries sharing its slab
(`_idle_mates`), so one slab is freed rather than the coldest part of many.

Threads: any; one lock guards the index and the eviction policy (taken before the pool's lock, never after).
vLLM's worker thread reads and writes it on store/retrieve, the NATS loop thread on fetches, write-behind
completions and controller commands. Nothing here touches NATS: admissions and evictions are handed to the
listeners (cheap, thread-safe appends): the `AdmissionReporter` that publishes them to the controller from
the loop, and the connector's step events that tell vLLM's scheduler what this tier holds.

It is a `Tier` (base.py) for lookups and the controller's commands; its data path hands out slot
references (`acquire`, `put`) instead of copying, since its chunks already live in the memory pool.

With `keep=False` (config `local_cpu: false`) the tier is a staging area: chunks stay only until their
write-behind to the lower tiers completes (`drop_staged`), and nothing is reported as held on the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Protocol

from kvmesh.services.engine.tiers.memory_pool import MemoryPool, Slot
from kvmesh.services.engine.tiers.base import NO_RETENTION, Retention
from kvmesh.shared.eviction import Clock, EvictionPolicy, make_policy
from kvmesh.shared.protocol import LOCAL_CPU, ChunkMeta, TierUsage
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)


RETAINED_BY = "requests"  # the owner of the CPU tier's retained chunks (see `max_retained_bytes`)


class TierListener(Protocol):
    """Told of every chunk the tier starts or stops holding, in order, under the tier's lock."""

    def admit(self, key: ChunkKey) -> None: ...

    def evict(self, key: ChunkKey) -> None: ...


class EvictionHolder(Protocol):
    """Keeps chunks the tier evicts readable for a while (adapter/cpu_mirror.py: until vLLM's scheduler saw the
    eviction). Called under the tier's lock."""

    def hold(self, key: ChunkKey, ref: "ChunkRef") -> bool: ...

    def find(self, key: ChunkKey) -> "ChunkRef | None": ...

    def full(self) -> bool: ...

    def seen(self, upto: int | None) -> int: ...


@dataclass(frozen=True)
class ChunkRef:
    """A chunk's bytes held for the caller: `slot` has one reference that the caller must `release()`."""

    meta: ChunkMeta
    slot: Slot

    def release(self) -> None:
        self.slot.release()


class LocalCPUBackend:
    """Key -> (slot, meta) under an eviction policy with pins.

    Invariant: a key is in `_entries` iff it is in `_policy`, and each entry owns exactly one reference of its
    slot, dropped when the entry leaves (eviction, removal, clear). Readers take their own reference
    (`acquire`), so an eviction never frees bytes that are being read: the slot returns to the pool only when
    the last holder releases it. Every entry costs its slot's bytes (`Slot.nbytes`) in the policy's byte count;
`_keys` maps each entry's slot back to its key (to find the entries sharing a slab).
    """

    location = LOCAL_CPU

    def __init__(self, pool: MemoryPool, keep: bool = True, policy: str = "LRU",
                 clock: Clock = time.monotonic, retained_share: float = 0.5) -> None:
        self.pool = pool
        self.keep = keep
        # requests' kv_priority / leases keep at most this many bytes over the rest (`retained_cpu_share`): vLLM
        # does not tell its clients apart, so they are one principal here
        self.max_retained_bytes = int(retained_share * pool.capacity_bytes)
        self._policy: EvictionPolicy = make_policy(policy, pool.capacity_bytes, clock)  # pin TTLs run on `clock`
        self._entries: dict[ChunkKey, ChunkRef] = {}
        self._keys: dict[Slot, ChunkKey] = {}  # each entry's slot -> its key
        self._lock = threading.Lock()
        self._listeners: list[TierListener] = []
        self._holder: EvictionHolder | None = None  # evicted chunks kept readable (hold_evictions)
        # chunks a request's lookup prefetched that no read has taken yet (StorageManager bounds them)
        self._unread: set[ChunkKey] = set()
        self.hits = 0  # chunks served (`acquire` found them), for /usage
        self.evictions = 0  # chunks the policy evicted to make room (not removals or clears)
        self.retain_refused = 0  # chunks a request asked to keep past `max_retained_bytes` (held as any other)

    # ---- listeners -------------------------------------------------------------------------------------------
    def listen(self, listener: TierListener) -> list[ChunkKey]:
        """Report admissions/evictions to `listener` from now on; returns what is held now (atomically)."""
        with self._lock:
            if self.keep:
                self._listeners.append(listener)
            return list(self._entries) if self.keep else []

    def unlisten(self, listener: TierListener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def hold_evictions(self, holder: EvictionHolder | None) -> None:
        """From now on every chunk the tier removes is offered to `holder` (None: to nobody) before its slot
        is released, and reads find it there while it is held (adapter/cpu_mirror.py). Only a tier that keeps
        chunks holds them."""
        with self._lock:
            self._holder = holder if self.keep else None

    def _admitted(self, key: ChunkKey) -> None:
        for listener in self._listeners:
            listener.admit(key)

    def _evicted(self, key: ChunkKey) -> None:
        for listener in self._listeners:
            listener.evict(key)

    # ---- queries ---------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._entries

    def held_keys(self) -> list[ChunkKey]:
        """Snapshot for a full sync (empty when the tier only stages)."""
        with self._lock:
            return list(self._entries) if self.keep else []

    def prefix(self, keys: Iterable[ChunkKey]) -> int:
        """How many leading `keys` are resident."""
        count = 0
        with self._lock:
            for key in keys:
                if key not in self._entries:
                    break
                count += 1
        return count

    def note_checksum(self, ref: ChunkRef, digest: int) -> None:
        """Keep a checksum computed over `ref`'s bytes with its entry, if the tier still holds that chunk in that
        slot (a slot's bytes never change while it holds a chunk), so the next reader needs not compute it."""
        with self._lock:
            entry = self._entries.get(ref.meta.key)
            if entry is not None and entry.slot is ref.slot and not entry.meta.checksum:
                self._entries[ref.meta.key] = ChunkRef(dataclasses.replace(entry.meta, checksum=digest), entry.slot)

    def touch_keys(self, keys: Iterable[ChunkKey]) -> None:
        """Mark resident `keys` recently used (a hit served from another tier, or a batch of hits)."""
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._policy.touch(key)

    @property
    def unread_prefetched(self) -> int:
        """Chunks a request's lookup prefetched that no read has taken since (nor eviction removed)."""
        with self._lock:
            return len(self._unread)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._policy.used_bytes

    def usage(self) -> TierUsage:
        """What the tier holds, as the worker reports it to the controller's /usage."""
        with self._lock:
            return TierUsage(num_chunks=len(self._entries), used_bytes=self._policy.used_bytes,
                             capacity_bytes=self.pool.capacity_bytes, pinned_chunks=self._policy.pinned_count,
                             hits=self.hits, evictions=self.evictions, retains_refused=self.retain_refused)

    # ---- reads and writes ------------------------------------------------------------------------------------
    def acquire(self, key: ChunkKey) -> ChunkRef | None:
        """The chunk with a reference for the caller (a hit for the policy), or None on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:  # evicted, but maybe held for a load the scheduler planned before it saw that
                held = self._holder.find(key) if self._holder is not None else None
                if held is not None:
                    self.hits += 1
                return held
            self._policy.touch(key)
            entry.slot.ref()
            self._unread.discard(key)
            self.hits += 1
            return ChunkRef(entry.meta, entry.slot)

    def copy_for_stores(self, key: ChunkKey) -> ChunkRef | None:
        """The chunk with a reference for the write-behind (not a read: no hit, no recency), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            entry.slot.ref()
            return ChunkRef(entry.meta, entry.slot)

    def allocate(self, state: bool = False) -> Slot | None:
        """A free pool slot for a chunk (or with `state` a recurrent state: `ChunkSpan.state`), evicting idle
        entries in the policy's victim order if needed; None if nothing can go.

        Entries whose slot is still held elsewhere (being written behind or read) are passed over: evicting
        them would not free memory now. Pinned chunks are never victims. A victim of the other size class
        (memory_pool.py) frees no slot of this one unless its whole slab comes free: it goes with its slab
        mates, and is passed over when they cannot all go now. Where evicted entries are held
        (`hold_evictions`), no victim frees a slot until the holder lets it go: evicting stops once the holder is
        full (None: the caller's save or fetch is dropped, as with a full pool).
        """
        slot = self.pool.allocate(state)
        if slot is not None:
            return slot
        cls = self.pool.class_of(state)
        passed: set[ChunkKey] = set()  # victims whose slab cannot come free now
        with self._lock:
            while True:  # unpinned (expired pins released), first victim first, freeing room of this class
                key = self._policy.first_victim(
                    lambda k: k not in passed and self._victims_of(k, cls, check_policy=False) is not None)
                if key is None:
                    break
                victims = self._victims_of(key, cls)  # now with its mates' pins (not while the policy is walked)
                if victims is None:
                    passed.add(key)
                    continue
                for victim in victims:
                    self._remove_locked(victim)
                self.evictions += len(victims)
                slot = self.pool.allocate(state)
                if slot is not None:
                    return slot
                if self._holder is not None and self._holder.full():
                    break
        return self.pool.allocate(state)  # a reader may have released one meanwhile

    def _victims_of(self, key: ChunkKey, cls: int, check_policy: bool = True) -> list[ChunkKey] | None:
        """What evicting `key` takes to free a slot of class `cls`: `key` alone when its slot is of that class,
        else with the entries sharing its slab (that slab then comes free); None when that cannot be done now
        (its slot or a mate's is held elsewhere, a mate is not in the tier, or with `check_policy` pinned, or
        retained when `key` is not: a retained key is a victim only once the policy has no unretained one left).
        Without `check_policy` it asks the policy nothing (its queries may release expired pins: not while the
        policy walks its order)."""
        slot = self._entries[key].slot
        if slot.refs != 1:
            return None
        if slot.cls == cls:
            return [key]
        retained_ok = check_policy and self._policy.is_retained(key)
        keys = [key]
        for mate in self.pool.slab_mates(slot):
            mate_key = self._keys.get(mate)
            if mate_key is None or mate.refs != 1:
                return None
            if check_policy and (self._policy.is_pinned(mate_key)
                                 or (self._policy.is_retained(mate_key) and not retained_ok)):
                return None
            keys.append(mate_key)
        return keys

    def put(self, meta: ChunkMeta, slot: Slot, prefetched: bool = False,
            retention: Retention = NO_RETENTION) -> bool:
        """Make the chunk resident; the tier takes over the caller's slot reference (also on False).
        `prefetched`: a request's lookup prefetched it, counted in `unread_prefetched` until a read takes it.
        `retention`: the storing request's (adapter/request_retention.py), taken while the tier's retained bytes
        stay within `max_retained_bytes` (else the chunk is held as any other; `retain_refused` counts it).

        False when the key is already resident (the new copy is dropped) or when the policy has no room
        because everything resident is pinned.
        """
        key = meta.key
        with self._lock:
            if key in self._entries:
                self._policy.touch(key)
                self._retain(key, retention)
                slot.release()
                return False
            victims = self._policy.victims_for(slot.nbytes)
            if victims is None:
                slot.release()
                return False
            for victim in victims:
                self._remove_locked(victim)
            self.evictions += len(victims)
            self._entries[key] = ChunkRef(meta, slot)
            self._keys[slot] = key
            self._policy.add(key, slot.nbytes)
            self._retain(key, retention)
            if prefetched:
                self._unread.add(key)
            if self.keep:
                self._admitted(key)
        return True

    def _retain(self, key: ChunkKey, retention: Retention) -> None:
        if not retention.asked or not self.keep:
            return
        lease_secs = retention.lease_secs()
        if (retention.priority > 0 or lease_secs) and not self._policy.retain(
                key, RETAINED_BY, self.max_retained_bytes, retention.priority, lease_secs):
            self.retain_refused += 1

    def retain_keys(self, keys: Iterable[ChunkKey], retention: Retention) -> None:
        """Give resident `keys` a request's retention (a request that loaded them, or found them held when it
        saved), as `put` does."""
        if not retention.asked:
            return
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._retain(key, retention)

    def is_retained(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._policy.is_retained(key)

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._remove_locked(key) is not None

    def drop_staged(self, key: ChunkKey, slot: Slot) -> None:
        """Write-behind of a staged chunk is done: forget it unless the tier keeps chunks (or it was replaced)."""
        if self.keep:
            return
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.slot is slot and not self._policy.is_pinned(key):
                self._remove_locked(key)

    def _remove_locked(self, key: ChunkKey) -> ChunkRef | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._policy.remove(key)
        self._keys.pop(entry.slot, None)
        self._unread.discard(key)
        if self.keep:
            self._evicted(key)
        if self._holder is None or not self._holder.hold(key, entry):
            entry.slot.release()
        return entry

    # ---- Tier: lookups and the controller's commands ----------------------------------------------------------
    async def contains(self, keys: list[ChunkKey]) -> int:
        return self.prefix(keys)

    async def pin(self, keys: list[ChunkKey], num_tokens: list[int] | None = None,
                  ttl_secs: float | None = None) -> int:
        """Pin the resident prefix of `keys`; the number of tokens pinned (the tier knows each chunk's)."""
        pinned = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or not self._policy.pin(key, ttl_secs):
                    break
                pinned += entry.meta.num_tokens
        return pinned

    async def unpin(self, keys: list[ChunkKey], num_tokens: list[int] | None = None) -> int:
        """Drop one pin of each pinned key of the prefix; the number of tokens unpinned."""
        unpinned = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or not self._policy.unpin(key):
                    break
                unpinned += entry.meta.num_tokens
        return unpinned

    async def touch(self, keys: list[ChunkKey]) -> None:
        self.touch_keys(keys)

    async def clear(self) -> int:
        return self.clear_all()

    def is_pinned(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._policy.is_pinned(key)

    def clear_all(self) -> int:
        """Remove every chunk, pinned ones included; the number of tokens removed.

        The CPU tier belongs to this instance alone, so an operator's clear of it wipes it (the quickstarts: pin,
        then clear, and lookup no longer lists the instance). Pins protect chunks from eviction here; in the
        disk and remote stores, which other instances share, they also survive a clear.
        """
        num_tokens = 0
        with self._lock:
            for key in list(self._entries):
                entry = self._remove_locked(key)
                if entry is not None:
                    num_tokens += entry.meta.num_tokens
        return num_tokens

    def close(self) -> None:
        """Drop every chunk, pinned or not, and every held one (the engine is closing)."""
        with self._lock:
            for key in list(self._entries):
                entry = self._entries.pop(key)
                self._policy.remove(key)
                self._keys.pop(entry.slot, None)
                entry.slot.release()
            holder, self._holder = self._holder, None
        if holder is not None:
            holder.seen(None)
