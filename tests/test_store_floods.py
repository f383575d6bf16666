"""Data floods never starve control (issue 24, finding 5): one principal's flood of the largest inline puts its
credentials let it send must neither get a store cut off by nats-server as a slow consumer nor fail another
principal's requests.

Real parts only: the NATS that KVMesh starts (its generated settings, users and per-principal permissions), a
disk store and a remote store in this test's event loop on their own connections, tenant B flooding from another
process (so it publishes as fast as a process can, whatever this loop does), tenant A asking both stores from
this loop while the flood runs. The flood runs from before A's first request until after its last, by
construction: B stops only when told to.

A Python reader can be outrun by enough publishers of large messages, so the flood may still get a store's bulk
connection (its puts) cut off; the test asserts what the stores promise: A's gets, contains, pins, unpins and
stats all answered, their control connections never cut off, and puts taken again once the flood is over.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import pytest

from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.service import DiskStoreService
from kvmesh.services.remote_store.options import RemoteStoreOptions
from kvmesh.services.remote_store.service import RemoteStoreService
from kvmesh.shared import bus, protocol
from kvmesh.shared.config import GB
from kvmesh.shared.local_mesh import LocalMesh
from kvmesh.shared.protocol import Principal

from test_remote_store import MiB, chunk
from waiting import WAIT_S, wait_until_async

KiB = 1024
FLOOD_BYTES = 40 * MiB  # the flood; B sends less if its connection's max_payload says so
FLOOD_CONNECTIONS = 4  # B's connections, each publishing as fast as it can
ROUNDS = 100  # tenant A's rounds of contains / get / pin / unpin / stats at each store

# Tenant B: the largest inline puts NATS lets it publish (up to 40 MiB), to every store named, round robin, until
# its stdin closes. It prints "flooding" once its first puts are out, and at the end how many it published.
FLOOD = """
import asyncio, os, sys
import numpy as np
from kvmesh.shared import bus, chunk_file, protocol

async def flood(url, caller, store_ids):
    auth = bus.NatsAuth(user=os.environ["FLOOD_USER"], password=os.environ["FLOOD_PASSWORD"])
    connections = [await bus.connect(url, f"flooder-{i}", auth, first_connect_wait=30)
                   for i in range(int(os.environ["FLOOD_CONNECTIONS"]))]
    nbytes = min(int(os.environ["FLOOD_BYTES"]), connections[0].max_payload - protocol.INLINE_HEADROOM)
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    meta = protocol.ChunkMeta(key=os.urandom(16), num_tokens=256, shape=[nbytes], dtype="uint8", fmt="test",
                              nbytes=nbytes, checksum=chunk_file.checksum(data))
    payload = protocol.encode(protocol.PutRequest(meta=meta, data=data.tobytes()))  # one put, sent again and again
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin, stop.set)  # EOF on stdin: the test is done
    sent = [0]

    async def ignore(msg):  # the stores' answers: read and dropped
        pass

    async def publish(nc):
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=ignore)
        while not stop.is_set():
            await nc.publish(protocol.Subjects.store(store_ids[sent[0] % len(store_ids)], "put", caller), payload,
                             reply=inbox)
            sent[0] += 1
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(publish(nc)) for nc in connections]
    while sent[0] < 2 * len(connections) * len(store_ids):
        await asyncio.sleep(0.01)
    print("flooding", nbytes, flush=True)
    await asyncio.gather(*tasks)
    for nc in connections:
        await nc.close()
    print("sent", sent[0], flush=True)

asyncio.run(flood(sys.argv[1], sys.argv[2], sys.argv[3:]))
"""


@pytest.fixture
def mesh() -> Iterator[LocalMesh]:
    local = LocalMesh([])
    local.start_nats()
    yield local
    local.stop()


def slow_consumers(mesh: LocalMesh) -> list[str]:
    """nats-server's log lines about slow consumers (the server cutting a client off or about to)."""
    assert mesh._nats is not None and mesh._nats._workdir is not None
    log_file = Path(mesh._nats._workdir.name) / "nats.log"
    return [line for line in log_file.read_text(errors="replace").splitlines() if "slow consumer" in line.lower()]


