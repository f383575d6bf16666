"""The disk store on a real nats-server with real files, the service running in the test's event loop.

Behaviour that needs the store in its own process (restart, SIGKILL, the CLI) is in test_disk_store_process.py.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.disk_store.index import Entry, SpaceRefused
from kvmesh.services.disk_store.options import build_parser, options_from_args
from kvmesh.services.disk_store.writer import WriteFaults
from kvmesh.services.engine.tiers.base import NO_RETENTION, ChunkBuffer, Retention
from kvmesh.services.engine.tiers.disk import DiskStoreClient
from kvmesh.services.engine.tiers.pool_lending import PoolUnavailable
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.store_kit.chunk_index import ChunkIndex
from kvmesh.shared.store_kit.state_file import CLAIMS_NAME
from kvmesh.shared.store_kit.store_bounds import StoreBounds
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.pool_wire import socket_path
from kvmesh.shared.wire.shm import SharedSegment

from support.disk_store import (CHUNK, ENGINE, FILE_BYTES, Harness, chunk, harness,  # noqa: F401 (harness: a fixture)
                                key_of)
from support.store_events import admission_batches
from support.waiting import WAIT_S, ManualClock, wait_until_async


def chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.parent != root)


@pytest.fixture
def segment() -> Iterator[SharedSegment]:
    with SharedSegment.create(8 * CHUNK) as seg:
        yield seg


# ---------------------------------------------------------------------------------------------------------


async def test_round_trip_bit_exact_over_a_lent_pool_and_inline(harness: Harness, segment: SharedSegment) -> None:
    await harness.start()
    client = harness.client
    # A lent pool: the bytes stay in the segment; only (token, offset) cross NATS.
    meta, data = chunk(1)
    segment.buf[CHUNK:2 * CHUNK] = data
    put_buffer = ChunkBuffer(view=segment.buf[CHUNK:2 * CHUNK], pool=segment, pool_offset=CHUNK)
    assert await client.put(meta, put_buffer)
    segment.buf[CHUNK:2 * CHUNK] = b"\0" * CHUNK  # the engine reuses its buffer right after the reply
    assert await client.wait_written(WAIT_S)
    get_buffer = ChunkBuffer(view=segment.buf[5 * CHUNK:7 * CHUNK], pool=segment, pool_offset=5 * CHUNK)
    got = await client.get_into(meta.key, get_buffer)
    assert got is not None and got.nbytes == CHUNK and got.num_tokens == meta.num_tokens
    assert bytes(segment.buf[5 * CHUNK:6 * CHUNK]) == data
    # Inline both ways.
    meta2, data2 = chunk(2)
    assert await client.put(meta2, ChunkBuffer(view=memoryview(data2)))
    assert await client.wait_written(WAIT_S)
    assert await harness.get(2) == data2
    assert await harness.get(1) == data  # a pool-put chunk can be read inline, and vice versa
    assert await client.get_into(meta2.key, get_buffer) is not None
    assert bytes(segment.buf[5 * CHUNK:6 * CHUNK]) == data2
    # The same key twice makes one file; a miss is None; odd sizes work.
    assert await harness.put(1) and await harness.put(3, nbytes=1000)
    assert await harness.get(3, 1000) == chunk(3, 1000)[1]
    assert len(chunk_files(harness.root)) == 3
    assert await harness.get(99) is None
    assert await client.contains([key_of(1), key_of(2), key_of(99), key_of(3)]) == 2
    stats = (await client.stats())[0]
    assert stats.num_chunks == 3 and stats.details["puts_duplicate"] == 1
    assert stats.details["puts_pool"] == 1 and stats.details["gets_pool"] == 2 and stats.details["pools"] == 1
    assert stats.details["puts_inline"] == 3 and stats.details["gets_inline"] == 3
    assert await client.get_into(meta.key, ChunkBuffer(view=segment.buf[:10], pool=segment)) is None


async def test_lru_eviction_keeps_the_size_cap_and_gets_refresh_recency(harness: Harness) -> None:
    await harness.start(capacity=3 * FILE_BYTES + 100)
    for i in (1, 2, 3):
        assert await harness.put(i)
    assert await harness.get(1) is not None  # 1 is now more recent than 2
    assert await harness.put(4)
    assert await harness.held(1, 2, 3, 4) == [True, False, True, True]
    assert await harness.put(5)
    assert await harness.held(1, 3, 4, 5) == [True, False, True, True]
    stats = (await harness.client.stats())[0]
    assert stats.num_chunks == 3 and stats.used_bytes <= stats.capacity_bytes
    # the evicted chunks' files are deleted in the background
    await wait_until_async(lambda: len(chunk_files(harness.root)) == 3, what="two evicted files deleted")
    # A chunk bigger than the whole cap is refused, and nothing is evicted for it.
    assert not await harness.put(6, nbytes=4 * FILE_BYTES, wait=False)
    assert await harness.held(1, 4, 5) == [True, True, True]


async def test_pins_survive_pressure_and_clear_and_a_full_pinned_store_refuses_puts(harness: Harness) -> None:
    await harness.start(capacity=2 * FILE_BYTES + 100)
    client = harness.client
    assert await harness.put(1) and await harness.put(2)
    keys = [key_of(1), key_of(2)]
    assert await client.pin(keys, [101, 102]) == 203
    files_before = chunk_files(harness.root)
    reply = await harness.request("put", protocol.PutRequest(meta=chunk(3)[0], data=chunk(3)[1]), protocol.Ack)
    assert not reply.ok and "no room" in reply.error  # refused with a reason ...
    assert await harness.held(1, 2, 3) == [True, True, False]  # ... and nothing else changed
    assert chunk_files(harness.root) == files_before
    assert await harness.wipe() == 0  # everything is pinned
    assert await harness.get(1) == chunk(1)[1] and await harness.get(2) == chunk(2)[1]
    # Pins are a contiguous prefix at chunk granularity; unpin releases one pin.
    assert await client.pin([key_of(2), key_of(9), key_of(1)], [102, 109, 101]) == 102
    assert await client.unpin([key_of(2)], [102]) == 102
    assert await client.unpin([key_of(1), key_of(2)], [101, 102]) == 203  # 1's only pin, 2's first pin
    assert await client.unpin([key_of(2)], [102]) == 0  # no pin left on 2
    assert await harness.put(3)  # 1 and 2 are unpinned now: 1 (least recent) goes
    assert await harness.held(1, 2, 3) == [False, True, True]
    assert await client.pin([key_of(3)], []) == 103  # no counts given: the stored ones
    assert await harness.wipe() == 102  # 2 wiped, 3 pinned and kept
    assert await harness.held(2, 3) == [False, True]
    stats = (await client.stats())[0]
    assert stats.pinned_chunks == 1 and stats.num_chunks == 1


async def test_pins_with_ttl_expire_and_pins_survive_a_restart(harness: Harness) -> None:
    clock = harness.clock = ManualClock()  # both store instances' pins run on it (persisted as wall-clock times)
    await harness.start(capacity=2 * FILE_BYTES + 100)
    assert await harness.put(1) and await harness.put(2)
    assert await harness.client.pin([key_of(1)], [101]) == 101
    assert await harness.client.pin([key_of(2)], [102], ttl_secs=60) == 102
    await harness.stop()
    service = await harness.start(capacity=2 * FILE_BYTES + 100)
    assert (await harness.client.stats())[0].pinned_chunks == 2
    # the index holds the scanned chunks; the scan's own list of them is not kept for the store's life
    assert service.store.scan_report is not None and service.store.scan_report.chunks == []
    assert not await harness.put(3, wait=False)  # both pinned: no room
    clock.advance(61)
    assert await harness.put(3)  # 2's pin expired: it is the victim; 1 stays pinned
    assert await harness.held(1, 2, 3) == [True, False, True]


async def test_a_corrupted_or_truncated_file_is_a_miss_and_is_dropped(harness: Harness) -> None:
    await harness.start()
    for i in (1, 2, 3):
        assert await harness.put(i)
    flipped = chunk_file.chunk_path(harness.root, key_of(1))
    raw = bytearray(flipped.read_bytes())
    raw[-100] ^= 0xFF
    flipped.write_bytes(raw)
    truncated = chunk_file.chunk_path(harness.root, key_of(2))
    os.truncate(truncated, truncated.stat().st_size - 10)
    assert await harness.get(1) is None and await harness.get(2) is None
    assert not flipped.exists() and not truncated.exists()
    assert await harness.held(1, 2, 3) == [False, False, True]
    assert await harness.get(3) == chunk(3)[1]
    assert (await harness.client.stats())[0].details["corrupt_dropped"] == 2


async def test_write_failure_leaves_no_file_and_the_store_serving(harness: Harness) -> None:
    # Staged puts: accepted, then the background write hits ENOSPC half way through the file.
    await harness.start(faults=WriteFaults(enospc=1))
    assert await harness.put(1)
    assert await harness.held(1) == [False]
    assert chunk_files(harness.root) == []  # neither the chunk file nor its temporary
    details = (await harness.client.stats())[0].details
    assert details["write_errors"] == 1 and "No space left" in details["last_write_error"]
    assert await harness.put(1) and await harness.get(1) == chunk(1)[1]  # the store goes on
    await harness.stop()
    # Write-through puts: the failure is the put's own answer.
    await harness.start(staging_bytes=0, faults=WriteFaults(enospc=1))
    meta, data = chunk(2)
    reply = await harness.request("put", protocol.PutRequest(meta=meta, data=data), protocol.Ack)
    assert not reply.ok and "No space left" in reply.error
    assert await harness.held(1, 2) == [True, False]
    assert len(chunk_files(harness.root)) == 1
    assert await harness.put(2) and await harness.get(2) == data


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, timeout=10).returncode == 0


async def test_a_really_full_disk_refuses_or_fails_the_put_cleanly(nc, tmp_path: Path) -> None:
    mount = tmp_path / "tiny"
    if not _mount_tmpfs(mount, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root); the ENOSPC hook test covers the write path")
    harness = Harness(nc, mount / "disk")
    try:
        # Checked at accept time: the put is refused with a reason.
        await harness.start(capacity=64 * FILE_BYTES)
        assert await harness.put(1, nbytes=600 * 1024)
        reply = await harness.request("put", protocol.PutRequest(meta=chunk(2, 600 * 1024)[0],
                                                                 data=chunk(2, 600 * 1024)[1]), protocol.Ack)
        assert not reply.ok and "disk full" in reply.error
        await harness.stop()
        # Unchecked: the real ENOSPC comes from inside the write; no partial file stays.
        await harness.start(capacity=64 * FILE_BYTES, staging_bytes=0, faults=WriteFaults(no_space_check=True))
        reply = await harness.request("put", protocol.PutRequest(meta=chunk(2, 600 * 1024)[0],
                                                                 data=chunk(2, 600 * 1024)[1]), protocol.Ack)
        assert not reply.ok and "No space left" in reply.error
        assert [p.name for p in chunk_files(harness.root)] == [chunk_file.chunk_path(harness.root, key_of(1)).name]
        assert await harness.get(1, 600 * 1024) == chunk(1, 600 * 1024)[1]
        await harness.stop()
    finally:
        await harness.stop()  # closes the store's files, so the unmount is not busy
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=10)


async def test_garbage_on_every_subject_leaves_it_serving(harness: Harness) -> None:
    await harness.start()
    assert await harness.put(1)
    ops = ["put", "get", "contains", "touch", "remove", "clear", "wipe", "pin", "unpin", "stats"]
    garbage = [b"", b"\x00\xff\xfe", b"not msgpack", protocol.encode(protocol.Ack()),
               protocol.encode(protocol.HealthRequest()), b"\x81\xa1v\x01"]
    for op in ops:
        for payload in garbage:
            reply = await harness.nc.request(protocol.Subjects.store(harness.store_id, op, ENGINE), payload,
                                             timeout=WAIT_S)
            assert reply.data  # an error answer, never silence or a crash
    bad_meta = protocol.ChunkMeta(key=b"short", num_tokens=1, shape=[4], dtype="uint8", fmt="x", nbytes=4)
    good_meta = chunk(7)[0]
    bad_requests = [
        ("put", protocol.PutRequest(meta=bad_meta, data=b"1234")),
        ("put", protocol.PutRequest(meta=good_meta, data=b"too short")),
        ("put", protocol.PutRequest(meta=good_meta)),
        ("put", protocol.PutRequest(meta=good_meta, pool="../../etc/passwd")),
        ("put", protocol.PutRequest(meta=good_meta, pool="0" * 32)),
        ("put", protocol.PutRequest(meta=protocol.ChunkMeta(key=key_of(8), num_tokens=-1, shape=[], dtype="",
                                                            fmt="", nbytes=-5), data=b"")),
        ("get", protocol.GetRequest(key=b"x" * 40)),
        ("get", protocol.GetRequest(key=key_of(1), pool="0" * 32, capacity=CHUNK)),
        ("contains", protocol.ChunkKeys(keys=[b"", b"x" * 100])),
        ("pin", protocol.ChunkKeys(keys=[b"bad"], num_tokens=[1, 2, 3], ttl_secs=-1.0)),
        ("remove", protocol.ChunkKeys(keys=[b"bad"])),
    ]
    for op, message in bad_requests:
        reply = await harness.nc.request(protocol.Subjects.store(harness.store_id, op, ENGINE),
                                         protocol.encode(message), timeout=WAIT_S)
        assert reply.data
    assert await harness.held(7, 8) == [False, False]
    assert await harness.get(1) == chunk(1)[1]
    assert await harness.put(2) and await harness.get(2) == chunk(2)[1]
    health = await bus.request(harness.nc, protocol.Subjects.health(protocol.store_path(harness.store_id)),
                               protocol.HealthRequest(), protocol.HealthReply, WAIT_S)
    assert health.service == "disk_store" and health.details["puts_refused"] >= 5


async def test_admission_events_with_increasing_seq_reach_a_subscriber(harness: Harness) -> None:
    received: list[object] = []

    async def on_event(msg) -> None:
        for kind in (protocol.AdmissionBatch, protocol.SyncChunk):
            try:
                received.append(protocol.decode(msg.data, kind))
                return
            except Exception:
                continue

    await harness.nc.subscribe(protocol.Subjects.events(protocol.store_path(harness.store_id)), cb=on_event)
    await harness.start(capacity=2 * FILE_BYTES + 100)
    def batches_so_far() -> list[protocol.AdmissionBatch]:
        return [m for m in received if isinstance(m, protocol.AdmissionBatch)]

    def reported(field: str) -> set[bytes]:
        return {k for b in batches_so_far() for k in getattr(b, field)}

    for i in (1, 2):
        assert await harness.put(i)
        # a batch per put: the next put only once this one's admission has arrived
        await wait_until_async(lambda: key_of(i) in reported("admitted"), what=f"the admission of chunk {i}")
    assert await harness.put(3)  # evicts 1
    assert await harness.client.remove([key_of(2)]) == 1
    await wait_until_async(lambda: key_of(3) in reported("admitted") and reported("evicted") >= {key_of(1), key_of(2)},
                           what="the admission of 3 and the evictions of 1 and 2")
    batches = batches_so_far()
    seqs = [b.seq for b in batches]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= 2
    assert all(b.location == protocol.LOCAL_DISK and b.producer_id == harness.store_id for b in batches)
    admitted = [k for b in batches for k in b.admitted]
    evicted = [k for b in batches for k in b.evicted]
    assert set(admitted) >= {key_of(1), key_of(2), key_of(3)} and set(evicted) >= {key_of(1), key_of(2)}
    syncs = [m for m in received if isinstance(m, protocol.SyncChunk)]
    assert syncs and syncs[0].final and syncs[0].keys == []  # the full sync at start (empty directory)


async def test_remove_and_stats(harness: Harness) -> None:
    await harness.start()
    for i in (1, 2, 3):
        assert await harness.put(i)
    assert await harness.client.contains([key_of(1), key_of(2), key_of(9), key_of(3)]) == 2
    assert await harness.client.remove([key_of(2), key_of(9)]) == 1
    assert await harness.held(1, 2, 3) == [True, False, True]
    stats = await harness.client.stats()
    assert stats[0].store_id == harness.store_id and stats[0].num_chunks == 2
    assert stats[0].used_bytes == 2 * FILE_BYTES


async def test_client_of_a_dead_store_answers_misses_and_logs_once(nc, caplog) -> None:
    client = DiskStoreClient(nc, "disk-nobody", ENGINE, request_timeout=0.2)
    meta, data = chunk(1)
    caplog.set_level(logging.WARNING, logger="kvmesh.services.engine.tiers.disk")
    for _ in range(3):
        assert await client.put(meta, ChunkBuffer(view=memoryview(data))) is False
        assert await client.get_into(meta.key, ChunkBuffer(view=memoryview(bytearray(CHUNK)))) is None
        assert await client.contains([meta.key]) == 0
        assert await client.pin([meta.key], [256]) == 0 and await client.unpin([meta.key], [256]) == 0
        assert await client.remove([meta.key]) == 0 and await client.clear() == 0
        assert await client.stats() == []
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
    assert client.location == protocol.LOCAL_DISK and client.store_ids == ["disk-nobody"]


# ---- claims: a clear takes back only the caller's chunks ---------------------------------------------------
TENANT_A = protocol.Principal.engine("tenant-a").producer("tenant-a")
TENANT_B = protocol.Principal.engine("tenant-b").producer("tenant-b")


class EventLog:
    """The store's AdmissionBatches as the controller would see them."""

    def __init__(self) -> None:
        self.batches: list[protocol.AdmissionBatch] = []

    async def subscribe(self, harness: Harness) -> None:
        self.batches = await admission_batches(harness.nc, harness.store_id)

    def keys(self, field: str) -> set[bytes]:
        return {k for batch in self.batches for k in getattr(batch, field)}


