"""Floods cut off only the flooder (issue 24, finding 5): one principal's flood of the largest messages its
credentials let it send, inline puts and as much garbage on a control op, must neither get a store cut off by
nats-server as a slow consumer nor fail another principal's requests.

Real parts only: the NATS that KVMesh starts (its generated settings, users and per-principal permissions), a
disk store and a remote store in this test's event loop on their own connections, tenant B flooding from another
process (so it publishes as fast as a process can, whatever this loop does), tenant A asking both stores from
this loop while the flood runs. The flood runs from before A's first request until after its last, by
construction: B stops only when told to.

A Python reader can be outrun by enough publishers of large messages, so the flood may get B's own lane (the
store's connection that serves B alone) cut off; the test asserts what the stores promise: every request of A's
(puts, gets with their bytes, contains, pins, unpins, stats) answered, no store connection but B's lane cut off,
and B served again once its flood is over. Then how lanes follow the domains map: principals past --max-lanes
share one connection by their own subjects, lanes open and close as principals come and go, and a store whose map
lists no engine serves every engine on one shared connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.service import DiskStoreService
from kvmesh.services.remote_store.options import RemoteStoreOptions
from kvmesh.services.remote_store.service import RemoteStoreService
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.options_cli import GB
from kvmesh.shared.protocol import Principal
from kvmesh.shared.store_kit.store_bounds import StoreBounds

from support.remote_store import MiB, chunk
from support.store_answers import answered
from support.waiting import WAIT_S, wait_until_async

KiB = 1024
FLOOD_BYTES = 40 * MiB  # the flood; B sends less if its connection's max_payload says so
FLOOD_CONNECTIONS = 4  # B's connections, each publishing as fast as it can
ROUNDS = 100  # tenant A's rounds of contains / get / pin / unpin / stats at each store

# Tenant B: the largest inline puts NATS lets it publish (up to 40 MiB), and as many bytes of garbage on `get`, to
# every store named, round robin, until its stdin closes. It prints "flooding" once its first messages are out,
# and at the end how many it published.
FLOOD = """
import asyncio, os, sys
import numpy as np
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.wire import chunk_file

