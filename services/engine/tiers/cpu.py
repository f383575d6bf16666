"""The CPU tier (`LocalCPUBackend`): chunks resident in the engine's memory pool, evicted by the configured
`cache_policy` (LRU, LFU, FIFO, MRU: shared/eviction/) under the pool's size.

Threads: any; one lock guards the index and the eviction policy (taken before the pool's lock, never after).
vLLM's worker thread reads and writes it on store/retrieve, the NATS loop thread on fetches, write-behind
completions and controller commands. Nothing here touches NATS: admissions and evictions are handed to the
`AdmissionReporter` (a cheap, thread-safe append) which publishes them from the loop.

With `keep=False` (config `local_cpu: false`) the tier is a staging area: chunks stay only until their
write-behind to the lower tiers completes (`drop_staged`), and nothing is reported as held on the CPU.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Iterable

from kvmesh.services.engine.core.memory_pool import MemoryPool, Slot
from kvmesh.shared.admissions import AdmissionReporter
from kvmesh.shared.eviction import EvictionPolicy, make_policy
from kvmesh.shared.keys import ChunkKey
from kvmesh.shared.protocol import ChunkMeta

log = logging.getLogger(__name__)


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
    the last holder releases it. Every chunk costs one slot (`pool.slot_nbytes`) in the policy's byte count.
    """

    location = "LocalCPUBackend"

    def __init__(self, pool: MemoryPool, keep: bool = True, policy: str = "LRU",
                 reporter: AdmissionReporter | None = None) -> None:
        self.pool = pool
        self.keep = keep
        self._policy: EvictionPolicy = make_policy(policy, pool.capacity_bytes)
        self._entries: dict[ChunkKey, ChunkRef] = {}
        self._lock = threading.Lock()
        self._reporter = reporter

    # ---- reporting -------------------------------------------------------------------------------------------
    def attach_reporter(self, reporter: AdmissionReporter | None) -> None:
        """Start (or stop, with None) reporting admissions/evictions; the reporter's full sync covers the past."""
        with self._lock:
            self._reporter = reporter if self.keep else None

    def _admitted(self, key: ChunkKey) -> None:
        if self._reporter is not None:
            self._reporter.admit(key)

    def _evicted(self, key: ChunkKey) -> None:
        if self._reporter is not None:
            self._reporter.evict(key)

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

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._policy.used_bytes

    # ---- reads and writes ------------------------------------------------------------------------------------
    def acquire(self, key: ChunkKey) -> ChunkRef | None:
        """The chunk with a reference for the caller (a hit for the policy), or None on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._policy.touch(key)
            entry.slot.ref()
            return ChunkRef(entry.meta, entry.slot)

    def allocate(self) -> Slot | None:
        """A free pool slot, evicting idle chunks in the policy's victim order if needed; None if nothing can go.

        Chunks whose slot is still held elsewhere (being written behind or read) are passed over: evicting
        them would not free memory now. Pinned chunks are never victims.
        """
        slot = self.pool.allocate()
        if slot is not None:
            return slot
        with self._lock:
            for key in self._policy.evictable():  # unpinned (expired pins released), first victim first
                entry = self._entries[key]
                if entry.slot.refs != 1:
                    continue
                self._remove_locked(key)
                slot = self.pool.allocate()
                if slot is not None:
                    return slot
        return self.pool.allocate()  # a reader may have released one meanwhile

    def put(self, meta: ChunkMeta, slot: Slot) -> bool:
        """Make the chunk resident; the tier takes over the caller's slot reference (also on False).

        False when the key is already resident (the new copy is dropped) or when the policy has no room
        because everything resident is pinned.
        """
        key = meta.key
        with self._lock:
            if key in self._entries:
                self._policy.touch(key)
                slot.release()
                return False
            victims = self._policy.victims_for(self.pool.slot_nbytes)
            if victims is None:
                slot.release()
                return False
            for victim in victims:
                self._remove_locked(victim)
            self._entries[key] = ChunkRef(meta, slot)
            self._policy.add(key, self.pool.slot_nbytes)
            if self.keep:
                self._admitted(key)
        return True

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
        if self.keep:
            self._evicted(key)
        entry.slot.release()
        return entry

    # ---- controller operations -------------------------------------------------------------------------------
    def pin(self, keys: Iterable[ChunkKey], ttl_secs: float | None = None) -> int:
        """Pin the resident prefix of `keys`; the number of tokens pinned."""
        num_tokens = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or not self._policy.pin(key, ttl_secs):
                    break
                num_tokens += entry.meta.num_tokens
        return num_tokens

    def unpin(self, keys: Iterable[ChunkKey]) -> int:
        """Drop one pin of each pinned key of the prefix; the number of tokens unpinned."""
        num_tokens = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or not self._policy.unpin(key):
                    break
                num_tokens += entry.meta.num_tokens
        return num_tokens

    def is_pinned(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._policy.is_pinned(key)

    def clear(self) -> int:
        """Remove every chunk, pinned ones included; the number of tokens removed.

        The CPU tier belongs to this instance alone, so an operator's clear of it wipes it (seeds 000/001: pin,
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
        """Drop every chunk, pinned or not (the engine is closing)."""
        with self._lock:
            for key in list(self._entries):
                entry = self._entries.pop(key)
                self._policy.remove(key)
                entry.slot.release()
