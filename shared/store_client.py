"""What the engine needs from a chunk store, whichever it is (disk store on this host, remote store).

`ChunkBuffer` names where chunk bytes live in the engine: a view, and if the view lies in a shared-memory
segment, that segment's name and offset, so a store on the same host can read or write the bytes in place
(no bytes through NATS). `ChunkStoreClient` is the interface the engine's storage manager calls; the disk
store and the remote store each provide one (`services/disk_store/client.py`, `services/remote_store/client.py`).
All methods are coroutines on the engine's NATS loop; none raises on a dead store: they log and answer a
miss / False / 0 (a failing store never fails vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvmesh.shared.keys import ChunkKey
from kvmesh.shared.protocol import ChunkMeta, StatsReply


@dataclass(frozen=True)
class ChunkBuffer:
    view: memoryview  # byte view, len >= the chunk's nbytes
    shm_name: str | None = None  # shared-memory segment holding `view`, if any
    shm_offset: int = 0  # offset of `view` inside that segment


class ChunkStoreClient(Protocol):
    location: str  # protocol.LOCAL_DISK or protocol.REMOTE
    store_ids: list[str]  # the store(s) behind this client (one per remote partition)

    async def put(self, meta: ChunkMeta, buffer: ChunkBuffer) -> bool:
        """Hand a chunk to the store; True once the store has the bytes (it may still be writing them)."""

    async def get_into(self, key: ChunkKey, buffer: ChunkBuffer) -> ChunkMeta | None:
        """Fill `buffer` with the chunk's bytes (checksum verified); None on a miss or any failure."""

    async def contains(self, keys: list[ChunkKey]) -> int:
        """How many leading `keys` the store holds; 0 when it cannot be reached."""

    async def pin(self, keys: list[ChunkKey], num_tokens: list[int], ttl_secs: float | None = None) -> int:
        """Pin the contiguous held prefix of `keys`; the number of tokens pinned."""

    async def unpin(self, keys: list[ChunkKey], num_tokens: list[int]) -> int:
        """Unpin; the number of tokens unpinned."""

    async def remove(self, keys: list[ChunkKey]) -> int:
        """Remove chunks; how many were removed."""

    async def clear(self) -> int:
        """Remove every unpinned chunk; the number of tokens cleared."""

    async def stats(self) -> list[StatsReply]:
        """One StatsReply per store behind the client (missing entries for unreachable stores)."""
