"""The remote store's bulk data path: chunk bytes on direct TCP connections. This module: the wire format.

Why not NATS (measured with benchmarks/remote_store.py, which times both in the same run): moving 32 MiB
chunks between two processes, nats-py in frames of 1 or 8 MiB reached 0.04-0.21 GB/s on the 2-core dev VM and
0.35-0.51 GB/s on an idle 16-core host (one 32 MiB message: ~440 ms), while a TCP loopback stream with
`loop.sock_sendall` / `loop.sock_recv_into` into preallocated buffers reached 0.4-2.4 and 2.2-4.9 GB/s: 5-10x.
So NATS only negotiates a stream (StreamRequest -> StreamOffer with a single-use ticket, so the port serves
exactly the clients NATS authorises) and carries the control ops; the chunk bytes go here, straight from the
sender's buffer into the receiver's, and a slow receiver slows the sender down (TCP flow control) instead of
losing messages.

Wire format, per connection, one request at a time:
    request: op (1 byte: H hello, P put, G get) | u32 LE length | msgpack message
             | put: meta.nbytes bytes, then the u64 LE xxh3 checksum of those bytes (a trailer: meta.checksum,
               never 0; the store refuses the put unless the bytes it received hash to it)
    reply:   u32 LE length | msgpack message (Ack or GetReply) | found get: meta.nbytes bytes
The first request of a connection is a hello with its ticket. Messages are shared/protocol/messages.py's
(StreamHello, PutRequest, GetRequest, Ack, GetReply); only headers are msgpack, the bytes are raw.
The receiver computes the checksum piece by piece as the bytes land (`recv_exactly`), while each piece is
still in the CPU cache: a separate pass over 32 MiB would read it back from memory.

Serving end: `StreamServer` (shared/wire/stream_server.py; the remote store's adds puts), on the server's event loop,
one task per connection. Client end: a `StreamPool` of `StreamConnection`s per store (services/engine/tiers/remote_stream.py),
on the engine's NATS loop (the engine imports only the client end and this module, never the store). Nobody
ever gets a truncated chunk: the receiver counts bytes against meta.nbytes and checks meta.checksum; a transfer
that stalls past its deadline (a dead or too slow peer) closes the connection, and the other side sees an error,
not short data.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import TypeVar

import xxhash

from kvmesh.shared import protocol
from kvmesh.shared.errors import StoreError
from kvmesh.shared.wire.tls_socket import TlsSocket

# A stream connection: a plain socket, or an encrypted one (shared/wire/tls_socket.py) where the port is TLS.
Channel = socket.socket | TlsSocket


OP_HELLO, OP_PUT, OP_GET = b"H", b"P", b"G"
REQUEST_HEAD = struct.Struct("<cI")
REPLY_HEAD = struct.Struct("<I")
TRAILER = struct.Struct("<Q")
MAX_MESSAGE_BYTES = 1024 * 1024  # headers only: anything longer is garbage, not a message
DRAIN_CHUNK_BYTES = 1024 * 1024

M = TypeVar("M")


class StreamError(StoreError):
    """A stream connection broke, stalled or carried something that is not our protocol."""


class StreamClosed(StreamError):
    """The peer closed the connection before sending anything of what was expected."""


def tune_socket(sock: socket.socket) -> None:
    """Small headers must not wait for Nagle; keepalive finds peers that vanished while a connection idles."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


# ---- framing (both ends) ------------------------------------------------------------------------------------
async def recv_into(sock: Channel, view: memoryview) -> int:
    """What arrived into `view`: how many bytes (0 at the end of the stream)."""
    if isinstance(sock, TlsSocket):
        return await sock.recv_into(view)
    return await asyncio.get_running_loop().sock_recv_into(sock, view)


async def sendall(sock: Channel, data: bytes | bytearray | memoryview) -> None:
    if isinstance(sock, TlsSocket):
        await sock.sendall(data)
    else:
        await asyncio.get_running_loop().sock_sendall(sock, data)


async def recv_exactly(sock: Channel, view: memoryview, hasher: "xxhash.xxh3_64 | None" = None) -> None:
    """Fill `view` from `sock`, or raise StreamError: never returns with fewer bytes.

    With a `hasher`, each piece is hashed as it lands (the digest equals chunk_file.checksum of the whole).
    """
    got, size = 0, len(view)
    while got < size:
        count = await recv_into(sock, view[got:])
        if count == 0:
            if got == 0:
                raise StreamClosed(f"connection closed before {size} expected bytes")
            raise StreamError(f"connection closed after {got} of {size} bytes")
        if hasher is not None:
            hasher.update(view[got:got + count])
        got += count


async def recv_message(sock: Channel, size: int, expected: type[M]) -> M:
    if size > MAX_MESSAGE_BYTES:
        raise StreamError(f"message of {size} bytes announced: not our protocol")
    body = bytearray(size)
    await recv_exactly(sock, memoryview(body))
    return protocol.decode(bytes(body), expected)


async def send_request(sock: Channel, op: bytes, message: object) -> None:
    body = protocol.encode(message)
    await sendall(sock, REQUEST_HEAD.pack(op, len(body)) + body)


async def recv_request_head(sock: Channel) -> tuple[bytes, int]:
    """The next request's op byte and message length."""
    head = bytearray(REQUEST_HEAD.size)
    await recv_exactly(sock, memoryview(head))
    op, size = REQUEST_HEAD.unpack(head)
    return op, size


async def send_reply(sock: Channel, message: object) -> None:
    body = protocol.encode(message)
    await sendall(sock, REPLY_HEAD.pack(len(body)) + body)


async def send_reply_and_data(sock: Channel, message: object, data: memoryview) -> None:
    """`send_reply`, then `data`, in one system call when the socket takes it all (a get's reply and its chunk:
    one wake-up of the receiver, not two)."""
    body = protocol.encode(message)
    head = REPLY_HEAD.pack(len(body)) + body
    data = data if data.format == "B" and data.ndim == 1 else data.cast("B")
    if isinstance(sock, TlsSocket):
        await sock.sendall(head)
        await sock.sendall(data)
        return
    try:
        sent = sock.sendmsg([head, data])
    except (BlockingIOError, InterruptedError):
        sent = 0
    loop = asyncio.get_running_loop()
    if sent < len(head):
        await loop.sock_sendall(sock, head[sent:])
        sent = len(head)
    if sent - len(head) < len(data):
        await loop.sock_sendall(sock, data[sent - len(head):])


async def recv_reply(sock: Channel, expected: type[M]) -> M:
    head = bytearray(REPLY_HEAD.size)
    await recv_exactly(sock, memoryview(head))
    (size,) = REPLY_HEAD.unpack(head)
    return await recv_message(sock, size, expected)


async def drain(sock: Channel, nbytes: int) -> None:
    """Read and drop `nbytes` (the bytes of a put the store does not keep), keeping the stream in step."""
    scratch = memoryview(bytearray(min(nbytes, DRAIN_CHUNK_BYTES)))
    left = nbytes
    while left > 0:
        part = min(left, len(scratch))
        await recv_exactly(sock, scratch[:part])
        left -= part
