"""Eviction policy with pins: one implementation shared by the CPU tier, the disk store and the remote store.

`LRUPolicy` tracks chunk sizes under a byte budget. Invariant: every held key is in exactly one of two
ordered maps: `_evictable` (unpinned, least recently used first) or `_pinned` (pin count > 0, never a
victim). `touch` moves an evictable key to the most-recent end; pinning moves a key out of `_evictable`,
the last unpin moves it back at the most-recent end. Not thread-safe: the owner holds its own lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterator

Key = Hashable


@dataclass
class _Pin:
    count: int
    expires_at: float | None  # monotonic time; None = until unpinned


class LRUPolicy:
    """Least-recently-used victims under `capacity_bytes`; pinned keys are exempt."""

    name = "LRU"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._evictable: OrderedDict[Key, int] = OrderedDict()  # key -> nbytes, LRU first
        self._pinned: dict[Key, int] = {}  # key -> nbytes
        self._pins: dict[Key, _Pin] = {}

    def __contains__(self, key: Key) -> bool:
        return key in self._evictable or key in self._pinned

    def __len__(self) -> int:
        return len(self._evictable) + len(self._pinned)

    def keys(self) -> Iterator[Key]:
        yield from self._pinned
        yield from self._evictable

    def size_of(self, key: Key) -> int:
        return self._evictable.get(key, self._pinned.get(key, 0))

    @property
    def pinned_count(self) -> int:
        return len(self._pinned)

    def is_pinned(self, key: Key) -> bool:
        return key in self._pinned

    def pins(self) -> Iterator[tuple[Key, int, float | None]]:
        """(key, pin count, monotonic expiry or None) of every pin that has not expired yet."""
        now = time.monotonic()
        for key, pin in self._pins.items():
            if pin.expires_at is None or pin.expires_at > now:
                yield key, pin.count, pin.expires_at

    def add(self, key: Key, nbytes: int) -> None:
        """Record a new key as most recently used (the caller made room first with `victims_for`)."""
        if key in self:
            self.touch(key)
            return
        self._evictable[key] = nbytes
        self.used_bytes += nbytes

    def remove(self, key: Key) -> int:
        """Forget `key` (pinned or not); returns its size, 0 if absent."""
        nbytes = self._evictable.pop(key, None)
        if nbytes is None:
            nbytes = self._pinned.pop(key, None)
            self._pins.pop(key, None)
        if nbytes is None:
            return 0
        self.used_bytes -= nbytes
        return nbytes

    def touch(self, key: Key) -> None:
        if key in self._evictable:
            self._evictable.move_to_end(key)

    def victims_for(self, nbytes: int) -> list[Key] | None:
        """Least-recently-used unpinned keys whose removal makes room for `nbytes` more.

        Returns [] when there is room already, None when even evicting every unpinned key is not enough
        (then nothing should change). Expired pins are released first.
        """
        self._expire_pins()
        excess = self.used_bytes + nbytes - self.capacity_bytes
        if excess <= 0:
            return []
        if nbytes > self.capacity_bytes or sum(self._pinned.values()) + nbytes > self.capacity_bytes:
            return None
        victims: list[Key] = []
        for key, size in self._evictable.items():
            victims.append(key)
            excess -= size
            if excess <= 0:
                return victims
        return None

    def pin(self, key: Key, ttl_secs: float | None = None) -> bool:
        """Pin a held key (pins nest); False if the key is not held."""
        if key not in self:
            return False
        expires_at = time.monotonic() + ttl_secs if ttl_secs else None
        pin = self._pins.get(key)
        if pin is None:
            self._pins[key] = _Pin(1, expires_at)
            self._pinned[key] = self._evictable.pop(key)
        else:
            pin.count += 1
            pin.expires_at = None if pin.expires_at is None or expires_at is None else max(pin.expires_at, expires_at)
        return True

    def unpin(self, key: Key) -> bool:
        """Drop one pin; the last one makes the key evictable again (most recent). False if not pinned."""
        pin = self._pins.get(key)
        if pin is None:
            return False
        pin.count -= 1
        if pin.count <= 0:
            self._release(key)
        return True

    def _release(self, key: Key) -> None:
        del self._pins[key]
        self._evictable[key] = self._pinned.pop(key)

    def _expire_pins(self) -> None:
        if not self._pins:
            return
        now = time.monotonic()
        for key in [k for k, pin in self._pins.items() if pin.expires_at is not None and pin.expires_at <= now]:
            self._release(key)


def make_policy(name: str, capacity_bytes: int) -> LRUPolicy:
    """The policy named by the `cache_policy` config key."""
    if name.upper() == "LRU":
        return LRUPolicy(capacity_bytes)
    raise ValueError(f"cache_policy: unknown eviction policy {name!r} (known: LRU)")
