"""The disk store's index snapshot (services/disk_store/snapshot.py): a restart takes the chunk files from it as far
as it checks out, on a real nats-server with real files, the store running in the test's event loop."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
import xxhash

from kvmesh.services.disk_store import snapshot
from kvmesh.services.disk_store.options import build_parser, options_from_args
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.wire import chunk_file

from support.disk_store import FILE_BYTES, Harness, chunk, harness, key_of  # noqa: F401 (harness: a fixture)
from support.waiting import wait_until_async


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
    head = struct.Struct("<8sQQ")
    magic, count, _ = head.unpack_from(raw)
    body = bytearray(raw[head.size:])
    body[16:24] = struct.pack("<Q", 10**12)  # the first record's data bytes: more than its file holds
    return head.pack(magic, count, xxhash.xxh3_64_intdigest(bytes(body))) + bytes(body)


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
