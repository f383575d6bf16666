"""Sealed anonymous shared memory for the bulk data path between processes on one host (docs/architecture.md).

The engine's buffer pool is one `SharedSegment.create(size)`: a memfd (no name anywhere, so nothing is left
behind when the engine dies), sized once and sealed against shrinking and growing, so a process that maps it
can never see its pages vanish (no SIGBUS). Its descriptor is the only way to reach it: the engine hands it to
the disk store of its host over a Unix socket (shared/wire/pool_wire.py), and the store maps it with
`SharedSegment.adopt(fd)`, which refuses a descriptor that is not a sealed regular file.

Not thread-safe to create/close concurrently; views may be used from any thread while the segment is open.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK  # what a mapper needs: the file can never become shorter than its mapping
_OWNER_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedSegment:
    """One mapped segment. `buf` is a writable byte view of all `size` bytes.

    The creator keeps the descriptor (`fd`) open to hand it on; an adopted segment closes it once mapped.
    """

    def __init__(self, fd: int, size: int, keep_fd: bool) -> None:
        self.size = size
        self._mmap = mmap.mmap(fd, size) if size else None
        self.fd: int | None = fd if keep_fd else None
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    @classmethod
    def create(cls, size: int, label: str = "kvmesh-pool") -> "SharedSegment":
        """A new zero-filled sealed memfd of `size` bytes (`label` shows in /proc/<pid>/fd only)."""
        fd = os.memfd_create(label, os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            # Reserve every page now: a sparse segment that memory cannot back later kills the first process
            # that touches it (SIGBUS), and ranks next to NCCL's and vLLM's own shared memory overcommit easily.
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _OWNER_SEALS)
            return cls(fd, size, keep_fd=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int) -> "SharedSegment":
        """Map the segment behind a descriptor received from another process, and close the descriptor.

        ValueError when it is not a regular file sealed against shrinking (then a truncation by its sender
        could kill us with SIGBUS), or is empty."""
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("the descriptor is not a regular file")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0  # a file that does not support seals (not a memfd)
            if not seals & REQUIRED_SEALS:
                raise ValueError("the file is not sealed against shrinking (F_SEAL_SHRINK)")
            if info.st_size <= 0:
                raise ValueError("the file is empty")
            return cls(fd, info.st_size, keep_fd=False)  # the mapping stays valid without the descriptor
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap (views still exported elsewhere keep it mapped until they are released) and close the
        descriptor."""
        self.buf.release()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # someone still holds a view: the mapping goes when they drop it
                pass
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "SharedSegment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

