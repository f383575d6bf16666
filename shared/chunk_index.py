"""A chunk store's index: held chunks, puts in flight, eviction order, pins and token counts.

Bookkeeping only, no I/O and no locks: a store calls it from its own event loop thread and does the work the
index asks for (free these victims' bytes, this put may now be seen). Both chunk stores use it (the remote
store's memory, the disk store's files; shared/store_service.py answers their control ops from it), so that
contains / pin / unpin / remove / clear mean the same thing everywhere:

  * contains(keys)  -> how many leading keys are held (a put still in flight is not held);
  * pin(keys)       -> the contiguous held prefix gets one more pin (pins nest, optional TTL);
  * unpin(keys)     -> the contiguous pinned prefix loses one pin;
  * remove(key)     -> forgets a held key (pinned or not) and discards a put of it in flight;
  * clear()         -> forgets every unpinned key and discards every put in flight.

Every change of what is held is reported through `on_admit` / `on_evict` (an AdmissionReporter's methods).
An entry's `charge` is what it counts against the capacity: the remote store's buffer size class, the disk
store's file size (header page + data), which both differ from the chunk's own `nbytes`. Which chunks are evicted
first is the store's `cache_policy` (LRU, LFU, FIFO, MRU: shared/eviction/).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Protocol, TypeVar

from kvmesh.shared.errors import StoreError
from kvmesh.shared.eviction import Clock, make_policy
from kvmesh.shared.keys import ChunkKey


class IndexEntry(Protocol):
    """What the index needs to know of a store's per-chunk record."""

    @property
    def charge(self) -> int:  # bytes counted against the capacity
        ...

    @property
    def num_tokens(self) -> int:
        ...


E = TypeVar("E", bound=IndexEntry)


class SpaceRefused(StoreError):
    """No room for a chunk even after evicting every unpinned one; nothing was changed."""


@dataclass
class _InFlight(Generic[E]):
    entry: E
    discard: bool = False  # removed or cleared while in flight: do not hold it when it lands


def _ignore(_: ChunkKey) -> None:
    pass


