"""Chunks encrypted at rest (services/engine/tiers/sealed.py) in a real disk store (in this loop, on a real
nats-server and real files) and a real remote store (its stream port, its persisted files): a sealed chunk goes
through the lent pool and comes back whole; the store holds no byte run of the plaintext; a chunk file copied under
another key, a chunk read under another sharing domain's key and a chunk stored in clear are misses, counted; a
chunk put to both stores at once is sealed once and opens from either."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
from pathlib import Path
from typing import AsyncIterator, Iterator

import pytest

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.memory_pool import MemoryPool
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.services.engine.tiers.sealed import SEAL_OVERHEAD, ChunkSealer, PutSeals, SealedTier
from kvmesh.shared.wire import chunk_file

from support.disk_store import CHUNK, ENGINE, Harness, chunk, harness, key_of  # noqa: F401 (harness: a fixture)
from support.remote_store import MiB, nats_url, start_stores  # noqa: F401 (nats_url: a fixture)
from support.waiting import WAIT_S, wait_until_async

DOMAIN_A = ChunkSealer("tenant-a", b"a" * 32)
DOMAIN_B = ChunkSealer("tenant-b", b"b" * 32)


@pytest.fixture
def pools() -> Iterator[tuple[MemoryPool, MemoryPool]]:
    """The engine's CPU pool (shared memory, lent to the disk store) and a staging pool for sealed chunks."""
    cpu = MemoryPool(8 * CHUNK, CHUNK, use_shm=True, pin=False)
    staging = MemoryPool(4 * (CHUNK + SEAL_OVERHEAD + 4096), CHUNK + SEAL_OVERHEAD, use_shm=True, pin=False)
    yield cpu, staging
    cpu.close()
    staging.close()


def sealed(client: object, sealer: ChunkSealer, staging: MemoryPool) -> SealedTier:
    return SealedTier(client, sealer, staging, collections.Counter())  # type: ignore[arg-type]


async def put_from_slot(tier: SealedTier, cpu: MemoryPool, i: int) -> tuple[bytes, bool]:
    """Chunk `i` put from a CPU pool slot, as the write-behind does; its bytes and the put's answer."""
    meta, data = chunk(i)
    slot = cpu.allocate()
    assert slot is not None
    try:
        slot.chunk_buffer().view[:CHUNK] = data
        return data, await tier.put(meta, slot.chunk_buffer(CHUNK))
    finally:
        slot.release()


async def get_into_slot(tier: SealedTier, cpu: MemoryPool, i: int) -> bytes | None:
    """Chunk `i` read into a CPU pool slot, as a fetch does (the meta checked as the engine's load does)."""
    slot = cpu.allocate()
    assert slot is not None
    try:
        slot.tensor.fill_(0)
        meta = await tier.get_into(key_of(i), slot.chunk_buffer())
        if meta is None:
            return None
        assert meta == chunk(i)[0]  # the chunk's own meta: size, checksum, tokens, layout
        return bytes(slot.chunk_buffer().view[:meta.nbytes])
    finally:
        slot.release()


def stored_file(root: Path, i: int) -> bytes:
    return chunk_file.chunk_path(root, key_of(i)).read_bytes()


