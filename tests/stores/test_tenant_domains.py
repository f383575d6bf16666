"""Tenants on one mesh, as issue 24 probed them: each tenant an engine principal with its own generated NATS
credentials (`kvmesh credentials --domain`), talking to a real disk store and a real remote store over a real
nats-server, with nothing but what its credentials allow.

Across sharing domains, B cannot unpin A's pins, remove A's chunk, replace A's bytes, pre-plant bytes A will read,
nor see A's chunks (get, contains, the remote store's stream). Within one domain, the documented residual: a
member can pre-plant under a key nobody holds yet (keys are public), but still cannot unpin or remove what another
member holds.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, AsyncIterator

import pytest

from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.service import DiskStoreService
from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.services.remote_store.options import RemoteStoreOptions
from kvmesh.services.remote_store.service import RemoteStoreService
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.credentials import MeshCredentials, local_mesh_dir, server_accepts
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import Principal, Subjects
from kvmesh.shared.wire import chunk_file

from support.store_answers import answered
from support.waiting import WAIT_S, wait_until_async

MiB = 1024 * 1024
NBYTES = 64 * 1024



@pytest.fixture
def mesh(nats_mesh: LocalMesh) -> LocalMesh:
    return nats_mesh


def add_tenant(mesh: LocalMesh, instance: str, domain: str) -> bus.NatsAuth:
    """`kvmesh credentials --domain <domain> engine.<instance>` in the mesh's directory, loaded into its NATS."""
    credentials = MeshCredentials(local_mesh_dir(int(mesh.nats_url.rsplit(":", 1)[1])))
    path = Principal.engine(instance).path
    credentials.ensure(path, domain=domain)
    assert credentials.reload_server()  # returns once the server runs the new user
    auth = bus.NatsAuth.from_file(credentials.file(path))
    host, port = mesh.nats_url.removeprefix("nats://").rsplit(":", 1)
    assert server_accepts(host, int(port), auth), f"NATS refuses {path} after its reload"
    return auth


class Tenant:
    """One engine principal's connection, calling a store's ops as its worker `w0`."""

    def __init__(self, nc: Any, instance: str, store_id: str) -> None:
        self.nc, self.store_id = nc, store_id
        self.caller = Principal.engine(instance).producer("w0")

    async def ask(self, op: str, request: Any, reply_type: type[Any]) -> Any:
        return await bus.request(self.nc, Subjects.store(self.store_id, op, self.caller), request, reply_type, WAIT_S)

    async def put(self, meta: protocol.ChunkMeta, data: bytes) -> protocol.Ack:
        return await self.ask("put", protocol.PutRequest(meta=meta, data=data), protocol.Ack)

    async def get(self, key: bytes) -> bytes | None:
        """The bytes the store serves this tenant for `key` (inline), None on a miss."""
        reply = await self.ask("get", protocol.GetRequest(key=key), protocol.GetReply)
        return reply.data if reply.found else None

    async def contains(self, key: bytes) -> int:
        return (await self.ask("contains", protocol.ChunkKeys(keys=[key]), protocol.ContainsReply)).prefix

    async def command(self, op: str, key: bytes) -> int:
        reply = await self.ask(op, protocol.ChunkKeys(keys=[key]), protocol.CommandReply)
        assert reply.ok, reply.error
        return reply.num_chunks


def chunk(key: bytes, seed: int) -> tuple[protocol.ChunkMeta, bytes]:
    data = bytes([seed]) * NBYTES  # each tenant's bytes differ; the key is the same public one
    return protocol.ChunkMeta(key=key, num_tokens=256, shape=[NBYTES], dtype="uint8", fmt="test", nbytes=NBYTES,
                              checksum=chunk_file.checksum(data)), data


@contextlib.asynccontextmanager
async def store_on(mesh: LocalMesh, kind: str, root: Path) -> AsyncIterator[str]:
    """A disk store or remote store of this test, connected as its own principal (its credentials and the
    domains map beside them come from the mesh's directory, as for a store started by hand); its id."""
    store_id = f"{kind}-{os.urandom(3).hex()}"
    service: Any
    if kind == "disk":
        service = DiskStoreService(DiskStoreOptions(root=root, capacity_bytes=64 * MiB, store_id=store_id,
                                                    nats_url=mesh.nats_url, staging_bytes=0), heartbeat_interval=60)
    else:
        service = RemoteStoreService(RemoteStoreOptions(store_id=store_id, capacity_bytes=64 * MiB,
                                                        nats_url=mesh.nats_url, stream_host="127.0.0.1",
                                                        heartbeat_interval=60.0))
    await service.start()
    try:
        yield store_id
    finally:
        await service.stop()


@contextlib.asynccontextmanager
async def tenants(mesh: LocalMesh, store_id: str, *specs: tuple[str, str]) -> AsyncIterator[list[Tenant]]:
    """One connected Tenant per (instance, domain), each with its own credentials, once the store serves it (a
    store opens a principal's lane when its domains map lists it: within a moment of `kvmesh credentials`)."""
    connections = []
    try:
        for instance, domain in specs:
            auth = add_tenant(mesh, instance, domain)
            connections.append((await bus.connect(mesh.nats_url, f"tenant-{instance}", auth), instance))
        connected = [Tenant(nc, instance, store_id) for nc, instance in connections]
        for tenant in connected:
            await wait_until_async(lambda: answered(tenant.nc, store_id, tenant.caller),
                                   what=f"{store_id} serving {tenant.caller}")
        yield connected
    finally:
        for nc, _ in connections:
            await nc.close()


