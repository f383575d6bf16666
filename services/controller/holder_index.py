"""The holder index: which producers (engine workers, stores) hold which chunk keys. A pure data structure (no NATS, no clock).

It lives in the controller process and is only touched from the controller's event loop (ingest handlers,
lookups and the maintenance task all run there), so it needs no lock.

Memory is the design constraint (≤ 200 bytes per indexed key at millions of keys): one shared dict maps a
16-byte key to an int bitmask of producer *slots*. A key costs its bytes object (~49 B), one dict entry
(~40–80 B with the table's slack) and, for masks above 256, a small int (~28 B); there are no per-producer
sets of keys. The dict holds only untracked objects (bytes, int), so CPython's cyclic GC never walks it.

Admission order (who serves a P2P hit, services/controller/peers.py): for the slots marked ordered (engine
workers' CPU tiers) the index also keeps the order in which they admitted each key, as the controller applied
their admissions. A key that one ordered slot holds needs no entry; one that several hold has a tuple of their
slots, earliest admission first. So the order costs memory only for chunks several CPU tiers hold at once.
"""

from __future__ import annotations

import heapq
from typing import Collection, Iterable, Protocol

from kvmesh.shared.wire.keys import ChunkKey


class IndexWatcher(Protocol):
    """Told of every change to the index (the KV event stream, kv_event_stream.py), after it is made."""

    def changed(self, slot: int, stored: list[ChunkKey], removed: list[ChunkKey]) -> None:
        """`slot` gained `stored` and lost `removed` (exactly the keys whose bit changed)."""

    def cleared(self, slot: int) -> None:
        """`slot` holds no key any more (it was cleared or released)."""


