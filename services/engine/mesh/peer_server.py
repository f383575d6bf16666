"""An engine's CPU tier served to its peers (P2P hits, docs/architecture.md): the stream server of the remote
store's data path (shared/stream_server.py), reading from the CPU tier, gets only.

A get holds the chunk's slot for the send (`LocalCPUBackend.acquire`): an eviction meanwhile frees nothing, so a
peer receives the chunk's bytes as they were, or a miss, never another chunk's. A chunk only the CPU tier holds
has no checksum yet (the write-behind computes it for the stores): it is computed on the way out, so the peer
checks every chunk it receives like one from a store.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvmesh.services.engine.tiers.cpu import ChunkRef, LocalCPUBackend
from kvmesh.shared.chunk_file import checksum
from kvmesh.shared.keys import ChunkKey
from kvmesh.shared.protocol import ChunkMeta


@dataclass(frozen=True)
class _Held:
    meta: ChunkMeta  # its checksum set
    ref: ChunkRef

    def data(self) -> memoryview:
        return self.ref.slot.chunk_buffer(self.meta.nbytes).view


class CpuTierSource:
    """The CPU tier as a stream server's ChunkSource (shared/stream_server.py)."""

    def __init__(self, cpu: LocalCPUBackend) -> None:
        self.cpu = cpu

    def acquire(self, key: ChunkKey, caller: str) -> _Held | None:
        ref = self.cpu.acquire(key)
        if ref is None:
            return None
        meta = ref.meta
        if not meta.checksum:
            meta = dataclasses.replace(meta, checksum=checksum(ref.slot.chunk_buffer(meta.nbytes).view))
        return _Held(meta, ref)

    def release(self, chunk: _Held) -> None:  # type: ignore[override]
        chunk.ref.release()
