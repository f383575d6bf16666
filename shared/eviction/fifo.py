"""FIFO: unpinned keys leave in the order they arrived; hits change nothing."""

from __future__ import annotations

from typing import Iterator

from kvmesh.shared.eviction.base import EvictionPolicy, Key


class FIFOPolicy(EvictionPolicy):
    """First in, first out.

    `_evictable` is the arrival order, oldest first, and hits leave it alone: a chunk read again still goes when
    its turn comes. A key whose last pin goes joins the back of the queue (time pinned does not age it).
    """

    name = "FIFO"

    def _victim_order(self) -> Iterator[Key]:
        return iter(self._evictable)

    def _on_hit(self, key: Key) -> None:
        pass  # insertion order only
