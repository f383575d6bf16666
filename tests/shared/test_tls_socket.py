"""shared/wire/tls_socket.py over real loopback sockets with certificates from shared/tls.py: after the TLS
handshake and the key exchange inside it, bytes of every size cross bit-exact both ways in AES-GCM frames, read
whole or in pieces, and never in clear on the wire; a frame altered, replayed, reordered, cut short or announced
too long on the way (a relay between the two ends meddles) closes the connection with an error saying which."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
from typing import Callable

import pytest

from kvmesh.shared.tls import TlsMaterial, client_context, server_context
from kvmesh.shared.wire.stream_wire import recv_exactly
from kvmesh.shared.wire.tls_socket import (
    FRAME_BYTES,
    MAX_FRAME_BYTES,
    TAG_BYTES,
    ChannelError,
    TlsSocket,
    session_keys,
)

from support.waiting import WAIT_S

FRAME_OVERHEAD = 4 + TAG_BYTES


class Relay:
    """A TCP relay from the client to the server. It passes bytes through and keeps those going to the server
    (`seen`); once `meddle(size, change, then_close)` is set, it hands the client's next `size` bytes to `change`
    and passes on what that returns (then closes towards the server if told)."""

    def __init__(self, server_port: int) -> None:
        self.server_port = server_port
        self.seen = bytearray()
        self._meddling: tuple[int, Callable[[bytes], bytes], bool] | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def meddle(self, size: int, change: Callable[[bytes], bytes], then_close: bool = False) -> None:
        self._meddling = (size, change, then_close)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.server_port)
        await asyncio.gather(self._to_server(reader, up_writer), self._to_client(up_reader, writer),
                             return_exceptions=True)

    async def _to_server(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held = b""
        try:
            while data := await reader.read(1 << 16):
                self.seen += data
                if self._meddling is None:
                    writer.write(data)
                else:
                    held += data
                    size, change, then_close = self._meddling
                    if len(held) < size:
                        continue
                    writer.write(change(held[:size]))
                    if then_close:
                        break
                    writer.write(held[size:])
                    held, self._meddling = b"", None
                await writer.drain()
            await writer.drain()
        finally:
            writer.close()

    async def _to_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def close(self) -> None:
        self._server.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    return TlsMaterial(tmp_path_factory.mktemp("tls") / "tls").ensure(["remote-store"],
                                                                       hosts=["127.0.0.1"])["remote-store"]


@pytest.fixture(scope="module")
def contexts(files):
    return client_context(files.ca), server_context(files.cert, files.key)


@pytest.fixture(scope="module")
def contexts_1_2(files):
    client = client_context(files.ca)
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    return client, server_context(files.cert, files.key)


async def connected(client_tls: ssl.SSLContext, server_tls: ssl.SSLContext):
    """(client, server, relay, close): two TlsSockets through a relay, keys exchanged."""
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    relay = Relay(listener.getsockname()[1])
    relay_port = await relay.start()
    raw = socket.socket()
    raw.setblocking(False)

    async def serve() -> TlsSocket:
        accepted, _ = await loop.sock_accept(listener)
        accepted.setblocking(False)
        return await TlsSocket.wrap(accepted, server_tls, server_side=True)

    async def connect() -> TlsSocket:
        await loop.sock_connect(raw, ("127.0.0.1", relay_port))
        return await TlsSocket.wrap(raw, client_tls, server_side=False, server_hostname="127.0.0.1")

    client, server = await asyncio.wait_for(asyncio.gather(connect(), serve()), WAIT_S)

    async def close() -> None:
        client.close()
        server.close()
        listener.close()
        await relay.close()

    return client, server, relay, close


@pytest.fixture
async def ends(contexts):
    """(client, server, relay): two TlsSockets through a relay, keys exchanged."""
    client, server, relay, close = await connected(*contexts)
    yield client, server, relay
    await close()


async def test_bytes_of_every_size_cross_bit_exact_both_ways_never_in_clear(ends) -> None:
    client, server, relay = ends
    assert client.version() in ("TLSv1.2", "TLSv1.3") and server.version() == client.version()
    sizes = [1, 15, 16, 17, 4095, 65_536 + 3, FRAME_BYTES - 1, FRAME_BYTES, FRAME_BYTES + 1, 3 * FRAME_BYTES + 7,
             MAX_FRAME_BYTES + 5]
    for size in sizes:
        for sender, receiver in ((client, server), (server, client)):
            data = os.urandom(size)
            out = bytearray(size)
            await asyncio.wait_for(asyncio.gather(sender.sendall(data), recv_exactly(receiver, memoryview(out))),
                                   WAIT_S)
            assert out == data, size
    needle, out = os.urandom(64), bytearray(64)
    await client.sendall(needle)
    await asyncio.wait_for(recv_exactly(server, memoryview(out)), WAIT_S)
    assert out == needle and needle[:16] not in relay.seen


async def test_tls_1_2_switches_to_frames_as_cleanly(contexts_1_2) -> None:
    """TLS 1.2 ends its handshake in another order (the server's Finished last, no tickets after it): the switch
    leaves nothing behind there either."""
    client, server, _, close = await connected(*contexts_1_2)
    try:
        assert client.version() == server.version() == "TLSv1.2"
        for sender, receiver in ((client, server), (server, client)):
            data, out = os.urandom(FRAME_BYTES + 3), bytearray(FRAME_BYTES + 3)
            await asyncio.wait_for(asyncio.gather(sender.sendall(data), recv_exactly(receiver, memoryview(out))),
                                   WAIT_S)
            assert out == data
    finally:
        await close()


async def test_reads_smaller_than_a_frame_get_it_in_order(ends) -> None:
    """A frame longer than the caller's buffer is served over several reads (1 byte, odd sizes, larger)."""
    client, server, _ = ends
    data = os.urandom(FRAME_BYTES + 1000)
    await client.sendall(data)  # fits in the socket buffers: two frames on their way
    got = bytearray()
    reads = 0
    while len(got) < len(data):
        view = memoryview(bytearray([1, 7, 1000, 65_536][reads % 4]))
        count = await asyncio.wait_for(server.recv_into(view), WAIT_S)
        assert 0 < count <= len(view)
        got += view[:count]
        reads += 1
    assert got == data and reads > len(data) // 65_536


async def assert_closed_with(server: TlsSocket, client: TlsSocket, expected: str) -> None:
    """The server's next read raises `expected`; its socket is closed, so the client sees the end; the server's
    later calls raise too."""
    with pytest.raises(ChannelError, match=expected):
        await asyncio.wait_for(server.recv_into(memoryview(bytearray(1 << 20))), WAIT_S)
    assert server.sock.fileno() == -1
    try:
        ended = await asyncio.wait_for(client.recv_into(memoryview(bytearray(16))), WAIT_S)
    except ConnectionError:
        ended = 0
    assert ended == 0
    with pytest.raises(ChannelError, match="failed earlier"):
        await server.recv_into(memoryview(bytearray(16)))


def flip(offset: int) -> Callable[[bytes], bytes]:
    return lambda frame: frame[:offset] + bytes([frame[offset] ^ 0x01]) + frame[offset + 1:]


@pytest.mark.parametrize("where, offset", [("ciphertext", 4 + 50), ("tag", 4 + 100 + 3), ("length", 3)])
async def test_an_altered_byte_closes_the_connection(ends, where: str, offset: int) -> None:
    client, server, relay = ends
    relay.meddle(100 + FRAME_OVERHEAD, flip(offset))
    await client.sendall(os.urandom(100))
    if where == "length":  # 100 ^ 1 = 101: the frame seems a byte longer; the next frame's first byte completes it
        await client.sendall(os.urandom(1))
    await assert_closed_with(server, client, "frame 0 failed its authentication tag")


async def test_a_replayed_frame_closes_the_connection(ends) -> None:
    client, server, relay = ends
    relay.meddle(100 + FRAME_OVERHEAD, lambda frame: frame + frame)
    data = os.urandom(100)
    await client.sendall(data)
    out = bytearray(100)
    await asyncio.wait_for(recv_exactly(server, memoryview(out)), WAIT_S)
    assert out == data  # the first one passes
    await assert_closed_with(server, client, "frame 1 failed its authentication tag")


async def test_reordered_frames_close_the_connection(ends) -> None:
    client, server, relay = ends
    size = 100 + FRAME_OVERHEAD
    relay.meddle(2 * size, lambda frames: frames[size:] + frames[:size])
    await client.sendall(os.urandom(100))
    await client.sendall(os.urandom(100))
    await assert_closed_with(server, client, "frame 0 failed its authentication tag")


@pytest.mark.parametrize("keep", [2, 4 + 60, 100 + FRAME_OVERHEAD - 1])
async def test_a_frame_cut_short_closes_the_connection(ends, keep: int) -> None:
    client, server, relay = ends
    relay.meddle(100 + FRAME_OVERHEAD, lambda frame: frame[:keep], then_close=True)
    await client.sendall(os.urandom(100))
    await assert_closed_with(server, client, "the connection closed inside a frame")


@pytest.mark.parametrize("length", [MAX_FRAME_BYTES + 1, 0xFFFFFFFF, 0])
async def test_a_length_out_of_bounds_closes_the_connection(ends, length: int) -> None:
    client, server, relay = ends
    relay.meddle(100 + FRAME_OVERHEAD, lambda frame: struct.pack(">I", length) + frame[4:])
    await client.sendall(os.urandom(100))
    await assert_closed_with(server, client, f"a frame of {length} bytes announced")


def test_each_direction_has_its_own_key_from_both_randoms() -> None:
    """A frame reflected to its sender cannot pass (its key is the other direction's); either random changes
    both keys."""
    client_random, server_random = os.urandom(32), os.urandom(32)
    to_server, to_client = session_keys(client_random, server_random)
    assert len(to_server) == len(to_client) == 32 and to_server != to_client
    for other in (session_keys(os.urandom(32), server_random), session_keys(client_random, os.urandom(32))):
        assert other[0] != to_server and other[1] != to_client
