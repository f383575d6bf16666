"""The remote store's chunk buffers (services/remote_store/buffers.py): each new one its own zeroed, faulted-in
mapping advised to use huge pages and unmapped when dropped; a recycled one never shows another chunk's bytes; a
refused put gives its buffer back; the prefaulted arena (--prefault-gb) serves the first puts, stays within the
capacity and hands pages back; the background faulting (--fault-ahead-gb) stays within the capacity, never touches
a carved buffer, and is off at 0. Store in this test's event loop on a real nats-server where a client is involved.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.services.remote_store.buffers import PAGE, BufferPool, address_of, size_class
from kvmesh.services.remote_store.options import RemoteStoreOptions, build_parser, options_from_args
from kvmesh.services.remote_store.store import MemoryStore, PutRefused
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.options_cli import GB

from support.remote_store import ENGINE, MiB, chunk, nats_url, one_store, start_stores  # noqa: F401 (fixtures)
from support.waiting import WAIT_S, wait_until_async

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


async def unmapped(address: int) -> bool:
    """Wait until nothing maps `address` any more (the event loop's handle that resumed a task after a worker
    thread holds the thread's result until the loop's next step; a collection rules out cycles)."""
    def gone() -> bool:
        gc.collect()
        return mapping_of(address) is None
    return await wait_until_async(gone, what=f"the mapping at {address:#x} gone")


def mapping_of(address: int) -> tuple[str, dict[str, str]] | None:
    """The /proc/self/smaps entry holding `address`: its range line and its fields; None if nothing maps it."""
    current: tuple[str, dict[str, str]] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's range line, e.g. 7f12a0000000-7f12a2000000 rw-p ...
            start, end = (int(part, 16) for part in head.split("-"))
            if current is not None:
                return current
            if start <= address < end:
                current = (line, {})
        elif current is not None:
            name, _, value = line.partition(":")
            current[1][name] = value.strip()
    return current


async def test_a_new_buffer_is_a_zeroed_writable_mapping_of_its_size_class_unmapped_when_dropped() -> None:
    pool = BufferPool(max_spare_bytes=0)
    nbytes = 3 * MiB + 123  # not a whole number of pages, nor of huge pages
    buffer = await pool.get(nbytes)
    assert len(buffer) == size_class(nbytes) == 3 * MiB + PAGE and buffer.flags.writeable
    assert not buffer.any()  # zeros: nothing of an earlier mapping or process
    address = address_of(buffer)
    assert mapping_of(address) is not None
    buffer[:] = 7
    pool.give(buffer)  # no room for spares: let go
    del buffer
    assert await unmapped(address)  # not kept by an allocator


@pytest.mark.skipif("[never]" in (THP_SETTING.read_text() if THP_SETTING.exists() else "[never]"),
                    reason="this kernel offers no transparent huge pages")
async def test_a_new_buffer_asks_for_huge_pages() -> None:
    buffer = await BufferPool(max_spare_bytes=0).get(4 * MiB)  # holds at least one aligned 2 MiB range
    found = mapping_of(address_of(buffer))
    assert found is not None and found[1].get("THPeligible") == "1", found  # with THP=madvise only if advised


async def test_a_put_into_a_recycled_buffer_reads_back_exactly_its_own_bytes(one_store) -> None:
    service, client = one_store
    store = service.store
    first, first_data = chunk(1 * MiB, 1)  # fills its whole buffer
    assert await client.put(first, ChunkBuffer(memoryview(first_data)))
    first_address = address_of(store.index.held(first.key).buffer)
    fillers = [chunk(1 * MiB, seed) for seed in range(2, 9)]  # the 8 MiB store is full after these
    for meta, data in fillers:
        assert await client.put(meta, ChunkBuffer(memoryview(data)))
    assert first.key in store.index

    shorter, shorter_data = chunk(1 * MiB - 1000, 20)  # same size class: evicts `first` and takes its buffer
    assert await client.put(shorter, ChunkBuffer(memoryview(shorter_data)))
    assert first.key not in store.index
    held = store.index.held(shorter.key)
    assert address_of(held.buffer) == first_address and len(held.data()) == shorter.nbytes

    out = np.full(1 * MiB, 0xAB, dtype=np.uint8)  # room for the whole buffer: only the chunk's bytes may land
    got = await client.get_into(shorter.key, ChunkBuffer(memoryview(out)))
    assert got is not None and got.nbytes == shorter.nbytes
    assert np.array_equal(out[:shorter.nbytes], shorter_data)
    assert (out[shorter.nbytes:] == 0xAB).all()  # nothing of `first` after it


async def test_a_put_refused_for_its_checksum_gives_its_buffer_back() -> None:
    store = MemoryStore(capacity_bytes=16 * MiB)
    try:
        meta, data = chunk(1 * MiB, 3)
        begun = await store.begin_put(meta, ENGINE)
        assert begun is not None
        buffer = begun.buffer
        begun.data()[:] = data
        begun.data()[0] ^= 0xFF  # a byte corrupted on the way
        with pytest.raises(PutRefused, match="do not match their checksum"):
            store.commit_put(begun)
        assert begun.buffer is None and meta.key not in store.index and store.index.reserved_bytes == 0
        assert store.pool.take(meta.nbytes) is buffer  # a spare again, for the next put
        assert store.counters.checksum_failures == 1
    finally:
        await store.close()


async def test_a_put_refused_for_room_gives_its_buffer_back() -> None:
    store = MemoryStore(capacity_bytes=16 * MiB)  # spares up to 2 MiB: a larger buffer is unmapped, not kept
    try:
        arriving, _ = chunk(12 * MiB, 4)
        held = await store.begin_put(arriving, ENGINE)  # in flight: its room cannot be evicted
        assert held is not None
        meta, _ = chunk(6 * MiB, 5)
        begun = await store.begin_put(meta, ENGINE, ahead=1 * MiB)  # room for the first MiB only
        assert begun is not None
        address = address_of(begun.buffer)
        with pytest.raises(PutRefused):
            store.make_room(begun, meta.nbytes)  # 12 + 6 MiB do not fit 16
        assert begun.buffer is None and meta.key not in store.index
        assert store.index.reserved_bytes == held.charge and store.pool.spare_bytes == 0
        assert await unmapped(address)  # its memory went back to the system
        store.abort_put(held)
        assert store.index.reserved_bytes == 0
    finally:
        await store.close()


def resident_kib(start: int, end: int) -> int:
    """Resident KiB of the mappings overlapping [start, end) (handed-back ranges split the arena's mapping, and
    its ends may merge with neighbours)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low < end and start < high
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


# ---- the prefaulted arena (--prefault-gb) ----------------------------------------------------------------------
def held_memory(store: MemoryStore) -> int:
    """Everything the store's memory holds: chunks, room reserved for arriving ones, spares, the uncarved arena."""
    return store.index.used_bytes + store.index.reserved_bytes + store.pool.spare_bytes + store.pool.arena_bytes


async def test_a_prefaulted_store_carves_its_first_puts_from_the_arena_within_its_capacity(nats_url: str) -> None:
    capacity = 8 * MiB
    services, nc = await start_stores(nats_url, f"pf{os.urandom(3).hex()}", capacity=capacity,
                                      prefault_bytes=capacity)
    client = RemoteStoreClient(nc, [services[0].options.store_id], ENGINE, request_timeout=WAIT_S)
    store = services[0].store
    try:
        assert store.pool.arena_bytes == store.pool.prefaulted_bytes == capacity  # faulted before serving
        chunks = [chunk(1 * MiB - 100 * seed, seed) for seed in range(10)]  # sizes within one size class
        for number, (meta, data) in enumerate(chunks, 1):
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
            assert held_memory(store) <= capacity
            assert store.pool.arena_bytes == max(0, capacity - number * MiB)
        assert store.pool.allocated == 0  # no put faulted a new buffer: 8 carved, then evicted ones recycled
        for meta, data in chunks[2:]:  # the first two were evicted
            out = np.full(1 * MiB, 0xCD, dtype=np.uint8)
            assert await client.get_into(meta.key, ChunkBuffer(memoryview(out))) is not None
            assert np.array_equal(out[:meta.nbytes], data) and (out[meta.nbytes:] == 0xCD).all()
        stats = (await client.stats())[0]
        assert stats.details["prefaulted_bytes"] == capacity and stats.details["arena_bytes"] == 0
    finally:
        await client.close()
        await nc.close()
        await services[0].stop()


async def test_the_arena_hands_pages_back_when_the_pool_lets_a_buffer_go_or_the_free_room_shrinks() -> None:
    pool = BufferPool(max_spare_bytes=1 * MiB)
    await pool.prefault(8 * MiB + 123, 8 * MiB + 123)  # whole pages only
    assert pool.arena_bytes == 8 * MiB
    kept, dropped = pool.take(1 * MiB), pool.take(1 * MiB)
    assert kept is not None and dropped is not None and pool.arena_bytes == 6 * MiB and pool.allocated == 0
    kept[:] = 1
    dropped[:] = 2
    pool.give(kept)
    pool.give(dropped)  # the spares are full: its pages go back to the system
    assert pool.spare_bytes == 1 * MiB and (kept == 1).all()
    assert not dropped.any()  # (the test kept a view the pool thinks is gone) its pages were handed back: zeros
    assert "nh" in mapping_of(address_of(dropped))[1]["VmFlags"].split()  # khugepaged never fills them in again
    span = (pool.arena.address, pool.arena.address + pool.arena.size)
    rss_before = resident_kib(*span)
    pool.trim(3 * MiB)  # free room shrank to 3 MiB: the spare (1 MiB) and 3 of the 6 uncarved MiB go
    assert pool.spare_bytes == 0 and pool.arena_bytes == 3 * MiB
    assert resident_kib(*span) <= rss_before - 4 * 1024
    assert pool.take(4 * MiB) is None and pool.take(3 * MiB) is not None  # what is left can still be carved
    await pool.close()


