"""Which remote-store replica owns a chunk key: a fixed function every client and every store computes alike.

Keys are uniform 16-byte hashes (shared/wire/keys.py), so their first 8 bytes modulo the number of partitions
spread chunks evenly. Store ids are given in partition order (`remote-0`, `remote-1`, ...).
"""

from __future__ import annotations

from kvmesh.shared.wire.keys import ChunkKey


def partition_of(key: ChunkKey, num_partitions: int) -> int:
    """The partition (0-based) that owns `key` among `num_partitions`."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    return int.from_bytes(key[:8], "little") % num_partitions
