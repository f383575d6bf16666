"""The remote store's bulk data path: chunk bytes on direct TCP connections, both ends.

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
             | put: meta.nbytes bytes, then the u64 LE xxh3 checksum of those bytes (a trailer, so a sender
               that has no checksum yet computes it while sending)
    reply:   u32 LE length | msgpack message (Ack or GetReply) | found get: meta.nbytes bytes
The first request of a connection is a hello with its ticket. Messages are shared/protocol.py's
(StreamHello, PutRequest, GetRequest, Ack, GetReply); only headers are msgpack, the bytes are raw.
Checksums are computed piece by piece as the bytes pass (`recv_exactly`/`send_hashed`), while each piece is
still in the CPU cache: a separate pass over 32 MiB would read it back from memory.

Store end: `StreamServer`, on the store's event loop, one task per connection. Client end: `StreamPool` of
`StreamConnection`s per store, on the engine's NATS loop. Nobody ever gets a truncated chunk: the receiver
counts bytes against meta.nbytes and checks meta.checksum; a transfer that stalls past its deadline (a dead
or too slow peer) closes the connection, and the other side sees an error, not short data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import struct
import time
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import xxhash

from kvmesh.shared import protocol
from kvmesh.shared.errors import ProtocolError, StoreError
from kvmesh.shared.keys import ChunkKey
from kvmesh.services.remote_store.store import MemoryStore, PutRefused

log = logging.getLogger(__name__)

OP_HELLO, OP_PUT, OP_GET = b"H", b"P", b"G"
_REQUEST_HEAD = struct.Struct("<cI")
_REPLY_HEAD = struct.Struct("<I")
_TRAILER = struct.Struct("<Q")
HASH_PIECE_BYTES = 1024 * 1024  # hash-then-send pieces: small enough to stay in cache between the two
MAX_MESSAGE_BYTES = 1024 * 1024  # headers only: anything longer is garbage, not a message
TICKET_TTL_SECS = 30.0
HELLO_TIMEOUT_SECS = 10.0
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
async def recv_exactly(sock: socket.socket, view: memoryview, hasher: "xxhash.xxh3_64 | None" = None) -> None:
    """Fill `view` from `sock`, or raise StreamError: never returns with fewer bytes.

    With a `hasher`, each piece is hashed as it lands (the digest equals chunk_file.checksum of the whole).
    """
    loop = asyncio.get_running_loop()
    got, size = 0, len(view)
    while got < size:
        count = await loop.sock_recv_into(sock, view[got:])
        if count == 0:
            if got == 0:
                raise StreamClosed(f"connection closed before {size} expected bytes")
            raise StreamError(f"connection closed after {got} of {size} bytes")
        if hasher is not None:
            hasher.update(view[got:got + count])
        got += count


async def send_hashed(sock: socket.socket, view: memoryview, hasher: "xxhash.xxh3_64") -> None:
    """Send `view`, hashing each piece just before it goes (so the kernel copies it from the cache)."""
    loop = asyncio.get_running_loop()
    for start in range(0, len(view), HASH_PIECE_BYTES):
        piece = view[start:start + HASH_PIECE_BYTES]
        hasher.update(piece)
        await loop.sock_sendall(sock, piece)


async def _recv_message(sock: socket.socket, size: int, expected: type[M]) -> M:
    if size > MAX_MESSAGE_BYTES:
        raise StreamError(f"message of {size} bytes announced: not our protocol")
    body = bytearray(size)
    await recv_exactly(sock, memoryview(body))
    return protocol.decode(bytes(body), expected)


async def send_request(sock: socket.socket, op: bytes, message: object) -> None:
    body = protocol.encode(message)
    await asyncio.get_running_loop().sock_sendall(sock, _REQUEST_HEAD.pack(op, len(body)) + body)


async def recv_request_head(sock: socket.socket) -> tuple[bytes, int]:
    """The next request's op byte and message length."""
    head = bytearray(_REQUEST_HEAD.size)
    await recv_exactly(sock, memoryview(head))
    op, size = _REQUEST_HEAD.unpack(head)
    return op, size


async def send_reply(sock: socket.socket, message: object) -> None:
    body = protocol.encode(message)
    await asyncio.get_running_loop().sock_sendall(sock, _REPLY_HEAD.pack(len(body)) + body)


async def recv_reply(sock: socket.socket, expected: type[M]) -> M:
    head = bytearray(_REPLY_HEAD.size)
    await recv_exactly(sock, memoryview(head))
    (size,) = _REPLY_HEAD.unpack(head)
    return await _recv_message(sock, size, expected)


