"""The engine's host memory: one buffer, cut into fixed-size slots of one chunk each, reference-counted.

Threads: any. vLLM's worker thread allocates and fills slots (store) or reads them (retrieve); the NATS loop
thread hands slots to the stores (write-behind) and fills them (fetch from below). Every method takes the
pool's lock briefly and never waits for a slot: `allocate()` answers None when none is free, and the caller
evicts, skips or shortens (no deadlock, unlike a blocking allocator).

The buffer is one POSIX shared-memory segment so the disk store on this host can read and write chunk bytes
in place (a store request carries the segment name and the slot's offset, never the bytes). It is registered
with CUDA as pinned memory when CUDA is present, and falls back to plain process memory (with a log line)
when /dev/shm cannot hold it.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import re
import threading
import weakref
from dataclasses import dataclass, field

import torch

from kvmesh.shared.shm import SHM_DIR, SharedSegment
from kvmesh.shared.tier import ChunkBuffer
from kvmesh.shared.processes import pid_alive

log = logging.getLogger(__name__)

_SLOT_ALIGN = 4096  # slots start page-aligned: aligned reads into them, and no page shared by two slots
_SEGMENT_NAME = re.compile(r"kvmesh-(\d+)-[0-9a-f]+")  # shared/shm.py's default names: kvmesh-<pid>-<hex>
_OPEN_POOLS: "weakref.WeakSet[MemoryPool]" = weakref.WeakSet()


@dataclass(eq=False)
class Slot:
    """One chunk-sized region of the pool. `refs` counts holders; at 0 the slot is free.

    Holders are the CPU tier (while the chunk is resident), a write-behind job (while a store reads the bytes),
    a retrieve (while the bytes are scattered into vLLM's cache) and a fetch (while a store writes them).
    """

    index: int
    offset: int  # byte offset in the pool buffer (and in the shared-memory segment)
    nbytes: int  # capacity
    tensor: torch.Tensor  # uint8 view of [offset, offset + nbytes)
    pool: "MemoryPool" = field(repr=False)
    refs: int = 0

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """The slot's leading bytes as a tensor of `dtype` and `shape` (no copy)."""
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.tensor[:nbytes].view(dtype).view(tuple(shape))

    def chunk_buffer(self, nbytes: int | None = None) -> ChunkBuffer:
        """Where a store on this host finds the slot's bytes: a byte view plus segment name and offset."""
        length = self.nbytes if nbytes is None else nbytes
        view = memoryview(self.tensor.numpy())[:length]
        return ChunkBuffer(view=view, shm_name=self.pool.shm_name, shm_offset=self.offset)

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
        self._segment: SharedSegment | None = None
        self._pinned = False
        self.shm_name: str | None = None
        if use_shm and size:
            sweep_stale_segments()  # what crashed engines left behind counts against /dev/shm's free space
        if size == 0:
            self._base = torch.empty(0, dtype=torch.uint8)
            log.warning("CPU pool of %d bytes holds no chunk of %d bytes: every store will be skipped "
                        "(raise max_local_cpu_size)", capacity_bytes, self.slot_nbytes)
        elif use_shm and _shm_free_bytes() >= size:
            self._segment = SharedSegment.create(size)
            self.shm_name = self._segment.name
            self._base = torch.frombuffer(self._segment.buf, dtype=torch.uint8)
        else:
            if use_shm:
                log.warning("%s has %.2f GB free, the CPU pool needs %.2f GB: using process memory; the disk "
                            "store will receive chunk bytes by copy instead of in place",
                            SHM_DIR, _shm_free_bytes() / 1024**3, size / 1024**3)
            self._base = torch.empty(size, dtype=torch.uint8)
        if size and (pin if pin is not None else torch.cuda.is_available()):
            self._pin()
        self._slots = [Slot(i, i * self.slot_nbytes, self.slot_nbytes,
                            self._base[i * self.slot_nbytes:(i + 1) * self.slot_nbytes], self)
                       for i in range(self.num_slots)]
        self._free: list[Slot] = list(reversed(self._slots))  # pop() gives slot 0 first
        self._closed = False
        _OPEN_POOLS.add(self)

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
        """Unregister pinned memory, unmap and unlink the segment. Slots must not be used afterwards."""
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
        if self._segment is not None:
            try:
                self._segment.close()
            except BufferError:
                gc.collect()  # tensors over the mapping may only wait for a reference cycle to be broken
                try:
                    self._segment.close()
                except BufferError:
                    log.debug("CPU pool %s still has views; the mapping goes with them", self.shm_name)
            self._segment.unlink()  # the name goes now in any case: no leak in /dev/shm
            self._segment = None

    def _pin(self) -> None:
        # page-locking makes GPU copies to/from the pool DMA-able (and asynchronous)
        err = torch.cuda.cudart().cudaHostRegister(self._base.data_ptr(), self._base.numel(), 0)
        if int(err) != 0:
            log.warning("could not pin the CPU pool (cudaHostRegister error %s); copies will be slower", err)
        else:
            self._pinned = True


def sweep_stale_segments() -> int:
    """Unlink shared-memory segments left by KVMesh processes that died without closing them; how many.

    A SIGKILLed vLLM cannot unlink its pool, and tmpfs keeps the pages until the name goes. Only segments whose
    creating process (the pid in the name) no longer exists are removed.
    """
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        match = _SEGMENT_NAME.fullmatch(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            (SHM_DIR / name).unlink()
            removed += 1
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segment(s) left in %s by processes that are gone", removed, SHM_DIR)
    return removed


@atexit.register
def _close_open_pools() -> None:
    """An interpreter exiting without engine.close() still unlinks its segments."""
    for pool in list(_OPEN_POOLS):
        try:
            pool.close()
        except Exception:
            pass


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _shm_free_bytes() -> int:
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize
