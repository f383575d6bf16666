"""The disk store's index snapshot (services/disk_store/snapshot.py): a restart takes the chunk files from it as far
as it checks out, on a real nats-server with real files, the store running in the test's event loop."""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path

import msgpack
import pytest
import xxhash

from kvmesh.services.disk_store import snapshot
from kvmesh.services.disk_store.options import build_parser, options_from_args
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.store_kit.store_bounds import StoreBounds
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KEY_BYTES

from kvmesh.services.engine.tiers.base import ChunkBuffer, Retention
from kvmesh.shared.eviction.base import MAX_LEASE_SECS, MAX_PRIORITY

from support.disk_store import FILE_BYTES, Harness, chunk, harness, key_of  # noqa: F401 (harness: a fixture)
from support.waiting import WAIT_S, ManualClock, wait_until_async


def chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kvc"))


async def put_all(harness: Harness, *indices: int) -> None:
    for i in indices:
        assert await harness.put(i)


async def served(harness: Harness, *indices: int) -> list[bool]:
    """Whether each chunk is read back bit-exact (a get verifies its header, key and checksum)."""
    return [await harness.get(i) == chunk(i)[1] for i in indices]


async def test_a_restart_takes_the_chunks_from_the_snapshot_and_serves_the_same_chunks(harness: Harness) -> None:
    await harness.start()
    await put_all(harness, 1, 2, 3, 4, 5)
    assert await served(harness, 2) == [True]  # a read changes its file's mtime: recorded at close
    await harness.stop()
    assert snapshot.read_snapshot(harness.root)[0].complete  # a clean stop's: the next start need not list files
    service = await harness.start()
    report = service.store.scan_report
    assert report is not None and report.snapshot == "used"
    assert report.trusted == 5 and report.removed_corrupt == 0  # no file's header was read
    assert await served(harness, 1, 2, 3, 4, 5) == [True] * 5
    stats = (await harness.client.stats())[0]
    assert stats.num_chunks == 5 and stats.used_bytes == 5 * FILE_BYTES


