"""MRU: the most recently used unpinned key is the first victim (for scans that never come back to a chunk)."""

from __future__ import annotations

from typing import Iterator

from kvmesh.shared.eviction.base import EvictionPolicy, Key


class MRUPolicy(EvictionPolicy):
    """Most recently used first.

    The same recency order as LRU (`_evictable`, least recent first; arrivals and hits move a key to the newest
    end), walked from the newest end: the chunk just written, read or unpinned is the first to go.
    """

    name = "MRU"

    def _victim_order(self) -> Iterator[Key]:
        return reversed(self._evictable)

    def _on_hit(self, key: Key) -> None:
        self._evictable.move_to_end(key)
