"""The cache engine on a real NATS: worker agent, write-behind to a real disk store process, NATS outages.

Every wait has a timeout; every engine is closed (which joins its loop thread) and every process stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator

import pytest
import torch
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.config.engine_config import load_engine_config
from kvmesh.services.engine.config.lmcache_keys import IGNORED
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared import protocol
from kvmesh.shared.errors import MeshUnavailable
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec
from kvmesh.shared.protocol import (CONTROLLER, LOCAL_CPU, LOCAL_DISK, CommandReply, Subjects, WorkerCommand,
                                    disk_store_id)
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KeyParams

from support.controller import running_controller
from support.engine import CHUNK, PagedKV, disk_store_mesh, engine_config, random_tokens
from support.engine_mesh import PARAMS, _store_and_settle, disk_mesh, engine_on  # noqa: F401 (disk_mesh: a fixture)
from support.waiting import WAIT_S, wait_until, wait_until_async


@pytest.fixture
def kv() -> PagedKV:
    return PagedKV(num_blocks=128)


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats().start()
    yield server
    server.stop()


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NatsClient]:
    client = await bus.connect(nats_server.url, name="test-observer", allow_reconnect=False)
    yield client
    await client.close()


async def test_worker_agent_registers_reports_and_answers_commands(nats_server: EmbeddedNats, nc: NatsClient,
                                                                 kv: PagedKV) -> None:
    registrations: list[protocol.RegisterEngine] = []
    batches: list[protocol.AdmissionBatch] = []

    async def on_register(msg: Msg) -> None:
        registrations.append(protocol.decode(msg.data, protocol.RegisterEngine))

    async def on_event(msg: Msg) -> None:
        try:
            batches.append(protocol.decode(msg.data, protocol.AdmissionBatch))
        except protocol.ProtocolError:
            pass  # a SyncChunk

    every_worker = protocol.Principal.engine("inst-a").path + ".*"  # the worker id is the engine's own
    await nc.subscribe(Subjects.register(every_worker), cb=on_register)
    await nc.subscribe(Subjects.events(every_worker), cb=on_event)
    await nc.flush()
    engine = await asyncio.to_thread(engine_on, nats_server.url, kv, lmcache_instance_id="inst-a")
    path = protocol.Principal.engine("inst-a").producer(engine.worker_id)
    try:
        await wait_until_async(lambda: any(r.worker_id == engine.worker_id for r in registrations),
                               what="registration")
        reg = registrations[-1]
        assert (reg.instance_id, reg.model, reg.chunk_size, reg.world_size, reg.rank) == ("inst-a", "test-model",
                                                                                          CHUNK, 1, 0)
        assert reg.kv_format == kv.layout.chunk_format() and reg.save_unfull_chunk and reg.disk_store is None
        # The worker reports where it runs: the address it reaches NATS from (loopback here) and its host name.
        assert reg.ip == "127.0.0.1" and reg.host == socket.gethostname()
        assert protocol.is_worker_id_of(reg.worker_id, "inst-a", 1, 0) and reg.worker_id != "inst-a"

        prompt = random_tokens(12, seed=1)  # seed 000: a 12-token prompt, one partial chunk
        await asyncio.to_thread(token_api.store, engine, prompt, **kv.kv(kv.slots(12)))
        key = engine.hasher.keys(prompt)[0]
        await wait_until_async(lambda: any(key in b.admitted for b in batches), what="the admission")
        assert [b.seq for b in batches] == list(range(1, len(batches) + 1))

        async def command(op: str, location: str = LOCAL_CPU, tokens: list[int] | None = None) -> CommandReply:
            return await bus.request(nc, Subjects.worker("inst-a", engine.worker_id, op),
                                     WorkerCommand(op=op, location=location, tokens=tokens or []), CommandReply, WAIT_S)

        tokens = prompt.tolist()
        assert (await command("lookup", tokens=tokens)).num_tokens == 12
        assert (await command("pin", tokens=tokens)).num_tokens == 12
        assert (await command("unpin", tokens=tokens)).num_tokens == 12
        assert (await command("pin", tokens=tokens)).num_tokens == 12
        assert (await command("clear")).num_tokens == 12  # the CPU tier's clear drops pinned chunks too
        await wait_until_async(lambda: any(key in b.evicted for b in batches), what="the eviction")
        assert token_api.lookup(engine, prompt) == 0
        reply = await command("pin", location=LOCAL_DISK, tokens=tokens)
        assert not reply.ok and "LocalDiskBackend" in (reply.error or "")

        health = await bus.request(nc, Subjects.health(path), protocol.HealthRequest(), protocol.HealthReply,
                                   WAIT_S)
        assert health.service == "engine" and health.service_id == engine.worker_id
    finally:
        await asyncio.to_thread(engine.close)


async def test_two_engines_sharing_an_instance_id_are_reported_on_both_sides(nats_server: EmbeddedNats, kv: PagedKV,
                                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Two engines keeping one lmcache_instance_id are two workers to a real controller: one serves the id, the
    other is listed as its duplicate (not merged), and each engine logs the conflict it is told about."""
    caplog.set_level(logging.WARNING)
    async with running_controller(nats_server.url) as (_, client):
        first = await asyncio.to_thread(engine_on, nats_server.url, kv, lmcache_instance_id="same")
        second = await asyncio.to_thread(engine_on, nats_server.url, kv, lmcache_instance_id="same")
        try:
            assert first.worker_id != second.worker_id

            async def duplicates() -> list[str]:
                instances = (await client.get("/instances")).json()["instances"]
                return [w["worker_name"] for i in instances for w in i["duplicate_workers"]]
            assert await wait_until_async(duplicates, what="the duplicate listed") == [first.worker_id]

            def engine_warnings() -> set[str]:
                return {r.threadName for r in caplog.records
                        if r.levelno == logging.WARNING and r.name.startswith("kvmesh.services.engine")
                        and "claimed by 2 live workers" in r.getMessage()}
            await wait_until_async(lambda: len(engine_warnings()) == 2, what="a warning on each engine's loop thread")
        finally:
            await asyncio.to_thread(first.close)
            await asyncio.to_thread(second.close)


