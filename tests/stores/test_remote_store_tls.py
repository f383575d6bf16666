"""The remote store's stream port over TLS (--stream-tls-cert/--stream-tls-key): a client trusting the CA puts and
gets bit-exact chunks; a plaintext connection, a client without a CA or trusting another CA, and a TLS client of a
plaintext port are each refused, saying why; a client that ends its session cleanly leaves the port serving; a
certificate rotated on disk serves new connections; after the handshake, a frame that is not the session's closes
the connection, counted and logged."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.services.engine.tiers.remote_stream import StreamConnection
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.tls import TlsMaterial, client_context
from kvmesh.shared.wire.stream_wire import OP_HELLO, StreamError, send_request
from kvmesh.shared.wire.tls_socket import MAX_FRAME_BYTES, TlsSocket

from support.remote_store import ENGINE, MiB, chunk, nats_url, start_stores  # noqa: F401 (fixtures)
from support.tls import der, reissue, served_certificate
from support.waiting import WAIT_S, wait_until_async


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    material = TlsMaterial(tmp_path_factory.mktemp("tls") / "tls")
    material.ensure(["remote-store"], hosts=["127.0.0.1"])
    return material


@pytest.fixture
async def tls_store(nats_url: str, material: TlsMaterial):
    files = material.files("remote-store")
    services, nc = await start_stores(nats_url, f"rt{os.urandom(3).hex()}", capacity=16 * MiB,
                                      stream_tls_cert=files.cert, stream_tls_key=files.key)
    yield services[0], nc
    await nc.close()
    for service in services:
        await service.stop()


async def offer(nc, store_id: str) -> protocol.StreamOffer:
    return await bus.request(nc, protocol.Subjects.store(store_id, "stream", ENGINE),
                             protocol.StreamRequest(client="test"), protocol.StreamOffer, WAIT_S)


async def test_a_client_trusting_the_ca_puts_and_gets_bit_exact_over_tls(tls_store, material: TlsMaterial) -> None:
    service, nc = tls_store
    client = RemoteStoreClient(nc, [service.options.store_id], ENGINE, request_timeout=WAIT_S,
                               tls=client_context(material.ca))
    try:
        chunks = [chunk(n, seed) for seed, n in enumerate([1, 70_000, 3 * MiB + 5])]
        for meta, data in chunks:
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
        for meta, data in chunks:
            out = np.zeros(meta.nbytes, dtype=np.uint8)
            got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
            assert got is not None and got.checksum == meta.checksum and np.array_equal(out, data)
        assert service.stream.counters["stream_tls_refused"] == 0
        async with client._replicas[0].pool.connection(WAIT_S) as connection:
            assert connection.sock.version() in ("TLSv1.2", "TLSv1.3")  # the pool's connections are TLS
    finally:
        await client.close()


async def test_a_client_without_the_ca_or_with_another_ca_is_refused(tls_store, tmp_path: Path) -> None:
    service, nc = tls_store
    given = await offer(nc, service.options.store_id)
    assert given.tls
    with pytest.raises(StreamError, match="takes TLS connections only, and no CA is configured"):
        await StreamConnection.open(given, "test")
    other = TlsMaterial(tmp_path / "other").ensure(["remote-store"], hosts=["127.0.0.1"])["remote-store"].ca
    with pytest.raises(StreamError, match="not signed by the trusted CA"):
        await StreamConnection.open(await offer(nc, service.options.store_id), "test", client_context(other))
    await wait_until_async(lambda: service.stream.counters["stream_tls_refused"] >= 1,
                           what="the store counting the refused handshake")


async def test_a_plaintext_connection_with_a_valid_ticket_is_refused(tls_store,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    service, nc = tls_store
    given = await offer(nc, service.options.store_id)
    loop = asyncio.get_running_loop()
    with socket.create_connection((given.host, given.port), timeout=WAIT_S) as sock:
        sock.setblocking(False)
        await send_request(sock, OP_HELLO, protocol.StreamHello(ticket=given.ticket, client="plain"))
        answer = await asyncio.wait_for(loop.sock_recv(sock, 64), WAIT_S)
    assert answer == b""  # closed: no Ack, the ticket never read
    await wait_until_async(lambda: service.stream.counters["stream_tls_refused"] >= 1,
                           what="the store counting the refused handshake")
    assert any("does not speak TLS" in record.getMessage() for record in caplog.records)


async def test_a_tls_client_refuses_a_plaintext_stream_port(nats_url: str, material: TlsMaterial) -> None:
    services, nc = await start_stores(nats_url, f"rp{os.urandom(3).hex()}", capacity=8 * MiB)
    try:
        given = await offer(nc, services[0].options.store_id)
        with pytest.raises(StreamError, match="plaintext stream port, and TLS is configured"):
            await StreamConnection.open(given, "test", client_context(material.ca))
    finally:
        await nc.close()
        await services[0].stop()


async def test_a_rotated_certificate_serves_new_stream_connections(nats_url: str, tmp_path: Path) -> None:
    """The stream port's certificate and key replaced on disk (the same CA): new connections are served the new
    certificate without a restart; the client's connection from before goes on."""
    material = TlsMaterial(tmp_path / "tls")
    files = material.ensure(["remote-store"], hosts=["127.0.0.1"])["remote-store"]
    assert files.cert is not None
    services, nc = await start_stores(nats_url, f"rr{os.urandom(3).hex()}", capacity=8 * MiB,
                                      stream_tls_cert=files.cert, stream_tls_key=files.key)
    store_id = services[0].options.store_id
    client = RemoteStoreClient(nc, [store_id], ENGINE, request_timeout=WAIT_S, tls=client_context(material.ca))
    try:
        meta, data = chunk(70_000, 1)
        assert await client.put(meta, ChunkBuffer(memoryview(data)))  # its pooled connection is up from here
        port = (await offer(nc, store_id)).port
        assert await served_certificate(port, material.ca) == der(files.cert)
        rotated = reissue(material, "remote-store", ["127.0.0.1"])
        assert await served_certificate(port, material.ca) == rotated
        out = np.zeros(meta.nbytes, dtype=np.uint8)
        got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
        assert got is not None and np.array_equal(out, data)
        assert services[0].stream.counters["stream_tls_refused"] == 0
    finally:
        await client.close()
        await nc.close()
        await services[0].stop()