async def test_a_clear_takes_back_only_the_callers_chunks_and_reports_only_real_evictions(harness: Harness) -> None:
    events = EventLog()
    await events.subscribe(harness)
    await harness.start()
    a, b = harness.client_of(TENANT_A), harness.client_of(TENANT_B)
    for i, client in ((1, a), (2, a), (2, b), (3, b)):  # 2 is put by both (one file, two claims)
        assert await harness.put(i, client=client)
    assert len(chunk_files(harness.root)) == 3
    await wait_until_async(lambda: events.keys("admitted") >= {key_of(1), key_of(2), key_of(3)},
                           what="the admissions of 1, 2, 3")
    # A's clear: A's tokens (its view lost 1 and 2), but only 1 leaves the store
    assert await a.clear() == 101 + 102
    assert await harness.held(1, 2, 3) == [False, True, True]
    await wait_until_async(lambda: key_of(1) in events.keys("evicted"), what="the eviction of 1")
    assert events.keys("evicted") == {key_of(1)}  # one batch: 2 and 3 were never reported gone
    await wait_until_async(lambda: len(chunk_files(harness.root)) == 2, what="the file of 1 deleted")
    assert await harness.get(2) == chunk(2)[1]
    assert await a.clear() == 0  # nothing of A's left
    # B's clear takes the rest, the shared chunk with it
    assert await b.clear() == 102 + 103
    assert await harness.held(2, 3) == [False, False]
    await wait_until_async(lambda: events.keys("evicted") == {key_of(1), key_of(2), key_of(3)},
                           what="the evictions of 2 and 3")
    stats = (await harness.client.stats())[0]
    assert stats.num_chunks == 0 and stats.details["claimants"] == 0


async def test_pinned_chunks_outlive_their_callers_clear_until_unpinned(harness: Harness) -> None:
    await harness.start()
    a = harness.client_of(TENANT_A)
    for i in (1, 2):
        assert await harness.put(i, client=a)
    assert await harness.client.pin([key_of(1)], [101]) == 101  # the controller's /pin, say
    assert await a.clear() == 101 + 102  # A no longer claims either ...
    assert await harness.held(1, 2) == [True, False]  # ... the pinned one stays for its pin
    assert await harness.get(1) == chunk(1)[1]
    assert await harness.client.unpin([key_of(1)], [101]) == 101  # its last pin: now it goes
    assert await harness.held(1) == [False]
    await wait_until_async(lambda: chunk_files(harness.root) == [], what="both files deleted")


async def test_wipe_is_the_operators_alone_and_spares_pins(harness: Harness) -> None:
    await harness.start()
    a, b = harness.client_of(TENANT_A), harness.client_of(TENANT_B)
    for i, client in ((1, a), (2, b), (3, a)):
        assert await harness.put(i, client=client)
    assert await harness.client.pin([key_of(3)], [103]) == 103
    reply = await harness.request("wipe", protocol.WipeRequest(), protocol.CommandReply, caller=TENANT_A)
    assert not reply.ok and "operator" in reply.error and TENANT_A in reply.error
    assert await harness.held(1, 2, 3) == [True, True, True]
    assert await harness.wipe() == 101 + 102  # every unpinned chunk, whoever put it
    assert await harness.held(1, 2, 3) == [False, False, True]
    stats = (await harness.client.stats())[0]
    assert stats.num_chunks == 1 and stats.pinned_chunks == 1


async def test_claims_survive_a_restart_and_chunks_without_claims_stay_until_wiped(harness: Harness) -> None:
    await harness.start()
    a, b = harness.client_of(TENANT_A), harness.client_of(TENANT_B)
    for i, client in ((1, a), (2, a), (2, b), (3, b)):
        assert await harness.put(i, client=client)
    await harness.stop()  # a clean stop saves the claims
    await harness.start()
    assert await a.clear() == 101 + 102
    assert await harness.held(1, 2, 3) == [False, True, True]
    await harness.stop()
    (harness.root / CLAIMS_NAME).unlink()  # as a directory from before claims: chunks nobody claims
    await harness.start()
    assert await b.clear() == 0 and await harness.held(2, 3) == [True, True]  # kept ...
    assert await harness.wipe() == 102 + 103 and await harness.held(2, 3) == [False, False]  # ... until wiped


async def test_a_put_in_flight_is_discarded_by_its_callers_clear(harness: Harness) -> None:
    service = await harness.start()
    writer = service.store._writer
    assert writer is not None
    landing = asyncio.Event()  # accepted writes stay in flight until the test lets them land
    write = writer.write

    async def held_back_write(meta: protocol.ChunkMeta, data: memoryview) -> None:
        await landing.wait()
        await write(meta, data)

    writer.write = held_back_write  # type: ignore[method-assign]
    a, b = harness.client_of(TENANT_A), harness.client_of(TENANT_B)
    for i, client in ((1, a), (2, a), (2, b), (3, b)):  # staged and answered ok; the files not written yet
        assert await harness.put(i, client=client, wait=False)
    assert await harness.held(1, 2, 3) == [False, False, False]
    assert await a.clear() == 101 + 102  # both in flight; 2 stays wanted by B
    landing.set()
    assert await a.wait_written(WAIT_S)
    assert await harness.held(1, 2, 3) == [False, True, True]
    await wait_until_async(lambda: len(chunk_files(harness.root)) == 2, what="the file of 1 never kept")


