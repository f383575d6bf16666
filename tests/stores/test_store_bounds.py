"""Bounds a NATS client can push on at both stores (issue 13; shared/store_kit/store_bounds.py): inline put size, the
request queue of each op (a flood is dropped and counted, the store keeps its connection), keys per request
(repeats act once, also across a restart), and full syncs merged and rate-limited per producer. Stores run in
this test's event loop on a real nats-server, with their own NATS connections where the connection matters.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from kvmesh.shared import protocol

from kvmesh.services.disk_store import options as disk_options
from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.service import DiskStoreService
from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.services.remote_store import options as remote_options
from kvmesh.services.remote_store.options import RemoteStoreOptions
from kvmesh.services.remote_store.service import RemoteStoreService
from kvmesh.shared.errors import ConfigError, MeshUnavailable
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.options_cli import GB
from kvmesh.shared.store_kit.store_bounds import StoreBounds

from support.controller import running_controller
from support.remote_store import ENGINE, MiB, chunk
from support.waiting import WAIT_S, wait_until_async

KiB = 1024


@pytest.fixture
async def remote_factory(nats_server: EmbeddedNats) -> AsyncIterator:
    """Remote stores on their own NATS connections, and a client connection of the test's."""
    opened: list[RemoteStoreService] = []
    nc = await bus.connect(nats_server.url, "test-store-bounds")

    async def make(bounds: StoreBounds, capacity_bytes: int = 64 * MiB) -> RemoteStoreService:
        service = RemoteStoreService(RemoteStoreOptions(
            store_id=f"sb{os.urandom(3).hex()}", capacity_bytes=capacity_bytes, nats_url=nats_server.url,
            stream_host="127.0.0.1", heartbeat_interval=60.0, bounds=bounds))
        await service.start()
        opened.append(service)
        return service

    yield make, nc
    await nc.close()
    for service in opened:
        await service.stop()


def disk_service(nats_url: str, root: Path, store_id: str, bounds: StoreBounds) -> DiskStoreService:
    return DiskStoreService(DiskStoreOptions(root=root, capacity_bytes=GB, store_id=store_id, nats_url=nats_url,
                                             fsync=False, bounds=bounds), heartbeat_interval=60.0)


async def ask(nc: Any, store_id: str, op: str, message: object, reply_type: type) -> Any:
    return await bus.request(nc, protocol.Subjects.store(store_id, op, ENGINE), message, reply_type, WAIT_S)


async def inline_put(nc: Any, store_id: str, nbytes: int, seed: int,
                     meta: protocol.ChunkMeta | None = None) -> protocol.Ack:
    """An inline put of a new chunk of `nbytes` (of `meta`'s key, if given)."""
    meta, data = chunk(nbytes, seed, key=meta.key if meta is not None else None)
    return await ask(nc, store_id, "put", protocol.PutRequest(meta=meta, data=data.tobytes()), protocol.Ack)


# ---- inline puts and the request queue ------------------------------------------------------------------------
async def test_an_inline_put_over_the_bound_gets_an_error_naming_the_flag_at_both_stores(
        remote_factory, nats_server: EmbeddedNats, tmp_path: Path) -> None:
    make, nc = remote_factory
    bounds = StoreBounds(max_inline_bytes=1 * MiB, request_queue_bytes=8 * MiB)
    remote = await make(bounds)
    disk = disk_service(nats_server.url, tmp_path / "disk", f"disk-sb{os.urandom(3).hex()}", bounds)
    await disk.start()
    try:
        for store_id in (remote.options.store_id, disk.options.store_id):
            refused = await inline_put(nc, store_id, 1 * MiB + 1, 1)
            assert not refused.ok and "--max-inline-bytes" in refused.error and str(1 * MiB + 1) in refused.error
            assert (await inline_put(nc, store_id, 1 * MiB, 2)).ok  # at the bound: taken

            async def held(store_id: str = store_id) -> bool:  # the disk store holds it once it is written
                stats = await ask(nc, store_id, "stats", protocol.StatsRequest(), protocol.StatsReply)
                return stats.num_chunks == 1

            await wait_until_async(held, what=f"{store_id} holding the chunk at the bound")
    finally:
        await disk.stop()


FLOOD = """
import asyncio, sys
import numpy as np
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.wire import chunk_file

async def flood(url, subject, inbox, count, nbytes):
    nc = await bus.connect(url, "flooder")
    for seed in range(count):
        data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        meta = protocol.ChunkMeta(key=np.random.default_rng(seed).bytes(16), num_tokens=256, shape=[nbytes],
                                  dtype="uint8", fmt="test", nbytes=nbytes, checksum=chunk_file.checksum(data))
        await nc.publish(subject, protocol.encode(protocol.PutRequest(meta=meta, data=data.tobytes())), reply=inbox)
    await nc.flush()
    await nc.close()

asyncio.run(flood(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
"""


