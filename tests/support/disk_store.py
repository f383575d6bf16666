"""The disk store's test parts (tests/stores/, and the engine tests of pool lending): `Harness`, in-process disk
stores on one directory with a client to the running one, and deterministic chunks (`key_of`, `chunk`)."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.service import DiskStoreService
from kvmesh.services.disk_store.writer import WriteFaults
from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.disk import DiskStoreClient
from kvmesh.services.engine.tiers.pool_lending import Registration, register
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.shm import SharedSegment

from support.waiting import WAIT_S

CHUNK = 64 * 1024
FILE_BYTES = chunk_file.DATA_ALIGN + CHUNK  # header page + data, what a chunk costs against the cap
ENGINE = protocol.Principal.engine("test").producer("w0")  # the caller path the harness's client sends as


def key_of(i: int) -> bytes:
    return hashlib.blake2b(f"chunk-{i}".encode(), digest_size=16).digest()


def chunk(i: int, nbytes: int = CHUNK, checksum: bool = True) -> tuple[protocol.ChunkMeta, bytes]:
    data = hashlib.shake_256(f"data-{i}".encode()).digest(nbytes)
    meta = protocol.ChunkMeta(key=key_of(i), num_tokens=100 + i, shape=[nbytes], dtype="uint8",
                              fmt="test", nbytes=nbytes, checksum=chunk_file.checksum(data) if checksum else 0)
    return meta, data


class Harness:
    """Starts/stops in-process disk stores on one directory and gives a client to the running one."""

    def __init__(self, nc, root: Path) -> None:
        self.nc, self.root = nc, root
        self.store_id = f"disk-{uuid.uuid4().hex[:8]}"
        self.service: DiskStoreService | None = None
        self.client = DiskStoreClient(nc, self.store_id, ENGINE, request_timeout=WAIT_S)
        self.clock: Callable[[], float] = time.monotonic  # the stores' pin TTLs run on it
        self.lent: list[Registration] = []

    async def start(self, capacity: int = 64 * FILE_BYTES, staging_bytes: int = 4 * CHUNK,
                    faults: WriteFaults | None = None, **options_: Any) -> DiskStoreService:
        options = DiskStoreOptions(root=self.root, capacity_bytes=capacity, store_id=self.store_id,
                                   staging_bytes=staging_bytes, fsync=False, **options_)
        self.service = DiskStoreService(options, faults=faults or WriteFaults(), clock=self.clock)
        await self.service.start(self.nc)
        return self.service

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()
            self.service = None

    def client_of(self, caller: str) -> DiskStoreClient:
        """A client sending as `caller` (another engine worker, another tenant)."""
        return DiskStoreClient(self.nc, self.store_id, caller, request_timeout=WAIT_S)

    async def put(self, i: int, nbytes: int = CHUNK, wait: bool = True, client: DiskStoreClient | None = None) -> bool:
        meta, data = chunk(i, nbytes)
        client = client or self.client
        ok = await client.put(meta, ChunkBuffer(view=memoryview(bytearray(data))))
        if wait:
            assert await client.wait_written(timeout=WAIT_S)
        return ok

    async def get(self, i: int, nbytes: int = CHUNK) -> bytes | None:
        out = bytearray(nbytes)
        meta = await self.client.get_into(key_of(i), ChunkBuffer(view=memoryview(out)))
        return None if meta is None else bytes(out[:meta.nbytes])

    async def held(self, *indices: int) -> list[bool]:
        return [await self.client.contains([key_of(i)]) == 1 for i in indices]

    async def lend(self, segment: SharedSegment, caller: str = ENGINE) -> Registration:
        """Lend `segment` to the running store as `caller`, as an engine's client does on its first put; the
        connection closes with the test's end (then the store drops the pool)."""
        registration = await asyncio.to_thread(register, self.store_id, caller, segment, WAIT_S,
                                               bus.server_scope(self.nc))
        self.lent.append(registration)
        return registration

    def request(self, op: str, message: object, reply_type: type, timeout: float = WAIT_S, caller: str = ENGINE):
        return bus.request(self.nc, protocol.Subjects.store(self.store_id, op, caller), message, reply_type, timeout)

    async def wipe(self) -> int:
        """The operator's wipe; the tokens it removed."""
        reply = await self.request("wipe", protocol.WipeRequest(), protocol.CommandReply, caller=protocol.OPERATOR.path)
        assert reply.ok, reply.error
        return reply.num_tokens


@pytest.fixture
async def harness(nc, tmp_path: Path) -> AsyncIterator[Harness]:
    h = Harness(nc, tmp_path / "disk")
    yield h
    await h.client.close()
    for registration in h.lent:
        registration.close()
    await h.stop()