def test_options_from_flags_only(tmp_path: Path) -> None:
    """A store takes flags (and its own variables), never the engine's LMCache config."""
    config = tmp_path / "disk-offload.yaml"
    config.write_text('chunk_size: 256\nlocal_disk: "file://local/disk_test/local_disk/"\nmax_local_disk_size: 5.0\n')
    env = {"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_LOCAL_DISK": str(tmp_path / "x"),
           "LMCACHE_MAX_LOCAL_DISK_SIZE": "0.5", "LMCACHE_NATS_URL": "nats://elsewhere:4222"}
    with pytest.raises(ConfigError, match="pass --dir"):
        options_from_args(build_parser().parse_args(["--store-id", "d1"]), env)
    with pytest.raises(ConfigError, match="pass --max-size-gb"):
        options_from_args(build_parser().parse_args(["--dir", str(tmp_path), "--store-id", "d1"]), env)
    options = options_from_args(build_parser().parse_args(
        ["--dir", "file:///data/kv", "--max-size-gb", "2", "--store-id", "d1"]), env)
    assert options.root == Path("/data/kv") and options.capacity_bytes == 2 * 1024**3
    assert options.nats_url == "nats://127.0.0.1:4222"  # the default, not the engine's nats_url
    options = options_from_args(build_parser().parse_args(
        ["--dir", "file:///data/kv", "--max-size-gb", "2", "--store-id", "d1", "--nats-url", "h:4222"]), {})
    assert options.root == Path("/data/kv") and options.nats_url == "nats://h:4222"


