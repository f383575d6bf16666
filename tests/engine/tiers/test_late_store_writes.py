"""A pool slot lent to the disk store is never reused while that store may still write into it (issue 23).

The engine lends its CPU pool to the disk store of its host, and a get names a slot of it: the store reads the
chunk file straight into that slot. A get the engine gave up on (no answer within `disk_data_timeout_secs`) may
still be served later by a store that was only stalled; the slot then stays quarantined until the store says
the get will never write (`cancel_get`) or the store is gone. Real processes here: NATS, a disk store process
stopped with SIGSTOP, resumed with SIGCONT or killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import msgpack
import pytest
import torch

from kvmesh.services.disk_store import reader as store_module
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.core.storage_manager import Run
from kvmesh.services.engine.tiers.disk import DiskStoreClient
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK
from kvmesh.shared.wire.shm import SharedSegment

from support.disk_store import CHUNK as H_CHUNK, Harness, chunk, harness  # noqa: F401 (harness: a fixture)
from support.disk_store_process import (CHUNK as STORE_CHUNK, ENGINE, SLOTS, StoreProcess, data_of, key_of, put_pool,
                                        slot)
from support.engine import CHUNK, PagedKV, random_tokens
from support.engine_mesh import _store_and_settle, disk_mesh, engine_on  # noqa: F401 (disk_mesh: a fixture)
from support.waiting import WAIT_S, wait_until, wait_until_async

DATA_TIMEOUT = 1.0  # the engine gives up on a disk get after this long (the stalled store answers much later)


@pytest.fixture
def kv() -> PagedKV:
    return PagedKV(num_blocks=128)


def store_details(engine: CacheEngine) -> dict[str, Any]:
    client = engine.storage.lower(LOCAL_DISK)
    assert client is not None
    stats = engine.nats_loop.call(client.stats(), WAIT_S, default=[])
    assert stats, "the disk store did not answer its stats"
    return stats[0].details


def stalled_get(engine: CacheEngine, mesh: LocalMesh, kv: PagedKV, tokens: torch.Tensor) -> int:
    """Store `tokens` (one chunk) on disk and drop it from the CPU tier, stop the store (SIGSTOP), then fetch
    the chunk as a prefetch does (from the runs located while the store still answered): the get times out,
    a miss. The store's pid."""
    wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
    _store_and_settle(engine, tokens, kv, kv.slots(CHUNK))
    assert token_api.clear(engine, LOCAL_CPU) == CHUNK  # on disk only now
    storage = engine.storage
    spans = engine.hasher.spans(tokens)
    runs = engine.nats_loop.call(storage.locate(spans), WAIT_S, default=None)
    assert runs == [Run(LOCAL_DISK, 0, 1)]
    pid = mesh.processes[0].pid
    os.kill(pid, signal.SIGSTOP)
    refs = engine.nats_loop.call(storage.fetch(spans, engine.meta_mismatch, runs=runs), WAIT_S, default=None)
    assert refs == [], "a stalled store's get must end as a miss"
    return pid


