"""Background chunk writes: a staging pool that owns the bytes of accepted puts, and the writer threads.

Why staging: the engine reuses its shared-memory buffer as soon as a put is answered, and a 32 MiB chunk takes
~25-60 ms to reach the disk with fsync but ~3-6 ms to copy. So the put handler copies the chunk out of the
engine's segment into a store-owned staging buffer (one memcpy, GIL released, each piece hashed as it is
copied so the staged bytes are verified against the put's checksum), answers, and a writer thread writes the
file. The staging pool bounds memory: when it is full, a put waits for a buffer to come back (back pressure),
up to a deadline. With a staging capacity of 0 the store writes straight from the engine's segment
and answers after the file is complete (write-through); a chunk larger than the whole staging capacity is
written through too.

Measured with benchmarks/disk_store.py (32 MiB chunks, one put in flight, 2-core VM, fsync per file): staged
puts are answered in 13-15 ms p50, write-through puts in 53-112 ms p50 (the disk's speed); throughput is the
disk's either way. Hence staged by default. The price: a put answered "ok" is not yet durable; a crash loses
the staged chunks (never returning partial ones), which a cache can afford. `durable_puts` (--durable-puts)
turns staging off and answers after the file, its rename and its directory are fsync'd.

Threads: `StagingPool` lives on the store's event loop; copies and writes run on `ChunkWriter`'s threads.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvmesh.shared import protocol

from kvmesh.shared.wire import chunk_file

FAULTS_ENV = "KVMESH_DISK_STORE_FAULTS"


@dataclass
class WriteFaults:
    """Test hooks, from $KVMESH_DISK_STORE_FAULTS (comma-separated):

    `enospc=N`       the next N chunk writes fail with ENOSPC after part of the temporary file is written;
    `no_space_check` skip the free-space check at accept time, so a real full disk fails inside the write.
    """

    enospc: int = 0
    no_space_check: bool = False

    @classmethod
    def from_env(cls) -> "WriteFaults":
        faults = cls()
        for item in filter(None, (part.strip() for part in os.environ.get(FAULTS_ENV, "").split(","))):
            name, _, value = item.partition("=")
            if name == "enospc":
                faults.enospc = int(value or 1)
            elif name == "no_space_check":
                faults.no_space_check = True
            else:
                raise ValueError(f"{FAULTS_ENV}: unknown fault {name!r}")
        return faults


class StagingBuffer:
    """A page-aligned anonymous mapping reused across puts (a fresh 32 MiB buffer costs ~20 ms of faults)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._mmap = mmap.mmap(-1, max(nbytes, 1))
        if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= 2 << 20:
            try:
                self._mmap.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults on first use
            except OSError:
                pass
        self.view = memoryview(self._mmap)[:nbytes]

    def close(self) -> None:
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass


class StagingPool:
    """Store-owned buffers for accepted puts, at most `capacity_bytes` in all.

    Invariant: `in_use + free_bytes <= capacity_bytes`; free buffers are kept by size for reuse (chunks of one
    model are mostly one size) and dropped, oldest size first, when a new size needs the room.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.in_use = 0
        self._free: dict[int, list[StagingBuffer]] = defaultdict(list)
        self._free_bytes = 0
        self._returned = asyncio.Condition()

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    async def acquire(self, nbytes: int, timeout: float) -> StagingBuffer | None:
        """A buffer of exactly `nbytes`, waiting up to `timeout` for one to be released; None if none came."""
        if nbytes > self.capacity_bytes:
            return None
        async with self._returned:
            try:
                await asyncio.wait_for(self._returned.wait_for(lambda: self._fits(nbytes)), timeout)
            except asyncio.TimeoutError:
                return None
            return self._take(nbytes)

    def _fits(self, nbytes: int) -> bool:
        return bool(self._free.get(nbytes)) or self.in_use + nbytes <= self.capacity_bytes

    def _take(self, nbytes: int) -> StagingBuffer:
        self.in_use += nbytes
        free = self._free.get(nbytes)
        if free:
            self._free_bytes -= nbytes
            return free.pop()
        # Make room among free buffers of other sizes, then allocate.
        for size in list(self._free):
            while self._free[size] and self.in_use + self._free_bytes > self.capacity_bytes:
                self._free[size].pop().close()
                self._free_bytes -= size
        return StagingBuffer(nbytes)

    async def release(self, buffer: StagingBuffer) -> None:
        async with self._returned:
            self.in_use -= buffer.nbytes
            self._free[buffer.nbytes].append(buffer)
            self._free_bytes += buffer.nbytes
            self._returned.notify_all()

    def close(self) -> None:
        for buffers in self._free.values():
            for buffer in buffers:
                buffer.close()
        self._free.clear()
        self._free_bytes = 0


COPY_PIECE_BYTES = 1024 * 1024  # copy-then-hash pieces: small enough to stay in cache between the two


def copy_and_hash(dst: memoryview, src: memoryview) -> int:
    """Copy `src` into `dst`; the xxh3 (chunk_file.checksum) of the copy, so what is verified is what gets written.

    numpy's copy releases the GIL (memoryview assignment does not); each piece is hashed right after it is
    copied, while it is still in the CPU cache: a separate pass over 32 MiB would read it back from memory.
    """
    hasher = xxhash.xxh3_64()
    to, of = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    for start in range(0, len(of), COPY_PIECE_BYTES):
        end = start + COPY_PIECE_BYTES
        np.copyto(to[start:end], of[start:end])
        hasher.update(dst[start:end])
    return hasher.intdigest()


class ChunkWriter:
    """Writes chunk files on `threads` writer threads (FIFO); each write is crash-safe (tmp + fsync + rename)."""

    def __init__(self, root: Path, threads: int = 1, fsync: bool = True, faults: WriteFaults | None = None,
                 sync_directory: bool = False) -> None:
        self.root = root
        self.fsync = fsync
        self.sync_directory = sync_directory  # durable puts: the rename is fsync'd too before the put is answered
        self.faults = faults or WriteFaults()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="disk-write")
        # Copies get their own thread: a put must not wait behind queued writes to be answered.
        self._copy_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-stage")

    async def copy(self, dst: memoryview, src: memoryview) -> int:
        """Stage `src` into `dst`; the checksum of the staged bytes (`copy_and_hash`)."""
        return await asyncio.get_running_loop().run_in_executor(self._copy_pool, copy_and_hash, dst, src)

    async def write(self, meta: protocol.ChunkMeta, data: memoryview) -> int:
        """Write one chunk file; returns its inode. Raises OSError (disk full, I/O error) leaving no file."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._write, meta, data)

    def _write(self, meta: protocol.ChunkMeta, data: memoryview) -> int:
        if self.faults.enospc > 0:
            self.faults.enospc -= 1
            return self._write_failing(meta, data)
        return chunk_file.write_chunk_file(self.root, meta, data, fsync=self.fsync,
                                           sync_directory=self.sync_directory).stat().st_ino

    def _write_failing(self, meta: protocol.ChunkMeta, data: memoryview) -> int:
        """The fault hook: a write that runs out of space half way, cleaned up the way write_chunk_file does."""
        half = memoryview(data)[: len(data) // 2]
        path = chunk_file.chunk_path(self.root, meta.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}{chunk_file.TMP_SUFFIX}")
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(chunk_file.encode_header(meta))
                f.write(half)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def shutdown(self) -> None:
        self._copy_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