STORES = ["disk", "remote"]


@pytest.mark.parametrize("kind", STORES)
async def test_another_domain_can_neither_unpin_remove_nor_replace(mesh: LocalMesh, tmp_path: Path,
                                                                     kind: str) -> None:
    key = os.urandom(16)  # a key both can compute: keys are public
    meta_a, data_a = chunk(key, 1)
    meta_b, data_b = chunk(key, 2)
    async with store_on(mesh, kind, tmp_path / "store") as store_id, \
            tenants(mesh, store_id, ("tenant-a", "dom-a"), ("tenant-b", "dom-b")) as (a, b):
        assert (await a.put(meta_a, data_a)).ok
        assert await a.get(key) == data_a
        assert await a.command("pin", key) == 1
        # B sees nothing of A's
        assert await b.get(key) is None and await b.contains(key) == 0
        # B cannot take A's pin, nor remove A's chunk (both answer 0), nor land its own bytes in A's key
        assert await b.command("unpin", key) == 0
        assert await b.command("remove", key) == 0
        refused = await b.put(meta_b, data_b)
        assert not refused.ok and "another sharing domain" in (refused.error or "")
        assert await a.get(key) == data_a and await a.contains(key) == 1
        # the pin is still A's: once A drops its own claim, the chunk lives on until A unpins
        assert await a.command("remove", key) == 1
        assert await a.get(key) == data_a
        assert await a.command("unpin", key) == 1
        assert await a.get(key) is None


@pytest.mark.parametrize("kind", STORES)
async def test_another_domain_cannot_pre_plant(mesh: LocalMesh, tmp_path: Path, kind: str) -> None:
    key = os.urandom(16)
    meta_a, data_a = chunk(key, 1)
    meta_b, data_b = chunk(key, 2)
    async with store_on(mesh, kind, tmp_path / "store") as store_id, \
            tenants(mesh, store_id, ("tenant-a", "dom-a"), ("tenant-b", "dom-b")) as (a, b):
        assert (await b.put(meta_b, data_b)).ok  # B stores under the key A will use, before A does
        assert await b.get(key) == data_b  # B's own chunk, in B's domain
        assert await a.get(key) is None and await a.contains(key) == 0  # A misses: it never reads B's bytes
        # A's own put is refused while B's chunk holds the key (the held chunk is untouched), and lands once
        # B's claim is gone: A then reads A's bytes
        assert not (await a.put(meta_a, data_a)).ok
        assert await b.command("remove", key) == 1
        assert (await a.put(meta_a, data_a)).ok
        assert await a.get(key) == data_a and await b.get(key) is None


async def test_another_domain_misses_on_the_remote_stores_stream(mesh: LocalMesh, tmp_path: Path) -> None:
    key = os.urandom(16)
    meta_a, data_a = chunk(key, 1)
    async with store_on(mesh, "remote", tmp_path / "store") as store_id, \
            tenants(mesh, store_id, ("tenant-a", "dom-a"), ("tenant-b", "dom-b")) as (a, b):
        stream_a = RemoteStoreClient(a.nc, [store_id], a.caller, request_timeout=WAIT_S)
        stream_b = RemoteStoreClient(b.nc, [store_id], b.caller, request_timeout=WAIT_S)
        try:
            assert await stream_a.put(meta_a, ChunkBuffer(memoryview(bytearray(data_a))))
            out = bytearray(NBYTES)
            assert await stream_b.get_into(key, ChunkBuffer(memoryview(out))) is None and out == bytes(NBYTES)
            assert await stream_b.contains([key]) == 0
            assert await stream_a.get_into(key, ChunkBuffer(memoryview(out))) is not None and out == data_a
        finally:
            await stream_a.close()
            await stream_b.close()


@pytest.mark.parametrize("kind", STORES)
async def test_within_one_domain_the_residual(mesh: LocalMesh, tmp_path: Path, kind: str) -> None:
    """Documented residual (docs/security.md): keys are public, so a member of A's domain can put under a key
    nobody holds yet and A then reads those bytes; but it cannot unpin or remove what A holds."""
    planted_key, held_key = os.urandom(16), os.urandom(16)
    meta_m, data_m = chunk(planted_key, 3)
    meta_a, data_a = chunk(held_key, 1)
    async with store_on(mesh, kind, tmp_path / "store") as store_id, \
            tenants(mesh, store_id, ("tenant-a", "dom-a"), ("tenant-m", "dom-a")) as (a, m):
        assert (await m.put(meta_m, data_m)).ok
        assert await a.get(planted_key) == data_m  # the residual: same domain, same key, M's bytes
        assert (await a.put(meta_a, data_a)).ok
        assert await a.command("pin", held_key) == 1
        assert await m.get(held_key) == data_a  # members share what they hold
        assert await m.command("unpin", held_key) == 0
        assert await m.command("remove", held_key) == 0
        assert (await m.put(*chunk(held_key, 3))).ok  # a put of a held key only adds M's claim ...
        assert await a.get(held_key) == data_a  # ... never M's bytes
        assert await a.command("remove", held_key) == 1 and await a.command("unpin", held_key) == 1
        assert await a.get(held_key) == data_a  # M's claim keeps it: A's removal took back only A's own