class ChunkIndex(Generic[E]):
    """Held chunks under a byte budget, with eviction by the named policy (default LRU) and pins.

    Invariant: a key is held (in `_held` and in the eviction policy: visible to contains/get, its charge in
    `used_bytes`), in flight (in `_in_flight`, its charge in `reserved_bytes`, invisible and never a victim), or
    unknown; never two of these. `used_bytes + reserved_bytes <= capacity_bytes` holds after every `reserve`.
    """

    def __init__(self, capacity_bytes: int, on_admit: Callable[[ChunkKey], None] = _ignore,
                 on_evict: Callable[[ChunkKey], None] = _ignore, *, policy: str = "LRU",
                 clock: Clock = time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        # ValueError naming `cache_policy` if unknown; pin TTLs expire on `clock`
        self._policy = make_policy(policy, capacity_bytes, clock)
        self._held: dict[ChunkKey, E] = {}
        self._in_flight: dict[ChunkKey, _InFlight[E]] = {}
        self.reserved_bytes = 0
        self.on_admit = on_admit
        self.on_evict = on_evict
        self._pins_version = 0

    # ---- queries -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._held

    @property
    def used_bytes(self) -> int:
        return self._policy.used_bytes

    @property
    def policy_name(self) -> str:
        """The eviction policy's `cache_policy` name (LRU, LFU, FIFO, MRU)."""
        return self._policy.name

    @property
    def pinned_count(self) -> int:
        return self._policy.pinned_count

    @property
    def in_flight_count(self) -> int:
        return len(self._in_flight)

    @property
    def pins_version(self) -> int:
        """Bumped whenever pins are taken, dropped or lose their key: a store persisting pins saves on change."""
        return self._pins_version

    def held(self, key: ChunkKey) -> E | None:
        """The entry of a held key, without changing its recency."""
        return self._held.get(key)

    def is_known(self, key: ChunkKey) -> bool:
        """Held, or in flight and still wanted."""
        return key in self._held or self.in_flight(key) is not None

    def in_flight(self, key: ChunkKey) -> E | None:
        """The entry of a put of `key` in flight and still wanted (it becomes held when it lands)."""
        flight = self._in_flight.get(key)
        return flight.entry if flight is not None and not flight.discard else None

    def in_flight_items(self) -> list[tuple[ChunkKey, E]]:
        """Every put in flight and still wanted."""
        return [(key, flight.entry) for key, flight in self._in_flight.items() if not flight.discard]

    def is_pinned(self, key: ChunkKey) -> bool:
        return self._policy.is_pinned(key)

    def keys(self) -> list[ChunkKey]:
        return list(self._held)

    def contains_prefix(self, keys: Iterable[ChunkKey]) -> int:
        count = 0
        for key in keys:
            if key not in self._held:
                break
            count += 1
        return count

    # ---- reads -------------------------------------------------------------------------------------------
    def touch(self, key: ChunkKey) -> E | None:
        """The entry of a held key, counted as a hit by the policy (LRU: now the most recent); None if not held."""
        entry = self._held.get(key)
        if entry is not None:
            self._policy.touch(key)
        return entry

    # ---- puts --------------------------------------------------------------------------------------------
    def reserve(self, key: ChunkKey, entry: E) -> list[tuple[ChunkKey, E]]:
        """Accept a put: evict the policy's victims to make room and count the entry's charge as reserved.

        Returns the evicted (key, entry) pairs, whose bytes the store frees. Raises SpaceRefused, changing
        nothing, when pinned chunks and puts in flight leave no room. The key must not be known.
        """
        if self.is_known(key):
            raise ValueError(f"chunk {key.hex()} is already held or in flight")
        victims = self._policy.victims_for(entry.charge + self.reserved_bytes)
        if victims is None:
            pinned = sum(self._held[k].charge for k in self._held if self._policy.is_pinned(k))
            raise SpaceRefused(f"no room for chunk {key.hex()} of {entry.charge} bytes: capacity "
                               f"{self.capacity_bytes}, pinned {pinned}, in flight {self.reserved_bytes}")
        evicted = [(victim, self._forget(victim)) for victim in victims]
        stale = self._in_flight.pop(key, None)  # a discarded put of the same key still landing: superseded
        if stale is not None:
            self.reserved_bytes -= stale.entry.charge
        self._in_flight[key] = _InFlight(entry)
        self.reserved_bytes += entry.charge
        return evicted

    def revive(self, key: ChunkKey) -> bool:
        """A new put of a key whose put is in flight (even one discarded by a removal): keep that one.

        True if there is one, which will now be held when it lands; the new put then has nothing to do. For a
        store whose put in flight already has the bytes (the disk store's staged write); the remote store lets
        the new put supersede instead (`reserve`), since its bytes are still arriving.
        """
        flight = self._in_flight.get(key)
        if flight is None:
            return False
        flight.discard = False
        return True

    def commit(self, key: ChunkKey, entry: E | None = None) -> bool:
        """The put of `entry` landed: True if it is now held, False if it was discarded (or superseded).

        `entry` tells a superseded put from the one that replaced it; None means the put in flight, whichever.
        """
        flight = self._in_flight.get(key)
        if flight is None or (entry is not None and flight.entry is not entry):
            return False
        del self._in_flight[key]
        self.reserved_bytes -= flight.entry.charge
        if flight.discard:
            return False
        self._held[key] = flight.entry
        self._policy.add(key, flight.entry.charge)
        self.on_admit(key)
        return True

    def abort(self, key: ChunkKey, entry: E | None = None) -> None:
        """The put of `entry` (None: the put in flight, whichever) failed: release its reservation."""
        flight = self._in_flight.get(key)
        if flight is not None and (entry is None or flight.entry is entry):
            del self._in_flight[key]
            self.reserved_bytes -= flight.entry.charge

    def load(self, key: ChunkKey, entry: E) -> None:
        """Hold a chunk found at start (persisted); call oldest (least recently used) first: it arrives as a new
        key, so LRU, MRU and FIFO rebuild their order from the call order, and LFU starts every count over."""
        self._held[key] = entry
        self._policy.add(key, entry.charge)
        self.on_admit(key)

    def trim_to_capacity(self) -> list[tuple[ChunkKey, E]]:
        """Evict unpinned chunks, in the policy's victim order, until the held ones fit the capacity (after
        loading chunks persisted under a larger capacity); the evicted (key, entry) pairs."""
        return [(victim, self._forget(victim)) for victim in self._policy.victims_for(0) or []]

    # ---- removals ----------------------------------------------------------------------------------------
    def remove(self, key: ChunkKey) -> E | None:
        """Forget a held key, pinned or not, and discard a put of it in flight; the held entry or None."""
        flight = self._in_flight.get(key)
        if flight is not None:
            flight.discard = True
        return self._forget(key) if key in self._held else None

    def drop(self, key: ChunkKey, entry: E) -> bool:
        """Forget `key` only if it still holds `entry` (its bytes turned out bad or gone; a newer put of the key
        may have replaced it meanwhile). True if it was forgotten."""
        if self._held.get(key) is not entry:
            return False
        self._forget(key)
        return True

    def clear(self) -> list[tuple[ChunkKey, E]]:
        """Forget every unpinned held key and discard every put in flight; the removed (key, entry) pairs."""
        for flight in self._in_flight.values():
            flight.discard = True
        return [(key, self._forget(key)) for key in list(self._held) if not self._policy.is_pinned(key)]

    def _forget(self, key: ChunkKey) -> E:
        if self._policy.is_pinned(key):
            self._pins_version += 1
        self._policy.remove(key)
        entry = self._held.pop(key)
        self.on_evict(key)
        return entry

    # ---- pins --------------------------------------------------------------------------------------------
    def pin(self, keys: Iterable[ChunkKey], ttl_secs: float | None = None) -> list[ChunkKey]:
        """Pin the contiguous held prefix of `keys` (pins nest); the keys pinned."""
        pinned: list[ChunkKey] = []
        for key in keys:
            if key not in self._held or not self._policy.pin(key, ttl_secs):
                break
            pinned.append(key)
        self._pins_version += bool(pinned)
        return pinned

    def unpin(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """Drop one pin from each key of the contiguous pinned prefix of `keys`; the keys unpinned."""
        unpinned: list[ChunkKey] = []
        for key in keys:
            if not self._policy.unpin(key):
                break
            unpinned.append(key)
        self._pins_version += bool(unpinned)
        return unpinned

    def pins(self) -> dict[ChunkKey, tuple[int, float | None]]:
        """Live pins, to persist: key -> (nesting count, seconds left, None = until unpinned)."""
        return {key: (count, left) for key, count, left in self._policy.pins()}

    def tokens_of(self, keys: Iterable[ChunkKey]) -> int:
        return sum(entry.num_tokens for key in keys if (entry := self._held.get(key)) is not None)
