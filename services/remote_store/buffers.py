"""Chunk buffers of the remote store: page-faulted once, off the event loop, then recycled.

Runs in the store process. `BufferPool` methods are called on the store's event loop; the page faulting of a
new buffer runs in a worker thread (numpy's strided write releases the GIL), because first touching 32 MiB
would otherwise stall every connection the loop serves.

A new buffer costs what the kernel does on first touch: a fault per page and zeroing the page. Each one is its
own anonymous mapping advised to use transparent huge pages (honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`; else 4 KiB pages, slower to fault only),
touched once per 4 KiB page (the kernel zeroed it already: writing every byte would zero it twice), exactly
`size_class(nbytes)` bytes, unmapped when its last array goes. Quiet, that is ~5 ms of CPU per 32 MiB; on a
loaded 2-core machine it costs as much as receiving the bytes, so puts into an empty store ran at 0.2-0.3x raw
TCP while puts that recycle an evicted chunk's buffer did not. Hence the `Arena`: memory faulted in at start
(`--prefault-gb`), before any put waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
from collections import defaultdict

import numpy as np

log = logging.getLogger(__name__)

PAGE = 4096
HUGE_PAGES: int | None = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
NO_HUGE_PAGES: int | None = getattr(mmap, "MADV_NOHUGEPAGE", None)


def size_class(nbytes: int) -> int:
    """Buffers are recycled by size class: the chunk size rounded up to whole pages."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def address_of(buffer: np.ndarray) -> int:
    return buffer.__array_interface__["data"][0]


def _map(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """A new anonymous mapping of `size` bytes, zeroed, every page faulted in, as an array over it (run in a worker
    thread, not inside a recv on the loop)."""
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # ENOMEM: begin_put answers a MemoryError as a refused put
        raise MemoryError(f"cannot map {size} bytes: {exc}") from exc
    if HUGE_PAGES is not None:
        with contextlib.suppress(OSError):  # THP off or unsupported here: plain pages, slower to fault only
            region.madvise(HUGE_PAGES)
    array = np.frombuffer(region, dtype=np.uint8)  # writable; keeps `region` mapped while any view lives
    array[::PAGE] = 0
    return region, array


def _new_buffer(size: int) -> np.ndarray:
    return _map(size)[1]


class Arena:
    """Memory faulted in when the store starts (`--prefault-gb`), carved into new buffers front to back.

    A put into an empty store then finds its buffer's pages already faulted, like a put that recycles an evicted
    chunk's buffer. A carved buffer is an ordinary buffer from then on (a chunk's, then a spare). The mapping
    lives while any carved buffer does, so pages the pool lets go of (a carved buffer it does not keep, or the
    uncarved rest when the store's free room shrinks) are handed back to the system with MADV_DONTNEED.
    """

    def __init__(self, size: int) -> None:
        self.region, self.array = _map(size)
        if NO_HUGE_PAGES is not None:  # faulted on huge pages; from now on khugepaged must not fill handed-back
            with contextlib.suppress(OSError):  # pages in again (it would, around pages still in use)
                self.region.madvise(NO_HUGE_PAGES)
        self.address = address_of(self.array)
        self.next = 0  # the first uncarved byte
        self.end = size  # pages from here on were handed back

    @property
    def left(self) -> int:
        return self.end - self.next

    def carve(self, size: int) -> np.ndarray | None:
        if size > self.left:
            return None
        buffer = self.array[self.next:self.next + size]
        self.next += size
        return buffer

    def release(self, buffer: np.ndarray) -> None:
        """Hand `buffer`'s pages back if it was carved from here (nobody may use it any more)."""
        offset = address_of(buffer) - self.address
        if 0 <= offset < self.next:
            self.region.madvise(mmap.MADV_DONTNEED, offset, len(buffer))

    def shrink(self, nbytes: int) -> None:
        """Hand back at least `nbytes` (whole pages) of the uncarved rest, or all of it."""
        cut = min(self.left, -(-nbytes // PAGE) * PAGE)
        if cut > 0:
            self.end -= cut
            self.region.madvise(mmap.MADV_DONTNEED, self.end, cut)


class BufferPool:
    """Spare, already-faulted buffers by size class, the prefaulted arena, and allocation of new buffers in a
    worker thread.

    Invariant: a spare buffer is referenced by nothing but `_spares`, and `spare_bytes <= max_spare_bytes`.
    The store decides how much faulted memory may wait unused (`budget`, its free room): the pool never grows
    spares past it, and `trim` brings spares plus the arena's uncarved rest (`arena_bytes`) back under it.
    Full chunks all share one size class, so an eviction hands its buffer straight to the next put.
    """

    def __init__(self, max_spare_bytes: int) -> None:
        self.max_spare_bytes = max_spare_bytes
        self.spare_bytes = 0
        self.allocated = 0  # new buffers made (for stats: each one cost a round of page faults)
        self.prefaulted_bytes = 0  # the arena's size when it was made
        self.arena: Arena | None = None
        self._spares: dict[int, list[np.ndarray]] = defaultdict(list)
        self._filling: asyncio.Task[None] | None = None
        self._filling_size = 0

    @property
    def arena_bytes(self) -> int:
        """Faulted bytes of the arena not carved yet."""
        return self.arena.left if self.arena is not None else 0

    async def prefault(self, nbytes: int) -> None:
        """Fault `nbytes` (whole pages) in now, in a worker thread, as the arena new buffers are carved from."""
        size = nbytes // PAGE * PAGE
        if size > 0:
            self.arena = await asyncio.to_thread(Arena, size)
            self.prefaulted_bytes = size

    def take(self, nbytes: int) -> np.ndarray | None:
        """A spare buffer of `nbytes`' size class, else one carved from the arena, or None."""
        spares = self._spares.get(size_class(nbytes))
        if not spares:
            return self.arena.carve(size_class(nbytes)) if self.arena is not None else None
        buffer = spares.pop()
        self.spare_bytes -= len(buffer)
        return buffer

    async def get(self, nbytes: int) -> np.ndarray:
        """A spare or arena buffer if there is one, else a new one faulted in a worker thread."""
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
        else:
            self._let_go(buffer)

    def trim(self, limit: int) -> None:
        """Drop spares, then hand back the arena's uncarved rest, until both take at most `limit` bytes (the
        store's free room shrank)."""
        limit = max(0, limit)
        for size in sorted(self._spares, reverse=True):
            spares = self._spares[size]
            while spares and self.spare_bytes + self.arena_bytes > limit:
                self._let_go(spares.pop())
                self.spare_bytes -= size
        if self.arena is not None and self.spare_bytes + self.arena_bytes > limit:
            self.arena.shrink(self.spare_bytes + self.arena_bytes - limit)

    def _let_go(self, buffer: np.ndarray) -> None:
        """`buffer` is referenced by nobody else: its own mapping is unmapped when this last reference goes; a
        buffer carved from the arena hands its pages back explicitly."""
        if self.arena is not None:
            self.arena.release(buffer)

    def fill_ahead(self, nbytes: int, budget: int) -> None:
        """In the background, fault one spare of `nbytes`' class if `budget` bytes allow it.

        Called after a put had to allocate: the next put of the same size (a stream of chunks) then finds
        a faulted buffer while this one's bytes are still arriving.
        """
        size = size_class(nbytes)
        if self._filling is not None or self.arena_bytes >= size:  # the arena has the next one ready
            return
        if self.spare_bytes + size > min(budget - self.arena_bytes, self.max_spare_bytes):
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
        self.arena = None
