"""What the disk store adds to the shared ChunkIndex: its per-chunk entry, and the check of a request's key.

The bookkeeping itself (held chunks, writes in flight, eviction under the cap, pins, claims, contains/pin/unpin/
remove/clear/wipe) is shared/store_kit/chunk_index.py, the same as the remote store's. Pins and claims persist through
shared/store_kit/state_file.py (`StoreState`), also the same as a persisting remote store's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.errors import StoreError
from kvmesh.shared.store_kit.chunk_index import SpaceRefused
from kvmesh.shared.wire.keys import KEY_BYTES

__all__ = ["Entry", "SpaceRefused", "check_key"]


@dataclass(frozen=True, slots=True)  # one per chunk: no __dict__
class Entry:
    """A chunk file: its data size, its size on disk (header page + data), and its token count."""

    nbytes: int
    file_bytes: int
    num_tokens: int

    @property
    def charge(self) -> int:  # the file is what fills the disk
        return self.file_bytes


def check_key(key: object) -> None:
    """StoreError unless `key` (a request's) is a chunk key."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise StoreError(f"chunk key must be {KEY_BYTES} bytes, got {key!r:.60}")
