"""What every eviction policy shares: byte accounting under a budget, pins that nest with an optional TTL,
their expiry, retention (a request's `kv_priority` and lease: kept over the rest, bounded per owner), and the
refusal rule. A policy subclass only says in which order unpinned, unretained keys become victims and what a
hit does to that order.

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
# the bounds of a retention (`retain`), wherever a client's request asks for one (the engine's kv_transfer_params,
# a store's put): a priority above MAX_PRIORITY or a lease longer than MAX_LEASE_SECS is not taken
MAX_PRIORITY = 1_000_000
MAX_LEASE_SECS = 30 * 86400.0
Clock = Callable[[], float]  # monotonic seconds; tests inject one they advance by hand


@dataclass
class _Pin:
    count: int
    expires_at: float | None  # on the policy's clock; None = until unpinned


@dataclass
class _Retention:
    """Why a key is kept over the others: a priority (> 0: higher kept longer) and/or a lease to `lease_end`
    (the policy's clock; None: no lease). Counted against its owner's bound while it lasts."""

    priority: int
    lease_end: float | None
    owner: str
    nbytes: int

    def rank(self) -> tuple[int, int, float]:
        """Victims go lowest rank first: lower priority, then unleased before leased, then the sooner lease end."""
        return (self.priority, self.lease_end is not None, self.lease_end or 0.0)


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
        self._kept: dict[Key, int] = {}  # retained, unpinned keys -> nbytes (see the invariants)
        self._retention: dict[Key, _Retention] = {}  # every retained key, pinned or not
        self._retained_by: dict[str, int] = {}  # owner -> bytes of its retained keys
        self._next_lease_end: float | None = None  # no lease ends before this

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
        return key in self._evictable or key in self._pinned or key in self._kept

    def __len__(self) -> int:
        return len(self._evictable) + len(self._pinned) + len(self._kept)

    def _victims(self) -> Iterator[Key]:
        """Every unpinned key, first victim first: the unretained ones in the policy's order, then the retained
        ones, lowest rank first."""
        yield from self._victim_order()
        if self._kept:
            yield from sorted(self._kept, key=lambda key: self._retention[key].rank())

    def _size(self, key: Key) -> int:
        nbytes = self._evictable.get(key)
        return nbytes if nbytes is not None else self._kept[key]

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
        return list(self._victims())

    def first_victim(self, eligible: Callable[[Key], bool]) -> Key | None:
        """The first unpinned key, in victim order, that `eligible` accepts (None when none does). Walks the
        order lazily: the cost is the keys passed over, not the keys held (benchmarks/scale.py)."""
        self._expire_pins()
        return next((key for key in self._victims() if eligible(key)), None)

    def keys(self) -> list[Key]:
        """Every held key: the pinned ones first, then the unpinned ones in victim order."""
        self._expire_pins()
        return [*self._pinned, *self._victims()]

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
        self._drop_retention(key)
        if key in self._evictable:
            nbytes = self._evictable.pop(key)
            self._departed(key)
        elif key in self._kept:
            nbytes = self._kept.pop(key)
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
        for key in self._victims():
            victims.append(key)
            excess -= self._size(key)
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
            if key in self._kept:
                nbytes = self._kept.pop(key)
            else:
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

    # ---- retention -----------------------------------------------------------------------------------
    def retain(self, key: Key, owner: str, max_owner_bytes: int, priority: int = 0,
               lease_secs: float | None = None) -> bool:
        """Keep a held key over the unretained ones: with `priority` > 0 while it is held, with a lease for
        `lease_secs` (> 0) from now. False, changing nothing, when there is nothing to keep it for, the key is
        not held, or `owner`'s retained bytes would pass `max_owner_bytes`. A key retained already keeps its
        owner and takes the higher priority and the later lease end."""
        self._expire_pins()
        lease_end = self._clock() + lease_secs if lease_secs is not None and lease_secs > 0 else None
        if (priority <= 0 and lease_end is None) or key not in self:
            return False
        held = self._retention.get(key)
        if held is not None:
            held.priority = max(held.priority, priority)
            if lease_end is not None:
                held.lease_end = lease_end if held.lease_end is None else max(held.lease_end, lease_end)
        else:
            nbytes = self._evictable[key] if key in self._evictable else self._pinned[key]
            if self._retained_by.get(owner, 0) + nbytes > max_owner_bytes:
                return False
            held = self._retention[key] = _Retention(max(priority, 0), lease_end, owner, nbytes)
            self._retained_by[owner] = self._retained_by.get(owner, 0) + nbytes
            if key in self._evictable:
                self._kept[key] = self._evictable.pop(key)
                self._departed(key)
        if held.lease_end is not None and (self._next_lease_end is None or held.lease_end < self._next_lease_end):
            self._next_lease_end = held.lease_end
        return True

    def retained_bytes(self, owner: str) -> int:
        """Bytes of `owner`'s retained keys now."""
        self._expire_pins()
        return self._retained_by.get(owner, 0)

    def is_retained(self, key: Key) -> bool:
        self._expire_pins()
        return key in self._retention

    def retentions(self) -> Iterator[tuple[Key, str, int, float | None]]:
        """(key, owner, priority, seconds left of its lease or None) of every retained key, to persist."""
        self._expire_pins()
        now = self._clock()
        for key, held in self._retention.items():
            yield key, held.owner, held.priority, None if held.lease_end is None else held.lease_end - now

    def _drop_retention(self, key: Key) -> None:
        held = self._retention.pop(key, None)
        if held is None:
            return
        left = self._retained_by[held.owner] - held.nbytes
        if left:
            self._retained_by[held.owner] = left
        else:
            del self._retained_by[held.owner]

    def _end_leases(self, now: float) -> None:
        """Leases that ended by `now` end: a key without priority is no longer retained (rejoins the order)."""
        if self._next_lease_end is None or now < self._next_lease_end:
            return
        for key, held in list(self._retention.items()):
            if held.lease_end is None or held.lease_end > now:
                continue
            held.lease_end = None
            if held.priority > 0:
                continue
            self._drop_retention(key)
            if key in self._kept:
                self._evictable[key] = self._kept.pop(key)
                self._arrived(key)
        self._next_lease_end = min((held.lease_end for held in self._retention.values()
                                    if held.lease_end is not None), default=None)

    # ---- internals ---------------------------------------------------------------------------------------
    def _enter(self, key: Key, nbytes: int) -> None:
        if key in self._retention:
            self._kept[key] = nbytes
            return
        self._evictable[key] = nbytes
        self._arrived(key)

    def _release(self, key: Key) -> None:
        del self._pins[key]
        nbytes = self._pinned.pop(key)
        self._pinned_bytes -= nbytes
        self._enter(key, nbytes)

    def _expire_pins(self) -> None:
        """Release expired pins and end ended leases."""
        if self._next_lease_end is not None:
            self._end_leases(self._clock())
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