def test_tensor_parallel_worker_ids(nats_server: EmbeddedNats, kv: PagedKV) -> None:
    params = KeyParams(model="m", kv_format="", world_size=2, rank=1)
    engine = build_engine(engine_config(nats_url=nats_server.url, lmcache_instance_id="tp"), params, kv.layout)
    try:
        # rank 1 of instance "tp", tagged with this engine's process: unique even where instance ids repeat
        assert protocol.is_worker_id_of(engine.worker_id, "tp", 2, 1) and engine.worker_id.startswith("tp.r1@")
    finally:
        engine.close()


async def test_controller_move_copies_and_moves_between_an_engine_s_tiers(disk_mesh: LocalMesh, kv: PagedKV,
                                                                          tmp_path: Path) -> None:
    """LMCache's /move through a real controller to a real engine and disk store: CPU -> disk (a copy the store
    verifies), disk -> CPU (the bytes come back exact), and a move that leaves the CPU tier."""
    engine = await asyncio.to_thread(engine_on, str(disk_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"),
                                     lmcache_instance_id="mover")
    tokens, src = random_tokens(128, seed=21), kv.slots(128)
    expected = kv.token_kv(src)

    def held(location: str) -> int:
        return token_api.lookup(engine, tokens, search_range=[location])

    async def move(source: str, target: str, copy: bool) -> int:
        response = await client.post("/move", json={"old_position": ["mover", source], "new_position": [
            "mover", target], "tokens": tokens.tolist(), "should_copy": copy})
        assert response.status_code == 200, response.text
        return response.json()["num_tokens"]

    async with running_controller(str(disk_mesh.nats_url), nats_auth=disk_mesh.auth(CONTROLLER)) as (service, client):
        try:
            await wait_until_async(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk client")
            await asyncio.to_thread(_store_and_settle, engine, tokens, kv, src)
            disk = engine.storage.lower(LOCAL_DISK)
            removed = engine.nats_loop.call(disk.remove(engine.hasher.keys(tokens.tolist())), WAIT_S, default=0)
            assert removed == 4 and await asyncio.to_thread(held, LOCAL_DISK) == 0  # on the CPU tier only

            async def registered() -> bool:
                return (await client.post("/health", json={"instance_id": "mover"})).status_code == 200
            await wait_until_async(registered, what="the engine registered")
            assert await move(LOCAL_CPU, LOCAL_DISK, copy=True) == 128
            assert engine.nats_loop.call(disk.wait_written(WAIT_S), WAIT_S + 2, default=False)  # staged -> on disk
            assert await asyncio.to_thread(held, LOCAL_DISK) == 128 and await asyncio.to_thread(held, LOCAL_CPU) == 128

            cleared = await client.post("/clear", json={"instance_id": "mover", "location": LOCAL_CPU})
            assert cleared.status_code == 200 and await asyncio.to_thread(held, LOCAL_CPU) == 0
            assert await move(LOCAL_DISK, LOCAL_CPU, copy=True) == 128
            assert await asyncio.to_thread(held, LOCAL_CPU) == 128
            dst = kv.slots(128, exclude=src)
            assert bool((await asyncio.to_thread(token_api.retrieve, engine, tokens, **kv.kv(dst))).all())
            assert torch.equal(kv.token_kv(dst), expected)

            assert await move(LOCAL_CPU, LOCAL_DISK, copy=False) == 128  # LMCache's default: a move
            assert await asyncio.to_thread(held, LOCAL_CPU) == 0 and await asyncio.to_thread(held, LOCAL_DISK) == 128

            # The worker itself refuses what the controller would (a command on NATS is untrusted input).
            async def worker_move(**fields: object) -> CommandReply:
                command = WorkerCommand(op="move", tokens=tokens.tolist(), **fields)
                return await bus.request(service.core.router.nc, Subjects.worker("mover", engine.worker_id, "move"),
                                         command, CommandReply, WAIT_S)
            out_of_store = await worker_move(location=LOCAL_DISK, target=LOCAL_CPU, keep_source=False)
            assert not out_of_store.ok and "shared" in (out_of_store.error or "")
            no_target = await worker_move(location=LOCAL_DISK, target="Elsewhere")
            assert not no_target.ok and "Elsewhere" in (no_target.error or "")
            assert await asyncio.to_thread(held, LOCAL_DISK) == 128  # nothing lost
        finally:
            await asyncio.to_thread(engine.close)


@pytest.mark.parametrize("local_cpu", [True, False])
def test_chunks_evicted_from_cpu_come_back_from_the_disk_store(disk_mesh: LocalMesh, kv: PagedKV, tmp_path: Path,
                                                               local_cpu: bool) -> None:
    engine = engine_on(str(disk_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"), cpu_chunks=4,
                       local_cpu=local_cpu)
    try:
        a, b = random_tokens(128, seed=10), random_tokens(128, seed=11)  # 4 chunks each: one pool each
        src_a, src_b = kv.slots(128), kv.slots(128)
        expected_a = kv.token_kv(src_a)
        wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        _store_and_settle(engine, a, kv, src_a)
        _store_and_settle(engine, b, kv, src_b)  # evicts a from the CPU tier (when it keeps chunks)
        assert token_api.lookup(engine, a, search_range=[LOCAL_CPU]) == 0
        assert token_api.lookup(engine, a) == 128 and token_api.lookup(engine, b) == 128
        assert token_api.lookup(engine, a, search_range=[LOCAL_DISK]) == 128

        dst = kv.slots(128, exclude=torch.cat([src_a, src_b]))
        got = token_api.retrieve(engine, a, **kv.kv(dst))
        assert bool(got.all())
        assert torch.equal(kv.token_kv(dst), expected_a)
        held_on_cpu = token_api.lookup(engine, a, search_range=[LOCAL_CPU])
        assert held_on_cpu == (128 if local_cpu else 0)  # fetched chunks are kept only with local_cpu
        assert engine.storage.stats["fetched_LocalDiskBackend"] == 4
        # every byte went through the engine's pool, lent to the store once: none inline on NATS
        disk = engine.storage.lower(LOCAL_DISK)
        details = engine.nats_loop.call(disk.stats(), WAIT_S, default=[])[0].details
        assert (details["puts_pool"], details["gets_pool"], details["pools"]) == (8, 4, 1)
        assert details["puts_inline"] == details["gets_inline"] == 0

        # chunks already on disk are not sent again
        done = engine.storage.stats["write_behind_done"]
        token_api.store(engine, a, **kv.kv(src_a))
        assert engine.wait_write_behind(WAIT_S)
        assert engine.storage.stats["write_behind_done"] == done

        # controller commands at the disk location go through the disk store's client
        assert token_api.pin(engine, a, LOCAL_DISK) == 128
        assert token_api.unpin(engine, a, LOCAL_DISK) == 128
        assert token_api.clear(engine, LOCAL_DISK) == 256
        assert token_api.lookup(engine, b, search_range=[LOCAL_DISK]) == 0
    finally:
        engine.close()


def test_force_skip_save_stores_nothing_and_still_loads(disk_mesh: LocalMesh, kv: PagedKV, tmp_path: Path) -> None:
    """LMCACHE_FORCE_SKIP_SAVE=1, read by load_engine_config as the connector does: no tier gets a chunk."""
    settings = engine_config(nats_url=str(disk_mesh.nats_url), local_disk=str(tmp_path / "disk"),
                             max_local_disk_size=0.05).to_dict()
    settings = {key: value for key, value in settings.items() if key not in IGNORED and key != "force_skip_save"}
    a, b = random_tokens(96, seed=30), random_tokens(96, seed=31)
    src = kv.slots(96)
    expected_a = kv.token_kv(src)

    saving = build_engine(load_engine_config(settings, environ={"LMCACHE_FORCE_SKIP_SAVE": "0"}), PARAMS, kv.layout)
    try:  # the control: the same settings store a's chunks in the CPU tier and the disk store
        assert saving.wait_connected(WAIT_S), "engine did not reach NATS"
        wait_until(lambda: saving.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        _store_and_settle(saving, a, kv, src)
        assert token_api.lookup(saving, a, search_range=[LOCAL_CPU]) == 96
        assert token_api.lookup(saving, a, search_range=[LOCAL_DISK]) == 96
    finally:
        saving.close()

    config = load_engine_config(settings, environ={"LMCACHE_FORCE_SKIP_SAVE": "1"})
    assert config.force_skip_save
    engine = build_engine(config, PARAMS, kv.layout)
    try:
        assert engine.wait_connected(WAIT_S), "engine did not reach NATS"
        wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        _store_and_settle(engine, b, kv, kv.slots(96, exclude=src))
        assert token_api.lookup(engine, b) == 0  # neither the CPU tier nor the disk store got b
        assert token_api.lookup(engine, b, search_range=[LOCAL_DISK]) == 0
        assert engine.storage.stats["write_behind_done"] == 0
        # what the tiers hold still loads
        dst = kv.slots(96, exclude=src)
        assert bool(token_api.retrieve(engine, a, **kv.kv(dst)).all())
        assert torch.equal(kv.token_kv(dst), expected_a)
    finally:
        engine.close()


def test_prefetch_warms_the_cpu_tier(disk_mesh: LocalMesh, kv: PagedKV, tmp_path: Path) -> None:
    engine = engine_on(str(disk_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"), cpu_chunks=4)
    try:
        a = random_tokens(96, seed=20)
        wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        _store_and_settle(engine, a, kv, kv.slots(96))
        assert token_api.clear(engine, LOCAL_CPU) == 96
        token_api.prefetch(engine, a)
        wait_until(lambda: token_api.lookup(engine, a, search_range=[LOCAL_CPU]) == 96, what="the prefetched chunks")
        assert engine.storage.stats["fetched_LocalDiskBackend"] == 3

        # a retrieve right behind a prefetch waits for the chunks in flight instead of reading them twice
        assert token_api.clear(engine, LOCAL_CPU) == 96
        token_api.prefetch(engine, a)
        dst = kv.slots(96)
        assert bool(token_api.retrieve(engine, a, **kv.kv(dst)).all())
        assert engine.storage.stats["fetched_LocalDiskBackend"] == 6
    finally:
        engine.close()


def test_nats_outage_gives_misses_at_once_and_the_engine_reconnects(kv: PagedKV, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    server = EmbeddedNats().start()
    port = server.port
    engine = engine_on(server.url, kv, local_disk=str(tmp_path / "disk"), lmcache_instance_id="outage",
                       blocking_timeout_secs=WAIT_S, request_timeout_secs=0.5)
    restarted: EmbeddedNats | None = None
    try:
        a = random_tokens(64, seed=30)
        token_api.store(engine, a, **kv.kv(kv.slots(64)))  # no disk store is running: write-behind fails, CPU keeps it
        server.stop()
        wait_until(lambda: not engine.connected, what="the engine to see NATS gone")

        # While NATS is down no call hands anything to the NATS loop, so none can wait for the dead NATS.
        handed: list[str] = []

        def spy(name: str, real: Callable[..., object]) -> Callable[..., object]:
            def handed_over(*args: object) -> object:
                handed.append(name)
                return real(*args)
            return handed_over

        for name in ("submit", "call_soon"):  # `call` goes through `submit`
            monkeypatch.setattr(engine.nats_loop, name, spy(name, getattr(engine.nats_loop, name)))
        b = random_tokens(96, seed=31)
        token_api.store(engine, b, **kv.kv(kv.slots(96)))
        assert token_api.lookup(engine, b) == 96 and token_api.lookup(engine, a) == 64  # the CPU tier still serves
        assert bool(token_api.retrieve(engine, a, **kv.kv(kv.slots(64))).all())
        unknown = random_tokens(64, seed=32)
        assert token_api.lookup(engine, unknown) == 0
        assert not bool(token_api.retrieve(engine, unknown, **kv.kv(kv.slots(64))).any())
        assert token_api.pin(engine, a, LOCAL_DISK) == 0
        assert handed == []
        monkeypatch.undo()

        restarted = EmbeddedNats(port=port).start()
        wait_until(lambda: engine.connected, what="the engine to reconnect")

        async def ask() -> CommandReply:
            nc = await bus.connect(restarted.url, name="test", allow_reconnect=False)

            async def answer() -> CommandReply | None:
                try:
                    return await bus.request(nc, Subjects.worker("outage", engine.worker_id, "lookup"),
                                             WorkerCommand(op="lookup", location=LOCAL_CPU, tokens=b.tolist()),
                                             CommandReply, WAIT_S)
                except MeshUnavailable:
                    return None

            try:  # the subscriptions come back with the reconnect
                return await wait_until_async(answer, what="the worker answering after the reconnect", interval=0.1)
            finally:
                await nc.close()

        assert asyncio.run(ask()).num_tokens == 96
        # A store that does not answer (no disk store on the mesh) ends the fetch by its request failing (no
        # responder, or the 0.5 s request timeout), not by the retrieve's blocking timeout running out.
        assert not bool(token_api.retrieve(engine, unknown, **kv.kv(kv.slots(64))).any())
        assert engine.storage.stats["fetch_timeout"] == 0
    finally:
        engine.close()
        if restarted is not None:
            restarted.stop()
        server.stop()


def test_first_connect_may_fail_and_is_retried(kv: PagedKV) -> None:
    from kvmesh.shared.messaging.embedded_nats import free_port

    port = free_port()
    engine = build_engine(engine_config(nats_url=f"nats://127.0.0.1:{port}", lmcache_instance_id="late"),
                          PARAMS, kv.layout)
    server: EmbeddedNats | None = None
    try:
        a = random_tokens(64, seed=40)
        token_api.store(engine, a, **kv.kv(kv.slots(64)))  # works without NATS
        assert token_api.lookup(engine, a) == 64 and not engine.connected
        server = EmbeddedNats(port=port).start()
        assert engine.wait_connected(WAIT_S)
    finally:
        engine.close()
        if server is not None:
            server.stop()


def test_close_joins_the_loop_thread(nats_server: EmbeddedNats, kv: PagedKV) -> None:
    before = {t.name for t in threading.enumerate()}
    engine = engine_on(nats_server.url, kv, lmcache_instance_id="threads")
    engine.close()
    leftover = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not [name for name in leftover if name.startswith("kvmesh")], leftover


@pytest.fixture
def full_mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    """NATS, a real disk store and two remote-store partitions (the processes `kvmesh up` runs)."""
    disk_id = disk_store_id()
    services = [ServiceSpec("kvmesh.services.disk_store", ["--dir", str(tmp_path / "disk"), "--max-size-gb", "0.05",
                                                           "--store-id", disk_id], disk_id)]
    for partition in range(2):
        services.append(ServiceSpec("kvmesh.services.remote_store",
                                    ["--max-size-gb", "0.05", "--partition", str(partition), "--partitions", "2",
                                     "--store-id", f"remote-{partition}"], f"remote-{partition}"))
    mesh = LocalMesh(services).start(ready_timeout=WAIT_S)
    yield mesh
    mesh.stop()


@pytest.mark.parametrize("encrypt", [False, True], ids=["in-clear", "sealed"])
def test_retrieval_goes_cpu_then_disk_then_remote(full_mesh: LocalMesh, kv: PagedKV, tmp_path: Path,
                                                  encrypt: bool) -> None:
    """Sealed (encrypt_stores), each chunk is sealed once for both stores, and loads from either."""
    from kvmesh.shared.protocol import REMOTE

    engine = engine_on(str(full_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"), cpu_chunks=4,
                       remote_url="lm://localhost:65432", remote_partitions=2, encrypt_stores=encrypt)
    try:
        wait_until(lambda: engine.storage.lower(REMOTE) is not None, what="the remote store client")
        disk, remote = engine.storage.lower(LOCAL_DISK), engine.storage.lower(REMOTE)
        a, b = random_tokens(128, seed=50), random_tokens(128, seed=51)
        src_a, src_b = kv.slots(128), kv.slots(128)
        expected_a, expected_b = kv.token_kv(src_a), kv.token_kv(src_b)
        _store_and_settle(engine, a, kv, src_a)
        _store_and_settle(engine, b, kv, src_b)
        assert token_api.lookup(engine, a, search_range=[REMOTE]) == 128
        assert token_api.lookup(engine, a, search_range=[LOCAL_DISK]) == 128
        assert engine.storage.stats["sealed_chunks"] == (8 if encrypt else 0)  # 8 chunks, each put to both stores

        # a: chunks 0-1 only on disk, chunks 2-3 only in the remote store, nothing in the CPU tier
        keys_a = engine.hasher.keys(a)
        assert engine.nats_loop.call(disk.remove(keys_a[2:]), WAIT_S, default=0) == 2
        assert engine.nats_loop.call(remote.remove(keys_a[:2]), WAIT_S, default=0) == 2
        assert token_api.lookup(engine, a, search_range=[LOCAL_DISK]) == 64
        assert token_api.lookup(engine, a, search_range=[REMOTE]) == 0
        assert token_api.lookup(engine, a) == 128  # the prefix spans both tiers
        exclude = torch.cat([src_a, src_b])
        dst = kv.slots(128, exclude=exclude)
        assert bool(token_api.retrieve(engine, a, **kv.kv(dst)).all())
        assert torch.equal(kv.token_kv(dst), expected_a)
        assert engine.storage.stats["fetched_LocalDiskBackend"] == 2
        assert engine.storage.stats["fetched_RemoteBackend"] == 2

        # b: only in the remote store (disk cleared, CPU cleared)
        assert token_api.clear(engine, LOCAL_DISK) > 0
        token_api.clear(engine, LOCAL_CPU)
        dst_b = kv.slots(128, exclude=torch.cat([exclude, dst]))
        assert bool(token_api.retrieve(engine, b, **kv.kv(dst_b)).all())
        assert torch.equal(kv.token_kv(dst_b), expected_b)
        assert token_api.pin(engine, b, REMOTE) == 128 and token_api.unpin(engine, b, REMOTE) == 128
        assert not [name for name in engine.storage.stats if name.startswith("sealed_miss")]
    finally:
        engine.close()


def test_a_save_to_some_stores_leaves_the_others_to_the_next_save(full_mesh: LocalMesh, kv: PagedKV,
                                                                  tmp_path: Path) -> None:
    """A save whose store tiers (a request's kv_store_tiers) name the disk store and not the remote store does
    not mark its chunks held by every store: a later save of the same chunks with every tier (once the CPU tier
    has lost them) sends them to the remote store."""
    from kvmesh.shared.protocol import REMOTE

    engine = engine_on(str(full_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"),
                       remote_url="lm://localhost:65432", remote_partitions=2)
    try:
        wait_until(lambda: engine.storage.lower(REMOTE) is not None, what="the remote store client")
        tokens = random_tokens(64, seed=52)
        src = kv.slots(64)
        spans = engine.hasher.spans(tokens)
        engine.save(spans, **kv.kv(src), store_to=frozenset({LOCAL_CPU, LOCAL_DISK}))
        assert engine.wait_write_behind(WAIT_S)
        # (no lookup before the next save: one that finds a store without them forgets them as held, too)
        assert not any(engine.storage.write_behind.known_held(span.key) for span in spans)
        token_api.clear(engine, LOCAL_CPU)
        engine.save(spans, **kv.kv(src))  # every tier
        assert engine.wait_write_behind(WAIT_S)
        disk = engine.storage.lower(LOCAL_DISK)
        assert disk is not None and engine.nats_loop.call(disk.wait_written(WAIT_S), WAIT_S + 2, default=False)
        assert token_api.lookup(engine, tokens, search_range=[REMOTE]) == 64
        assert token_api.lookup(engine, tokens, search_range=[LOCAL_DISK]) == 64
        assert all(engine.storage.write_behind.known_held(span.key) for span in spans)
        dst = kv.slots(64, exclude=src)
        token_api.clear(engine, LOCAL_CPU)
        assert token_api.clear(engine, LOCAL_DISK) > 0
        assert bool(token_api.retrieve(engine, tokens, **kv.kv(dst)).all())  # from the remote store
        assert torch.equal(kv.token_kv(dst), kv.token_kv(src))
    finally:
        engine.close()


def test_a_save_to_the_disk_store_sends_on_what_the_cpu_tier_alone_holds(disk_mesh: LocalMesh, kv: PagedKV,
                                                                         tmp_path: Path) -> None:
    """Chunks stored to the CPU tier only (a request's kv_store_tiers), then saved by a request that stores to
    the disk store, reach the disk store, sent from the CPU tier (not copied out of vLLM's cache again: the
    second save's blocks hold other KV here, and the disk store gets the first's); saved once more, they are
    known to be held and not sent again."""
    engine = engine_on(str(disk_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"))
    try:
        wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        disk = engine.storage.lower(LOCAL_DISK)
        assert disk is not None and engine.nats_loop is not None
        tokens = random_tokens(64, seed=53)
        spans = engine.hasher.spans(tokens)
        src = kv.slots(64)
        other = kv.slots(64, exclude=src)
        assert not torch.equal(kv.token_kv(src), kv.token_kv(other))
        engine.save(spans, **kv.kv(src), store_to=frozenset({LOCAL_CPU}))
        assert engine.wait_write_behind(WAIT_S) and engine.storage.stats["write_behind_done"] == 0
        engine.save(spans, **kv.kv(other), store_to=frozenset({LOCAL_DISK}))
        assert engine.wait_write_behind(WAIT_S)
        assert engine.nats_loop.call(disk.wait_written(WAIT_S), WAIT_S + 2, default=False)
        assert engine.storage.stats["write_behind_done"] == 2
        token_api.clear(engine, LOCAL_CPU)
        dst = kv.slots(64, exclude=torch.cat([src, other]))
        assert bool(token_api.retrieve(engine, tokens, **kv.kv(dst)).all())  # from the disk store
        assert torch.equal(kv.token_kv(dst), kv.token_kv(src))
        engine.save(spans, **kv.kv(src), store_to=frozenset({LOCAL_DISK}))
        assert engine.wait_write_behind(WAIT_S) and engine.storage.stats["write_behind_done"] == 2
    finally:
        engine.close()


@pytest.fixture
def small_disk_mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    """A real disk store that holds three of the tests' chunks (16 KiB of KV + a 4 KiB header page each)."""
    with disk_store_mesh(tmp_path / "disk", max_size_gb=0.0000668) as mesh:
        yield mesh


@pytest.mark.parametrize("refreshed", [True, False])
def test_cpu_hits_refresh_recency_in_the_disk_store(small_disk_mesh: LocalMesh, kv: PagedKV, tmp_path: Path,
                                                    refreshed: bool) -> None:
    """A chunk the CPU tier keeps serving is the disk store's most recent one too (the batched touch), so
    the disk store evicts another chunk; without the refresh it would evict the served one first."""
    engine = engine_on(str(small_disk_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"), touch_interval_secs=3600)
    try:
        wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        prompts = [random_tokens(32, seed=40 + i) for i in range(4)]  # one chunk each
        for prompt in prompts[:3]:
            _store_and_settle(engine, prompt, kv, kv.slots(32))
        assert all(token_api.lookup(engine, p, search_range=[LOCAL_DISK]) == 32 for p in prompts[:3])
        assert bool(token_api.retrieve(engine, prompts[0], **kv.kv(kv.slots(32))).all())  # a CPU hit on the oldest
        if refreshed:
            engine.nats_loop.call(engine.storage.recency.flush(), WAIT_S, default=None)
        _store_and_settle(engine, prompts[3], kv, kv.slots(32))  # the disk store must evict one
        on_disk = [token_api.lookup(engine, p, search_range=[LOCAL_DISK]) == 32 for p in prompts]
        assert on_disk == ([True, False, True, True] if refreshed else [False, True, True, True]), on_disk
    finally:
        engine.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["in-clear", "sealed"])
def test_a_chunk_whose_meta_is_not_what_its_key_holds_is_a_miss(disk_mesh: LocalMesh, kv: PagedKV,
                                                                tmp_path: Path, encrypt: bool) -> None:
    """A well-formed chunk file whose header (checks and all) describes something else than what the engine
    expects under that key (another layout's chunk: KV format, byte size, token count, dtype) is never loaded: the
    hit ends before it, the store's answer counts as a bad meta (sealed: its tag fails first, the meta being its
    associated data), and those tokens are recomputed."""
    root = tmp_path / "disk"
    engine = engine_on(str(disk_mesh.nats_url), kv, local_disk=str(root), cpu_chunks=8, local_cpu=False,
                       encrypt_stores=encrypt)
    counted = "sealed_miss_tag" if encrypt else "fetch_bad_meta"
    try:
        tokens = random_tokens(192, seed=12)  # 6 chunks
        src = kv.slots(192)
        wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        _store_and_settle(engine, tokens, kv, src)
        keys = engine.hasher.keys(tokens)
        assert token_api.lookup(engine, tokens, search_range=[LOCAL_DISK]) == 192
        intact = torch.zeros(192, dtype=torch.bool)
        assert torch.equal(token_api.retrieve(engine, tokens, **kv.kv(kv.slots(192, exclude=src))), ~intact)
        changes = ((4, {"fmt": "another-layout"}), (3, {"nbytes": -2}), (2, {"num_tokens": CHUNK - 1}),
                   (1, {"dtype": "float64"}))
        bad_metas = 0
        for position, change in changes:
            path = chunk_file.chunk_path(root, keys[position])
            meta, offset = chunk_file.read_chunk_meta(path)
            data = path.read_bytes()[offset:]
            if "nbytes" in change:  # a shorter chunk, its checksum right: only its size gives it away
                data = data[:change["nbytes"]]
                change = {"nbytes": len(data), "checksum": chunk_file.checksum(data)}
            chunk_file.write_chunk_file(root, dataclasses.replace(meta, **change), data)  # a valid file
            got = token_api.retrieve(engine, tokens, **kv.kv(kv.slots(192, exclude=src)))
            assert int(got.sum()) == position * CHUNK  # the chunks before it, never it or what follows
            # counted (the chunks read together with it that are bad too count as well)
            assert engine.storage.stats[counted] > bad_metas
            bad_metas = engine.storage.stats[counted]
        assert engine.storage.stats["fetched_LocalDiskBackend"] == 6 + 4 + 3 + 2 + 1
    finally:
        engine.close()


def test_a_restarted_engine_clears_what_its_previous_process_put_in_the_disk_store(
        disk_mesh: LocalMesh, kv: PagedKV, tmp_path: Path) -> None:
    def engine() -> CacheEngine:
        started = engine_on(str(disk_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05)
        wait_until(lambda: started.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        return started

    tokens = random_tokens(96, seed=32)
    before = engine()
    try:
        _store_and_settle(before, tokens, kv, kv.slots(96))
        first_worker_id = before.worker_id
    finally:
        before.close()
    after = engine()  # the same instance and rank in a new process: a new worker id, the same claims
    try:
        assert after.worker_id != first_worker_id and after.store_caller == before.store_caller
        assert token_api.clear(after, LOCAL_DISK) == 96
        assert token_api.lookup(after, tokens, search_range=[LOCAL_DISK]) == 0
    finally:
        after.close()


def test_hits_past_the_stores_keys_per_request_bound_reach_it_in_parts(disk_mesh: LocalMesh, kv: PagedKV,
                                                                      tmp_path: Path) -> None:
    engine = engine_on(str(disk_mesh.nats_url), kv, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05)
    try:
        wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk store client")
        # one interval of many hits
        engine.storage.recency.note_hits([i.to_bytes(16, "little") for i in range(120_000)])
        engine.nats_loop.call(engine.storage.recency.flush(), WAIT_S, default=None)
        client = engine.storage.lower(LOCAL_DISK)
        (stats,) = engine.nats_loop.call(client.stats(), WAIT_S, default=[])
        assert stats.details["requests_too_many_keys"] == 0
    finally:
        engine.close()