async def flood(url: str, subject: str, inbox: str, count: int, nbytes: int) -> None:
    """`count` inline puts of `nbytes` published as fast as another process can (its own NATS connection)."""
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", FLOOD, url, subject, inbox, str(count),
                                                   str(nbytes))
    assert await asyncio.wait_for(process.wait(), WAIT_S) == 0


async def test_a_flood_of_inline_puts_is_dropped_and_counted_and_the_store_keeps_its_connection(
        remote_factory, nats_server: EmbeddedNats) -> None:
    make, nc = remote_factory
    service = await make(StoreBounds(max_inline_bytes=1 * MiB, request_queue_bytes=2 * MiB))
    store_id = service.options.store_id
    replies: list[protocol.Ack] = []
    inbox = nc.new_inbox()

    async def on_reply(msg: Any) -> None:
        replies.append(protocol.decode(msg.data, protocol.Ack))

    await nc.subscribe(inbox, cb=on_reply)
    await nc.flush()
    subject = protocol.Subjects.store(store_id, "put", ENGINE)
    # Each burst stays under the server's 64 MiB max_pending for the store's connection: a larger one from a
    # faster publisher can still get the store cut off as a slow consumer (docs/security.md, "Not covered yet").
    # Each of these is larger than the whole queue: the NATS client drops every one without decoding it.
    await flood(nats_server.url, subject, inbox, 15, 3 * MiB)
    await wait_until_async(lambda: service.endpoint.dropped == 15, what="15 oversized puts dropped")
    # A burst of puts within the bounds: each is answered ok, or dropped if it found the queue full.
    await flood(nats_server.url, subject, inbox, 50, 1 * MiB)
    await wait_until_async(lambda: len(replies) + service.endpoint.dropped - 15 == 50,
                           what="every put of the burst answered or dropped")
    assert all(reply.ok for reply in replies)
    store_nc = service.nc
    assert store_nc is not None and store_nc.is_connected and store_nc.stats["reconnects"] == 0
    stats = await ask(nc, store_id, "stats", protocol.StatsRequest(), protocol.StatsReply)
    assert stats.details["requests_dropped"] == service.endpoint.dropped >= 15
    assert stats.num_chunks == len(replies)
    assert (await inline_put(nc, store_id, 512 * KiB, 999)).ok  # still serving


# ---- keys per request -----------------------------------------------------------------------------------------
async def test_repeated_keys_act_once_and_a_restart_replays_one_pin(nats_server: EmbeddedNats, nc,
                                                                    tmp_path: Path) -> None:
    bounds = StoreBounds(max_keys_per_request=200_000)
    store_id = f"disk-sb{os.urandom(3).hex()}"
    service = disk_service(nats_server.url, tmp_path / "disk", store_id, bounds)
    await service.start()
    meta, _ = chunk(4 * KiB, 1)
    other, _ = chunk(4 * KiB, 2)
    try:
        assert (await inline_put(nc, store_id, 4 * KiB, 1, meta)).ok
        repeated = [meta.key] * 150_000
        pinned = await ask(nc, store_id, "pin", protocol.ChunkKeys(keys=repeated), protocol.CommandReply)
        assert pinned.ok and pinned.num_chunks == 1
        touched = await ask(nc, store_id, "touch", protocol.ChunkKeys(keys=repeated), protocol.Ack)
        assert touched.ok
        contains = await ask(nc, store_id, "contains", protocol.ChunkKeys(keys=[meta.key, meta.key, other.key,
                                                                                  meta.key]),
                             protocol.ContainsReply)
        assert contains.prefix == 2  # the held prefix of the keys as sent
    finally:
        await service.stop()
    service = disk_service(nats_server.url, tmp_path / "disk", store_id, bounds)
    await service.start()
    try:
        stats = await ask(nc, store_id, "stats", protocol.StatsRequest(), protocol.StatsReply)
        assert stats.pinned_chunks == 1
        unpinned = await ask(nc, store_id, "unpin", protocol.ChunkKeys(keys=[meta.key]), protocol.CommandReply)
        assert unpinned.num_chunks == 1
        stats = await ask(nc, store_id, "stats", protocol.StatsRequest(), protocol.StatsReply)
        assert stats.pinned_chunks == 0  # one pin, not 150,000
        removed = await ask(nc, store_id, "remove", protocol.ChunkKeys(keys=[meta.key] * 1000),
                            protocol.CommandReply)
        assert removed.num_chunks == 1 and removed.num_tokens == meta.num_tokens
    finally:
        await service.stop()


