"""What every eviction policy shares: byte accounting under a budget, pins that nest with an optional TTL,
their expiry, and the refusal rule. A policy subclass only says in which order unpinned keys become victims
and what a hit does to that order.

Users: the engine's CPU tier (services/engine/tiers/cpu.py, under its own lock) and `ChunkIndex`
(shared/store_kit/chunk_index.py, on a store's event loop thread), which the disk store and the remote store both use.
Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, ClassVar, Collection, Hashable, Iterator

Key = Hashable
Clock = Callable[[], float]  # monotonic seconds; tests inject one they advance by hand


@dataclass
class _Pin:
    count: int
    expires_at: float | None  # on the policy's clock; None = until unpinned


class EvictionPolicy(ABC):
    """Victims under `capacity_bytes` in the order the subclass defines; pinned keys are never victims.

    Invariants:
      * every held key is in exactly one of `_evictable` (no pin) and `_pinned` (pin count > 0), with its size;
        `used_bytes` is the sum of both maps' sizes and `_pinned_bytes` that of `_pinned`;
      * `_evictable` is kept in arrival order, newest last: a key arrives when it is added and again when its
        last pin goes (unpinned or expired), so time spent pinned neither ages a key nor keeps its old place;
        a subclass may reorder it on hits (`_on_hit`) and reads the victim order from it (`_victim_order`);
      * a pin with a TTL protects its key until `clock()` reaches the expiry; expired pins are released before
        any answer that depends on them (victims, `is_pinned`, `pins`, the key orders);
      * `victims_for` never changes what is held: it names victims, the caller removes them. When pinned bytes
        leave no room it answers None.
    """

    name: ClassVar[str]  # the `cache_policy` value that selects this class

    def __init__(self, capacity_bytes: int, clock: Clock = time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._clock = clock
        self._evictable: OrderedDict[Key, int] = OrderedDict()  # key -> nbytes, arrival order (see above)
        self._pinned: dict[Key, int] = {}  # key -> nbytes
        self._pinned_bytes = 0
        self._pins: dict[Key, _Pin] = {}
        self._next_expiry: float | None = None  # no TTL pin expires before this: expiry checks are O(1) till then

    # ---- what a policy decides ---------------------------------------------------------------------------
    @abstractmethod
    def _victim_order(self) -> Iterator[Key]:
        """The unpinned keys, first victim first."""

    @abstractmethod
    def _on_hit(self, key: Key) -> None:
        """An unpinned held key was used (`touch`, or `add` of a key already held)."""

    def _arrived(self, key: Key) -> None:
        """`key` was just appended to `_evictable` (added, or its last pin went). For policies with own state."""

    def _departed(self, key: Key) -> None:
        """`key` was just taken out of `_evictable` (pinned or removed). For policies with own state."""

    # ---- queries -----------------------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._evictable or key in self._pinned

    def __len__(self) -> int:
        return len(self._evictable) + len(self._pinned)

    @property
    def pinned_count(self) -> int:
        self._expire_pins()
        return len(self._pinned)

    def is_pinned(self, key: Key) -> bool:
        self._expire_pins()
        return key in self._pinned

    def evictable(self) -> list[Key]:
        """The unpinned keys, first victim first (a snapshot: the caller may remove keys while walking it)."""
        self._expire_pins()
        return list(self._victim_order())

    def first_victim(self, eligible: Callable[[Key], bool]) -> Key | None:
        """The first unpinned key, in victim order, that `eligible` accepts (None when none does). Walks the
        order lazily: the cost is the keys passed over, not the keys held (benchmarks/scale.py)."""
        self._expire_pins()
        return next((key for key in self._victim_order() if eligible(key)), None)

    def keys(self) -> list[Key]:
        """Every held key: the pinned ones first, then the unpinned ones in victim order."""
        self._expire_pins()
        return [*self._pinned, *self._victim_order()]

    def pins(self) -> Iterator[tuple[Key, int, float | None]]:
        """(key, pin count, seconds left or None = until unpinned) of every live pin."""
        self._expire_pins()
        now = self._clock()
        for key, pin in self._pins.items():
            yield key, pin.count, None if pin.expires_at is None else pin.expires_at - now

    # ---- changes -----------------------------------------------------------------------------------------
    def add(self, key: Key, nbytes: int) -> None:
        """Hold a new key (the caller made room first with `victims_for`); a key already held counts as a hit."""
        if key in self:
            self.touch(key)
            return
        self.used_bytes += nbytes
        self._enter(key, nbytes)

    def add_new(self, keys: Collection[Key], sizes: list[int]) -> None:
        """Hold many keys none of which is held yet, in arrival order (a store's start): `add` of each, in bulk."""
        assert not self._pinned or self._pinned.keys().isdisjoint(keys), "a pinned key"
        before = len(self._evictable)
        self._evictable.update(zip(keys, sizes))
        assert len(self._evictable) == before + len(keys), "a key given twice or already held"
        self.used_bytes += sum(sizes)
        if type(self)._arrived is not EvictionPolicy._arrived:  # a policy with its own state (LFU)
            for key in keys:
                self._arrived(key)

    def touch(self, key: Key) -> None:
        """A hit. On a pinned key it changes nothing: the key rejoins the order when its last pin goes."""
        if key in self._evictable:
            self._on_hit(key)

    def remove(self, key: Key) -> int:
        """Forget `key`, pinned or not; its size, 0 if it was not held."""
        if key in self._evictable:
            nbytes = self._evictable.pop(key)
            self._departed(key)
        elif key in self._pinned:
            nbytes = self._pinned.pop(key)
            self._pinned_bytes -= nbytes
            del self._pins[key]
        else:
            return 0
        self.used_bytes -= nbytes
        return nbytes

    def victims_for(self, nbytes: int) -> list[Key] | None:
        """Unpinned keys, in victim order, whose removal makes room for `nbytes` more.

        [] when there is room already; None, changing nothing held, when even evicting every unpinned key
        would not be enough. Expired pins are released first.
        """
        self._expire_pins()
        excess = self.used_bytes + nbytes - self.capacity_bytes
        if excess <= 0:
            return []
        if self._pinned_bytes + nbytes > self.capacity_bytes:
            return None
        victims: list[Key] = []
        for key in self._victim_order():
            victims.append(key)
            excess -= self._evictable[key]
            if excess <= 0:
                return victims
        return None  # not reached while the byte counts agree (see the invariants)

    # ---- pins --------------------------------------------------------------------------------------------
    def pin(self, key: Key, ttl_secs: float | None = None) -> bool:
        """Pin a held key (pins nest; the latest expiry wins, no TTL beats any); False if it is not held."""
        if key not in self:
            return False
        expires_at = self._clock() + ttl_secs if ttl_secs else None
        pin = self._pins.get(key)
        if pin is None:
            self._pins[key] = _Pin(1, expires_at)
            nbytes = self._evictable.pop(key)
            self._departed(key)
            self._pinned[key] = nbytes
            self._pinned_bytes += nbytes
        else:
            pin.count += 1
            pin.expires_at = None if pin.expires_at is None or expires_at is None else max(pin.expires_at, expires_at)
        if expires_at is not None and (self._next_expiry is None or expires_at < self._next_expiry):
            self._next_expiry = expires_at
        return True

    def unpin(self, key: Key) -> bool:
        """Drop one pin; the last one makes the key evictable again, as a new arrival. False if not pinned."""
        self._expire_pins()
        pin = self._pins.get(key)
        if pin is None:
            return False
        pin.count -= 1
        if pin.count <= 0:
            self._release(key)
        return True

    # ---- internals ---------------------------------------------------------------------------------------
    def _enter(self, key: Key, nbytes: int) -> None:
        self._evictable[key] = nbytes
        self._arrived(key)

    def _release(self, key: Key) -> None:
        del self._pins[key]
        nbytes = self._pinned.pop(key)
        self._pinned_bytes -= nbytes
        self._enter(key, nbytes)

    def _expire_pins(self) -> None:
        if self._next_expiry is None:
            return
        now = self._clock()
        if now < self._next_expiry:
            return
        expired = [key for key, pin in self._pins.items() if pin.expires_at is not None and pin.expires_at <= now]
        for key in expired:
            self._release(key)
        self._next_expiry = min((pin.expires_at for pin in self._pins.values() if pin.expires_at is not None),
                                default=None)
