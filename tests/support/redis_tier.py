"""The Redis tier's test parts (tests/engine/ and the remote store's Redis mode in tests/stores/): deterministic
chunks (`chunk`), a put and a get through a `RedisTier`, and the tier's logger name (`TIER_LOG`)."""

from __future__ import annotations

import random

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.redis import RedisTier
from kvmesh.shared import protocol
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KEY_BYTES

TIER_LOG = "kvmesh.services.engine.tiers.redis"


def chunk(seed: int, nbytes: int = 64 * 1024, tokens: int = 32) -> tuple[protocol.ChunkMeta, bytes]:
    data = random.Random(seed).randbytes(nbytes)
    key = seed.to_bytes(4, "little") * (KEY_BYTES // 4)
    meta = protocol.ChunkMeta(key=key, num_tokens=tokens, shape=[nbytes], dtype="uint8", fmt="test",
                              nbytes=nbytes, checksum=chunk_file.checksum(data))
    return meta, data


async def put(tier: RedisTier, meta: protocol.ChunkMeta, data: bytes) -> bool:
    return await tier.put(meta, ChunkBuffer(memoryview(bytearray(data))))


async def get(tier: RedisTier, meta: protocol.ChunkMeta) -> bytes | None:
    out = bytearray(meta.nbytes + 100)  # a slot is at least as large as the chunk
    got = await tier.get_into(meta.key, ChunkBuffer(memoryview(out)))
    if got is None:
        return None
    assert got == meta
    return bytes(out[: meta.nbytes])