def holds_plaintext(stored: bytes | memoryview, data: bytes) -> bool:
    """Whether any 32-byte run of `data` (at 64 places over it) appears in `stored`."""
    stored = bytes(stored)
    return any(data[at:at + 32] in stored for at in range(0, len(data) - 32, len(data) // 64))


async def test_a_sealed_chunk_round_trips_through_the_lent_pool_and_the_file_holds_no_plaintext(
        harness: Harness, pools: tuple[MemoryPool, MemoryPool]) -> None:
    cpu, staging = pools
    await harness.start()
    tier = sealed(harness.client, DOMAIN_A, staging)
    data, ok = await put_from_slot(tier, cpu, 1)
    assert ok and await tier.wait_written(WAIT_S)
    on_disk = stored_file(harness.root, 1)
    assert len(on_disk) == chunk_file.DATA_ALIGN + CHUNK + SEAL_OVERHEAD
    assert holds_plaintext(data, data) and not holds_plaintext(on_disk, data)
    assert await get_into_slot(tier, cpu, 1) == data
    details = (await tier.stats())[0].details
    assert details["puts_pool"] == 1 and details["gets_pool"] == 1  # the sealed bytes went in place, both ways
    assert dict(tier.counts) == {"sealed_chunks": 1}  # no miss, nothing staged in process memory
    assert staging.num_free == staging.num_slots  # every staging slot back


async def test_a_chunk_file_copied_under_another_key_is_a_counted_miss(
        harness: Harness, pools: tuple[MemoryPool, MemoryPool]) -> None:
    cpu, staging = pools
    await harness.start()
    tier = sealed(harness.client, DOMAIN_A, staging)
    data, ok = await put_from_slot(tier, cpu, 1)
    assert ok and await tier.wait_written(WAIT_S)
    await harness.stop()
    # chunk 1's file rewritten as chunk 2's: a valid chunk file (its checks are not keyed), the sealed bytes moved
    stored, offset = chunk_file.read_chunk_meta(chunk_file.chunk_path(harness.root, key_of(1)))
    sealed_bytes = stored_file(harness.root, 1)[offset:offset + stored.nbytes]
    chunk_file.write_chunk_file(harness.root, dataclasses.replace(stored, key=key_of(2)), sealed_bytes, fsync=False)
    await harness.start()
    tier = sealed(harness.client, DOMAIN_A, staging)
    await wait_until_async(lambda: tier.contains([key_of(2)]), what="the copied file indexed")
    assert await get_into_slot(tier, cpu, 2) is None
    assert tier.counts["sealed_miss_tag"] == 1
    assert await get_into_slot(tier, cpu, 1) == data  # the original still loads


async def test_a_chunk_of_another_domain_and_a_chunk_in_clear_are_counted_misses(
        harness: Harness, pools: tuple[MemoryPool, MemoryPool]) -> None:
    cpu, staging = pools
    await harness.start()
    tier_a = sealed(harness.client, DOMAIN_A, staging)
    tier_b = sealed(harness.client, DOMAIN_B, staging)  # the same store and caller: only the key differs
    data, ok = await put_from_slot(tier_a, cpu, 1)
    assert ok
    assert await harness.put(2)  # in clear, as with encrypt_stores false or before encryption
    assert await get_into_slot(tier_b, cpu, 1) is None
    assert tier_b.counts["sealed_miss_foreign"] == 1
    assert await get_into_slot(tier_a, cpu, 2) is None
    assert tier_a.counts["sealed_miss_unsealed"] == 1
    assert await get_into_slot(tier_a, cpu, 1) == data
    assert await harness.get(1) != data  # a reader without the key gets the ciphertext


@pytest.fixture
async def remote_store(nats_url: str, tmp_path: Path) -> AsyncIterator[tuple[object, RemoteStoreClient]]:  # noqa: F811
    services, nc = await start_stores(nats_url, f"rs{os.urandom(3).hex()}", capacity=8 * MiB,
                                      persist_dir=tmp_path / "persist", fsync=False)
    client = RemoteStoreClient(nc, [s.options.store_id for s in services], ENGINE, request_timeout=WAIT_S)
    yield services[0], client
    await client.close()
    await nc.close()
    for service in services:
        await service.stop()


async def test_the_remote_store_holds_sealed_chunks_in_memory_and_in_its_files(
        remote_store: tuple[object, RemoteStoreClient], tmp_path: Path) -> None:
    service, client = remote_store
    cpu = MemoryPool(8 * CHUNK, CHUNK, use_shm=False, pin=False)
    staging = MemoryPool(4 * (CHUNK + SEAL_OVERHEAD + 4096), CHUNK + SEAL_OVERHEAD, use_shm=False, pin=False)
    tier_a, tier_b = sealed(client, DOMAIN_A, staging), sealed(client, DOMAIN_B, staging)
    data, ok = await put_from_slot(tier_a, cpu, 1)
    assert ok
    held = service.store.acquire(key_of(1), ENGINE)  # type: ignore[attr-defined]
    assert held is not None
    try:
        assert held.meta.nbytes == CHUNK + SEAL_OVERHEAD and not holds_plaintext(held.data(), data)
    finally:
        service.store.release(held)  # type: ignore[attr-defined]
    persisted = await wait_until_async(lambda: list((tmp_path / "persist").rglob("*.kvc")), what="the chunk persisted")
    assert not holds_plaintext(persisted[0].read_bytes(), data)
    assert await get_into_slot(tier_a, cpu, 1) == data
    assert await get_into_slot(tier_b, cpu, 1) is None and tier_b.counts["sealed_miss_foreign"] == 1
    assert dict(tier_a.counts) == {"sealed_chunks": 1} and staging.num_free == staging.num_slots


@pytest.mark.parametrize("shared", [True, False], ids=["seals-shared", "seals-apart"])
async def test_a_chunk_put_to_both_stores_at_once_is_sealed_once_and_opens_from_either(
        harness: Harness, remote_store: tuple[object, RemoteStoreClient], pools: tuple[MemoryPool, MemoryPool],
        shared: bool) -> None:
    """The write-behind's put of a chunk to the disk store and the remote store at once, their sealed tiers sharing
    one staging pool and (`shared`, as the engine builds them: tiers/registry.py) their seals: one seal, the same
    sealed bytes in both stores, nonce and all. Apart, each seals its own (two nonces: the bytes differ)."""
    cpu, staging = pools
    service, remote_client = remote_store
    await harness.start()
    stats: collections.Counter[str] = collections.Counter()
    seals = PutSeals()
    disk = SealedTier(harness.client, DOMAIN_A, staging, stats, seals if shared else None)
    remote = SealedTier(remote_client, DOMAIN_A, staging, stats, seals if shared else None)
    meta, data = chunk(1)
    slot = cpu.allocate()
    assert slot is not None
    try:
        slot.chunk_buffer().view[:CHUNK] = data
        buffer = slot.chunk_buffer(CHUNK)
        assert await asyncio.gather(disk.put(meta, buffer), remote.put(meta, buffer)) == [True, True]
    finally:
        slot.release()
    assert stats["sealed_chunks"] == (1 if shared else 2)
    assert await disk.wait_written(WAIT_S)
    stored, offset = chunk_file.read_chunk_meta(chunk_file.chunk_path(harness.root, key_of(1)))
    on_disk = stored_file(harness.root, 1)[offset:offset + stored.nbytes]
    held = service.store.acquire(key_of(1), ENGINE)  # type: ignore[attr-defined]
    assert held is not None
    try:
        in_remote = bytes(held.data())
    finally:
        service.store.release(held)  # type: ignore[attr-defined]
    assert len(on_disk) == len(in_remote) == CHUNK + SEAL_OVERHEAD and not holds_plaintext(on_disk, data)
    assert (on_disk == in_remote) is shared
    assert await get_into_slot(disk, cpu, 1) == data  # each tier reads its own store only
    assert await get_into_slot(remote, cpu, 1) == data
    assert set(stats) == {"sealed_chunks"} and staging.num_free == staging.num_slots
