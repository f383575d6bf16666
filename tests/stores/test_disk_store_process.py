"""The disk store as its own process (`python -m kvmesh.services.disk_store`): restarts, SIGKILL, the CLI.

The test process is the engine side: a client over a real nats-server, its buffers in a shared pool (a sealed
memfd) lent to the store over its pool socket.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.disk_store import snapshot
from kvmesh.services.engine.tiers.disk import DiskStoreClient
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, _die_with_parent
from kvmesh.shared.ops.store_commands import disk_store
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.shm import SharedSegment

from support.disk_store_process import (CHUNK, ENGINE, SLOTS, StoreProcess, data_of, key_of, meta_of, put_pool,
                                        slot)
from support.waiting import WAIT_S, wait_until_async


@pytest.fixture
def store(nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[StoreProcess]:
    process = StoreProcess(nats_server.url, tmp_path / "disk", tmp_path, max_size_gb=1.0)
    yield process
    process.stop(signal.SIGKILL)


@pytest.fixture
def segment() -> Iterator[SharedSegment]:
    with SharedSegment.create(SLOTS * CHUNK) as seg:
        yield seg


async def get_pool(client: DiskStoreClient, segment: SharedSegment, i: int) -> bytes | None:
    buffer = slot(segment, i)
    buffer.view[:] = b"\0" * CHUNK
    meta = await client.get_into(key_of(i), buffer)
    return None if meta is None else bytes(buffer.view[:meta.nbytes])


async def full_store_with_chunk_1_read(nc, store: StoreProcess, segment: SharedSegment,
                                       *flags: str) -> DiskStoreClient:
    """A store with room for 3 chunks, started with `flags`, holding chunks 1, 2, 3 (written in that order),
    of which chunk 1 has been read since."""
    store.max_size_gb = 3.5 * (chunk_file.DATA_ALIGN + CHUNK) / 1024**3
    store.start(*flags)
    await store.wait_healthy(nc)
    client = DiskStoreClient(nc, store.store_id, ENGINE, request_timeout=WAIT_S)
    for i in (1, 2, 3):
        assert await put_pool(client, segment, i)
    assert await client.wait_written(WAIT_S)
    assert await get_pool(client, segment, 1) == data_of(1)
    return client


async def test_chunks_persist_across_a_restart_with_their_lru_order(nc, store: StoreProcess,
                                                                    segment: SharedSegment) -> None:
    client = await full_store_with_chunk_1_read(nc, store, segment)  # 1 is now more recent than 2
    assert await client.pin([key_of(3)], [256]) == 256
    assert store.stop() == 0  # SIGTERM: a clean stop

    store.start()
    await store.wait_healthy(nc)
    assert await client.contains([key_of(1), key_of(2), key_of(3)]) == 3
    stats = (await client.stats())[0]
    assert stats.num_chunks == 3 and stats.pinned_chunks == 1
    # The LRU order survived (2 is the oldest: 1 was read after it was written), and so did 3's pin.
    assert await put_pool(client, segment, 4) and await client.wait_written(WAIT_S)
    assert [await client.contains([key_of(i)]) for i in (1, 2, 3, 4)] == [1, 0, 1, 1]
    for i in (1, 3, 4):
        assert await get_pool(client, segment, i) == data_of(i)


def kvmesh_wipe(nats_url: str, *store_ids: str) -> tuple[int, list[dict[str, object]], str]:
    """`kvmesh wipe` as the operator would run it: (exit code, one JSON object per store, stderr)."""
    argv = [sys.executable, "-m", "kvmesh.cli", "wipe", "--nats-url", nats_url, "--timeout", str(WAIT_S)]
    for store_id in store_ids:
        argv += ["--store", store_id]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=2 * WAIT_S, stdin=subprocess.DEVNULL)
    return result.returncode, [json.loads(line) for line in result.stdout.splitlines()], result.stderr


async def test_claims_survive_a_process_restart_and_the_operator_wipes_with_the_cli(
        nc, store: StoreProcess, segment: SharedSegment) -> None:
    store.start()
    await store.wait_healthy(nc)
    a, b = (DiskStoreClient(nc, store.store_id, protocol.Principal.engine(tenant).producer("w0"),
                            request_timeout=WAIT_S) for tenant in ("tenant-a", "tenant-b"))
    for i, client in ((1, a), (2, a), (2, b), (3, b)):
        assert await put_pool(client, segment, i)
    assert await a.wait_written(WAIT_S)
    assert store.stop() == 0  # SIGTERM: the claims are saved at close
    store.start()
    await store.wait_healthy(nc)
    assert await a.clear() == 2 * 256  # chunks 1 and 2 were A's ...
    assert [await b.contains([key_of(i)]) for i in (1, 2, 3)] == [0, 1, 1]  # ... 2 is still B's
    assert await b.pin([key_of(3)], [256]) == 256
    code, replies, stderr = await asyncio.to_thread(kvmesh_wipe, store.nats_url, store.store_id, "disk-nobody")
    assert code == 1, stderr  # one of the two stores did not answer
    assert replies[0] == {"store": store.store_id, "ok": True, "removed_chunks": 1, "removed_tokens": 256,
                          "kept_pinned_chunks": 1}
    assert replies[1]["store"] == "disk-nobody" and not replies[1]["ok"] and "no responder" in replies[1]["error"]
    assert [await b.contains([key_of(i)]) for i in (2, 3)] == [0, 1]


async def test_cache_policy_flag_reaches_the_store(nc, store: StoreProcess, segment: SharedSegment) -> None:
    """`--cache-policy FIFO`: the read of chunk 1 does not save it, unlike under LRU (the restart test above)."""
    client = await full_store_with_chunk_1_read(nc, store, segment, "--cache-policy", "fifo")
    assert await put_pool(client, segment, 4) and await client.wait_written(WAIT_S)
    assert [await client.contains([key_of(i)]) for i in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert (await client.stats())[0].details["cache_policy"] == "FIFO"


# An engine process: makes its pool, fills it with chunk 1's bytes, lends it, prints the token, waits for death.
ENGINE_PROCESS = """
import hashlib, sys
from kvmesh.services.engine.tiers.pool_lending import register
from kvmesh.shared.wire.shm import SharedSegment
segment = SharedSegment.create({size})
segment.buf[:{size}] = hashlib.shake_256(b"data-1").digest({size})
lent = register({store_id!r}, {caller!r}, segment, 30.0, {scope!r})  # held: the loan lasts while its connection is open
print(lent.token, flush=True)
sys.stdin.read()
"""


async def test_the_store_drops_a_pool_when_its_engine_process_dies(nc, store: StoreProcess) -> None:
    store.start()
    await store.wait_healthy(nc)
    client = DiskStoreClient(nc, store.store_id, ENGINE, request_timeout=WAIT_S)
    engine = subprocess.Popen([sys.executable, "-c", ENGINE_PROCESS.format(size=CHUNK, store_id=store.store_id,
                                                                           caller=ENGINE, scope=bus.server_scope(nc))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=_die_with_parent)
    try:
        token = (await asyncio.to_thread(engine.stdout.readline)).decode().strip()
        assert token, f"the engine process lent no pool:\n{store.log()}"
        subject = protocol.Subjects.store(store.store_id, "put", ENGINE)
        ack = await bus.request(nc, subject, protocol.PutRequest(meta=meta_of(1), pool=token), protocol.Ack, WAIT_S)
        assert ack.ok, ack.error  # the store read the bytes from the other process's pool
        assert (await client.stats())[0].details["pools"] == 1
    finally:
        engine.kill()
        engine.wait()

    async def dropped() -> bool:
        details = (await client.stats())[0].details
        return details["pools"] == 0 and details["pools_dropped"] == 1

    await wait_until_async(dropped, what="the dead engine's pool dropped")
    ack = await bus.request(nc, subject, protocol.PutRequest(meta=meta_of(2), pool=token), protocol.Ack, WAIT_S)
    assert not ack.ok and "is not lent by" in ack.error
    assert await client.wait_written(WAIT_S)
    out = bytearray(CHUNK)  # chunk 1 is on disk, intact
    assert await client.get_into(key_of(1), ChunkBuffer(view=memoryview(out))) is not None
    assert bytes(out) == data_of(1)


@pytest.mark.parametrize("snapshots", [False, True], ids=["no-snapshot", "snapshot-every-10ms"])
async def test_sigkill_during_puts_then_restart_returns_only_intact_chunks(nc, store: StoreProcess,
                                                                          segment: SharedSegment,
                                                                          snapshots: bool) -> None:
    """With snapshots every 10 ms the kill also lands during (or between) index snapshot writes, and the restart
    takes what it can from the last one written whole (snapshot.py)."""
    store.start(*(["--snapshot-interval", "0.01"] if snapshots else []))
    await store.wait_healthy(nc)
    client = DiskStoreClient(nc, store.store_id, ENGINE, request_timeout=1.0, data_timeout=2.0)
    accepted: list[int] = []
    seen_pending = False

    async def stream(first: int) -> None:  # 4 streams, one put in flight each: faster than fsync'd writes
        for i in range(first, 10_000, 4):
            if await put_pool(client, segment, i):
                accepted.append(i)

    async def in_the_middle_of_the_stream() -> bool:
        nonlocal seen_pending
        stats = await client.stats()
        seen_pending = seen_pending or bool(stats and stats[0].details["pending_writes"])
        return len(accepted) >= 40 and seen_pending

    streams = [asyncio.create_task(stream(first)) for first in range(4)]
    await wait_until_async(in_the_middle_of_the_stream, what="40 puts accepted and writes seen pending",
                           interval=0.002)
    store.stop(signal.SIGKILL)  # in the middle of the stream, with writes in flight
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    # Plant what a crash (or a bad disk) can leave: a partial temporary, a truncated and a garbage chunk file.
    victim = chunk_file.chunk_path(store.root, key_of(10_001))
    victim.parent.mkdir(parents=True, exist_ok=True)
    Path(str(victim) + ".12345.tmp").write_bytes(b"partial")
    good = next(store.root.rglob("*.kvc"))
    victim.write_bytes(good.read_bytes()[:-1000])
    chunk_file.chunk_path(store.root, key_of(10_002)).parent.mkdir(parents=True, exist_ok=True)
    chunk_file.chunk_path(store.root, key_of(10_002)).write_bytes(b"KVMESH\x01\x00garbage")
    if snapshots:
        assert (store.root / snapshot.SNAPSHOT_NAME).exists()
        (store.root / f"{snapshot.SNAPSHOT_NAME}.tmp").write_bytes(b"a snapshot write cut short")

    store.start()
    await store.wait_healthy(nc)
    client = DiskStoreClient(nc, store.store_id, ENGINE, request_timeout=WAIT_S)

    async def checked() -> bool:  # the stat check of the files taken from the snapshot, done while serving
        return (await client.stats())[0].details["snapshot_files_unchecked"] == 0
    await wait_until_async(checked, what="the snapshot's files checked")
    assert list(store.root.rglob("*.tmp")) == []
    assert not victim.exists() and not chunk_file.chunk_path(store.root, key_of(10_002)).exists()
    held = [i for i in range(max(accepted) + 8) if await client.contains([key_of(i)])]
    assert len(held) >= 1
    for i in range(max(accepted) + 8):
        got = await get_pool(client, segment, i)
        assert got is None or got == data_of(i), f"chunk {i} came back corrupt"
        assert (got is not None) == (i in held)
    assert (await client.stats())[0].num_chunks == len(held)


async def test_a_second_store_on_the_same_directory_is_refused(nc, store: StoreProcess, tmp_path: Path) -> None:
    store.start()
    await store.wait_healthy(nc)
    second = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.disk_store", "--nats-url", store.nats_url, "--dir", str(store.root),
         "--max-size-gb", "1", "--store-id", "other"], capture_output=True, timeout=2 * WAIT_S)
    assert second.returncode == 2 and b"another disk store" in second.stderr


async def test_started_with_the_flags_an_engine_passes(nc, nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """The engine's embedded mesh starts its disk store with the flags shared/ops/store_commands.py writes from the
    engine config (local_disk, max_local_disk_size, cache_policy): the store reads no LMCACHE_CONFIG_FILE."""
    disk = tmp_path / "not" / "yet" / "there"
    process = StoreProcess(nats_server.url, disk, tmp_path)
    process.start = lambda *extra: None  # type: ignore[method-assign]  # started by hand below
    spec = disk_store(disk, 1024**3 // 2, process.store_id, "LRU")
    log = open(tmp_path / "store-1.log", "wb")
    process.process = subprocess.Popen(
        [sys.executable, "-m", spec.module, "--nats-url", nats_server.url, *spec.args], stdout=log, stderr=log,
        preexec_fn=_die_with_parent, env={**os.environ, "LMCACHE_CONFIG_FILE": str(tmp_path / "ignored.yaml")})
    log.close()
    try:
        await process.wait_healthy(nc)
        stats = (await DiskStoreClient(nc, process.store_id, ENGINE, request_timeout=WAIT_S).stats())[0]
        assert stats.capacity_bytes == 1024**3 // 2 and Path(stats.details["dir"]) == disk and disk.is_dir()
    finally:
        assert process.stop() == 0


async def restart(nc, store: StoreProcess, *flags: str) -> None:
    """SIGKILL the store (no close, no final save), then start it again on the same directory."""
    store.stop(signal.SIGKILL)
    store.start(*flags)
    await store.wait_healthy(nc)


async def test_pins_unpins_and_clears_are_on_disk_once_answered(nc, store: StoreProcess,
                                                               segment: SharedSegment) -> None:
    """Each answer waits for the pins and claims files, so a SIGKILL right after it loses nothing answered."""
    store.start()
    await store.wait_healthy(nc)
    client = DiskStoreClient(nc, store.store_id, ENGINE, request_timeout=WAIT_S)
    for i in range(SLOTS):
        assert await put_pool(client, segment, i)
    assert await client.wait_written(WAIT_S)
    # a burst of pins in flight together (they share the writes of the pins file)
    assert await asyncio.gather(*(client.pin([key_of(i)], [256]) for i in range(6))) == [256] * 6
    await restart(nc, store)
    assert (await client.stats())[0].pinned_chunks == 6

    assert await client.unpin([key_of(0)], [256]) == 256
    await restart(nc, store)
    assert (await client.stats())[0].pinned_chunks == 5

    assert await client.clear() == SLOTS * 256  # every chunk was this caller's (claims saved with the pins)
    await restart(nc, store)
    assert await client.clear() == 0  # the clear was on disk: nothing of this caller's came back
    stats = (await client.stats())[0]
    assert stats.pinned_chunks == 5 and stats.details["claimants"] == 0


async def test_a_pin_whose_state_cannot_be_saved_says_so_and_the_store_goes_on(nc, store: StoreProcess,
                                                                              segment: SharedSegment) -> None:
    store.start()
    await store.wait_healthy(nc)
    client = DiskStoreClient(nc, store.store_id, ENGINE, request_timeout=WAIT_S)
    assert await put_pool(client, segment, 1) and await client.wait_written(WAIT_S)
    blocker = store.root / "pins.msgpack.tmp"
    blocker.mkdir()  # the pins file's temporary name is taken: the rewrite fails (as on a full or failing disk)
    subject = protocol.Subjects.store(store.store_id, "pin", ENGINE)
    reply = await bus.request(nc, subject, protocol.ChunkKeys(keys=[key_of(1)], num_tokens=[256]),
                              protocol.CommandReply, WAIT_S)
    assert not reply.ok and "could not be saved" in reply.error and "pins.msgpack.tmp" in reply.error
    assert await get_pool(client, segment, 1) == data_of(1)  # still serving
    blocker.rmdir()
    reply = await bus.request(nc, subject, protocol.ChunkKeys(keys=[key_of(1)], num_tokens=[256]),
                              protocol.CommandReply, WAIT_S)
    assert reply.ok and reply.num_tokens == 256
    await restart(nc, store)
    assert (await client.stats())[0].pinned_chunks == 1


async def test_durable_puts_are_answered_once_their_file_is_on_disk(nc, store: StoreProcess,
                                                                   segment: SharedSegment) -> None:
    store.start("--durable-puts")
    await store.wait_healthy(nc)
    client = DiskStoreClient(nc, store.store_id, ENGINE, request_timeout=WAIT_S)
    for i in range(4):
        assert await put_pool(client, segment, i)
        # at once, without waiting for the store: the file is complete and verifies
        out = bytearray(CHUNK)
        assert chunk_file.read_chunk_into(chunk_file.chunk_path(store.root, key_of(i)), memoryview(out)) == meta_of(i)
        assert bytes(out) == data_of(i)
    details = (await client.stats())[0].details
    assert details["durable_puts"] is True and details["staging_capacity"] == 0 and details["pending_writes"] == 0
    await restart(nc, store, "--durable-puts")  # right after the last answer
    assert await client.contains([key_of(i) for i in range(4)]) == 4
    for i in range(4):
        assert await get_pool(client, segment, i) == data_of(i)


def test_durable_puts_need_fsync(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.disk_store", "--dir", str(tmp_path), "--max-size-gb", "1",
         "--durable-puts", "--no-fsync"], capture_output=True, text=True, timeout=2 * WAIT_S, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "--durable-puts needs fsync" in result.stderr
