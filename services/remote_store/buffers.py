"""Chunk buffers of the remote store: page-faulted once, off the event loop, then recycled.

Runs in the store process. `BufferPool` methods are called on the store's event loop; the page faulting of a
new buffer runs in a worker thread (numpy's fill releases the GIL), because first touching 32 MiB costs
16-25 ms on these machines and would otherwise stall every connection the loop serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import numpy as np

log = logging.getLogger(__name__)

PAGE = 4096


def size_class(nbytes: int) -> int:
    """Buffers are recycled by size class: the chunk size rounded up to whole pages."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def _new_buffer(size: int) -> np.ndarray:
    buffer = np.empty(size, dtype=np.uint8)
    buffer.fill(0)  # fault every page in now, in this worker thread, not later inside a recv on the loop
    return buffer


class BufferPool:
    """Spare, already-faulted buffers by size class, and allocation of new ones in a worker thread.

    Invariant: a spare buffer is referenced by nothing but `_spares`, and `spare_bytes <= max_spare_bytes`.
    The store decides how many spares may exist (`budget`); the pool never grows spares past it.
    Full chunks all share one size class, so an eviction hands its buffer straight to the next put.
    """

    def __init__(self, max_spare_bytes: int) -> None:
        self.max_spare_bytes = max_spare_bytes
        self.spare_bytes = 0
        self.allocated = 0  # new buffers made (for stats: each one cost a round of page faults)
        self._spares: dict[int, list[np.ndarray]] = defaultdict(list)
        self._filling: asyncio.Task[None] | None = None
        self._filling_size = 0

    def take(self, nbytes: int) -> np.ndarray | None:
        """A spare buffer of `nbytes`' size class, or None."""
        spares = self._spares.get(size_class(nbytes))
        if not spares:
            return None
        buffer = spares.pop()
        self.spare_bytes -= len(buffer)
        return buffer

    async def get(self, nbytes: int) -> np.ndarray:
        """A spare buffer if there is one, else a new one faulted in a worker thread."""
        buffer = self.take(nbytes)
        filling = self._filling
        if buffer is None and filling is not None and self._filling_size == size_class(nbytes):
            await asyncio.shield(filling)  # one being faulted already: faulting a second in parallel is slower
            buffer = self.take(nbytes)
        if buffer is None:
            buffer = await asyncio.to_thread(_new_buffer, size_class(nbytes))
            self.allocated += 1
        return buffer

    def give(self, buffer: np.ndarray) -> None:
        """Keep a buffer nobody uses any more as a spare, or let it go if the spares are full."""
        if self.spare_bytes + len(buffer) <= self.max_spare_bytes:
            self._spares[len(buffer)].append(buffer)
            self.spare_bytes += len(buffer)

    def trim(self, limit: int) -> None:
        """Drop spares until they take at most `limit` bytes (the store's free room shrank)."""
        for size in sorted(self._spares, reverse=True):
            spares = self._spares[size]
            while spares and self.spare_bytes > max(0, limit):
                spares.pop()
                self.spare_bytes -= size

    def fill_ahead(self, nbytes: int, budget: int) -> None:
        """In the background, fault one spare of `nbytes`' class if `budget` bytes allow it.

        Called after a put had to allocate: the next put of the same size (a stream of chunks) then finds
        a faulted buffer while this one's bytes are still arriving.
        """
        size = size_class(nbytes)
        if self._filling is not None or self.spare_bytes + size > min(budget, self.max_spare_bytes):
            return
        self._filling_size = size
        self._filling = asyncio.get_running_loop().create_task(self._fill(size))

    async def _fill(self, size: int) -> None:
        try:
            buffer = await asyncio.to_thread(_new_buffer, size)
            self.allocated += 1
            self.give(buffer)
        except Exception as exc:  # out of memory is not fatal here: the next put allocates on demand
            log.warning("could not prepare a spare buffer of %d bytes: %s", size, exc)
        finally:
            self._filling = None

    async def close(self) -> None:
        if self._filling is not None:
            try:
                await self._filling
            except Exception:
                pass
        self._spares.clear()
        self.spare_bytes = 0