async def test_a_client_that_closes_its_tls_session_cleanly_leaves_the_port_serving(tls_store,
                                                                                     material: TlsMaterial) -> None:
    """A client that ends its TLS session with a close_notify before its hello (as a TLS library's close does): the
    store's read of the hello ends there (it used to read 0 bytes forever, its loop stuck) and it serves on."""
    service, nc = tls_store
    port = (await offer(nc, service.options.store_id)).port
    for _ in range(2):
        await served_certificate(port, material.ca)  # handshake, then close_notify and close
    client = RemoteStoreClient(nc, [service.options.store_id], ENGINE, request_timeout=WAIT_S,
                               tls=client_context(material.ca))
    try:
        meta, data = chunk(70_000, 2)
        assert await client.put(meta, ChunkBuffer(memoryview(data)))
        out = np.zeros(meta.nbytes, dtype=np.uint8)
        got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
        assert got is not None and np.array_equal(out, data)
    finally:
        await client.close()


@pytest.mark.parametrize("bound", ["any frame", "a frame before the hello"])
async def test_a_frame_out_of_bounds_after_the_handshake_is_refused_counted_and_logged(
        tls_store, material: TlsMaterial, caplog: pytest.LogCaptureFixture, bound: str) -> None:
    """A client that completes the handshake, then announces a frame longer than the bound (in clear: where the
    length goes) is closed before the store reads or allocates it. Before a valid hello, the bound is the longest
    hello (--stream-hello-max-bytes and the request head)."""
    service, nc = tls_store
    length = MAX_FRAME_BYTES + 1 if bound == "any frame" else service.stream.hello_max_bytes + 5 + 1
    given = await offer(nc, service.options.store_id)
    loop = asyncio.get_running_loop()
    raw = socket.create_connection((given.host, given.port), timeout=WAIT_S)
    raw.setblocking(False)
    try:
        sock = await TlsSocket.wrap(raw, client_context(material.ca), server_side=False, server_hostname=given.host)
        await loop.sock_sendall(raw, length.to_bytes(4, "big") + bytes(64))
        try:
            answer = await asyncio.wait_for(sock.recv_into(memoryview(bytearray(64))), WAIT_S)
        except ConnectionResetError:
            answer = 0
        assert answer == 0  # closed: no answer
    finally:
        raw.close()
    await wait_until_async(lambda: service.stream.counters["stream_frames_refused"] >= 1,
                           what="the store counting the refused frame")
    assert service.stream.counters["stream_tls_refused"] == 0
    assert any(f"a frame of {length} bytes announced" in record.getMessage()
               for record in caplog.records)