def test_cache_policy_from_the_flag_else_lru(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--dir", str(tmp_path), "--max-size-gb", "1", "--store-id", "d1", "--nats-url", "h:4222"]

    def policy(*extra: str, env: dict[str, str] | None = None) -> str:
        return options_from_args(build_parser().parse_args([*flags, *extra]), env or {}).cache_policy

    assert policy() == "LRU"
    assert policy(env={"LMCACHE_CACHE_POLICY": "lfu"}) == "LRU"  # the engine's variable is the engine's
    assert policy("--cache-policy", "fifo") == "FIFO"
    with pytest.raises(SystemExit):
        policy("--cache-policy", "arc")
    assert "--cache-policy: invalid choice: 'ARC'" in capsys.readouterr().err


def test_index_reserves_commits_and_discards() -> None:
    index: ChunkIndex[Entry] = ChunkIndex(capacity_bytes=300)
    entry = Entry(nbytes=90, file_bytes=100, num_tokens=10)
    assert index.reserve(b"a", entry) == [] and index.reserve(b"b", entry) == []
    assert index.contains_prefix([b"a"]) == 0  # not visible until written
    assert index.commit(b"a") and index.contains_prefix([b"a", b"b"]) == 1
    assert index.reserve(b"c", entry) == []
    assert index.pin([b"a"]) == [b"a"]
    with pytest.raises(SpaceRefused):  # pinned a and the in-flight b, c fill the cap: nothing to evict
        index.reserve(b"d", entry)
    index.unpin([b"a"])
    assert index.reserve(b"d", entry) == [(b"a", entry)]  # held a evicted; in-flight b, c never are
    index.abort(b"d")
    assert index.in_flight(b"b") is entry and index.remove(b"b") is None  # a pending write is discarded ...
    assert not index.commit(b"b")  # ... and not admitted when it lands
    assert index.commit(b"c") and index.wipe() == [(b"c", entry)]
    assert index.used_bytes == 0 and index.reserved_bytes == 0


# ---- integrity: every chunk carries a checksum, verified before it is admitted and on every read --------------


def write_file_with_meta(root: Path, meta: protocol.ChunkMeta, data: bytes, magic: bytes = chunk_file.MAGIC) -> Path:
    """A chunk file as a foreign or older writer could leave it (write_chunk_file refuses a meta without
    checksum): `meta`'s header, its own header check, and the bytes."""
    path = chunk_file.chunk_path(root, meta.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(magic + chunk_file.encode_header(meta)[len(magic):] + data)
    return path


@pytest.mark.parametrize("staging_bytes", [4 * CHUNK, 0], ids=["staged", "write-through"])
async def test_a_put_whose_bytes_fail_their_checksum_is_refused_before_it_is_admitted(
        harness: Harness, segment: SharedSegment, staging_bytes: int) -> None:
    batches = await admission_batches(harness.nc, harness.store_id)
    await harness.start(capacity=2 * FILE_BYTES + 100, staging_bytes=staging_bytes)
    assert await harness.put(1) and await harness.put(2)  # the store is full: a new chunk would evict 1
    meta, data = chunk(3)
    lying = protocol.ChunkMeta(**{**meta.__dict__, "checksum": meta.checksum ^ 1})
    segment.buf[:CHUNK] = data
    lent = await harness.lend(segment)
    for request in (protocol.PutRequest(meta=lying, data=data),
                    protocol.PutRequest(meta=lying, pool=lent.token, pool_offset=0)):
        ack = await harness.request("put", request, protocol.Ack)
        assert not ack.ok and "do not match their checksum" in ack.error
    # a put of a key already held is a duplicate whose bytes are not even read: bad ones change nothing
    held_meta, held_data = chunk(1)
    assert (await harness.request("put", protocol.PutRequest(meta=held_meta, data=b"x" * CHUNK), protocol.Ack)).ok
    assert await harness.client.wait_written(WAIT_S)
    # never admitted, never written, and nothing was evicted for it
    assert await harness.held(1, 2, 3) == [True, True, False]
    assert not chunk_file.chunk_path(harness.root, key_of(3)).exists()
    assert await harness.get(1) == held_data and await harness.get(2) == chunk(2)[1]
    stats = (await harness.client.stats())[0]
    assert stats.details["checksum_failures"] == 2 and stats.details["evicted"] == 0
    # the controller never hears of it: the admission of a later good put arrives, and 3's never did
    await harness.client.remove([key_of(2)])
    assert await harness.put(4)
    await wait_until_async(lambda: any(key_of(4) in b.admitted for b in batches), what="the admission of 4")
    assert not any(key_of(3) in b.admitted for b in batches)


async def test_a_checksum_of_0_is_refused_at_put_and_a_file_claiming_one_is_corrupt(harness: Harness) -> None:
    await harness.start()
    meta, data = chunk(1, checksum=False)
    ack = await harness.request("put", protocol.PutRequest(meta=meta, data=data), protocol.Ack)
    assert not ack.ok and "no checksum" in ack.error
    assert not await harness.client.put(meta, ChunkBuffer(view=memoryview(data)))
    assert await harness.held(1) == [False] and chunk_files(harness.root) == []

    # a held chunk whose file now says checksum 0 (its bytes unchanged) is a miss, and its file goes
    assert await harness.put(2)
    path = write_file_with_meta(harness.root, chunk(2, checksum=False)[0], chunk(2)[1])
    assert await harness.get(2) is None
    await wait_until_async(lambda: not path.exists(), what="the unverifiable file deleted")
    assert await harness.held(2) == [False]
    assert (await harness.client.stats())[0].details["corrupt_dropped"] == 1

    # files without a checksum, or of the old format (no header check), put behind a stopped store: deleted by
    # the listing that follows a start from the clean stop's snapshot (which names neither)
    await harness.stop()
    write_file_with_meta(harness.root, chunk(3, checksum=False)[0], chunk(3)[1])
    write_file_with_meta(harness.root, chunk(4)[0], chunk(4)[1], magic=b"KVMESH\x01\x00")
    assert len(chunk_files(harness.root)) == 2
    await harness.start()

    async def listed() -> bool:
        return (await harness.client.stats())[0].details["snapshot_files_unchecked"] == 0
    await wait_until_async(listed, what="the directory listed after the start")
    assert (await harness.client.stats())[0].details["snapshot_files_dropped"] == 2
    assert await harness.held(3, 4) == [False, False]
    await wait_until_async(lambda: chunk_files(harness.root) == [], what="the bad files deleted")


# ---- pools lent over the pool socket (shared/wire/pool_wire.py, engine/tiers/pool_lending.py, pools.py) ------------

async def test_a_pool_token_serves_only_the_caller_that_lent_it_and_only_inside_the_pool(
        harness: Harness, segment: SharedSegment) -> None:
    await harness.start()
    lent = await harness.lend(segment)
    meta, data = chunk(1)
    segment.buf[:CHUNK] = data
    other = protocol.Principal.engine("other").producer("w0")
    refused = [
        (ENGINE, protocol.PutRequest(meta=meta, pool="0" * 32), "is not lent by"),  # never registered
        (other, protocol.PutRequest(meta=meta, pool=lent.token), "is not lent by"),  # sniffed from another engine
        (ENGINE, protocol.PutRequest(meta=meta, pool=lent.token, pool_offset=segment.size - CHUNK + 1), "outside"),
        (ENGINE, protocol.PutRequest(meta=meta, pool=lent.token, pool_offset=-1), "outside"),
    ]
    for caller, request, reason in refused:
        ack = await harness.request("put", request, protocol.Ack, caller=caller)
        assert not ack.ok and reason in ack.error
    assert await harness.held(1) == [False]
    assert (await harness.request("put", protocol.PutRequest(meta=meta, pool=lent.token), protocol.Ack)).ok
    assert await harness.client.wait_written(WAIT_S)
    # gets by the same rules: a refused one writes nothing into the pool
    segment.buf[CHUNK:2 * CHUNK] = b"\x55" * CHUNK
    for caller, offset in ((other, CHUNK), (ENGINE, segment.size - 100), (ENGINE, -CHUNK)):
        reply = await harness.request("get", protocol.GetRequest(key=key_of(1), pool=lent.token, pool_offset=offset,
                                                                 capacity=CHUNK), protocol.GetReply, caller=caller)
        assert not reply.found and ("is not lent by" in reply.error or "outside" in reply.error)
    assert bytes(segment.buf[CHUNK:2 * CHUNK]) == b"\x55" * CHUNK
    reply = await harness.request("get", protocol.GetRequest(key=key_of(1), pool=lent.token, pool_offset=CHUNK,
                                                             capacity=CHUNK), protocol.GetReply)
    assert reply.found and bytes(segment.buf[CHUNK:2 * CHUNK]) == data
    details = (await harness.client.stats())[0].details
    assert details["puts_refused"] == 4 and details["puts_pool"] == 1 and details["gets_pool"] == 1


async def test_a_message_naming_a_file_reaches_no_file(harness: Harness, tmp_path: Path) -> None:
    """The old field names (or a path as the token) are no way to a file: the store opens nothing a message names."""
    await harness.start()
    assert await harness.put(1)
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * CHUNK)
    shm_victim = Path("/dev/shm") / f"kvmesh-victim-{uuid.uuid4().hex[:8]}"
    shm_victim.write_bytes(b"s" * CHUNK)
    try:
        meta = chunk(2)[0]
        for fields in ({"shm_name": str(victim), "shm_offset": 0}, {"shm_name": shm_victim.name},
                       {"pool": str(victim)}, {"pool": f"../../..{shm_victim}"}):
            put = msgpack.unpackb(protocol.encode(protocol.PutRequest(meta=meta)))
            reply = await harness.nc.request(protocol.Subjects.store(harness.store_id, "put", ENGINE),
                                             msgpack.packb({**put, **fields}), timeout=WAIT_S)
            ack = protocol.decode(reply.data, protocol.Ack)
            assert not ack.ok and ("neither a pool nor inline data" in ack.error or "is not lent by" in ack.error)
            get = msgpack.unpackb(protocol.encode(protocol.GetRequest(key=key_of(1), capacity=CHUNK)))
            reply = await harness.nc.request(protocol.Subjects.store(harness.store_id, "get", ENGINE),
                                             msgpack.packb({**get, **fields}), timeout=WAIT_S)
            answer = protocol.decode(reply.data, protocol.GetReply)
            assert answer.data == chunk(1)[1] if "pool" not in fields else not answer.found  # inline, or refused
        assert victim.read_bytes() == b"v" * CHUNK and shm_victim.read_bytes() == b"s" * CHUNK
        assert await harness.held(2) == [False]
    finally:
        shm_victim.unlink()


def offer(path: Path, hello: bytes, fds: list[int]) -> dict[str, Any]:
    """Blocking: connect to a pool socket, send `hello` with `fds` attached, return the store's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WAIT_S)
        sock.connect(str(path))
        socket.send_fds(sock, [hello], fds)
        return json.loads(sock.recv(4096) or b"{}")


async def test_the_store_takes_only_a_sealed_memfd_with_a_small_hello(harness: Harness, segment: SharedSegment,
                                                                       tmp_path: Path) -> None:
    await harness.start(pool_hello_max_bytes=256, pool_hello_timeout_secs=1.0)
    path = socket_path(harness.store_id, bus.server_scope(harness.nc))
    hello = json.dumps({"caller": ENGINE}).encode()
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    grow_only = os.memfd_create("grow-only", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    plain_file = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        for fd in (unsealed, grow_only, plain_file):
            os.ftruncate(fd, CHUNK)
        fcntl.fcntl(grow_only, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)  # it could still shrink: SIGBUS for a mapper
        assert segment.fd is not None
        cases = [
            (hello, [unsealed], "not sealed against shrinking"),
            (hello, [grow_only], "not sealed against shrinking"),
            (hello, [plain_file], "not sealed against shrinking"),
            (hello, [directory], "not a regular file"),
            (hello, [], "exactly one descriptor"),
            (hello, [segment.fd, segment.fd], "exactly one descriptor"),
            (json.dumps({"caller": "x" * 300}).encode(), [segment.fd], "over 256 bytes"),
            (b"\xffnot json", [segment.fd], "not JSON"),
            (b'{"who": 1}', [segment.fd], "names no caller"),
        ]
        for message, fds, reason in cases:
            answer = await asyncio.to_thread(offer, path, message, fds)
            assert reason in answer.get("error", ""), (reason, answer)
        # a hello that never comes is refused after --pool-hello-timeout (no timing asserted: only the answer)
        assert "no hello within" in (await asyncio.to_thread(offer, path, b"", [])).get("error", "")
    finally:
        for fd in (unsealed, grow_only, plain_file, directory):
            os.close(fd)
    details = (await harness.client.stats())[0].details
    assert details["pools"] == 0 and details["pools_refused"] == len(cases) + 1
    meta, data = chunk(1)  # still serving, and still lending
    segment.buf[:CHUNK] = data
    assert await harness.client.put(meta, ChunkBuffer(view=segment.buf[:CHUNK], pool=segment))
    assert (await harness.client.stats())[0].details["puts_pool"] == 1


async def test_pools_are_bounded_and_dropped_when_their_connection_closes(harness: Harness,
                                                                          segment: SharedSegment) -> None:
    await harness.start(max_pools=1)
    first = await harness.lend(segment)
    with pytest.raises(PoolUnavailable, match="--max-pools"):
        await harness.lend(segment, caller=protocol.Principal.engine("other").producer("w0"))
    first.close()  # the engine is gone
    await wait_until_async(lambda: _details_match(harness, pools=0, pools_dropped=1), what="the pool dropped")
    meta, data = chunk(1)
    segment.buf[:CHUNK] = data
    ack = await harness.request("put", protocol.PutRequest(meta=meta, pool=first.token), protocol.Ack)
    assert not ack.ok and "is not lent by" in ack.error
    second = await harness.lend(segment)  # room again
    assert second.token != first.token
    assert (await harness.request("put", protocol.PutRequest(meta=meta, pool=second.token), protocol.Ack)).ok


async def test_a_pool_refused_before_its_hello_is_sent_names_the_reason(harness: Harness, segment: SharedSegment,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A store at --max-pools refuses at accept and closes. When that happens before the engine sends its hello
    (a loaded machine), the send fails with a broken pipe; the store's reason is still the error."""
    await harness.start(max_pools=1)
    await harness.lend(segment)
    send_fds = socket.send_fds

    def send_after_the_store_closed(sock: socket.socket, *args: Any) -> int:
        poller = select.poll()
        poller.register(sock, select.POLLHUP | select.POLLRDHUP)
        assert poller.poll(WAIT_S * 1000), "the store did not close the refused connection"
        return send_fds(sock, *args)

    monkeypatch.setattr(socket, "send_fds", send_after_the_store_closed)
    with pytest.raises(PoolUnavailable, match="--max-pools"):
        await harness.lend(segment, caller=protocol.Principal.engine("other").producer("w0"))


async def _details_match(harness: Harness, **expected: int) -> bool:
    details = (await harness.client.stats())[0].details
    return all(details[name] == value for name, value in expected.items())


async def test_without_the_pool_socket_a_client_sends_bytes_inline_and_says_why_once(
        harness: Harness, segment: SharedSegment, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    await harness.start()
    elsewhere = tempfile.mkdtemp(prefix="kvrt-")  # the client looks for the socket where there is none
    monkeypatch.setenv("KVMESH_RUNTIME_DIR", elsewhere)
    try:
        with caplog.at_level(logging.WARNING, logger="kvmesh.services.engine.tiers.pool_lending"):
            for i in (1, 2):
                meta, data = chunk(i)
                segment.buf[:CHUNK] = data
                assert await harness.client.put(meta, ChunkBuffer(view=segment.buf[:CHUNK], pool=segment))
        assert await harness.client.wait_written(WAIT_S)
        assert await harness.get(1) == chunk(1)[1] and await harness.get(2) == chunk(2)[1]
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)
    warnings = [r.getMessage() for r in caplog.records if "go inline" in r.getMessage()]
    assert len(warnings) == 1 and "no pool socket" in warnings[0]
    details = (await harness.client.stats())[0].details
    assert details["puts_inline"] == 2 and details["puts_pool"] == 0 and details["pools"] == 0


async def test_a_second_store_with_the_same_id_never_takes_the_live_stores_pool_socket() -> None:
    from kvmesh.services.disk_store.pools import PoolRegistry

    store_id = f"disk-twin-{uuid.uuid4().hex[:8]}"
    first = PoolRegistry(store_id, max_pools=4, hello_max_bytes=4096, hello_timeout=WAIT_S)
    second = PoolRegistry(store_id, max_pools=4, hello_max_bytes=4096, hello_timeout=WAIT_S)
    await first.start()
    try:
        assert first.path is not None
        inode = first.path.stat().st_ino
        await second.start()
        assert second.path is None, "the twin serves without pools (inline bytes)"
        await second.close()
        assert first.path.stat().st_ino == inode, "and its close leaves the live store's socket alone"
    finally:
        await first.close()
    assert not first.path.exists()
    third = PoolRegistry(store_id, max_pools=4, hello_max_bytes=4096, hello_timeout=WAIT_S)
    await third.start()  # the first is gone: its socket is free again
    try:
        assert third.path is not None
    finally:
        await third.close()


async def test_two_meshes_on_one_host_with_stores_of_the_same_id_each_get_their_own_engines_pools(
        tmp_path: Path) -> None:
    """Two vLLMs on one host, each embedding its own mesh, both name their disk store after the host: each
    engine must lend its pool to its own store, never to the other mesh's (its puts would all be refused)."""
    from kvmesh.shared.messaging.embedded_nats import EmbeddedNats

    harnesses: list[Harness] = []
    with EmbeddedNats() as first_nats, EmbeddedNats() as second_nats:
        try:
            for i, server in enumerate((first_nats, second_nats)):
                nc = await bus.connect(server.url, f"mesh-{i}", first_connect_wait=WAIT_S)
                harness = Harness(nc, tmp_path / f"disk-{i}")
                harness.store_id = harnesses[0].store_id if harnesses else harness.store_id  # the same id
                harness.client = DiskStoreClient(nc, harness.store_id, ENGINE, request_timeout=WAIT_S)
                harnesses.append(harness)
                await harness.start()
            for i, harness in enumerate(harnesses):
                with SharedSegment.create(2 * CHUNK) as segment:
                    meta, data = chunk(i)
                    segment.buf[:CHUNK] = data
                    buffer = ChunkBuffer(view=segment.buf[:CHUNK], pool=segment, pool_offset=0)
                    assert await harness.client.put(meta, buffer), f"mesh {i}: its store refused its own pool"
                    assert await harness.client.wait_written(WAIT_S)
                    details = (await harness.client.stats())[0].details
                    assert details["puts_pool"] == 1 and details["puts_inline"] == 0
                    await harness.client.close()
        finally:
            for harness in harnesses:
                await harness.stop()
                await harness.nc.close()


async def test_the_pool_socket_follows_the_store_to_a_restarted_nats_server(tmp_path: Path) -> None:
    """A NATS server restarted on its port is another server (a new id, so another pool socket name): the store,
    reconnected, listens where that server's engines look, so an engine that connects now lends its pool."""
    from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, free_port

    port = free_port()
    server = EmbeddedNats(port=port).start()
    nc = await bus.connect(server.url, "store-side", first_connect_wait=WAIT_S)
    harness = Harness(nc, tmp_path / "disk")
    engine_nc = None
    try:
        service = await harness.start()
        before = bus.server_scope(nc)
        assert service.store.pools.path == socket_path(harness.store_id, before)
        server.stop()
        server = EmbeddedNats(port=port).start()
        await wait_until_async(lambda: nc.is_connected and bus.server_scope(nc) != before
                               and service.store.pools.path == socket_path(harness.store_id, bus.server_scope(nc)),
                               what="the store's pool socket named by the restarted server")
        engine_nc = await bus.connect(server.url, "engine-side", first_connect_wait=WAIT_S)
        client = DiskStoreClient(engine_nc, harness.store_id, ENGINE, request_timeout=WAIT_S)
        with SharedSegment.create(2 * CHUNK) as segment:
            meta, data = chunk(7)
            segment.buf[:CHUNK] = data
            assert await client.put(meta, ChunkBuffer(view=segment.buf[:CHUNK], pool=segment, pool_offset=0))
            assert await client.wait_written(WAIT_S)
            details = (await client.stats())[0].details
            assert details["puts_pool"] == 1 and details["puts_inline"] == 0, details
            await client.close()
    finally:
        await harness.stop()
        await nc.close()
        if engine_nc is not None:
            await engine_nc.close()
        server.stop()


async def test_a_leased_put_outlives_unleased_ones_within_its_principals_share(harness: Harness) -> None:
    """A put's retention (the storing request's kv_priority / lease, `PutRequest.priority` / `lease_secs`): the
    store keeps such chunks over the rest, each engine principal within `--retained-share` of the store's size
    (here 2 of 6 chunks), a lease ends at its time, and a retention out of bounds is not taken."""
    clock = ManualClock()
    harness.clock = clock
    capacity = 6 * FILE_BYTES + 100
    service = await harness.start(capacity=capacity, bounds=StoreBounds(retained_share=2 * FILE_BYTES / capacity))
    a, b = harness.client_of(TENANT_A), harness.client_of(TENANT_B)

    async def put(i: int, client: DiskStoreClient, retention: Retention = NO_RETENTION) -> None:
        meta, data = chunk(i)
        assert await client.put(meta, ChunkBuffer(view=memoryview(bytearray(data))), retention)
        assert await client.wait_written(timeout=WAIT_S)

    lease = Retention(lease_until=time.time() + 600)
    for i in (1, 2, 3):  # A's third leased chunk would pass its share: held as any other
        await put(i, a, lease)
    await put(4, b, Retention(priority=5))  # B has a share of its own
    index = service.store.index
    assert index.retains_refused == 1
    for i in range(10, 20):  # ten unleased chunks through a store of six
        await put(i, a)
    assert await harness.held(1, 2, 3, 4) == [True, True, False, True]
    clock.advance(601)  # A's lease ended; B's priority lasts
    for i in range(20, 30):
        await put(i, a)
    assert await harness.held(1, 2, 4) == [False, False, True]
    # a lease longer than 30 days or a priority over 10^6 is not taken
    for request in (protocol.PutRequest(meta=chunk(40)[0], data=chunk(40)[1], lease_secs=31 * 86400.0),
                    protocol.PutRequest(meta=chunk(41)[0], data=chunk(41)[1], priority=10**7)):
        reply = await harness.request("put", request, protocol.Ack, caller=TENANT_B)
        assert reply.ok, reply.error
    assert index.retains_refused == 3 and service.store.details()["retains_refused"] == 3
