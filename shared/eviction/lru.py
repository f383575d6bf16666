"""LRU: the least recently used unpinned key is the first victim."""

from __future__ import annotations

from typing import Iterator

from kvmesh.shared.eviction.base import EvictionPolicy, Key


class LRUPolicy(EvictionPolicy):
    """Least recently used first.

    `_evictable` is the recency order, least recent first: an arrival (a new key, or one whose last pin went)
    and a hit both move a key to the newest end, so a chunk just read or just unpinned is evicted last.
    """

    name = "LRU"

    def _victim_order(self) -> Iterator[Key]:
        return iter(self._evictable)

    def _on_hit(self, key: Key) -> None:
        self._evictable.move_to_end(key)