async def _drain(sock: socket.socket, nbytes: int) -> None:
    """Read and drop `nbytes` (the bytes of a put the store does not keep), keeping the stream in step."""
    scratch = memoryview(bytearray(min(nbytes, DRAIN_CHUNK_BYTES)))
    left = nbytes
    while left > 0:
        part = min(left, len(scratch))
        await recv_exactly(sock, scratch[:part])
        left -= part


# ---- store end ----------------------------------------------------------------------------------------------
class StreamServer:
    """Serves puts and gets of a MemoryStore on a TCP port, to clients holding a ticket.

    Each connection is one task on the store's loop, handling its requests in order. A request's transfer
    (header, bytes and reply) must finish within `transfer_timeout` seconds, or the connection is closed:
    a stalled receiver costs its own connection, never the store. Idle connections stay open.
    """

    def __init__(self, store: MemoryStore, host: str, port: int = 0, transfer_timeout: float = 30.0) -> None:
        self.store = store
        self.host = host
        self.port = port
        self.transfer_timeout = transfer_timeout
        self._tickets: dict[bytes, float] = {}  # ticket -> expiry (monotonic)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE))[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = loop.create_task(self._accept_loop())

    def issue_ticket(self) -> bytes:
        """A single-use ticket for one new connection, valid for TICKET_TTL_SECS."""
        now = time.monotonic()
        for ticket in [t for t, expiry in self._tickets.items() if expiry <= now]:
            del self._tickets[ticket]
        ticket = secrets.token_bytes(16)
        self._tickets[ticket] = now + TICKET_TTL_SECS
        return ticket

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, peer = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep the listener, try again shortly
                log.warning("stream accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            tune_socket(sock)
            task = loop.create_task(self._serve(sock, peer))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket, peer: object) -> None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_SECS):
                client = await self._hello(sock)
            log.debug("stream connection from %s (%s)", peer, client)
            while True:
                try:
                    op, size = await recv_request_head(sock)  # an idle connection may wait here indefinitely
                except StreamClosed:
                    log.debug("stream connection from %s closed by the client", peer)
                    return
                async with asyncio.timeout(self.transfer_timeout):
                    if op == OP_PUT:
                        await self._put(sock, await _recv_message(sock, size, protocol.PutRequest))
                    elif op == OP_GET:
                        await self._get(sock, await _recv_message(sock, size, protocol.GetRequest))
                    else:
                        raise StreamError(f"unknown op {op!r}")
        except StreamError as exc:
            log.warning("stream connection from %s dropped: %s", peer, exc)
        except ProtocolError as exc:
            log.warning("stream connection from %s dropped: bad message: %s", peer, exc)
        except TimeoutError:
            log.warning("stream connection from %s dropped: a transfer took longer than %gs (peer too slow "
                        "or gone)", peer, self.transfer_timeout)
        except OSError as exc:
            log.info("stream connection from %s dropped: %s", peer, exc)
        except Exception:  # a bug here must cost one connection, never the store
            log.exception("stream connection from %s failed", peer)
        finally:
            sock.close()

    async def _hello(self, sock: socket.socket) -> str:
        op, size = await recv_request_head(sock)
        if op != OP_HELLO:
            raise StreamError(f"expected a hello, got op {op!r}")
        hello = await _recv_message(sock, size, protocol.StreamHello)
        expiry = self._tickets.pop(hello.ticket, None)
        if expiry is None or expiry < time.monotonic():
            await send_reply(sock, protocol.Ack(ok=False, error="unknown or expired stream ticket: ask for "
                                                               "a new one on the store's stream subject"))
            raise StreamError("bad ticket")
        await send_reply(sock, protocol.Ack())
        return hello.client

    async def _put(self, sock: socket.socket, request: protocol.PutRequest) -> None:
        meta = request.meta
        try:
            chunk = await self.store.begin_put(meta)
        except PutRefused as exc:
            if meta.nbytes < 0:
                raise StreamError(f"put of {meta.nbytes} bytes") from None
            await _drain(sock, meta.nbytes + _TRAILER.size)
            await send_reply(sock, protocol.Ack(ok=False, error=str(exc)))
            return
        if chunk is None:  # already held: the bytes are the same (keys name content)
            await _drain(sock, meta.nbytes + _TRAILER.size)
            await send_reply(sock, protocol.Ack())
            return
        hasher = xxhash.xxh3_64()
        trailer = bytearray(_TRAILER.size)
        try:
            await recv_exactly(sock, chunk.data(), hasher)
            await recv_exactly(sock, memoryview(trailer))
        except BaseException:
            self.store.abort_put(chunk)
            raise
        try:
            self.store.commit_put(chunk, claimed=_TRAILER.unpack(trailer)[0], digest=hasher.intdigest())
        except PutRefused as exc:
            await send_reply(sock, protocol.Ack(ok=False, error=str(exc)))
            return
        await send_reply(sock, protocol.Ack())

    async def _get(self, sock: socket.socket, request: protocol.GetRequest) -> None:
        chunk = self.store.acquire(request.key)
        if chunk is None:
            await send_reply(sock, protocol.GetReply(found=False))
            return
        try:
            if request.capacity and chunk.meta.nbytes > request.capacity:
                await send_reply(sock, protocol.GetReply(
                    found=False, meta=chunk.meta,
                    error=f"chunk is {chunk.meta.nbytes} bytes, the buffer {request.capacity}"))
                return
            await send_reply(sock, protocol.GetReply(found=True, meta=chunk.meta))
            await asyncio.get_running_loop().sock_sendall(sock, chunk.data())
        finally:
            self.store.release(chunk)