def lost(nc: Any) -> int:
    """How often `nc` lost its connection: its reconnects, and 1 if it is down now."""
    return nc.stats["reconnects"] + (0 if nc.is_connected else 1)


@pytest.fixture
async def stores(mesh: LocalMesh, tmp_path: Path) -> AsyncIterator[tuple[DiskStoreService, RemoteStoreService]]:
    assert mesh.nats_url is not None
    suffix = os.urandom(3).hex()
    disk = DiskStoreService(DiskStoreOptions(root=tmp_path / "disk", capacity_bytes=GB, store_id=f"disk-fl{suffix}",
                                             nats_url=mesh.nats_url, fsync=False), heartbeat_interval=60.0)
    remote = RemoteStoreService(RemoteStoreOptions(store_id=f"remote-fl{suffix}", capacity_bytes=GB,
                                                   nats_url=mesh.nats_url, stream_host="127.0.0.1",
                                                   heartbeat_interval=60.0))
    await disk.start()
    try:
        await remote.start()
        try:
            yield disk, remote
        finally:
            await remote.stop()
    finally:
        await disk.stop()


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
    line = (await asyncio.wait_for(process.stdout.readline(), WAIT_S)).decode().split()
    assert line and line[0] == "flooding", f"the flooder did not start: {line}"
    return process, int(line[1])


async def stop_flood(process: asyncio.subprocess.Process) -> int:
    """End the flood; how many puts B published."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.close()
    out = (await asyncio.wait_for(process.stdout.read(), WAIT_S)).decode().split()
    assert await asyncio.wait_for(process.wait(), WAIT_S) == 0
    return int(out[-1])


async def test_a_flood_of_the_largest_inline_puts_fails_no_other_request_and_cuts_off_no_store(
        mesh: LocalMesh, stores: tuple[DiskStoreService, RemoteStoreService]) -> None:
    disk, remote = stores
    store_ids = [disk.options.store_id, remote.options.store_id]
    tenant_a = Principal.engine("tenant-a")
    caller_a = tenant_a.producer("tenant-a")
    nc = await bus.connect(str(mesh.nats_url), "tenant-a", mesh.auth(tenant_a), first_connect_wait=WAIT_S)

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
            for store_id in store_ids:
                meta, data = held[store_id]
                try:
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
        await nc.close()
    assert published > 2 * len(store_ids), "B's flood ran the whole time"
    assert failures == [], f"tenant A's requests failed during B's flood of {flood_bytes}-byte puts"
    # The flood may outrun the stores' bulk connections (nats-server then cuts one off; it reconnects), never
    # the connections that carry every other op
    control = [f'"{service}:{store_id}"' for service, store_id in (("disk_store", store_ids[0]),
                                                                  ("remote_store", store_ids[1]))]
    assert [line for line in slow_consumers(mesh) if any(name in line for name in control)] == []
    assert [lost(disk.nc), lost(remote.nc)] == [0, 0], "a store's control connection was cut off"
    # and the bulk connections serve puts again once the flood is over
    for store_id in store_ids:
        meta, data = chunk(16 * KiB, seed=77)

        async def put_ok(store_id: str = store_id) -> bool:
            try:
                reply = await bus.request(nc_after, protocol.Subjects.store(store_id, "put", caller_a),
                                          protocol.PutRequest(meta=meta, data=data.tobytes()), protocol.Ack, WAIT_S)
            except Exception:  # the bulk connection still reconnecting
                return False
            return reply.ok

        nc_after = await bus.connect(str(mesh.nats_url), "tenant-a-after", mesh.auth(tenant_a),
                                     first_connect_wait=WAIT_S)
        try:
            await wait_until_async(put_ok, what=f"{store_id} taking A's put after the flood")
        finally:
            await nc_after.close()
