"""The remote store's stream port bounds (issue 13): a cap on open connections, the hello's deadline and size,
the idle timeout of greeted connections, the size a put may announce, and room made only as a put's bytes
arrive. Store in this test's event loop on a real nats-server; the attacker
is a plain TCP connection, the victim a real RemoteStoreClient that must keep putting and getting.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import AsyncIterator

import numpy as np
import pytest

from kvmesh.shared import protocol

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.services.remote_store.options import RemoteStoreOptions, build_parser, options_from_args
from kvmesh.services.remote_store.service import RemoteStoreService
from kvmesh.services.remote_store.store import RESERVE_STEP
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.wire.stream_wire import (
    OP_HELLO,
    OP_PUT,
    REQUEST_HEAD,
    recv_reply,
    send_request,
    tune_socket,
)

from support.remote_store import ENGINE, MiB, chunk
from support.waiting import WAIT_S, wait_until_async

Store = tuple[RemoteStoreService, RemoteStoreClient]


@pytest.fixture(scope="module")
def nats_url() -> str:
    with EmbeddedNats() as server:
        yield server.url


async def open_store(nats_url: str, **options: object) -> tuple[RemoteStoreService, RemoteStoreClient, object]:
    service = RemoteStoreService(RemoteStoreOptions(
        store_id=f"bounds{os.urandom(3).hex()}", capacity_bytes=16 * MiB, nats_url=nats_url,
        stream_host="127.0.0.1", heartbeat_interval=60.0, **options))
    await service.start()
    nc = await bus.connect(nats_url, "test-bounds")
    client = RemoteStoreClient(nc, [service.options.store_id], ENGINE, request_timeout=WAIT_S)
    return service, client, nc


@pytest.fixture
async def store_factory(nats_url: str) -> AsyncIterator:
    opened: list[tuple[RemoteStoreService, RemoteStoreClient, object]] = []

    async def make(**options: object) -> Store:
        opened.append(await open_store(nats_url, **options))
        return opened[-1][0], opened[-1][1]

    yield make
    for service, client, nc in opened:
        await client.close()
        await nc.close()
        await service.stop()


async def round_trip(client: RemoteStoreClient, seed: int) -> None:
    meta, data = chunk(1 * MiB + seed, seed)
    assert await client.put(meta, ChunkBuffer(memoryview(data)))
    out = np.zeros(meta.nbytes, dtype=np.uint8)
    got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
    assert got is not None and np.array_equal(out, data)


async def closed_by_store(reader: asyncio.StreamReader) -> bool:
    """True once the store closed the connection (EOF or reset), without a byte of answer."""
    try:
        return await asyncio.wait_for(reader.read(1), WAIT_S) == b""
    except ConnectionResetError:
        return True


async def test_connections_past_the_cap_are_closed_while_a_client_keeps_working(store_factory) -> None:
    service, client = await store_factory(max_stream_connections=4, stream_hello_timeout=WAIT_S * 4)
    await round_trip(client, 1)  # the client's kept connection: one of the 4
    port = service.stream.port
    stalled = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    await wait_until_async(lambda: service.stream.connection_count == 4, what="4 connections open")
    extra = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
    for reader, _ in extra:
        assert await closed_by_store(reader)
    await wait_until_async(lambda: service.stream.counters["stream_refused_over_cap"] == 5, what="5 refused")
    assert service.stream.connection_count == 4
    for seed in range(2, 5):  # on its kept connection, which the cap never touched
        await round_trip(client, seed)
    (stats,) = await client.stats()
    assert stats.details["stream_refused_over_cap"] == 5 and stats.details["stream_connections"] == 4
    for _, writer in stalled + extra:
        writer.close()


async def test_a_silent_or_half_greeted_connection_is_closed_after_the_hello_timeout(store_factory) -> None:
    service, client = await store_factory(stream_hello_timeout=0.2)
    silent, _ = await asyncio.open_connection("127.0.0.1", service.stream.port)
    half, half_writer = await asyncio.open_connection("127.0.0.1", service.stream.port)
    half_writer.write(REQUEST_HEAD.pack(OP_HELLO, 64) + b"x" * 10)  # a hello that never finishes
    assert await closed_by_store(silent) and await closed_by_store(half)
    await wait_until_async(lambda: service.stream.counters["stream_hello_timeouts"] == 2, what="2 timeouts")
    await round_trip(client, 1)  # a real client greets in time


async def test_an_oversized_hello_is_refused_before_it_is_read(store_factory) -> None:
    service, client = await store_factory(stream_hello_max_bytes=256)
    reader, writer = await asyncio.open_connection("127.0.0.1", service.stream.port)
    writer.write(REQUEST_HEAD.pack(OP_HELLO, 512 * 1024))  # under the message cap, over the hello's
    assert await closed_by_store(reader)
    assert service.stream.counters["stream_hellos_too_large"] == 1
    await round_trip(client, 1)
    (stats,) = await client.stats()
    assert stats.details["stream_hellos_too_large"] == 1


async def test_an_idle_kept_connection_is_closed_and_the_client_reconnects(store_factory) -> None:
    service, client = await store_factory(stream_idle_timeout=0.2)
    meta, data = chunk(2 * MiB, 7)
    assert await client.put(meta, ChunkBuffer(memoryview(data)))
    await wait_until_async(lambda: service.stream.counters["stream_idle_closed"] >= 1
                           and service.stream.connection_count == 0, what="the kept connection closed")
    out = np.zeros(meta.nbytes, dtype=np.uint8)
    got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))  # on the closed kept one, then a new one
    assert got is not None and np.array_equal(out, data)
    await wait_until_async(lambda: service.stream.counters["stream_idle_closed"] >= 2
                           and service.stream.connection_count == 0, what="the new one closed too")
    await round_trip(client, 8)  # a put on a closed kept connection reconnects as well


def test_bounds_are_flags_that_round_trip_and_must_be_positive() -> None:
    options = RemoteStoreOptions(store_id="remote-0", capacity_bytes=MiB, max_stream_connections=7,
                                 stream_hello_timeout=1.5, stream_hello_max_bytes=300, stream_idle_timeout=9.0)
    parsed = options_from_args(build_parser().parse_args(options.to_args()))
    assert (parsed.max_stream_connections, parsed.stream_hello_timeout, parsed.stream_hello_max_bytes,
            parsed.stream_idle_timeout) == (7, 1.5, 300, 9.0)
    defaults = options_from_args(build_parser().parse_args([]))
    assert (defaults.max_stream_connections, defaults.stream_hello_timeout, defaults.stream_hello_max_bytes,
            defaults.stream_idle_timeout) == (256, 10.0, 4096, 300.0)
    for flag in ("--max-stream-connections", "--stream-hello-timeout", "--stream-hello-max-bytes",
                 "--stream-idle-timeout"):
        with pytest.raises(ConfigError, match=flag):
            options_from_args(build_parser().parse_args([flag, "0"]))


# ---- what a put's header may claim --------------------------------------------------------------------------
async def greeted(service: RemoteStoreService) -> socket.socket:
    """A raw stream connection that presented a valid ticket (as ENGINE), ready for requests."""
    sock = socket.create_connection(("127.0.0.1", service.stream.port))
    tune_socket(sock)
    await send_request(sock, OP_HELLO, protocol.StreamHello(ticket=service.stream.issue_ticket(ENGINE), client="raw"))
    assert (await recv_reply(sock, protocol.Ack)).ok
    return sock


async def test_a_put_announcing_more_than_max_chunk_bytes_is_refused_before_its_bytes(store_factory) -> None:
    service, client = await store_factory(max_chunk_bytes=4 * MiB)
    meta, _ = chunk(4 * MiB + 1, 3)
    sock = await greeted(service)
    try:
        await send_request(sock, OP_PUT, protocol.PutRequest(meta=meta))  # and not one byte of the chunk
        reply = await asyncio.wait_for(recv_reply(sock, protocol.Ack), WAIT_S)
        assert not reply.ok and "--max-chunk-bytes" in reply.error and str(4 * MiB + 1) in reply.error
        assert await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), WAIT_S) == b""  # closed
    finally:
        sock.close()
    assert service.stream.counters["stream_puts_too_large"] == 1
    assert service.store.index.reserved_bytes == 0
    await round_trip(client, 1)


async def test_a_put_makes_room_only_as_its_bytes_arrive(store_factory) -> None:
    service, client = await store_factory()
    capacity = service.options.capacity_bytes
    size = RESERVE_STEP // 2
    held = [chunk(size, seed) for seed in range((capacity - RESERVE_STEP) // size)]  # room left: one step
    for meta, data in held:
        assert await client.put(meta, ChunkBuffer(memoryview(data)))
    index = service.store.index
    claim, data = chunk(capacity, 9)  # the whole capacity, announced
    sock = await greeted(service)
    try:
        await send_request(sock, OP_PUT, protocol.PutRequest(meta=claim))
        await wait_until_async(lambda: index.in_flight_count == 1, what="the put begun")
        assert len(index) == len(held) and index.reserved_bytes == RESERVE_STEP  # room for the first step only
        await asyncio.get_running_loop().sock_sendall(sock, memoryview(data)[:RESERVE_STEP + 1])
        await wait_until_async(lambda: index.reserved_bytes == 2 * RESERVE_STEP, what="room for the second step")
        # a step's worth evicted for bytes that arrived, not everything for a size claimed
        assert len(index) == len(held) - RESERVE_STEP // size
    finally:
        sock.close()  # the rest never comes: the put is aborted and gives its room back
    await wait_until_async(lambda: index.in_flight_count == 0 and index.reserved_bytes == 0, what="put aborted")
    assert [held_meta.key in index for held_meta, _ in held] == [False, False] + [True] * (len(held) - 2)
    assert await client.put(claim, ChunkBuffer(memoryview(data)))  # a whole put of the capacity still works
    out = np.zeros(claim.nbytes, dtype=np.uint8)
    assert await client.get_into(claim.key, ChunkBuffer(memoryview(out))) is not None and np.array_equal(out, data)