# ---- client end ---------------------------------------------------------------------------------------------
class StreamConnection:
    """One open, greeted connection to a store; one request at a time. Any error leaves it unusable."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.uses = 0

    @classmethod
    async def open(cls, offer: protocol.StreamOffer, client: str) -> "StreamConnection":
        """Connect to the offered address and present the ticket (the caller bounds the time)."""
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (await loop.getaddrinfo(offer.host, offer.port,
                                                                  type=socket.SOCK_STREAM))[0]
        sock = socket.socket(family, kind, proto)
        try:
            tune_socket(sock)
            await loop.sock_connect(sock, address)
            await send_request(sock, OP_HELLO, protocol.StreamHello(ticket=offer.ticket, client=client))
            ack = await recv_reply(sock, protocol.Ack)
            if not ack.ok:
                raise StreamError(f"{offer.host}:{offer.port} refused the stream: {ack.error}")
        except BaseException:
            sock.close()
            raise
        return cls(sock, f"{offer.host}:{offer.port}")

    async def put(self, meta: protocol.ChunkMeta, data: memoryview) -> protocol.Ack:
        """Send a chunk; the store's answer (ok=False with a reason when it refused the chunk).

        Without meta.checksum, the checksum is computed while sending and follows the bytes.
        """
        self.uses += 1
        loop = asyncio.get_running_loop()
        await send_request(self.sock, OP_PUT, protocol.PutRequest(meta=meta))
        if meta.checksum:
            await loop.sock_sendall(self.sock, data)
            checksum = meta.checksum
        else:
            hasher = xxhash.xxh3_64()
            await send_hashed(self.sock, data, hasher)
            checksum = hasher.intdigest()
        await loop.sock_sendall(self.sock, _TRAILER.pack(checksum))
        return await recv_reply(self.sock, protocol.Ack)

    async def get_into(self, key: ChunkKey, view: memoryview) -> protocol.GetReply:
        """Ask for a chunk; when found, its bytes are in `view[:meta.nbytes]` and match meta.checksum.

        A checksum mismatch is answered as a miss with an error (the connection stays in step).
        """
        self.uses += 1
        await send_request(self.sock, OP_GET, protocol.GetRequest(key=key, capacity=len(view)))
        reply = await recv_reply(self.sock, protocol.GetReply)
        if not reply.found:
            return reply
        meta = reply.meta
        if meta is None or meta.key != key or meta.nbytes > len(view):
            raise StreamError(f"{self.peer}: get {key.hex()} answered a mismatching chunk")
        hasher = xxhash.xxh3_64()
        await recv_exactly(self.sock, view[: meta.nbytes], hasher)
        if hasher.intdigest() != meta.checksum:
            return protocol.GetReply(found=False, meta=meta, error=f"chunk {key.hex()} failed its checksum")
        return reply

    def close(self) -> None:
        self.sock.close()


class StreamPool:
    """Kept-open connections to one store; at most `max_connections` in use at once.

    `negotiate` asks the store (over NATS) for an offer; each new connection needs a fresh one. After any
    failure the idle connections are closed too: they most likely point at a store that went away.
    """

    def __init__(self, negotiate: Callable[[], Awaitable[protocol.StreamOffer]], client: str,
                 max_connections: int = 4) -> None:
        self._negotiate = negotiate
        self._client = client
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[StreamConnection] = []
        self._closed = False

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[StreamConnection]:
        """A connection for one request; it returns to the pool only if the request completed."""
        async with self._slots:
            connection = self._idle.pop() if self._idle else await self._open()
            try:
                yield connection
            except BaseException:
                connection.close()
                self.reset()
                raise
            if self._closed:
                connection.close()
            else:
                self._idle.append(connection)

    async def _open(self) -> StreamConnection:
        offer = await self._negotiate()
        return await StreamConnection.open(offer, self._client)

    def reset(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def close(self) -> None:
        self._closed = True
        self.reset()