async def flood(url, caller, store_ids):
    auth = bus.NatsAuth(user=os.environ["FLOOD_USER"], password=os.environ["FLOOD_PASSWORD"])
    connections = [await bus.connect(url, f"flooder-{i}", auth, first_connect_wait=30)
                   for i in range(int(os.environ["FLOOD_CONNECTIONS"]))]
    nbytes = min(int(os.environ["FLOOD_BYTES"]), connections[0].max_payload - protocol.INLINE_HEADROOM)
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    meta = protocol.ChunkMeta(key=os.urandom(16), num_tokens=256, shape=[nbytes], dtype="uint8", fmt="test",
                              nbytes=nbytes, checksum=chunk_file.checksum(data))
    put = protocol.encode(protocol.PutRequest(meta=meta, data=data.tobytes()))  # one put, sent again and again
    garbage = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    messages = [("put", put), ("get", garbage)]
    stop, flooding = asyncio.Event(), asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin, stop.set)  # EOF on stdin: the test is done
    sent = [0]
    under_way = 2 * len(connections) * len(store_ids) * len(messages)  # every kind of message sent twice

    async def ignore(msg):  # the stores' answers: read and dropped
        pass

    async def publish(nc):
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=ignore)
        while not stop.is_set():
            op, payload = messages[(sent[0] // len(store_ids)) % len(messages)]
            await nc.publish(protocol.Subjects.store(store_ids[sent[0] % len(store_ids)], op, caller), payload,
                             reply=inbox)
            sent[0] += 1
            if sent[0] >= under_way:
                flooding.set()
            await asyncio.sleep(0)  # let the other connections publish too

    tasks = [asyncio.create_task(publish(nc)) for nc in connections]
    await flooding.wait()
    print("flooding", nbytes, flush=True)
    await asyncio.gather(*tasks)
    for nc in connections:
        await nc.close()
    print("sent", sent[0], flush=True)

asyncio.run(flood(sys.argv[1], sys.argv[2], sys.argv[3:]))
"""



@pytest.fixture
def mesh(nats_mesh: LocalMesh) -> LocalMesh:
    return nats_mesh


def slow_consumers(mesh: LocalMesh) -> list[str]:
    """nats-server's log lines about slow consumers (the server cutting a client off or about to)."""
    assert mesh._nats is not None and mesh._nats._workdir is not None
    log_file = Path(mesh._nats._workdir.name) / "nats.log"
    return [line for line in log_file.read_text(errors="replace").splitlines() if "slow consumer" in line.lower()]


def lost(nc: Any) -> int:
    """How often `nc` lost its connection: its reconnects, and 1 if it is down now."""
    return nc.stats["reconnects"] + (0 if nc.is_connected else 1)


TENANT_A, TENANT_B = Principal.engine("tenant-a"), Principal.engine("tenant-b")


@asynccontextmanager
async def both_stores(mesh: LocalMesh, tmp_path: Path, bounds: StoreBounds = StoreBounds(),
                      domains_file: Path | None = None) -> AsyncIterator[tuple[DiskStoreService, RemoteStoreService]]:
    """A disk store and a remote store on their own connections to `mesh`'s NATS (their domains map: the one
    beside the credentials the mesh provisions them, unless `domains_file` names another)."""
    assert mesh.nats_url is not None
    suffix = os.urandom(3).hex()
    disk = DiskStoreService(DiskStoreOptions(root=tmp_path / "disk", capacity_bytes=GB, store_id=f"disk-fl{suffix}",
                                             nats_url=mesh.nats_url, fsync=False, bounds=bounds,
                                             domains_file=domains_file), heartbeat_interval=60.0)
    remote = RemoteStoreService(RemoteStoreOptions(store_id=f"remote-fl{suffix}", capacity_bytes=GB,
                                                   nats_url=mesh.nats_url, stream_host="127.0.0.1",
                                                   heartbeat_interval=60.0, bounds=bounds,
                                                   domains_file=domains_file))
    await disk.start()
    try:
        await remote.start()
        try:
            yield disk, remote
        finally:
            await remote.stop()
    finally:
        await disk.stop()


@pytest.fixture
async def stores(mesh: LocalMesh, tmp_path: Path) -> AsyncIterator[tuple[DiskStoreService, RemoteStoreService]]:
    """Both stores, started once tenants A and B have their credentials (so the domains map lists them)."""
    mesh.auth(TENANT_A), mesh.auth(TENANT_B)
    async with both_stores(mesh, tmp_path) as started:
        yield started


async def start_flood(mesh: LocalMesh, store_ids: list[str]) -> tuple[asyncio.subprocess.Process, int]:
    """Tenant B's flood, running once this returns; the size of each put."""
    auth = mesh.auth(Principal.engine("tenant-b"))
    assert auth is not None and auth.user and auth.password
    caller = Principal.engine("tenant-b").producer("tenant-b")
    env = {**os.environ, "FLOOD_USER": auth.user, "FLOOD_PASSWORD": auth.password, "FLOOD_BYTES": str(FLOOD_BYTES),
           "FLOOD_CONNECTIONS": str(FLOOD_CONNECTIONS)}
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", FLOOD, str(mesh.nats_url), caller,
                                                   *store_ids, stdin=asyncio.subprocess.PIPE,
                                                   stdout=asyncio.subprocess.PIPE, env=env)
    assert process.stdout is not None
    # Its start pushes 32 of the largest messages through NATS into stores served by this busy loop: on a loaded
    # machine that alone can take longer than the usual deadline.
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 4 * WAIT_S)).decode().split()
        assert line and line[0] == "flooding", f"the flooder did not start: {line}"
    except BaseException:  # never leave it flooding the machine after the test
        process.kill()
        await process.wait()
        raise
    return process, int(line[1])