def test_prefault_is_a_flag_that_round_trips_and_stays_within_the_capacity() -> None:
    options = RemoteStoreOptions(store_id="remote-0", capacity_bytes=2 * GB, prefault_bytes=GB // 2)
    assert options_from_args(build_parser().parse_args(options.to_args())).prefault_bytes == GB // 2
    assert options_from_args(build_parser().parse_args([])).prefault_bytes == 0  # default: faulted as puts come
    for value in ("-1", "4.5"):
        with pytest.raises(ConfigError, match="--prefault-gb"):
            options_from_args(build_parser().parse_args(["--max-size-gb", "4", "--prefault-gb", value]))
    with pytest.raises(ValueError, match="prefault"):
        MemoryStore(capacity_bytes=MiB, prefault_bytes=2 * MiB)


async def test_persisted_chunks_load_into_the_arena_and_the_rest_stays_within_the_capacity(tmp_path: Path) -> None:
    capacity = 8 * MiB
    first = MemoryStore(capacity_bytes=capacity, persist_dir=tmp_path, fsync=False)
    await first.open()
    chunks = [chunk(3 * MiB, seed) for seed in range(2)]
    for meta, data in chunks:
        await first.put_bytes(meta, memoryview(data), ENGINE)
    await first.close()  # the chunk files are written

    second = MemoryStore(capacity_bytes=capacity, persist_dir=tmp_path, fsync=False, prefault_bytes=capacity)
    try:
        assert await second.open() == len(chunks)
        assert second.pool.allocated == 0 and second.pool.arena_bytes == capacity - 6 * MiB
        assert held_memory(second) <= capacity
        for meta, data in chunks:
            held = second.acquire(meta.key, ENGINE)
            assert held is not None and np.array_equal(held.data(), data)
            second.release(held)
    finally:
        await second.close()


# ---- the background faulting (--fault-ahead-gb) ----------------------------------------------------------------
async def put_in_pairs(client: RemoteStoreClient, chunks: list) -> None:
    """Put `chunks` two at a time (a stream each)."""
    for first in range(0, len(chunks), 2):
        pair = chunks[first:first + 2]
        assert all(await asyncio.gather(*(client.put(meta, ChunkBuffer(memoryview(data))) for meta, data in pair)))


class HeldWatch:
    """The most memory `store` held at any turn of the event loop while it runs (the worker faulting, puts
    arriving)."""

    def __init__(self, store: MemoryStore) -> None:
        self.store, self.worst, self.watching = store, 0, True
        self.task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self.watching:
            self.worst = max(self.worst, held_memory(self.store))
            await asyncio.sleep(0)  # a yield to the loop, not a wait on time

    async def stop(self) -> int:
        self.watching = False
        await self.task
        return self.worst


async def test_the_background_faulting_keeps_within_the_capacity_and_puts_land_bit_exact(nats_url: str) -> None:
    capacity = 16 * MiB
    services, nc = await start_stores(nats_url, f"fa{os.urandom(3).hex()}", capacity=capacity,
                                      fault_ahead_bytes=4 * capacity)  # a margin past the cap: the cap bounds it
    client = RemoteStoreClient(nc, [services[0].options.store_id], ENGINE, request_timeout=WAIT_S)
    store = services[0].store
    watch = HeldWatch(store)
    try:
        assert await wait_until_async(lambda: store.pool.arena_bytes == capacity, what="the arena faulted to the cap")
        assert store.pool.prefaulted_bytes == 0  # nobody sized a prefault
        chunks = [chunk(1 * MiB - 100 * seed, seed) for seed in range(24)]  # one size class; the last 16 stay
        await put_in_pairs(client, chunks)
        assert store.pool.allocated == 0  # every put found faulted memory: 16 carved, then evicted ones recycled
        assert store.pool.arena.next == capacity
        for meta, data in chunks[8:]:
            out = np.full(1 * MiB, 0xEE, dtype=np.uint8)
            assert await client.get_into(meta.key, ChunkBuffer(memoryview(out))) is not None
            assert np.array_equal(out[:meta.nbytes], data) and (out[meta.nbytes:] == 0xEE).all()
    finally:
        worst = await watch.stop()
        await client.close()
        await nc.close()
        await services[0].stop()
    assert worst <= capacity, f"held {worst} bytes, capacity {capacity}"


async def test_the_background_faulting_stops_where_buffers_from_elsewhere_fill_the_capacity(nats_url: str) -> None:
    capacity = 16 * MiB
    services, nc = await start_stores(nats_url, f"fd{os.urandom(3).hex()}", capacity=capacity,
                                      fault_ahead_bytes=3 * MiB)  # less than a chunk: each put faults its own
    client = RemoteStoreClient(nc, [services[0].options.store_id], ENGINE, request_timeout=WAIT_S)
    store = services[0].store
    watch = HeldWatch(store)
    try:
        assert await wait_until_async(lambda: store.pool.arena_bytes == 3 * MiB, what="the margin faulted")
        chunks = [chunk(4 * MiB, 200 + seed) for seed in range(6)]  # the store is full after 4
        await put_in_pairs(client, chunks)
        assert store.pool.arena.next == 0 and store.pool.allocated >= 4  # none carved: the arena never had 4 MiB
        assert await wait_until_async(lambda: not store.pool.faulting, what="the worker idle")
        assert store.index.used_bytes == capacity and store.pool.arena_bytes == 0  # its faulted pages handed back
        assert held_memory(store) <= capacity
    finally:
        worst = await watch.stop()
        await client.close()
        await nc.close()
        await services[0].stop()
    assert worst <= capacity, f"held {worst} bytes, capacity {capacity}"


async def test_puts_while_the_worker_faults_ahead_of_them_are_stored_bit_exact(nats_url: str) -> None:
    capacity = 64 * MiB
    services, nc = await start_stores(nats_url, f"fb{os.urandom(3).hex()}", capacity=capacity,
                                      fault_ahead_bytes=3 * MiB)  # a small margin: faulted as the puts carve it
    client = RemoteStoreClient(nc, [services[0].options.store_id], ENGINE, request_timeout=WAIT_S)
    store = services[0].store
    try:
        assert await wait_until_async(lambda: store.pool.arena_bytes == 3 * MiB, what="the margin faulted")
        chunks = [chunk(1 * MiB + 4096 * seed, 100 + seed) for seed in range(40)]  # sizes of several classes
        await put_in_pairs(client, chunks)
        assert store.pool.arena.next > 0  # puts were carved from memory the worker faulted
        assert held_memory(store) <= capacity
        for meta, data in chunks:
            out = np.zeros(meta.nbytes, dtype=np.uint8)
            assert await client.get_into(meta.key, ChunkBuffer(memoryview(out))) is not None
            assert np.array_equal(out, data)  # no byte of a carved buffer was touched by the worker after it
    finally:
        await client.close()
        await nc.close()
        await services[0].stop()


async def test_fault_ahead_zero_turns_the_background_faulting_off(nats_url: str) -> None:
    services, nc = await start_stores(nats_url, f"fc{os.urandom(3).hex()}", capacity=8 * MiB, fault_ahead_bytes=0)
    client = RemoteStoreClient(nc, [services[0].options.store_id], ENGINE, request_timeout=WAIT_S)
    store = services[0].store
    try:
        meta, data = chunk(1 * MiB, 7)
        assert await client.put(meta, ChunkBuffer(memoryview(data)))
        assert store.pool.arena is None and store.pool.allocated >= 1  # faulted as the put arrived, as before
        stats = (await client.stats())[0]
        assert stats.details["arena_bytes"] == 0 and stats.details["prefaulted_bytes"] == 0
    finally:
        await client.close()
        await nc.close()
        await services[0].stop()


def test_fault_ahead_is_a_flag_that_round_trips_and_refuses_a_bad_value() -> None:
    options = RemoteStoreOptions(store_id="remote-0", capacity_bytes=2 * GB, fault_ahead_bytes=GB // 2)
    assert options_from_args(build_parser().parse_args(options.to_args())).fault_ahead_bytes == GB // 2
    assert options_from_args(build_parser().parse_args([])).fault_ahead_bytes == GB  # the default
    assert options_from_args(build_parser().parse_args(["--fault-ahead-gb", "0"])).fault_ahead_bytes == 0
    for value in ("-1", "nan"):
        with pytest.raises(ConfigError, match="--fault-ahead-gb"):
            options_from_args(build_parser().parse_args(["--fault-ahead-gb", value]))
    with pytest.raises(ValueError, match="fault-ahead"):
        MemoryStore(capacity_bytes=MiB, fault_ahead_bytes=-1)


def test_a_store_process_given_a_bad_fault_ahead_exits_naming_the_option() -> None:
    result = subprocess.run([sys.executable, "-m", "kvmesh.services.remote_store", "--fault-ahead-gb", "-0.5"],
                            capture_output=True, text=True, timeout=WAIT_S, stdin=subprocess.DEVNULL)
    assert result.returncode != 0 and "--fault-ahead-gb" in result.stderr, result.stderr[-2000:]
