"""What the disk store adds to the shared ChunkIndex: its per-chunk entry, and pins that survive a restart.

The bookkeeping itself (held chunks, writes in flight, eviction under the cap, pins, contains/pin/unpin/remove/clear)
is shared/chunk_index.py, the same as the remote store's. Pure, no I/O: files.py reads and writes the pins file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvmesh.shared.chunk_index import ChunkIndex, SpaceRefused
from kvmesh.shared.keys import ChunkKey

__all__ = ["DiskIndex", "Entry", "PinRecord", "SpaceRefused", "pin_records", "restore_pins"]


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


class DiskIndex:
    """The disk store's index API from before it moved onto ChunkIndex: the same bookkeeping with the old
    return shapes (victim keys; (held, discarded) entries; (removed keys, tokens)). Kept for code written
    against it; the store itself uses `ChunkIndex[Entry]`, whose other methods this passes through."""

    def __init__(self, capacity_bytes: int, policy: str = "LRU") -> None:
        self.chunks: ChunkIndex[Entry] = ChunkIndex(capacity_bytes, policy=policy)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.chunks, name)

    def __len__(self) -> int:
        return len(self.chunks)

    def reserve(self, key: ChunkKey, entry: Entry) -> list[ChunkKey]:
        return [victim for victim, _ in self.chunks.reserve(key, entry)]

    def commit(self, key: ChunkKey) -> bool:
        return self.chunks.commit(key)

    def abort(self, key: ChunkKey) -> None:
        self.chunks.abort(key)

    def remove(self, key: ChunkKey) -> tuple[Entry | None, Entry | None]:
        discarded = self.chunks.in_flight(key)
        return self.chunks.remove(key), discarded

    def clear(self) -> tuple[list[ChunkKey], int]:
        discarded = self.chunks.in_flight_items()
        removed = self.chunks.clear()
        return [key for key, _ in removed], sum(entry.num_tokens for _, entry in removed + discarded)
