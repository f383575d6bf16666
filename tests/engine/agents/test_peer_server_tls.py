"""The P2P port over TLS (p2p_tls_cert / p2p_tls_key): a worker's PeerServer on a real NATS offers TLS streams; a
peer trusting the CA (p2p_tls_ca) gets the chunk bit-exact; a peer without the CA, with another CA, or speaking in
clear is refused, saying why; a certificate rotated on disk serves new peers while a peer connected before goes on."""

from __future__ import annotations

import asyncio
import collections
import os
import socket
from pathlib import Path
from typing import AsyncIterator

import pytest

from kvmesh.services.engine.agents.peer_server import PeerServer
from kvmesh.services.engine.tiers.cpu import LocalCPUBackend
from kvmesh.services.engine.tiers.memory_pool import MemoryPool
from kvmesh.services.engine.tiers.remote_stream import StreamConnection
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.protocol import Subjects
from kvmesh.shared.tls import TlsMaterial, client_context, server_context
from kvmesh.shared.wire.stream_wire import OP_HELLO, StreamError, send_request

from support.tls import der, reissue, served_certificate
from support.waiting import WAIT_S, wait_until_async

SLOT = 64 * 1024
CALLER = protocol.Principal.engine("b").producer("b")


@pytest.fixture
def material(tmp_path: Path) -> TlsMaterial:
    material = TlsMaterial(tmp_path / "tls")  # each test's own: one rotates it
    material.ensure(["engine"], hosts=["127.0.0.1"])
    return material


@pytest.fixture
async def tls_peer(material: TlsMaterial) -> AsyncIterator[tuple[PeerServer, object, bytes]]:
    """Worker a's CPU tier, holding one chunk, served on a TLS-only P2P port; a NATS client to ask it for streams."""
    cpu = LocalCPUBackend(MemoryPool(4 * SLOT, SLOT, use_shm=False))
    data = os.urandom(SLOT - 100)
    slot = cpu.allocate()
    assert slot is not None
    slot.chunk_buffer(len(data)).view[:] = data
    assert cpu.put(protocol.ChunkMeta(key=b"a" * 16, num_tokens=16, shape=[len(data)], dtype="uint8", fmt="test",
                                      nbytes=len(data)), slot)
    files = material.files("engine")
    with EmbeddedNats() as nats_server:
        nc = await bus.connect(nats_server.url, "test-p2p-tls", allow_reconnect=False)
        server = PeerServer(cpu, collections.Counter(), "a", "a", "default", "127.0.0.1", "127.0.0.1",
                            tls=server_context(files.cert, files.key))
        await server.start(nc)
        try:
            yield server, nc, data
        finally:
            await server.stop()
            await nc.close()


async def offer(nc) -> protocol.StreamOffer:
    return await bus.request(nc, Subjects.peer_stream("default", "a", "a", CALLER), protocol.StreamRequest(client="b"),
                             protocol.StreamOffer, WAIT_S)


async def test_a_peer_trusting_the_ca_gets_the_chunk_over_tls(tls_peer, material: TlsMaterial) -> None:
    server, nc, data = tls_peer
    given = await offer(nc)
    assert given.tls
    connection = await StreamConnection.open(given, "b", client_context(material.ca))
    try:
        buffer = memoryview(bytearray(SLOT))
        reply = await connection.get_into(b"a" * 16, buffer)
        assert reply.found and bytes(buffer[:len(data)]) == data
        assert connection.sock.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        connection.close()


async def test_peers_without_the_ca_or_with_another_ca_are_refused(tls_peer, tmp_path: Path) -> None:
    server, nc, _ = tls_peer
    with pytest.raises(StreamError, match="takes TLS connections only, and no CA is configured"):
        await StreamConnection.open(await offer(nc), "b")
    other = TlsMaterial(tmp_path / "other").ensure(["engine"], hosts=["127.0.0.1"])["engine"].ca
    with pytest.raises(StreamError, match="not signed by the trusted CA"):
        await StreamConnection.open(await offer(nc), "b", client_context(other))
    await wait_until_async(lambda: server.server.counters["stream_tls_refused"] >= 1,
                           what="the peer server counting the refused handshake")


async def test_a_peer_in_clear_is_refused(tls_peer, caplog: pytest.LogCaptureFixture) -> None:
    server, nc, _ = tls_peer
    given = await offer(nc)
    loop = asyncio.get_running_loop()
    with socket.create_connection((given.host, given.port), timeout=WAIT_S) as sock:
        sock.setblocking(False)
        await send_request(sock, OP_HELLO, protocol.StreamHello(ticket=given.ticket, client="plain"))
        assert await asyncio.wait_for(loop.sock_recv(sock, 64), WAIT_S) == b""  # closed, no Ack
    await wait_until_async(lambda: server.server.counters["stream_tls_refused"] >= 1,
                           what="the peer server counting the refused handshake")
    assert any("does not speak TLS" in record.getMessage() for record in caplog.records)


async def test_a_rotated_certificate_serves_new_peers_and_a_peer_connected_before_goes_on(
        tls_peer, material: TlsMaterial) -> None:
    server, nc, data = tls_peer
    files = material.files("engine")
    assert files.cert is not None
    given = await offer(nc)
    before = await StreamConnection.open(given, "b", client_context(material.ca))
    try:
        assert await served_certificate(given.port, material.ca) == der(files.cert)
        rotated = reissue(material, "engine", ["127.0.0.1"])
        assert await served_certificate(given.port, material.ca) == rotated
        for connection in (before, await StreamConnection.open(await offer(nc), "b", client_context(material.ca))):
            buffer = memoryview(bytearray(SLOT))
            reply = await connection.get_into(b"a" * 16, buffer)
            assert reply.found and bytes(buffer[:len(data)]) == data
            connection.close()
    finally:
        before.close()
    assert server.server.counters["stream_tls_refused"] == 0
