"""The disk store's cache of attached shared-memory segments (the engines' buffer pools), by name.

An engine's buffer pool is one big segment, so attaching once and reusing the mapping makes each put/get a
slice, not an mmap. A cached mapping is checked against the name on every use (one stat): if the engine
restarted and made a new segment under the same name, the stale mapping is dropped and the new one attached.
Used from the store's event loop thread; the returned views are then read/written by its I/O threads.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from kvmesh.shared.errors import StoreError
from kvmesh.shared.shm import SharedSegment

log = logging.getLogger(__name__)


class SegmentCache:
    """Up to `max_segments` attached segments, least recently used dropped first."""

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
        segment = self._segments.pop(name)
        segment.close()

    def close(self) -> None:
        for name in list(self._segments):
            self._drop(name)