def test_a_get_the_engine_gave_up_on_never_writes_into_a_reused_slot(disk_mesh: LocalMesh, kv: PagedKV,
                                                                     tmp_path: Path) -> None:
    """The stalled get is answered (late) after the slot it named would have been reused for another prompt's
    chunk in the CPU tier: that chunk keeps its own KV, and the quarantined slot is freed once the store acked
    the cancel."""
    engine = engine_on(str(disk_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"), cpu_chunks=8,
                       disk_data_timeout_secs=DATA_TIMEOUT)
    pid: int | None = None
    try:
        a, b = random_tokens(CHUNK, seed=20), random_tokens(CHUNK, seed=21)
        wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        before = store_details(engine)
        pid = stalled_get(engine, disk_mesh, kv, a)
        src_b = kv.slots(CHUNK)
        expected_b = kv.token_kv(src_b)
        # into the CPU tier (its write-behind put waits on the stopped store)
        token_api.store(engine, b, **kv.kv(src_b))
        wait_until(lambda: token_api.lookup(engine, b, search_range=[LOCAL_CPU]) == CHUNK, what="B in the CPU tier")
        os.kill(pid, signal.SIGCONT)
        pid = None

        def stale_get_handled() -> bool:  # served (the old behaviour) or refused: either way it is over
            now = store_details(engine)
            return now["gets"] > before["gets"] and (
                now["hits"] > before["hits"] or now.get("gets_late", 0) + now.get("gets_cancelled", 0) > 0)

        wait_until(stale_get_handled, what="the store handled the stalled get")
        dst = kv.slots(CHUNK, exclude=src_b)
        assert bool(token_api.retrieve(engine, b, **kv.kv(dst)).all())
        assert torch.equal(kv.token_kv(dst), expected_b), "B's chunk was overwritten by the late get of A"
        stats = engine.storage.stats
        wait_until(lambda: stats["slots_quarantined"] == 1 and stats["slots_quarantined_now"] == 0,
                   what="the quarantined slot released once the store acked the cancel")
        assert store_details(engine)["get_cancels"] >= 1
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        engine.close()


def test_a_killed_store_ends_the_quarantine(disk_mesh: LocalMesh, kv: PagedKV, tmp_path: Path) -> None:
    """A store that never answers the cancel but exits (its mapping of the pool is gone with it) frees the slot:
    the engine sees the store's end of the pool socket close."""
    engine = engine_on(str(disk_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"), cpu_chunks=8,
                       disk_data_timeout_secs=DATA_TIMEOUT)
    try:
        pool = engine.storage.cpu.pool
        pid = stalled_get(engine, disk_mesh, kv, random_tokens(CHUNK, seed=22))
        stats = engine.storage.stats
        assert stats["slots_quarantined"] == 1 and stats["slots_quarantined_now"] == 1
        free_while_quarantined = pool.num_free
        os.kill(pid, signal.SIGKILL)  # stopped: it never answers the cancel
        wait_until(lambda: stats["slots_quarantined_now"] == 0, what="the quarantine ended by the store's exit")
        wait_until(lambda: pool.num_free == free_while_quarantined + 1, what="the slot back in the pool")
    finally:
        engine.close()


# ---- the cancel protocol at the store alone -------------------------------------------------------------------
@pytest.fixture
def store(nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[StoreProcess]:
    process = StoreProcess(nats_server.url, tmp_path / "disk", tmp_path)
    yield process
    process.stop(signal.SIGKILL)


@contextlib.asynccontextmanager
async def lent_pool_holding_chunk_1(nc: Any, store: StoreProcess) -> AsyncIterator[tuple[DiskStoreClient,
                                                                                     SharedSegment, str]]:
    """The store started; a client that lent it a pool and put chunk 1 from it (on disk): (client, pool, token)."""
    store.start()
    await store.wait_healthy(nc)
    client = DiskStoreClient(nc, store.store_id, ENGINE, request_timeout=WAIT_S)
    with SharedSegment.create(SLOTS * STORE_CHUNK) as segment:
        try:
            assert await put_pool(client, segment, 1)
            assert await client.wait_written(WAIT_S)
            token = await client._pools.token(segment)
            assert token is not None
            yield client, segment, token
        finally:
            await client.close()


async def test_a_cancelled_or_late_get_writes_nothing(nc, store: StoreProcess) -> None:
    """A cancel that arrives before its get leaves a tombstone that refuses the get; a get that arrives after its
    deadline is refused; neither touches the buffer. A cancel naming a pool the caller did not lend is no ack."""
    async with lent_pool_holding_chunk_1(nc, store) as (client, segment, token):
        buffer = slot(segment, 2)
        zeros = bytes(STORE_CHUNK)
        buffer.view[:] = zeros

        async def get(get_id: int, deadline: float) -> protocol.GetReply:
            request = protocol.GetRequest(key=key_of(1), pool=token, pool_offset=buffer.pool_offset,
                                          capacity=STORE_CHUNK, get_id=get_id, deadline=deadline)
            return await bus.request(nc, protocol.Subjects.store(store.store_id, "get", ENGINE), request,
                                     protocol.GetReply, WAIT_S)

        async def cancel(get_id: int, deadline: float, pool: str = token) -> protocol.Ack:
            return await bus.request(nc, protocol.Subjects.store(store.store_id, "cancel_get", ENGINE),
                                     protocol.CancelGet(pool=pool, get_id=get_id, deadline=deadline),
                                     protocol.Ack, WAIT_S)

        # cancelled before it arrived: the late get is refused, nothing written
        assert (await cancel(7, time.monotonic() + WAIT_S)).ok
        reply = await get(7, time.monotonic() + WAIT_S)
        assert not reply.found and "cancelled" in (reply.error or "")
        assert bytes(buffer.view) == zeros
        # past its deadline: refused, nothing written
        reply = await get(8, time.monotonic() - 0.001)
        assert not reply.found and "deadline" in (reply.error or "")
        assert bytes(buffer.view) == zeros
        # neither: served (same pool, same slot)
        reply = await get(9, time.monotonic() + WAIT_S)
        assert reply.found and bytes(buffer.view) == data_of(1)
        # its cancel after the fact is an ack: it will not write again
        assert (await cancel(9, time.monotonic() + WAIT_S)).ok
        # a store that does not know the pool cannot promise anything about it
        refused = await cancel(10, time.monotonic() + WAIT_S, pool="0" * 32)
        assert not refused.ok and "not lent" in (refused.error or "")
        details = (await client.stats())[0].details
        assert (details["gets_cancelled"], details["gets_late"], details["get_cancels"]) == (1, 1, 3)


async def test_an_old_get_without_an_id_is_still_served(nc, store: StoreProcess) -> None:
    """Backwards readable: a pooled get from an engine that sends no get id nor deadline is served as before."""
    async with lent_pool_holding_chunk_1(nc, store) as (_, segment, token):
        buffer = slot(segment, 3)
        request = protocol.GetRequest(key=key_of(1), pool=token, pool_offset=buffer.pool_offset,
                                      capacity=STORE_CHUNK)
        reply = await bus.request(nc, protocol.Subjects.store(store.store_id, "get", ENGINE), request,
                                  protocol.GetReply, WAIT_S)
        assert reply.found and bytes(buffer.view) == data_of(1)


# ---- the same, in process: a write in progress, the tombstone bound, the messages' checks --------------------

async def test_a_cancel_is_answered_only_once_its_get_has_written(harness: Harness, monkeypatch) -> None:
    """A cancel that finds its get registered (its read under way) waits for the read to return."""
    release = threading.Event()
    read_chunk = store_module._read_chunk

    def slow_read(*args: Any) -> Any:  # the read thread, held until the test lets it go
        release.wait(WAIT_S)
        return read_chunk(*args)

    monkeypatch.setattr(store_module, "_read_chunk", slow_read)
    service = await harness.start()
    assert await harness.put(1)
    with SharedSegment.create(4 * H_CHUNK) as segment:
        registration = await harness.lend(segment)
        pool = service.store.pools.lent(registration.token, ENGINE)
        deadline = time.monotonic() + WAIT_S
        get = asyncio.ensure_future(harness.request("get", protocol.GetRequest(
            key=key_of(1), pool=registration.token, capacity=H_CHUNK, get_id=5, deadline=deadline), protocol.GetReply))
        try:
            await wait_until_async(lambda: 5 in pool.writing, what="the get registered as writing")
            cancel = asyncio.ensure_future(harness.request("cancel_get", protocol.CancelGet(
                pool=registration.token, get_id=5, deadline=deadline), protocol.Ack))
            await wait_until_async(lambda: service.store.counters["get_cancels"] == 1, what="the cancel arrived")
            assert not cancel.done(), "a cancel must not be acked while its get may still write"
            release.set()
            assert (await cancel).ok
            assert bytes(segment.buf[:H_CHUNK]) == chunk(1)[1]  # the write was over before the ack
            assert 5 not in pool.writing and (await get).found
        finally:
            release.set()
            await asyncio.wait([get])


async def test_cancels_past_the_bound_are_refused_until_tombstones_expire(harness: Harness, monkeypatch) -> None:
    """The tombstones a pool may hold are bounded; past the bound a cancel is refused (the engine keeps its slot
    and asks again), and expired tombstones make room."""
    monkeypatch.setattr(store_module, "MAX_CANCELLED_GETS", 2)
    await harness.start()
    with SharedSegment.create(4 * H_CHUNK) as segment:
        token = (await harness.lend(segment)).token
        now = time.monotonic()

        async def cancel(get_id: int, deadline: float) -> protocol.Ack:
            return await harness.request("cancel_get", protocol.CancelGet(pool=token, get_id=get_id,
                                                                          deadline=deadline), protocol.Ack)

        assert (await cancel(1, now + 0.2)).ok  # expires soon
        assert (await cancel(2, now + WAIT_S)).ok
        refused = await cancel(3, now + WAIT_S)
        assert not refused.ok and "cancelled gets" in (refused.error or "")
        await wait_until_async(lambda: time.monotonic() > now + 0.2, what="the first tombstone's deadline")
        assert (await cancel(3, now + WAIT_S)).ok
        # a past deadline needs no tombstone: the deadline check refuses that get anyway
        assert (await cancel(4, time.monotonic() - 1)).ok


@pytest.mark.parametrize("fields", [{"get_id": -1}, {"get_id": 2**63}, {"deadline": float("nan")},
                                    {"deadline": float("inf")}, {"deadline": -1.0}, {"get_id": True}])
def test_get_ids_and_deadlines_are_checked_on_decode(fields: dict[str, Any]) -> None:
    body = msgpack.unpackb(protocol.encode(protocol.GetRequest(key=b"k" * 16, pool="ab", get_id=1, deadline=1.0)))
    body.update(fields, v=protocol.PROTOCOL_VERSION, t="get_request")
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(msgpack.packb(body), protocol.GetRequest)
    cancel = {"pool": "ab", "get_id": 1, "deadline": 1.0, **fields, "v": protocol.PROTOCOL_VERSION, "t": "cancel_get"}
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(msgpack.packb(cancel), protocol.CancelGet)


def test_a_get_without_id_still_decodes_and_a_cancel_needs_one() -> None:
    old = {"key": b"k" * 16, "pool": "ab", "capacity": 4, "v": protocol.PROTOCOL_VERSION, "t": "get_request"}
    assert protocol.decode(msgpack.packb(old), protocol.GetRequest).get_id == 0
    no_id = {"pool": "ab", "get_id": 0, "deadline": 1.0, "v": protocol.PROTOCOL_VERSION, "t": "cancel_get"}
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(msgpack.packb(no_id), protocol.CancelGet)