async def test_a_request_over_max_keys_per_request_gets_an_error_and_the_store_keeps_serving(
        remote_factory) -> None:
    make, nc = remote_factory
    service = await make(StoreBounds(max_keys_per_request=1000))
    store_id = service.options.store_id
    keys = [os.urandom(16) for _ in range(1001)]
    for op, reply_type in (("contains", protocol.ContainsReply), ("pin", protocol.CommandReply),
                           ("touch", protocol.Ack), ("remove", protocol.CommandReply)):
        if reply_type is protocol.Ack:
            reply = await ask(nc, store_id, op, protocol.ChunkKeys(keys=keys), reply_type)
            assert not reply.ok and "--max-keys-per-request" in reply.error
        else:
            with pytest.raises(MeshUnavailable, match="1001 keys.*--max-keys-per-request"):
                await ask(nc, store_id, op, protocol.ChunkKeys(keys=keys), reply_type)
    contains = await ask(nc, store_id, "contains", protocol.ChunkKeys(keys=keys[:1000]), protocol.ContainsReply)
    assert contains.prefix == 0
    stats = await ask(nc, store_id, "stats", protocol.StatsRequest(), protocol.StatsReply)
    assert stats.details["requests_too_many_keys"] == 4


# ---- full syncs -----------------------------------------------------------------------------------------------
async def test_a_burst_of_sync_requests_and_hellos_makes_few_full_syncs_and_the_controller_ends_in_sync(
        remote_factory, nats_server: EmbeddedNats) -> None:
    make, nc = remote_factory
    async with running_controller(nats_server.url) as (_, http):
        service = await make(StoreBounds(min_sync_interval=2.0))
        store_id = service.options.store_id
        client = RemoteStoreClient(nc, [store_id], ENGINE, request_timeout=WAIT_S)

        async def store_view() -> dict[str, Any] | None:
            stores = (await http.get("/instances")).json()["stores"]
            return next((s for s in stores if s["store_id"] == store_id), None)

        async def controller_holds(count: int) -> bool:
            view = await store_view()
            return view is not None and view["num_keys"] == count and view["in_sync"]

        try:
            for seed in range(3):
                meta, data = chunk(64 * KiB, seed)
                assert await client.put(meta, ChunkBuffer(memoryview(data)))
            await wait_until_async(lambda: controller_holds(3), what="the controller holding the 3 chunks")
            reporter = service.reporter
            await wait_until_async(lambda: not reporter.announcing, what="no sync pending")
            syncs, asks = reporter.syncs_published, reporter.sync_asks
            sync_subject = protocol.Subjects.sync(protocol.store_path(store_id))
            for i in range(100):
                await nc.publish(sync_subject, protocol.encode(protocol.SyncRequest(reason=f"flood {i}")))
            for i in range(20):
                await nc.publish(protocol.Subjects.CONTROLLER_HELLO, protocol.encode(
                    protocol.ControllerHello(controller_id=f"fake-{i}", started_at=0.0)))
            meta, data = chunk(64 * KiB, 99)  # a change during the burst: the controller must see it too
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
            await nc.flush()
            await wait_until_async(lambda: reporter.sync_asks >= asks + 120 and not reporter.announcing,
                                   what="the burst heard and its syncs done")
            assert 1 <= reporter.syncs_published - syncs <= 2  # served, not dropped; merged, not 120
            await wait_until_async(lambda: controller_holds(4), what="the controller in sync with 4 chunks")
            stats = await ask(nc, store_id, "stats", protocol.StatsRequest(), protocol.StatsReply)
            assert stats.details["full_syncs"] == reporter.syncs_published
            assert stats.details["sync_asks"] == reporter.sync_asks
        finally:
            await client.close()


# ---- the flags ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [remote_options, disk_options], ids=["remote", "disk"])
def test_store_bounds_are_flags_that_round_trip_and_are_checked(options: Any, tmp_path: Path) -> None:
    bounds = StoreBounds(max_keys_per_request=7, max_inline_bytes=1000, request_queue_bytes=3 * MiB,
                         min_sync_interval=0.5, retained_share=0.25)
    if options is remote_options:
        written = RemoteStoreOptions(store_id="remote-0", capacity_bytes=MiB, bounds=bounds).to_args()
    else:
        written = DiskStoreOptions(root=tmp_path, capacity_bytes=MiB, store_id="disk-x", bounds=bounds).to_args()
    assert options.options_from_args(options.build_parser().parse_args(written)).bounds == bounds
    base = ["--dir", str(tmp_path), "--max-size-gb", "1", "--nats-url", "nats://127.0.0.1:4222",
            "--cache-policy", "LRU"] if options is disk_options else []
    assert options.options_from_args(options.build_parser().parse_args(base)).bounds == StoreBounds()
    for flags, named in ((["--max-keys-per-request", "0"], "--max-keys-per-request"),
                         (["--max-inline-bytes", "0"], "--max-inline-bytes"),
                         (["--request-queue-mb", "1", "--max-inline-bytes", str(2 * MiB)], "--max-inline-bytes"),
                         (["--min-sync-interval", "-1"], "--min-sync-interval"),
                         (["--retained-share", "1.5"], "--retained-share"),
                         (["--retained-share", "nan"], "--retained-share")):
        with pytest.raises(ConfigError, match=named):
            options.options_from_args(options.build_parser().parse_args(base + flags))