class HolderIndex:
    """Key -> bitmask of the producer slots that hold it.

    Invariant: a key is present iff its mask is non-zero, and bit `s` of `mask(key)` is set iff the producer
    in slot `s` holds the key as last reported. `count(s)` is exactly the number of keys with bit `s` set;
    it lets a full sync skip the sweep for stale keys when there are none (the usual case after a restart).
    `order(key)` lists the ordered slots holding `key` by first admission: a slot that evicts a key and admits
    it again goes last; one that holds it through a full sync keeps its place.
    """

    def __init__(self) -> None:
        self._masks: dict[ChunkKey, int] = {}
        self._counts: list[int] = []
        self._free: list[int] = []  # released slots, reused lowest first so masks stay narrow
        self._ordered = 0  # bits of the slots whose admission order is kept
        self._order: dict[ChunkKey, tuple[int, ...]] = {}  # keys two or more ordered slots hold -> those slots
        self.watcher: IndexWatcher | None = None  # None: no key lists are gathered (the usual case)

    def new_slot(self) -> int:
        """A producer slot: a released one if any (no key has its bit), else a new one. A producer keeps its
        slot across restarts; only a forgotten producer's slot is released (`release_slot`)."""
        if self._free:
            return heapq.heappop(self._free)
        self._counts.append(0)
        return len(self._counts) - 1

    def release_slot(self, slot: int) -> None:
        """Drop every key of `slot` and make it available to `new_slot` (its producer is forgotten)."""
        self.clear_slot(slot)
        self._ordered &= ~(1 << slot)
        heapq.heappush(self._free, slot)

    def set_ordered(self, slot: int, ordered: bool) -> None:
        """Keep the admission order of `slot`'s keys (an engine worker's CPU tier), or not (a store). When that
        changes for a slot holding keys (an id that was a store registers as an engine) its keys are dropped:
        a full sync follows every registration and brings them back, in order."""
        bit = 1 << slot
        if bool(self._ordered & bit) != ordered:
            self.clear_slot(slot)
            self._ordered ^= bit

    def order(self, key: ChunkKey) -> tuple[int, ...]:
        """The ordered slots holding `key`, earliest admission first."""
        entry = self._order.get(key)
        if entry is not None:
            return entry
        held = self._masks.get(key, 0) & self._ordered  # at most one bit: two would have an entry
        return (held.bit_length() - 1,) if held else ()

    def first_of(self, key: ChunkKey, candidates: int) -> int | None:
        """The slot among `candidates` (a mask) that admitted `key` first of those holding it, or None."""
        entry = self._order.get(key)
        if entry is None:
            held = self._masks.get(key, 0) & candidates & self._ordered
            return held.bit_length() - 1 if held else None
        return next((slot for slot in entry if candidates >> slot & 1), None)

    @property
    def num_slots(self) -> int:
        """Slots in use (the widest mask is at most the highest of them plus one bit)."""
        return len(self._counts) - len(self._free)

    def __len__(self) -> int:
        return len(self._masks)

    def count(self, slot: int) -> int:
        return self._counts[slot]

    def mask(self, key: ChunkKey) -> int:
        return self._masks.get(key, 0)

    def masks(self, keys: Iterable[ChunkKey]) -> list[int]:
        get = self._masks.get
        return [get(key, 0) for key in keys]

    @property
    def table(self) -> dict[ChunkKey, int]:
        """The raw dict, read-only by convention: the lookup path reads it without a method call per key."""
        return self._masks

    def admit(self, slot: int, keys: Iterable[ChunkKey]) -> int:
        """Set `slot`'s bit on `keys`; returns how many keys gained it (an ordered slot goes last in their order)."""
        bit = 1 << slot
        masks = self._masks
        get = masks.get
        added = 0
        gained: list[ChunkKey] | None = [] if self.watcher is not None else None
        if self._ordered & bit:
            others, order = self._ordered & ~bit, self._order
            for key in keys:
                mask = get(key, 0)
                if not mask & bit:
                    masks[key] = mask | bit
                    added += 1
                    if gained is not None:
                        gained.append(key)
                    earlier = mask & others
                    if earlier:  # no entry yet means one earlier ordered holder
                        order[key] = order.get(key, (earlier.bit_length() - 1,)) + (slot,)
        else:
            for key in keys:
                mask = get(key, 0)
                if not mask & bit:
                    masks[key] = mask | bit
                    added += 1
                    if gained is not None:
                        gained.append(key)
        self._counts[slot] += added
        if gained and self.watcher is not None:
            self.watcher.changed(slot, gained, [])
        return added

    def evict(self, slot: int, keys: Iterable[ChunkKey], tell: bool = True) -> int:
        """Clear `slot`'s bit on `keys` (unknown keys are ignored); returns how many keys lost it. `tell`: the
        watcher hears of the keys (a clear tells it `cleared` instead)."""
        bit = 1 << slot
        masks = self._masks
        get = masks.get
        removed = 0
        lost: list[ChunkKey] | None = [] if tell and self.watcher is not None else None
        order = self._order if self._ordered & bit else None
        for key in keys:
            mask = get(key, 0)
            if mask & bit:
                mask ^= bit
                if mask:
                    masks[key] = mask
                else:
                    del masks[key]
                removed += 1
                if lost is not None:
                    lost.append(key)
                if order is not None and key in order:
                    rest = tuple(other for other in order[key] if other != slot)
                    if len(rest) > 1:
                        order[key] = rest
                    else:
                        del order[key]
        self._counts[slot] -= removed
        if lost and self.watcher is not None:
            self.watcher.changed(slot, [], lost)
        return removed

    def replace(self, slot: int, keys: Collection[ChunkKey]) -> int:
        """Make `slot` hold exactly `keys` (the result of a full sync); returns how many stale keys were dropped.

        Setting the bits first makes `count(slot) - len(keys)` the number of stale keys, so the full sweep
        (O(all keys), ~0.1 s per million on a slow core) only runs when something really is stale.
        """
        self.admit(slot, keys)
        if self._counts[slot] == len(keys):
            return 0
        bit = 1 << slot
        stale = [key for key, mask in self._masks.items() if mask & bit and key not in keys]
        return self.evict(slot, stale)

    def clear_slot(self, slot: int) -> int:
        """Drop every key of `slot`; returns how many."""
        if not self._counts[slot]:
            return 0
        bit = 1 << slot
        dropped = self.evict(slot, [key for key, mask in self._masks.items() if mask & bit], tell=False)
        if self.watcher is not None:
            self.watcher.cleared(slot)
        return dropped
