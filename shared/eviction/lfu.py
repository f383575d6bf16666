"""LFU: the least frequently used unpinned key is the first victim; among equals, the least recently used."""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from typing import Iterator

from kvmesh.shared.eviction.base import Clock, EvictionPolicy, Key


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, ties broken by least recently used.

    Frequency buckets: `_buckets[n]` holds the unpinned keys used `n` times, least recently used first, and
    `_counts` lists the counts of the non-empty buckets in ascending order, so the victim order is the buckets
    walked from the lowest count. Invariant: every unpinned key is in exactly one bucket, the one of its count in
    `_uses`; `_uses` has the count of every held key, pinned ones too, so a pin neither resets a key's count nor
    loses the hits it gets while pinned. A new key starts at 1; a hit moves a key to the newest end of the next
    bucket. Each operation is O(1) dict work plus a bisect over `_counts` (O(log n)) and, when a bucket appears
    or empties, a list insert or delete in `_counts` (a memmove over the distinct counts, which are few).
    """

    name = "LFU"

    def __init__(self, capacity_bytes: int, clock: Clock = time.monotonic) -> None:
        super().__init__(capacity_bytes, clock)
        self._uses: dict[Key, int] = {}  # every held key -> how often it was added or hit
        self._buckets: dict[int, OrderedDict[Key, None]] = {}  # count -> unpinned keys, least recent first
        self._counts: list[int] = []  # the non-empty buckets' counts, ascending

    def _victim_order(self) -> Iterator[Key]:
        for count in self._counts:
            yield from self._buckets[count]

    def touch(self, key: Key) -> None:
        if key in self._pinned:
            self._uses[key] += 1  # counted now; the key takes its bucket when its last pin goes
        else:
            super().touch(key)

    def _on_hit(self, key: Key) -> None:
        self._leave_bucket(key)
        self._uses[key] += 1
        self._join_bucket(key)

    def _arrived(self, key: Key) -> None:
        self._uses.setdefault(key, 1)  # a key back from a pin keeps its count
        self._join_bucket(key)

    def _departed(self, key: Key) -> None:
        self._leave_bucket(key)

    def remove(self, key: Key) -> int:
        nbytes = super().remove(key)
        self._uses.pop(key, None)  # added again later, it starts over
        return nbytes

    def _join_bucket(self, key: Key) -> None:
        count = self._uses[key]
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedDict()
            bisect.insort(self._counts, count)
        bucket[key] = None

    def _leave_bucket(self, key: Key) -> None:
        count = self._uses[key]
        bucket = self._buckets[count]
        del bucket[key]
        if not bucket:
            del self._buckets[count]
            del self._counts[bisect.bisect_left(self._counts, count)]
