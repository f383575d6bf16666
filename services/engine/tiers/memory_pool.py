"""The engine's host memory: one buffer, cut into reference-counted slots, each the size of what it holds.

Threads: any. vLLM's worker thread allocates and fills slots (store) or reads them (retrieve); the NATS loop
thread hands slots to the stores (write-behind) and fills them (fetch from below). Every method takes the
pool's lock briefly and never waits for a slot: `allocate()` answers None when none is free, and the caller
evicts, skips or shortens (no deadlock, unlike a blocking allocator).

Size classes. A model without recurrent state stores one kind of object (a chunk): every slot is one chunk,
as the pool always was. A model with state layers (Mamba / GDN hybrids) stores two kinds, chunks (the attention
layers' pages) and states (the state layers' pages), of different sizes (Qwen3-Next-like: 128 KiB and 384 KiB);
each is held in a slot of its own size, so the CPU tier wastes none of the difference. The buffer is cut into
*slabs* (`slab_nbytes`: a common multiple of both sizes where one is near, 384 KiB there: three chunks or one
state), and each slab is carved for one class at a time into as many of its slots as fit; once its last slot is
freed it may be carved for either. Both classes share one byte budget rather than a fixed split: how many states
a workload saves per chunk depends on its steps (a state per prefill step at most, but one per chunk while
decoding: adapter/kv_groups.py `state_pages`), so any split would starve one class in some workload. What sharing
costs is fragmentation: a class with no free slot needs a free slab. The CPU tier therefore evicts a victim of
the other class with its slab mates (`slab_mates`, LocalCPUBackend.allocate), so one slab comes free instead of
a part of many; and a class takes its slots from a slab already carved for it before it cuts a free one.

The buffer is one sealed anonymous shared-memory segment (a memfd: shared/wire/shm.py) so the disk store on this
host, once the engine lent it the segment's descriptor, can read and write chunk bytes in place (a store
request carries the pool's token and the slot's offset, never the bytes; slots of both classes lie in the one
segment). Having no name, it leaves nothing behind when the process dies. It is registered with CUDA as pinned
memory when CUDA is present; without sharing (`use_shm=False`), or when the memfd cannot be made, it is plain
process memory.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.fault_ahead import AHEAD_BYTES, FaultAhead
from kvmesh.shared.wire.shm import SharedSegment

log = logging.getLogger(__name__)

CLOSE_WAIT_SECS = 10.0  # how long `close` waits for threads `in_use` (a seal or an open: milliseconds)
_SLOT_ALIGN = 4096  # slots start page-aligned: aligned reads into them, and no page shared by two slots


class MemoryPoolClosed(RuntimeError):
    """A thread was to work in a pool that is closed (its engine is stopping)."""


@dataclass(eq=False)
class Slot:
    """One object's region of the pool, carved from a slab. `refs` counts holders; at 0 the slot is free.

    Holders are the CPU tier (while the chunk is resident), a write-behind job (while a store reads the bytes),
    a retrieve (while the bytes are scattered into vLLM's cache) and a fetch (while a store writes them).
    """

    index: int
    offset: int  # byte offset in the pool buffer (and in the shared segment)
    nbytes: int  # capacity
    tensor: torch.Tensor  # uint8 view of [offset, offset + nbytes)
    pool: "MemoryPool" = field(repr=False)
    refs: int = 0
    slab: "_Slab | None" = field(default=None, repr=False)  # the slab it is carved from
    cls: int = 0  # its size class (CHUNK_CLASS, STATE_CLASS)
    # the last `view` asked, as (dtype, shape, view): a slot holds objects of one shape again and again, and each
    # torch op on vLLM's model thread lets KVMesh's other threads take the GIL
    _last_view: tuple[torch.dtype, tuple[int, ...], torch.Tensor] | None = field(default=None, repr=False)

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """The slot's leading bytes as a tensor of `dtype` and `shape` (no copy)."""
        shape = tuple(shape)
        last = self._last_view
        if last is not None and last[0] == dtype and last[1] == shape:
            return last[2]
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * dtype.itemsize
        view = self.tensor[:nbytes].view(dtype).view(shape)
        self._last_view = (dtype, shape, view)
        return view

    def chunk_buffer(self, nbytes: int | None = None) -> ChunkBuffer:
        """Where a store on this host finds the slot's bytes: a byte view plus the shared segment and offset."""
        length = self.nbytes if nbytes is None else nbytes
        view = memoryview(self.tensor.numpy())[:length]
        return ChunkBuffer(view=view, pool=self.pool.segment, pool_offset=self.offset)

    def ref(self) -> "Slot":
        self.pool._ref(self)
        return self

    def release(self) -> None:
        self.pool._release(self)


@dataclass(eq=False)
class _Slab:
    """One slab of the buffer: free, or carved into the slots of one class (`cls`) while any of them is held."""

    index: int
    offset: int
    cls: int | None = None  # the class it is carved for; None: free
    parts: dict[int, list[Slot]] = field(default_factory=dict)  # per class, made on first carve, kept for the next
    free_parts: int = 0  # while carved: how many of its parts are free


CHUNK_CLASS, STATE_CLASS = 0, 1
MAX_SLAB_FACTOR = 8  # a slab is at most this many of the larger object: bounds what a class switch evicts


def slab_nbytes(sizes: tuple[int, ...], capacity_bytes: int) -> int:
    """The slab for slots of `sizes` (page-aligned) in a pool of `capacity_bytes`: the multiple of the largest, up
    to MAX_SLAB_FACTOR times, that leaves the fewest bytes of the pool unusable were it carved wholly for either
    size (their least common multiple, when the pool holds some, leaves none but the pool's tail), the smallest of
    equals. One size: that size."""
    largest = max(sizes)

    def unusable(slab: int) -> int:
        slabs = capacity_bytes // slab
        return max(capacity_bytes - slabs * (slab // size) * size for size in sizes)

    return min((largest * factor for factor in range(1, MAX_SLAB_FACTOR + 1)),
               key=lambda slab: (unusable(slab), slab))


class MemoryPool:
    """Reference-counted slots of one or two size classes over one host buffer.

    `slot_nbytes`: a chunk's slot; `state_nbytes`: a state's (0, or the same once page-aligned: one class). Every
    slab (`slab_nbytes`) is carved for one class at a time, into as many of its slots as fit (`parts_per_slab`),
    and is free again once its last part is; `slot_nbytes` afterwards is the largest slot (what one object may
    need at most).

    Invariant: a free slab is in `_free_slabs`; a carved one has at least one part held and its free parts in
    `_free_parts` of its class (at the last part's release they leave it and the slab goes back to `_free_slabs`).
    `allocate` hands out a slot with refs = 1 and the last `release` frees it. Free slots are reused
    last-freed-first, so hot (already faulted-in) pages are reused before cold ones. Nothing here blocks: no free
    slot is an answer, not a wait.
    """

    def __init__(self, capacity_bytes: int, slot_nbytes: int, use_shm: bool = True,
                 pin: bool | None = None, state_nbytes: int = 0, fault_ahead_bytes: int = AHEAD_BYTES,
                 thread_setup: Callable[[], None] | None = None) -> None:
        if slot_nbytes <= 0 or state_nbytes < 0:
            raise ValueError(f"slot sizes must be positive, got {slot_nbytes} and {state_nbytes}")
        chunk = _round_up(slot_nbytes, _SLOT_ALIGN)
        state = _round_up(state_nbytes, _SLOT_ALIGN) if state_nbytes else chunk
        self.class_nbytes = (chunk,) if state == chunk else (chunk, state)  # per class, CHUNK_CLASS first
        self.slot_nbytes = max(self.class_nbytes)  # the largest slot
        self.slab_nbytes = slab_nbytes(self.class_nbytes, capacity_bytes)
        self.parts_per_slab = tuple(self.slab_nbytes // size for size in self.class_nbytes)
        self.num_slabs = max(0, capacity_bytes // self.slab_nbytes)
        size = self.num_slabs * self.slab_nbytes
        self._lock = threading.Lock()
        self._threads_in = 0  # threads working in the pool's memory outside any slot reference (`in_use`)
        self._threads_out = threading.Condition(self._lock)
        self.segment: SharedSegment | None = None  # the shared memory, None when the pool is process memory
        self._pinned = False
        if size == 0:
            self._base = torch.empty(0, dtype=torch.uint8)
            log.warning("CPU pool of %d bytes holds no object of %d bytes: every store will be skipped "
                        "(raise max_local_cpu_size)", capacity_bytes, self.slot_nbytes)
        else:
            if use_shm:
                try:
                    self.segment = SharedSegment.create(size)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.ENOMEM):  # the memory is not there: no pool at all
                        log.error("the CPU pool of %.2f GB does not fit in this host's memory (%s): KVMesh caches "
                                  "nothing in this process; lower max_local_cpu_size (it is per rank)",
                                  size / 1024**3, exc)
                        size, self.num_slabs = 0, 0
                    else:
                        log.warning("cannot make a shared CPU pool of %.2f GB (%s): using process memory; the "
                                    "disk store will receive chunk bytes by copy instead of in place",
                                    size / 1024**3, exc)
            if size == 0:
                self._base = torch.empty(0, dtype=torch.uint8)
            elif self.segment is not None:
                self._base = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
            else:
                self._base = torch.empty(size, dtype=torch.uint8)
        if size and (pin if pin is not None else torch.cuda.is_available()):
            self._pin()
        # pinning faulted every page already
        self.fault_ahead = (FaultAhead(self._base.data_ptr(), size, fault_ahead_bytes, thread_setup)
                            if size and fault_ahead_bytes > 0 and not self._pinned else None)
        self._slabs = [_Slab(i, i * self.slab_nbytes) for i in range(self.num_slabs)]
        self._free_slabs: list[_Slab] = list(reversed(self._slabs))  # pop() gives slab 0 first
        # per class, an ordered set: popitem() gives the last freed
        self._free_parts: list[dict[Slot, None]] = [{} for _ in self.class_nbytes]
        self._held_bytes = 0
        self._closed = False

    # ---- sizes -----------------------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.num_slabs * self.slab_nbytes

    def class_of(self, state: bool = False) -> int:
        """The size class of a chunk (or with `state` a state)."""
        return STATE_CLASS if state and len(self.class_nbytes) > 1 else CHUNK_CLASS

    def nbytes_for(self, state: bool = False) -> int:
        """The slot a chunk (or with `state` a state) takes."""
        return self.class_nbytes[self.class_of(state)]

    @property
    def num_slots(self) -> int:
        """How many chunks the empty pool holds."""
        return self.num_slabs * self.parts_per_slab[CHUNK_CLASS]

    @property
    def num_free(self) -> int:
        """How many more chunks the pool could give now (a held state takes the room of its slab's chunks)."""
        with self._lock:
            return len(self._free_parts[CHUNK_CLASS]) + len(self._free_slabs) * self.parts_per_slab[CHUNK_CLASS]

    @property
    def held_bytes(self) -> int:
        """Bytes of the slots held now, each counted at its own size."""
        with self._lock:
            return self._held_bytes

    @property
    def pinned(self) -> bool:
        return self._pinned

    # ---- slots -----------------------------------------------------------------------------------------------
    def allocate(self, state: bool = False) -> Slot | None:
        """A free slot with refs = 1 for a chunk (or with `state` a state), or None when none is free. A slab
        already carved for the class is used before a free one is cut (free slabs stay whole for either class)."""
        cls = self.class_of(state)
        with self._lock:
            if self._closed:
                return None
            free = self._free_parts[cls]
            if free:
                slot, _ = free.popitem()
                assert slot.slab is not None
                slot.slab.free_parts -= 1
            elif self._free_slabs:
                slab = self._free_slabs.pop()
                slot = self._carve(slab, cls)
                if self.fault_ahead is not None:
                    self.fault_ahead.advance(slab.offset + self.slab_nbytes)
            else:
                return None
            slot.refs = 1
            self._held_bytes += slot.nbytes
            return slot

    def _carve(self, slab: _Slab, cls: int) -> Slot:
        """`slab` as the slots of class `cls`: the first handed out, the rest free (under the lock)."""
        parts = slab.parts.get(cls)
        if parts is None:
            size = self.class_nbytes[cls]
            parts = slab.parts[cls] = [
                Slot(slab.index * self.parts_per_slab[cls] + i, slab.offset + i * size, size,
                     self._base[slab.offset + i * size:slab.offset + (i + 1) * size], self, slab=slab, cls=cls)
                for i in range(self.parts_per_slab[cls])]
        for part in reversed(parts[1:]):
            self._free_parts[cls][part] = None
        slab.cls, slab.free_parts = cls, len(parts) - 1
        return parts[0]

    def slab_mates(self, slot: Slot) -> list[Slot]:
        """The other held slots of `slot`'s slab: what must go, with `slot`, before the slab is free for either
        class."""
        with self._lock:
            slab = slot.slab
            if slab is None or slab.cls is None:
                return []
            return [part for part in slab.parts[slab.cls] if part is not slot and part.refs > 0]

    def _ref(self, slot: Slot) -> None:
        with self._lock:
            if slot.refs <= 0:
                raise RuntimeError(f"slot {slot.index} referenced after it was freed")
            slot.refs += 1

    def _release(self, slot: Slot) -> None:
        with self._lock:
            if slot.refs <= 0:
                raise RuntimeError(f"slot {slot.index} released more often than referenced")
            slot.refs -= 1
            if slot.refs or self._closed:
                return
            self._held_bytes -= slot.nbytes
            slab = slot.slab
            assert slab is not None and slab.cls == slot.cls
            slab.free_parts += 1
            if slab.free_parts < self.parts_per_slab[slab.cls]:
                self._free_parts[slab.cls][slot] = None
                return
            free = self._free_parts[slab.cls]
            for part in slab.parts[slab.cls]:  # the last part: the slab is free for either class again
                free.pop(part, None)
            slab.cls, slab.free_parts = None, 0
            self._free_slabs.append(slab)

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """The calling thread works in the pool's memory (a worker thread its asyncio caller cannot cancel): `close`
        waits for it before unmapping. MemoryPoolClosed once the pool is closed."""
        with self._lock:
            if self._closed:
                raise MemoryPoolClosed("the memory pool is closed")
            self._threads_in += 1
        try:
            yield
        finally:
            with self._lock:
                self._threads_in -= 1
                self._threads_out.notify_all()

    def close(self) -> None:
        """Unregister pinned memory, unmap the segment (once no thread is `in_use`, at most CLOSE_WAIT_SECS: else
        the mapping is left to the process's end). Slots must not be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free_slabs.clear()
            self._free_parts.clear()
            if not self._threads_out.wait_for(lambda: self._threads_in == 0, CLOSE_WAIT_SECS):
                log.warning("memory pool closed while %d threads still work in it: its memory stays mapped",
                            self._threads_in)
                return
        if self.fault_ahead is not None:  # before the buffer goes
            self.fault_ahead.close()
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            self._pinned = False
        self._slabs = []
        self._base = torch.empty(0, dtype=torch.uint8)
        if self.segment is not None:
            gc.collect()  # tensors over the mapping may only wait for a reference cycle to be broken
            self.segment.close()  # views still held elsewhere keep the mapping until they go
            self.segment = None

    def _pin(self) -> None:
        # page-locking makes GPU copies to/from the pool DMA-able (and asynchronous)
        err = torch.cuda.cudart().cudaHostRegister(self._base.data_ptr(), self._base.numel(), 0)
        if int(err) != 0:
            log.warning("could not pin the CPU pool (cudaHostRegister error %s); copies will be slower", err)
        else:
            self._pinned = True


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