async def stop_flood(process: asyncio.subprocess.Process) -> int:
    """End the flood; how many puts B published."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.close()
    try:
        out = (await asyncio.wait_for(process.stdout.read(), WAIT_S)).decode().split()
        assert await asyncio.wait_for(process.wait(), WAIT_S) == 0
    except BaseException:
        process.kill()
        await process.wait()
        raise
    return int(out[-1])


async def test_a_flood_of_the_largest_messages_fails_no_other_principals_request_and_cuts_off_only_its_lane(
        mesh: LocalMesh, stores: tuple[DiskStoreService, RemoteStoreService]) -> None:
    disk, remote = stores
    store_ids = [disk.options.store_id, remote.options.store_id]
    caller_a = TENANT_A.producer("tenant-a")
    nc = await bus.connect(str(mesh.nats_url), "tenant-a", mesh.auth(TENANT_A), first_connect_wait=WAIT_S)

    async def ask(store_id: str, op: str, message: object, reply_type: type) -> Any:
        return await bus.request(nc, protocol.Subjects.store(store_id, op, caller_a), message, reply_type, WAIT_S)

    held = {}  # a chunk of A's at each store before the flood, which A reads during it
    for store_id in store_ids:
        meta, data = chunk(64 * KiB, seed=len(held))
        assert (await ask(store_id, "put", protocol.PutRequest(meta=meta, data=data.tobytes()), protocol.Ack)).ok
        held[store_id] = (meta, data.tobytes())

        async def holds(store_id: str = store_id, key: bytes = meta.key) -> bool:
            reply = await ask(store_id, "contains", protocol.ChunkKeys(keys=[key]), protocol.ContainsReply)
            return reply.prefix == 1

        await wait_until_async(holds, what=f"{store_id} holding A's chunk")

    failures: list[str] = []
    flooder, flood_bytes = await start_flood(mesh, store_ids)
    try:
        for round_ in range(ROUNDS):
            if len(failures) >= 3:  # failing already (each failure may cost a timeout): enough to tell
                break
            for store_id in store_ids:
                meta, data = held[store_id]
                try:
                    new_meta, new_data = chunk(64 * KiB, seed=1000 + round_)
                    put = await ask(store_id, "put", protocol.PutRequest(meta=new_meta, data=new_data.tobytes()),
                                    protocol.Ack)
                    if not put.ok:
                        failures.append(f"{store_id} put: {put}")
                    contains = await ask(store_id, "contains", protocol.ChunkKeys(keys=[meta.key]),
                                         protocol.ContainsReply)
                    if contains.prefix != 1:
                        failures.append(f"{store_id} contains: {contains}")
                    got = await ask(store_id, "get", protocol.GetRequest(key=meta.key), protocol.GetReply)
                    if not got.found or got.data != data:
                        failures.append(f"{store_id} get: found={got.found} error={got.error}")
                    for op in ("pin", "unpin"):
                        reply = await ask(store_id, op, protocol.ChunkKeys(keys=[meta.key]), protocol.CommandReply)
                        if not (reply.ok and reply.num_chunks == 1):
                            failures.append(f"{store_id} {op}: {reply}")
                    stats = await ask(store_id, "stats", protocol.StatsRequest(), protocol.StatsReply)
                    if stats.store_id != store_id:
                        failures.append(f"{store_id} stats: {stats}")
                except Exception as exc:  # a request with no answer (timeout, no responders) is a failure too
                    failures.append(f"{store_id} round {round_}: {type(exc).__name__}: {exc}")
    finally:
        published = await stop_flood(flooder)
    assert published > 4 * len(store_ids), "B's flood ran the whole time"
    assert failures == [], f"tenant A's requests failed during B's flood of {flood_bytes}-byte messages"
    # The flood may outrun B's lanes (nats-server then cuts one off; it reconnects), never another connection
    cut_off = [line for line in slow_consumers(mesh) if any(store_id in line for store_id in store_ids)]
    assert [line for line in cut_off if f':{TENANT_B.name}"' not in line] == []
    for service in (disk, remote):
        endpoint = service.endpoint
        assert sorted(endpoint.lanes) == [TENANT_A.path, TENANT_B.path] and endpoint.shared is None
        assert [lost(endpoint.nc), lost(endpoint.lanes[TENANT_A.path].nc)] == [0, 0], "a store connection not B's"
        stats = await ask(service.options.store_id, "stats", protocol.StatsRequest(), protocol.StatsReply)
        assert stats.details["lanes"] == 2 and set(stats.details["lane_disconnects"]) <= {TENANT_B.path}
    await nc.close()
    # and B is served again once its flood is over
    nc_b = await bus.connect(str(mesh.nats_url), "tenant-b-after", mesh.auth(TENANT_B), first_connect_wait=WAIT_S)
    caller_b = TENANT_B.producer("tenant-b")
    try:
        for store_id in store_ids:
            meta, data = chunk(16 * KiB, seed=77)

            async def served(store_id: str = store_id) -> bool:
                try:
                    put = await bus.request(nc_b, protocol.Subjects.store(store_id, "put", caller_b),
                                            protocol.PutRequest(meta=meta, data=data.tobytes()), protocol.Ack, WAIT_S)
                    got = await bus.request(nc_b, protocol.Subjects.store(store_id, "get", caller_b),
                                            protocol.GetRequest(key=meta.key), protocol.GetReply, WAIT_S)
                except Exception:  # B's lane still reconnecting
                    return False
                return put.ok and got.found and got.data == data.tobytes()

            await wait_until_async(served, what=f"{store_id} serving B after its flood")
    finally:
        await nc_b.close()


async def test_lanes_follow_the_domains_map(mesh: LocalMesh, tmp_path: Path) -> None:
    """--max-lanes 1: the first principal gets a lane, the others share one connection, each subscribed by its own
    subjects (a wildcard there would also take the laned principal's flood); a principal added later is served
    once the map lists it; one removed loses its lane, and the next takes it."""
    tenants = [Principal.engine(f"tenant-{name}") for name in "acde"]
    clients = {}
    for tenant in tenants[:3]:
        mesh.auth(tenant)
    async with both_stores(mesh, tmp_path, StoreBounds(max_lanes=1)) as (disk, remote):
        store_ids = [disk.options.store_id, remote.options.store_id]
        endpoints = [disk.endpoint, remote.endpoint]
        for endpoint in endpoints:
            assert list(endpoint.lanes) == [tenants[0].path]
            assert endpoint.shared is not None and sorted(endpoint.shared.subscriptions) == [tenants[1].path,
                                                                                            tenants[2].path]
            subjects = [sub.subject for subs in endpoint.shared.subscriptions.values() for sub in subs]
            assert subjects and all(subject.endswith((f".{tenants[1].path}.*", f".{tenants[2].path}.*"))
                                    for subject in subjects)
        try:
            for tenant in tenants:
                clients[tenant] = await bus.connect(str(mesh.nats_url), tenant.name, mesh.auth(tenant),
                                                    first_connect_wait=WAIT_S)  # tenant-e is added here
            for tenant, client in clients.items():
                for store_id in store_ids:
                    await wait_until_async(lambda: answered(client, store_id, tenant.producer("w0")),
                                           what=f"{store_id} answering {tenant.path}")
            operator = await bus.connect(str(mesh.nats_url), "operator", mesh.auth(protocol.OPERATOR),
                                         first_connect_wait=WAIT_S)
            try:  # the operator's ops come on the store's main connection
                for store_id in store_ids:
                    stats = await bus.request(operator, protocol.Subjects.store(store_id, "stats",
                                                                                protocol.OPERATOR.path),
                                              protocol.StatsRequest(), protocol.StatsReply, WAIT_S)
                    assert (stats.details["lanes"], stats.details["lane_shared_principals"]) == (1, 3)
            finally:
                await operator.close()
            # the administrator takes tenant-a out of the map: its lane closes, tenant-c's opens
            assert mesh.credentials is not None
            domains_file = mesh.credentials.domains_file
            domains = json.loads(domains_file.read_text())
            del domains[tenants[0].path]
            domains_file.write_text(json.dumps(domains))
            for endpoint in endpoints:
                await wait_until_async(lambda: list(endpoint.lanes) == [tenants[1].path] and endpoint.shared
                                       is not None and sorted(endpoint.shared.subscriptions) == [
                                           tenants[2].path, tenants[3].path], what="tenant-c's lane")
            for store_id in store_ids:
                assert not await answered(clients[tenants[0]], store_id, tenants[0].producer("w0"))
                for tenant in tenants[1:]:
                    await wait_until_async(lambda: answered(clients[tenant], store_id, tenant.producer("w0")),
                                           what=f"{store_id} answering {tenant.path}")
        finally:
            for client in clients.values():
                await client.close()


async def test_a_principal_moving_to_its_own_lane_has_every_request_answered(mesh: LocalMesh, tmp_path: Path) -> None:
    """--max-lanes 1: tenant-c is served on the shared connection until tenant-a leaves the map, then on a lane
    of its own. Requests tenant-c keeps sending meanwhile (32 in flight at any time) are each answered: none
    finds no responder between its two subscriptions, none is dropped with what the old one still held."""
    tenant_a, tenant_c = Principal.engine("tenant-a"), Principal.engine("tenant-c")
    for tenant in (tenant_a, tenant_c):
        mesh.auth(tenant)
    async with both_stores(mesh, tmp_path, StoreBounds(max_lanes=1)) as (disk, _remote):
        store_id, endpoint, caller = disk.options.store_id, disk.endpoint, tenant_c.producer("w0")
        nc = await bus.connect(str(mesh.nats_url), tenant_c.name, mesh.auth(tenant_c), first_connect_wait=WAIT_S)
        try:
            await wait_until_async(lambda: answered(nc, store_id, caller), what="the store answering tenant-c")
            assert endpoint.shared is not None and list(endpoint.shared.subscriptions) == [tenant_c.path]
            moved, unanswered, asked = asyncio.Event(), [], [0]

            async def keep_asking() -> None:
                while not moved.is_set():
                    asked[0] += 1
                    if not await answered(nc, store_id, caller):
                        unanswered.append(asked[0])

            askers = [asyncio.create_task(keep_asking()) for _ in range(32)]
            assert mesh.credentials is not None
            domains = json.loads(mesh.credentials.domains_file.read_text())
            del domains[tenant_a.path]
            mesh.credentials.domains_file.write_text(json.dumps(domains))
            await wait_until_async(lambda: list(endpoint.lanes) == [tenant_c.path] and endpoint.shared is None,
                                   what="tenant-c on its own lane, the shared connection retired")
            before = asked[0]
            await wait_until_async(lambda: asked[0] > before + 64, what="requests on the new lane")
            moved.set()
            await asyncio.gather(*askers)
            assert not unanswered, f"{len(unanswered)} of {asked[0]} requests unanswered"
        finally:
            await nc.close()


async def test_a_store_whose_map_lists_no_engine_serves_every_engine_on_one_shared_connection(
        mesh: LocalMesh, tmp_path: Path) -> None:
    """A NATS whose users were made by hand: no domains map (or one that lists no engine). Every engine is served,
    by wildcard, on one connection apart from the store's main one (a flood there can cut off the others)."""
    async with both_stores(mesh, tmp_path, domains_file=tmp_path / "no-domains.json") as (disk, remote):
        nc = await bus.connect(str(mesh.nats_url), "tenant-a", mesh.auth(TENANT_A), first_connect_wait=WAIT_S)
        try:
            for service in (disk, remote):
                endpoint = service.endpoint
                assert endpoint.lanes == {} and endpoint.shared is not None
                assert list(endpoint.shared.subscriptions) == ["engine.>"]  # every engine's path
                assert await answered(nc, service.options.store_id, TENANT_A.producer("w0"))
                stats = await bus.request(nc, protocol.Subjects.store(service.options.store_id, "stats",
                                                                      TENANT_A.producer("w0")),
                                          protocol.StatsRequest(), protocol.StatsReply, WAIT_S)
                assert (stats.details["lanes"], stats.details["lane_shared_principals"]) == (0, -1)
        finally:
            await nc.close()
