"""The remote store's test parts (tests/stores/): stores in the test's event loop on a module's nats-server
(`nats_url`, `start_stores`, `one_store`) and random chunks (`chunk`)."""

from __future__ import annotations

import os
from typing import AsyncIterator

import numpy as np
import pytest

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.services.remote_store.options import RemoteStoreOptions
from kvmesh.services.remote_store.service import RemoteStoreService
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.wire import chunk_file

from support.waiting import WAIT_S

MiB = 1024 * 1024
ENGINE = protocol.Principal.engine("test").producer("w0")  # the caller path the tests' clients send as


@pytest.fixture(scope="module")
def nats_url() -> str:
    with EmbeddedNats() as server:
        yield server.url


def chunk(nbytes: int, seed: int, num_tokens: int = 256, key: bytes | None = None) -> tuple[protocol.ChunkMeta, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    meta = protocol.ChunkMeta(key=key or os.urandom(16), num_tokens=num_tokens, shape=[nbytes], dtype="uint8",
                              fmt="test", nbytes=nbytes, checksum=chunk_file.checksum(memoryview(data)))
    return meta, data


async def start_stores(nats_url: str, prefix: str, partitions: int = 1, capacity: int = 64 * MiB,
                       **options: object) -> tuple[list[RemoteStoreService], object]:
    services = []
    for partition in range(partitions):
        service = RemoteStoreService(RemoteStoreOptions(
            store_id=f"{prefix}-{partition}", capacity_bytes=capacity, nats_url=nats_url, partition=partition,
            num_partitions=partitions, stream_host="127.0.0.1", heartbeat_interval=60.0, **options))
        await service.start()
        services.append(service)
    nc = await bus.connect(nats_url, f"test-{prefix}", options.get("auth"))  # the stores' credentials and TLS
    return services, nc


@pytest.fixture
async def one_store(nats_url: str) -> AsyncIterator[tuple[RemoteStoreService, RemoteStoreClient]]:
    prefix = f"rs{os.urandom(3).hex()}"
    services, nc = await start_stores(nats_url, prefix, capacity=8 * MiB)
    client = RemoteStoreClient(nc, [s.options.store_id for s in services], ENGINE, request_timeout=WAIT_S)
    yield services[0], client
    await client.close()
    await nc.close()
    for service in services:
        await service.stop()