def tear_in_the_body(raw: bytes) -> bytes:
    return raw[: len(raw) // 2]  # a crash in the middle of writing it


def tear_in_the_header(raw: bytes) -> bytes:
    return raw[:10]


def flip_a_byte(raw: bytes) -> bytes:
    return raw[:-7] + bytes([raw[-7] ^ 0x40]) + raw[-6:]


def lie_with_a_valid_checksum(raw: bytes) -> bytes:
    """A record whose file is not whole header pages plus its data, the body's checksum recomputed: only the
    bounds checks can refuse it."""
    magic, count, _, flags, retained = snapshot._HEAD.unpack_from(raw)
    body = bytearray(raw[snapshot._HEAD.size:])
    body[KEY_BYTES:KEY_BYTES + 8] = struct.pack("<Q", 10**12)  # the first record's data bytes: more than its file
    return snapshot._HEAD.pack(magic, count, xxhash.xxh3_64_intdigest(bytes(body)), flags, retained) + bytes(body)


def another_version(raw: bytes) -> bytes:
    return raw[:6] + b"\x09" + raw[7:]


@pytest.mark.parametrize("damage", [tear_in_the_body, tear_in_the_header, flip_a_byte, lie_with_a_valid_checksum,
                                    another_version])
async def test_a_torn_or_damaged_snapshot_is_detected_and_every_file_is_scanned(harness: Harness, damage,
                                                                                caplog) -> None:
    await harness.start()
    await put_all(harness, 1, 2, 3, 4)
    await harness.stop()
    path = harness.root / snapshot.SNAPSHOT_NAME
    path.write_bytes(damage(path.read_bytes()))
    service = await harness.start()
    report = service.store.scan_report
    assert report is not None and report.snapshot.startswith("rejected") and report.trusted == 0
    assert "not used" in caplog.text  # the log says why
    assert await served(harness, 1, 2, 3, 4) == [True] * 4  # nothing lost
    await harness.stop()  # and the next stop writes a good one again
    assert (await harness.start()).store.scan_report.snapshot == "used"


async def test_files_removed_added_and_changed_behind_the_snapshot_are_found_and_checked(harness: Harness) -> None:
    await harness.start()
    await put_all(harness, 1, 2, 3, 4, 5, 6)
    await harness.stop()
    root = harness.root
    path_of = {i: chunk_file.chunk_path(root, key_of(i)) for i in range(1, 10)}
    path_of[1].unlink()  # removed
    chunk_file.write_chunk_file(root, chunk(7)[0], chunk(7)[1], fsync=False)  # added, a good file
    path_of[8].parent.mkdir(parents=True, exist_ok=True)
    path_of[8].write_bytes(b"not a chunk file")  # added, a bad file
    leftover = path_of[9].with_name(path_of[9].name + ".123.tmp")
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(b"a write cut short")
    # changed: the same size, other bytes (the header passes the scan; the read's checksum catches it)
    raw = bytearray(path_of[2].read_bytes())
    raw[-1] ^= 0xFF
    path_of[2].write_bytes(raw)
    os.truncate(path_of[3], FILE_BYTES - 10)  # changed: truncated (the scan deletes it)
    # changed with its size and mtime kept, so its record matches: another chunk's file under its name
    stat4 = path_of[4].stat()
    path_of[4].write_bytes(path_of[5].read_bytes())
    os.utime(path_of[4], ns=(stat4.st_atime_ns, stat4.st_mtime_ns))
    # a copy of 6's file, size and mtime kept, in a fan-out directory not its own: its record must not vouch for it
    elsewhere = root / ("00" if path_of[6].parent.name != "00" else "01") / path_of[6].name
    elsewhere.parent.mkdir(exist_ok=True)
    shutil.copy2(path_of[6], elsewhere)

    service = await harness.start()
    report = service.store.scan_report
    # a clean stop's snapshot is complete: the store serves from its records before it lists the directory
    assert report is not None and report.snapshot == "used"
    assert report.trusted == 6 and report.removed_corrupt == 0 and report.removed_tmp == 0

    async def checked() -> bool:
        return (await harness.client.stats())[0].details["snapshot_files_unchecked"] == 0
    await wait_until_async(checked, what="the snapshot's files checked and the directory listed")
    details = (await harness.client.stats())[0].details
    # 1 (gone) and 3 (truncated) fail their stat check; 8 (bad) and the misplaced copy were added behind it and
    # deleted, 7 (good) was added behind it and indexed; 2 (same size, new mtime) passes the header checks and stays
    assert details["snapshot_files_dropped"] == 4 and details["snapshot_files_added"] == 1
    assert not path_of[3].exists() and not path_of[8].exists() and not elsewhere.exists()
    assert leftover.exists()  # a running store leaves `*.tmp` files alone (its writes); a crash's start removes them
    assert await harness.held(1, 2, 3, 7) == [False, True, False, True]
    assert await served(harness, 5, 6, 7) == [True] * 3
    # the reads still check each file: 2's bytes and 4's header (it names chunk 5) fail, both are dropped
    assert await harness.get(2) is None and await harness.get(4) is None
    assert await harness.held(2, 4) == [False, False]
    await wait_until_async(lambda: not path_of[2].exists() and not path_of[4].exists(), what="bad files deleted")
    assert (await harness.client.stats())[0].details["corrupt_dropped"] == 2


async def test_a_stale_periodic_snapshot_loses_nothing_put_or_removed_after_it(harness: Harness) -> None:
    await harness.start(snapshot_interval_secs=0.05)
    path = harness.root / snapshot.SNAPSHOT_NAME
    await put_all(harness, 1, 2)
    await wait_until_async(lambda: snapshot.read_snapshot(harness.root) is not None
                           and len(snapshot.read_snapshot(harness.root)[0]) == 2, what="a periodic snapshot of 2 chunks")
    stale = path.read_bytes()  # as a crash would leave it: the last periodic one
    assert not snapshot.read_snapshot(harness.root)[0].complete  # so a start lists the directory before serving
    await put_all(harness, 3)
    assert await harness.client.remove([key_of(1)]) == 1  # its file deleted (the stale snapshot names it)
    await wait_until_async(lambda: not chunk_file.chunk_path(harness.root, key_of(1)).exists(),
                           what="the removed chunk's file deleted")
    await harness.stop()
    path.write_bytes(stale)
    service = await harness.start()
    report = service.store.scan_report
    assert report is not None and report.snapshot == "used" and report.trusted == 1  # chunk 2
    assert await harness.held(1) == [False]
    assert await served(harness, 2, 3) == [True, True]


async def test_the_byte_cap_holds_after_a_restart_from_the_snapshot(harness: Harness) -> None:
    await harness.start(capacity=6 * FILE_BYTES)
    await put_all(harness, 1, 2, 3, 4, 5, 6)
    await harness.stop()
    service = await harness.start(capacity=3 * FILE_BYTES)  # the cap shrank across the restart
    report = service.store.scan_report
    assert report is not None and report.snapshot == "used" and report.trusted == 6
    stats = (await harness.client.stats())[0]
    assert stats.num_chunks == 3 and stats.used_bytes <= stats.capacity_bytes == 3 * FILE_BYTES
    assert len(chunk_files(harness.root)) == 3  # the trimmed chunks' files are gone before it serves
    held = [i for i in range(1, 7) if await harness.held(i) == [True]]
    assert len(held) == 3 and await served(harness, *held) == [True] * 3
    assert await harness.put(7)  # and a put still evicts to stay under the cap
    stats = (await harness.client.stats())[0]
    assert stats.num_chunks == 3 and stats.used_bytes <= stats.capacity_bytes


def test_the_snapshot_interval_flag(tmp_path: Path) -> None:
    base = ["--dir", str(tmp_path), "--max-size-gb", "1", "--store-id", "d1"]
    assert options_from_args(build_parser().parse_args(base), {}).snapshot_interval_secs == 300.0
    options = options_from_args(build_parser().parse_args([*base, "--snapshot-interval", "0"]), {})
    assert options.snapshot_interval_secs == 0 and "--snapshot-interval" in options.to_args()
    with pytest.raises(ConfigError, match="--snapshot-interval"):
        options_from_args(build_parser().parse_args([*base, "--snapshot-interval", "-1"]), {})


# ---- retention (a put's kv_priority and lease) across a restart ----------------------------------------------
RETAINED_CAPACITY = 6 * FILE_BYTES + 100  # six chunks
RETAINED_SHARE = 2 * FILE_BYTES / RETAINED_CAPACITY  # what one principal may retain: two of them


async def put_retained(harness: Harness, i: int, retention: Retention) -> None:
    meta, data = chunk(i)
    assert await harness.client.put(meta, ChunkBuffer(view=memoryview(bytearray(data))), retention)
    assert await harness.client.wait_written(timeout=WAIT_S)


async def start_retaining(harness: Harness, share: float = RETAINED_SHARE):
    return await harness.start(capacity=RETAINED_CAPACITY, bounds=StoreBounds(retained_share=share))


async def test_a_retained_chunk_survives_a_restart_and_outlives_the_unretained_ones(harness: Harness) -> None:
    """The snapshot keeps each chunk's retention: after a restart a leased chunk and a prioritised one are still
    kept over unretained ones (which eviction pressure takes, older and newer alike), and the lease still ends at
    its wall-clock time."""
    harness.clock = clock = ManualClock()
    await start_retaining(harness)
    await put_retained(harness, 1, Retention(lease_until=time.time() + 600))
    await put_retained(harness, 2, Retention(priority=7))
    await put_all(harness, 3, 4)
    await harness.stop()
    service = await start_retaining(harness)
    index = service.store.index
    assert [index.is_retained(key_of(i)) for i in (1, 2, 3)] == [True, True, False]
    assert service.store.details()["retains_refused"] == 0
    await put_all(harness, *range(10, 20))  # ten unretained chunks through a store of six
    assert await harness.held(1, 2, 3, 4) == [True, True, False, False]
    assert await served(harness, 1, 2) == [True, True]
    clock.advance(601)  # the lease's end (600 s after the put, on the wall clock) has passed: 1 is unretained
    await put_all(harness, *range(20, 30))
    assert await harness.held(1, 2) == [False, True]


def as_version_2(raw: bytes) -> bytes:
    """The same chunk records in the layout before retention (no retained count, no retention records)."""
    _, count, _, flags, _ = snapshot._HEAD.unpack_from(raw)
    records = raw[snapshot._HEAD.size:snapshot._HEAD.size + count * snapshot._RECORD.size]
    return snapshot._HEAD_V2.pack(snapshot.MAGIC_V2, count, xxhash.xxh3_64_intdigest(records), flags) + records


async def test_a_version_2_snapshot_still_loads_its_chunks_unretained(harness: Harness) -> None:
    await start_retaining(harness)
    await put_retained(harness, 1, Retention(priority=7))
    await put_all(harness, 2, 3)
    await harness.stop()
    path = harness.root / snapshot.SNAPSHOT_NAME
    path.write_bytes(as_version_2(path.read_bytes()))
    service = await start_retaining(harness)
    report = service.store.scan_report
    assert report is not None and report.snapshot == "used" and report.trusted == 3
    assert not service.store.index.is_retained(key_of(1))
    assert await served(harness, 1, 2, 3) == [True] * 3
    await put_all(harness, *range(10, 16))  # six more through a store of six: 1 goes as any other
    assert await harness.held(1) == [False]
    await harness.stop()  # and the next stop writes the current version
    assert (harness.root / snapshot.SNAPSHOT_NAME).read_bytes()[:8] == snapshot.MAGIC


def with_retentions(raw: bytes, retentions: list[tuple[int, int, float, int]], owners: list[str]) -> bytes:
    """The snapshot's chunk records with forged retention records (chunk i, priority, lease end, owner's index)
    and owners, the checksum made right: only the bounds checks on retention can refuse them."""
    _, count, _, flags, _ = snapshot._HEAD.unpack_from(raw)
    records = raw[snapshot._HEAD.size:snapshot._HEAD.size + count * snapshot._RECORD.size]
    body = records + b"".join(snapshot._RETAINED.pack(key_of(i), priority, lease_end, owner)
                              for i, priority, lease_end, owner in retentions) + msgpack.packb(owners)
    return snapshot._HEAD.pack(snapshot.MAGIC, count, xxhash.xxh3_64_intdigest(body), flags,
                               len(retentions)) + body


async def test_forged_retention_fields_are_bounded_and_counted(harness: Harness) -> None:
    """Every retention field read back is untrusted: a priority over 10^6, a lease end that is no number, an owner
    the list does not name are dropped, a lease end past the 30-day horizon is clamped to it (each counted); what
    is left is re-taken within each owner's share, which no snapshot can raise."""
    await start_retaining(harness)
    await put_all(harness, 1, 2, 3, 4, 5, 6)
    await harness.stop()
    path = harness.root / snapshot.SNAPSHOT_NAME
    far = time.time() + 365 * 86400
    path.write_bytes(with_retentions(path.read_bytes(), [
        (1, MAX_PRIORITY + 1, 0.0, 0),  # priority out of range: dropped
        (2, 0, float("nan"), 0),  # lease end not a number: dropped
        (3, 5, 0.0, 9),  # no such owner: dropped
        (4, 0, far, 0),  # a lease a year long: clamped to 30 days
        (5, MAX_PRIORITY, 0.0, 1),  # the other owner: within its share
        (6, MAX_PRIORITY, 0.0, 0),  # owner 0's second chunk: within its share (two chunks)
        (2, MAX_PRIORITY, 0.0, 1),  # owner 1's second one: within its share too
        (3, MAX_PRIORITY, 0.0, 1),  # owner 1's third: past its share, held unretained
    ], ["engine/a", "engine/b"]))
    service = await start_retaining(harness)
    store, index = service.store, service.store.index
    assert store.scan_report is not None and store.scan_report.snapshot == "used"
    assert store.counters["snapshot_retentions_dropped"] == 4  # three dropped, one clamped
    assert index.retains_refused == 1  # the share held
    assert [index.is_retained(key_of(i)) for i in range(1, 7)] == [False, True, False, True, True, True]
    assert index.retained_bytes("engine/a") == index.retained_bytes("engine/b") == 2 * FILE_BYTES
    lease_end = {key: end for key, _, _, end in index.retentions()}[key_of(4)]
    assert lease_end is not None and lease_end <= time.time() + MAX_LEASE_SECS
    assert await served(harness, 1, 2, 3, 4, 5, 6) == [True] * 6


async def test_forged_retention_owners_reject_the_snapshot(harness: Harness, caplog) -> None:
    await harness.start()
    await put_all(harness, 1, 2)
    await harness.stop()
    path = harness.root / snapshot.SNAPSHOT_NAME
    path.write_bytes(with_retentions(path.read_bytes(), [(1, 5, 0.0, 0)], [b"\xff" * 3]))  # not a name
    service = await harness.start()
    assert service.store.scan_report.snapshot.startswith("rejected") and "not used" in caplog.text
    assert not service.store.index.is_retained(key_of(1))
    assert await served(harness, 1, 2) == [True, True]
