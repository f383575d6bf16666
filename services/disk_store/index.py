"""What the disk store adds to the shared ChunkIndex: its per-chunk entry, and pins that survive a restart.

The bookkeeping itself (held chunks, writes in flight, eviction under the cap, pins, claims, contains/pin/unpin/
remove/clear/wipe) is shared/chunk_index.py, the same as the remote store's. Pure, no I/O: files.py reads and
writes the pins file (claims persist as the index's `ClaimTable`: shared/state_file.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvmesh.shared.chunk_index import ChunkIndex, SpaceRefused
from kvmesh.shared.keys import ChunkKey

__all__ = ["Entry", "PinRecord", "SpaceRefused", "pin_records", "restore_pins"]


@dataclass(frozen=True)
class Entry:
    """A chunk file: its data size, its size on disk (header page + data), and its token count."""

    nbytes: int
    file_bytes: int
    num_tokens: int

    @property
    def charge(self) -> int:  # the file is what fills the disk
        return self.file_bytes


@dataclass(frozen=True)
class PinRecord:
    """A pin as it is persisted: nesting count and wall-clock expiry (None = until unpinned).

    Wall-clock, because the index's pins expire on the monotonic clock, which restarts with the machine.
    """

    count: int
    expires_at: float | None


def pin_records(index: ChunkIndex[Any]) -> dict[ChunkKey, PinRecord]:
    """The index's live pins, to persist."""
    now = time.time()
    return {key: PinRecord(count, None if left is None else now + left)
            for key, (count, left) in index.pins().items()}


def restore_pins(index: ChunkIndex[Any], records: dict[ChunkKey, PinRecord]) -> int:
    """Re-take persisted pins on the held keys (expired ones are dropped); how many keys were pinned."""
    now = time.time()
    restored = 0
    for key, record in records.items():
        if key not in index or (record.expires_at is not None and record.expires_at <= now):
            continue
        ttl = None if record.expires_at is None else record.expires_at - now
        for _ in range(max(1, record.count)):
            index.pin([key], ttl)
        restored += 1
    return restored
