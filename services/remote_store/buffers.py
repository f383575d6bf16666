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
TCP while puts that recycle an evicted chunk's buffer did not. Hence the `Arena`: memory faulted in before any
put waits for it, at start (`--prefault-gb`) and by a worker thread that keeps `--fault-ahead-gb` faulted ahead
of the carving, within the store's free room (`BufferPool.fault_ahead`). That worker runs at the pace the CPU
allows: beside a stream of puts on the loaded 2-core machine it faulted 32 MiB in ~200 ms (~4 ms quiet), slower
than the bytes arrive, so what pays is what it faulted while the store was quiet: the margin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import threading
from collections import defaultdict

import numpy as np

log = logging.getLogger(__name__)

PAGE = 4096
HUGE_PAGES: int | None = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
NO_HUGE_PAGES: int | None = getattr(mmap, "MADV_NOHUGEPAGE", None)
NO_RESERVE: int = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python's mmap names it from 3.12 on
HUGE_PAGE = 2 * 1024 * 1024  # the arena is faulted this much at a time (a transparent huge page on x86-64)
FAULT_STEP = 32 * 1024 * 1024  # faulted per worker-thread call of the background faulting


def size_class(nbytes: int) -> int:
    """Buffers are recycled by size class: the chunk size rounded up to whole pages."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def address_of(buffer: np.ndarray) -> int:
    return buffer.__array_interface__["data"][0]


def _map(size: int, fault: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    """A new anonymous mapping of `size` bytes, zeroed, advised to use huge pages, as an array over it; with `fault`
    every page faulted in (run in a worker thread, not inside a recv on the loop)."""
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (0 if fault else NO_RESERVE))
    except OSError as exc:  # ENOMEM: begin_put answers a MemoryError as a refused put
        raise MemoryError(f"cannot map {size} bytes: {exc}") from exc
    if HUGE_PAGES is not None:
        with contextlib.suppress(OSError):  # THP off or unsupported here: plain pages, slower to fault only
            region.madvise(HUGE_PAGES)
    array = np.frombuffer(region, dtype=np.uint8)  # writable; keeps `region` mapped while any view lives
    if fault:
        array[::PAGE] = 0
    return region, array


def _new_buffer(size: int) -> np.ndarray:
    return _map(size)[1]


class Arena:
    """One mapping new buffers are carved from front to back, faulted in ahead of the carving.

    `faulted` moves forward as pages are faulted: at start (`--prefault-gb`, awaited before the store serves) and
    in the background (`--fault-ahead-gb`: `fault_step` in a worker thread, never past `ceiling`, which the pool
    keeps within the store's free room). Only faulted bytes are carved, so a put into an empty store finds its
    buffer's pages faulted, like a put that recycles an evicted chunk's buffer; the bytes past `faulted` cost
    nothing but address space (mapped without reserving swap). A carved buffer is an ordinary buffer from then on
    (a chunk's, then a spare). The mapping lives while any carved buffer does, so pages the pool lets go of (a
    carved buffer it does not keep, or faulted bytes not carved yet when the store's free room shrinks) are handed
    back to the system with MADV_DONTNEED, advised off huge pages first so that khugepaged never fills them in
    again around pages still in use.

    `_lock` keeps a handed-back range and the worker's faulting apart: the worker holds it while it faults a step,
    the loop only when the free room shrank into what the worker may be faulting (a nearly full store).
    """

    def __init__(self, size: int, faulted: int = 0) -> None:
        """Map `size` bytes (whole pages) and fault in the first `faulted` now (call in a worker thread)."""
        self.region, self.array = _map(size, fault=False)
        self.address = address_of(self.array)
        self.size = size
        self.next = 0  # the first uncarved byte
        self.faulted = 0  # pages from `next` to here are faulted in and not carved
        self.ceiling = faulted  # the most `fault_step` may fault up to
        self._lock = threading.Lock()
        while self.faulted < self.ceiling:
            self.fault_step(self.ceiling - self.faulted)

    @property
    def left(self) -> int:
        """Faulted bytes not carved yet: what counts against the store's cap as free room does."""
        return max(0, self.faulted - self.next)

    def carve(self, size: int) -> np.ndarray | None:
        if size > self.left:
            return None
        buffer = self.array[self.next:self.next + size]
        self.next += size
        return buffer

    def fault_step(self, nbytes: int = FAULT_STEP) -> int:
        """Fault in up to `nbytes` more, never past `ceiling`; the bytes faulted.

        Run in a worker thread: it writes only to bytes no buffer was carved from, in one numpy write (which lets
        go of the GIL).
        """
        with self._lock:
            start = self.faulted
            stop = min(start + nbytes, self.ceiling, self.size)
            if stop <= start:
                return 0
            self.array[start:stop:PAGE] = 0
            self.faulted = stop
            return stop - start

    def release(self, buffer: np.ndarray) -> None:
        """Hand `buffer`'s pages back if it was carved from here (nobody may use it any more)."""
        offset = address_of(buffer) - self.address
        if 0 <= offset < self.next:
            self._hand_back(offset, len(buffer))

    def hold_at_most(self, room: int) -> None:
        """Keep at most `room` faulted bytes not carved yet (handing back the rest, whole pages) and fault no more
        than that ahead."""
        room = max(0, room) // PAGE * PAGE
        if self.next + room >= self.ceiling:  # the common case: nothing to cut, no wait for the worker
            return
        with self._lock:  # the worker is between two steps: `faulted` and `ceiling` are ours to move
            self.ceiling = min(self.ceiling, self.next + room)
            cut = self.left - room
            if cut > 0:
                self.faulted -= cut
                self._hand_back(self.faulted, cut)

    def _hand_back(self, offset: int, nbytes: int) -> None:
        if NO_HUGE_PAGES is not None:
            with contextlib.suppress(OSError):
                self.region.madvise(NO_HUGE_PAGES, offset, nbytes)
        self.region.madvise(mmap.MADV_DONTNEED, offset, nbytes)


class BufferPool:
    """Spare, already-faulted buffers by size class, the prefaulted arena, and allocation of new buffers in a
    worker thread.

    Invariant: a spare buffer is referenced by nothing but `_spares`, and `spare_bytes <= max_spare_bytes`.
    The store decides how much faulted memory may wait unused (`budget`, its free room): the pool never grows
    spares past it, and `trim` brings spares plus the arena's uncarved rest (`arena_bytes`) back under it.
    Full chunks all share one size class, so an eviction hands its buffer straight to the next put.
    """

    def __init__(self, max_spare_bytes: int, fault_ahead_bytes: int = 0) -> None:
        self.max_spare_bytes = max_spare_bytes
        self.fault_ahead_bytes = fault_ahead_bytes  # the margin the background faulting keeps ready (0: none)
        self.spare_bytes = 0
        self.allocated = 0  # new buffers made (for stats: each one cost a round of page faults)
        self.prefaulted_bytes = 0  # the arena's size when it was made
        self.arena: Arena | None = None
        self._spares: dict[int, list[np.ndarray]] = defaultdict(list)
        self._filling: asyncio.Task[None] | None = None
        self._filling_size = 0
        self._faulting: asyncio.Task[None] | None = None

    @property
    def arena_bytes(self) -> int:
        """Faulted bytes of the arena not carved yet."""
        return self.arena.left if self.arena is not None else 0

    async def prefault(self, nbytes: int, capacity: int) -> None:
        """Map the arena new buffers are carved from and fault its first `nbytes` (whole pages) in now, in a worker
        thread. It spans `capacity` when the pool faults ahead in the background, else `nbytes`."""
        size = (capacity if self.fault_ahead_bytes > 0 else nbytes) // PAGE * PAGE
        if size <= 0:
            return
        prefault = nbytes // PAGE * PAGE
        try:
            self.arena = await asyncio.to_thread(Arena, size, prefault)
        except MemoryError as exc:
            if size == prefault:
                raise
            log.warning("no background faulting (--fault-ahead-gb): %s", exc)
            self.fault_ahead_bytes = 0
            self.arena = await asyncio.to_thread(Arena, prefault, prefault) if prefault else None
        self.prefaulted_bytes = prefault

    @property
    def faulting(self) -> bool:
        """Whether the worker is faulting the arena ahead now."""
        return self._faulting is not None

    def fault_ahead(self, budget: int) -> None:
        """Keep `fault_ahead_bytes` of the arena faulted past the last carved byte, as far as `budget` (the store's
        free room) allows beside the spares: a worker thread faults them while the loop serves.

        This only raises the arena's `ceiling`: a step in flight was sized by the old one. `trim`, which follows
        every shrink of the free room, lowers it (and hands back what is past it) under the arena's lock."""
        arena = self.arena
        if arena is None or self.fault_ahead_bytes <= 0:
            return
        allowed = min(self.fault_ahead_bytes, budget - self.spare_bytes)
        arena.ceiling = max(arena.ceiling, min(arena.size, arena.next + allowed))
        if self._faulting is None and arena.faulted < arena.ceiling:
            self._faulting = asyncio.get_running_loop().create_task(self._fault(arena))

    async def _fault(self, arena: Arena) -> None:
        try:
            while arena.faulted < arena.ceiling and await asyncio.to_thread(arena.fault_step):
                pass
        except Exception as exc:  # not fatal: puts fault their own buffers
            log.warning("background faulting of the arena stopped: %s", exc)
        finally:
            self._faulting = None

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
        if self.arena is not None:
            self.arena.hold_at_most(limit - self.spare_bytes)

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
        if self._faulting is not None:  # the arena is being faulted ahead: a spare faulted beside it only slows it
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
        for task in (self._filling, self._faulting):
            if task is not None:
                if task is self._faulting and self.arena is not None:
                    self.arena.ceiling = 0  # its worker stops after the huge page it is faulting
                try:
                    await task
                except Exception:
                    pass
        self._spares.clear()
        self.spare_bytes = 0
        self.arena = None
