"""The engine's host memory: one buffer, cut into fixed-size slots of one chunk each, reference-counted.

Threads: any. vLLM's worker thread allocates and fills slots (store) or reads them (retrieve); the NATS loop
thread hands slots to the stores (write-behind) and fills them (fetch from below). Every method takes the
pool's lock briefly and never waits for a slot: `allocate()` answers None when none is free, and the caller
evicts, skips or shortens (no deadlock, unlike a blocking allocator).

The buffer is one sealed anonymous shared-memory segment (a memfd: shared/wire/shm.py) so the disk store on this
host, once the engine lent it the segment's descriptor, can read and write chunk bytes in place (a store
request carries the pool's token and the slot's offset, never the bytes). Having no name, it leaves nothing
behind when the process dies. It is registered with CUDA as pinned memory when CUDA is present; without
sharing (`use_shm=False`), or when the memfd cannot be made, it is plain process memory.
"""

from __future__ import annotations

import errno
import gc
import logging
import threading
from dataclasses import dataclass, field

import torch

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.shared.wire.shm import SharedSegment

log = logging.getLogger(__name__)

_SLOT_ALIGN = 4096  # slots start page-aligned: aligned reads into them, and no page shared by two slots


@dataclass(eq=False)
class Slot:
    """One chunk-sized region of the pool. `refs` counts holders; at 0 the slot is free.

    Holders are the CPU tier (while the chunk is resident), a write-behind job (while a store reads the bytes),
    a retrieve (while the bytes are scattered into vLLM's cache) and a fetch (while a store writes them).
    """

    index: int
    offset: int  # byte offset in the pool buffer (and in the shared segment)
    nbytes: int  # capacity
    tensor: torch.Tensor  # uint8 view of [offset, offset + nbytes)
    pool: "MemoryPool" = field(repr=False)
    refs: int = 0

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """The slot's leading bytes as a tensor of `dtype` and `shape` (no copy)."""
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * dtype.itemsize
        return self.tensor[:nbytes].view(dtype).view(tuple(shape))

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


class MemoryPool:
    """Fixed-size, reference-counted slots over one host buffer.

    Invariant: a slot is in `_free` iff its `refs` is 0; `allocate` hands it out with refs = 1 and the last
    `release` puts it back. Free slots are reused last-freed-first, so hot (already faulted-in) pages are reused
    before cold ones. Nothing here blocks: an empty free list is an answer, not a wait.
    """

    def __init__(self, capacity_bytes: int, slot_nbytes: int, use_shm: bool = True,
                 pin: bool | None = None) -> None:
        if slot_nbytes <= 0:
            raise ValueError(f"slot_nbytes must be positive, got {slot_nbytes}")
        self.slot_nbytes = _round_up(slot_nbytes, _SLOT_ALIGN)
        self.num_slots = max(0, capacity_bytes // self.slot_nbytes)
        size = self.num_slots * self.slot_nbytes
        self._lock = threading.Lock()
        self.segment: SharedSegment | None = None  # the shared memory, None when the pool is process memory
        self._pinned = False
        if size == 0:
            self._base = torch.empty(0, dtype=torch.uint8)
            log.warning("CPU pool of %d bytes holds no chunk of %d bytes: every store will be skipped "
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
                        size, self.num_slots = 0, 0
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
        self._slots = [Slot(i, i * self.slot_nbytes, self.slot_nbytes,
                            self._base[i * self.slot_nbytes:(i + 1) * self.slot_nbytes], self)
                       for i in range(self.num_slots)]
        self._free: list[Slot] = list(reversed(self._slots))  # pop() gives slot 0 first
        self._closed = False

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_nbytes

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def pinned(self) -> bool:
        return self._pinned

    def allocate(self) -> Slot | None:
        """A free slot with refs = 1, or None when every slot is held."""
        with self._lock:
            if not self._free or self._closed:
                return None
            slot = self._free.pop()
            slot.refs = 1
            return slot

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
            if slot.refs == 0:
                self._free.append(slot)

    def close(self) -> None:
        """Unregister pinned memory, unmap the segment. Slots must not be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free.clear()
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            self._pinned = False
        self._slots = []
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

