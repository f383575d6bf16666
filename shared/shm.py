"""Named shared-memory segments for the bulk data path between processes on one host (docs/architecture.md).

`SharedSegment` creates or attaches `/dev/shm/<name>` with a plain `mmap`, the same object that
`multiprocessing.shared_memory.SharedMemory(name=...)` opens, so either side may use either API. It avoids
`SharedMemory` on purpose for attaching: before Python 3.13 an attach registers the segment with the
attaching process's resource tracker, which unlinks the owner's segment when the attacher exits.

Typical use: the engine creates one big segment for its buffer pool and sends `(name, offset)` in
PutRequest/GetRequest; a store on the same host keeps the segments it attached in a `SegmentCache` (attach
once by name, then every put/get is a slice, not an mmap) and reads/writes in place.
Not thread-safe to create/close concurrently; views may be used from any thread while the segment is open.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import uuid
from collections import OrderedDict
from pathlib import Path

from kvmesh.shared.errors import StoreError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def segment_path(name: str) -> Path:
    """The file of segment `name` (a leading '/' as in POSIX shm_open names is accepted)."""
    bare = name[1:] if name.startswith("/") else name
    if not _NAME.fullmatch(bare) or bare in (".", ".."):
        raise ValueError(f"bad shared-memory segment name {name!r}")
    return SHM_DIR / bare


class SharedSegment:
    """One mapped shared-memory segment. `buf` is a writable byte view of all `size` bytes."""

    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._ino = os.fstat(fd).st_ino
        self._mmap = mmap.mmap(fd, size) if size else None
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    @classmethod
    def create(cls, size: int, name: str | None = None) -> "SharedSegment":
        """A new zero-filled segment of `size` bytes; fails if `name` exists. The creator unlinks it."""
        name = name or f"kvmesh-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(segment_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            return cls(name, fd, size, owner=True)
        except BaseException:
            segment_path(name).unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)  # the mapping stays valid without the descriptor

    @classmethod
    def attach(cls, name: str) -> "SharedSegment":
        """Map an existing segment (FileNotFoundError if there is none by that name)."""
        fd = os.open(segment_path(name), os.O_RDWR)
        try:
            return cls(name, fd, os.fstat(fd).st_size, owner=False)
        finally:
            os.close(fd)

    def is_current(self) -> bool:
        """False once the name was unlinked or now names another segment (its owner restarted)."""
        try:
            stat = os.stat(segment_path(self.name))
        except FileNotFoundError:
            return False
        return stat.st_ino == self._ino and stat.st_size == self.size

    def close(self) -> None:
        """Unmap; views still exported elsewhere keep it mapped until they are released."""
        self.buf.release()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # someone still holds a view: the mapping goes when they drop it
                pass

    def unlink(self) -> None:
        segment_path(self.name).unlink(missing_ok=True)

    def __enter__(self) -> "SharedSegment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()


class SegmentCache:
    """Up to `max_segments` attached segments by name, least recently used dropped first.

    A cached mapping is checked against the name on every use (one stat): if the engine restarted and made a
    new segment under the same name, the stale mapping is dropped and the new one attached. Used from a store's
    event loop thread; the views it returns are then read/written by the store's I/O threads.
    """

    def __init__(self, max_segments: int = 64) -> None:
        self.max_segments = max_segments
        self._segments: OrderedDict[str, SharedSegment] = OrderedDict()

    def view(self, name: str, offset: int, nbytes: int) -> memoryview:
        """`nbytes` bytes at `offset` of segment `name`; StoreError if it does not exist or is too small."""
        segment = self._segments.get(name)
        if segment is not None and not segment.is_current():
            self._drop(name)
            segment = None
        if segment is None:
            try:
                segment = SharedSegment.attach(name)
            except (OSError, ValueError) as exc:
                raise StoreError(f"cannot attach shared memory {name!r}: {exc}") from None
            self._segments[name] = segment
            log.info("attached shared memory %s (%d bytes)", name, segment.size)
            while len(self._segments) > self.max_segments:
                self._drop(next(iter(self._segments)))
        self._segments.move_to_end(name)
        if offset < 0 or nbytes < 0 or offset + nbytes > segment.size:
            raise StoreError(f"shared memory {name!r}: range [{offset}, {offset + nbytes}) is outside its "
                             f"{segment.size} bytes")
        return segment.buf[offset:offset + nbytes]

    def _drop(self, name: str) -> None:
        self._segments.pop(name).close()

    def close(self) -> None:
        for name in list(self._segments):
            self._drop(name)
