"""The disk store's in-memory index: which chunks are held, which are being written, LRU order and pins.

Pure bookkeeping, no I/O: the service calls it from its event loop thread only (no locks here), and does the
file work the index asks for (delete these victims, this write may be admitted, ...).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

from kvmesh.shared.eviction import LRUPolicy
from kvmesh.shared.keys import ChunkKey


@dataclass(frozen=True)
class Entry:
    """A held chunk: its data size, its size on disk (header + data), and its token count."""

    nbytes: int
    file_bytes: int
    num_tokens: int


@dataclass
class Pending:
    """A chunk accepted by a put whose file is not complete yet."""

    entry: Entry
    discard: bool = False  # removed or cleared while being written: delete the file when it lands


class SpaceRefused(Exception):
    """No room for a chunk even after evicting every unpinned one; nothing was changed."""


@dataclass(frozen=True)
class PinRecord:
    """A pin as it is persisted: nesting count and wall-clock expiry (None = until unpinned)."""

    count: int
    expires_at: float | None


class DiskIndex:
    """Held chunks under a byte budget, with LRU eviction and pins.

    Invariant: a key is either held (in `_held` and in the LRU policy, its file complete and visible to
    contains/get), or pending (in `_pending`, its bytes counted in `reserved_bytes`, invisible and never a
    victim), or unknown. `used_bytes + reserved_bytes <= capacity_bytes` after every `reserve`. Pins apply to
    held keys only; `_pin_records` mirrors the pins with wall-clock expiries so they survive a restart.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._policy = LRUPolicy(capacity_bytes)
        self._held: dict[ChunkKey, Entry] = {}
        self._pending: dict[ChunkKey, Pending] = {}
        self.reserved_bytes = 0
        self._pin_records: dict[ChunkKey, PinRecord] = {}
        self.pins_version = 0  # bumped whenever the persisted pins change

    # ---- queries ---------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._held)

    @property
    def used_bytes(self) -> int:
        return self._policy.used_bytes

    @property
    def pinned_count(self) -> int:
        return self._policy.pinned_count

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def held(self, key: ChunkKey) -> Entry | None:
        return self._held.get(key)

    def is_pending(self, key: ChunkKey) -> bool:
        """Being written, whether or not it was removed meanwhile."""
        return key in self._pending

    def is_pending_active(self, key: ChunkKey) -> bool:
        """Being written and still wanted: it becomes held when its file lands."""
        pending = self._pending.get(key)
        return pending is not None and not pending.discard

    def keys(self) -> list[ChunkKey]:
        return list(self._held)

    def lru_order(self) -> Iterator[ChunkKey]:
        """Held keys, pinned first, then unpinned least recently used first (for tests and stats)."""
        return self._policy.keys()

    def contains_prefix(self, keys: Iterable[ChunkKey]) -> int:
        count = 0
        for key in keys:
            if key not in self._held:
                break
            count += 1
        return count

    def is_pinned(self, key: ChunkKey) -> bool:
        return self._policy.is_pinned(key)

    # ---- loading at start ------------------------------------------------------------------------------
    def load(self, key: ChunkKey, entry: Entry) -> None:
        """Add a chunk found on disk at start; call in LRU order (least recent first)."""
        self._held[key] = entry
        self._policy.add(key, entry.file_bytes)

    def over_capacity_victims(self) -> list[ChunkKey]:
        """Unpinned keys to drop when the files found at start exceed the capacity (LRU first)."""
        victims = self._policy.victims_for(0) or []
        for key in victims:
            self._forget(key)
        return victims

    # ---- writes ----------------------------------------------------------------------------------------
    def reserve(self, key: ChunkKey, entry: Entry) -> list[ChunkKey]:
        """Accept a chunk for writing: evict LRU victims to make room and count its bytes as reserved.

        Returns the evicted keys (their files must be deleted). Raises SpaceRefused, changing nothing,
        when pinned and in-flight bytes leave no room. The caller checked the key is neither held nor pending.
        """
        victims = self._policy.victims_for(entry.file_bytes + self.reserved_bytes)
        if victims is None:
            pinned = sum(self._held[k].file_bytes for k in self._held if self._policy.is_pinned(k))
            raise SpaceRefused(
                f"no room for {entry.file_bytes} bytes: capacity {self.capacity_bytes}, pinned {pinned}, "
                f"being written {self.reserved_bytes}")
        for victim in victims:
            self._forget(victim)
        self._pending[key] = Pending(entry)
        self.reserved_bytes += entry.file_bytes
        return victims

    def undiscard(self, key: ChunkKey) -> None:
        """A new put of a key that was removed while being written: keep it after all."""
        pending = self._pending.get(key)
        if pending is not None:
            pending.discard = False

    def commit(self, key: ChunkKey) -> bool:
        """The key's file is complete. True if it is now held; False if it was discarded meanwhile."""
        pending = self._pending.pop(key)
        self.reserved_bytes -= pending.entry.file_bytes
        if pending.discard:
            return False
        self._held[key] = pending.entry
        self._policy.add(key, pending.entry.file_bytes)
        return True

    def abort(self, key: ChunkKey) -> None:
        """The key's write failed: release its reservation."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            self.reserved_bytes -= pending.entry.file_bytes

    # ---- reads and removals ----------------------------------------------------------------------------
    def touch(self, key: ChunkKey) -> None:
        self._policy.touch(key)

    def remove(self, key: ChunkKey) -> tuple[Entry | None, Entry | None]:
        """Forget a held key (pinned or not) and discard a pending write of it.

        Returns (the held entry removed, the pending entry discarded), each None if there was none.
        """
        discarded = None
        pending = self._pending.get(key)
        if pending is not None and not pending.discard:
            pending.discard = True
            discarded = pending.entry
        return (self._forget(key) if key in self._held else None), discarded

    def drop_if_same(self, key: ChunkKey, entry: Entry) -> bool:
        """Forget `key` only if it still maps to `entry` (a read found its file bad or gone)."""
        if self._held.get(key) is entry:
            self._forget(key)
            return True
        return False

    def clear(self) -> tuple[list[ChunkKey], int]:
        """Forget every unpinned held key and discard pending ones; (removed held keys, tokens cleared)."""
        removed = [k for k in self._held if not self._policy.is_pinned(k)]
        tokens = 0
        for key in removed:
            tokens += self._forget(key).num_tokens
        for pending in self._pending.values():
            if not pending.discard:
                pending.discard = True
                tokens += pending.entry.num_tokens
        return removed, tokens

    def _forget(self, key: ChunkKey) -> Entry:
        self._policy.remove(key)
        if self._pin_records.pop(key, None) is not None:
            self.pins_version += 1
        return self._held.pop(key)

    # ---- pins ------------------------------------------------------------------------------------------
    def pin(self, keys: list[ChunkKey], ttl_secs: float | None = None) -> list[ChunkKey]:
        """Pin the contiguous held prefix of `keys`; returns the keys pinned."""
        pinned: list[ChunkKey] = []
        expires_at = time.time() + ttl_secs if ttl_secs else None
        for key in keys:
            if key not in self._held or not self._policy.pin(key, ttl_secs):
                break
            record = self._pin_records.get(key)
            if record is None:
                self._pin_records[key] = PinRecord(1, expires_at)
            else:  # same merge rule as LRUPolicy.pin: the longest lifetime wins
                longest = None if record.expires_at is None or expires_at is None else max(record.expires_at,
                                                                                           expires_at)
                self._pin_records[key] = PinRecord(record.count + 1, longest)
            pinned.append(key)
        self.pins_version += bool(pinned)
        return pinned

    def unpin(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        """Drop one pin from each key of the contiguous pinned prefix of `keys`; returns those keys."""
        unpinned: list[ChunkKey] = []
        for key in keys:
            if not self._policy.unpin(key):
                self._pin_records.pop(key, None)  # expired inside the policy: forget it here too
                break
            record = self._pin_records.get(key)
            if record is not None:
                if record.count <= 1 or not self._policy.is_pinned(key):
                    del self._pin_records[key]
                else:
                    self._pin_records[key] = PinRecord(record.count - 1, record.expires_at)
            unpinned.append(key)
        self.pins_version += 1
        return unpinned

    def pin_records(self) -> dict[ChunkKey, PinRecord]:
        """Live pins (expired ones left out), to persist."""
        now = time.time()
        return {k: r for k, r in self._pin_records.items() if r.expires_at is None or r.expires_at > now}

    def restore_pins(self, records: dict[ChunkKey, PinRecord]) -> int:
        """Re-apply persisted pins to held keys; returns how many keys were pinned."""
        now = time.time()
        restored = 0
        for key, record in records.items():
            if key not in self._held or (record.expires_at is not None and record.expires_at <= now):
                continue
            ttl = None if record.expires_at is None else record.expires_at - now
            for _ in range(max(1, record.count)):
                self._policy.pin(key, ttl)
            self._pin_records[key] = record
            restored += 1
        return restored
