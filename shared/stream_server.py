"""The serving end of the stream data path (see shared/stream_wire.py): chunks of a `ChunkSource` sent over TCP
to clients holding a single-use ticket, which they got on NATS (so the port serves exactly whom NATS authorises).

Used by the remote store (services/remote_store/stream_server.py adds its puts) and by an engine serving its CPU
tier to peers (services/engine/mesh/peer_server.py, gets only). A connection acts for the caller its ticket was
issued to (`issue_ticket`): the source sees that caller's path on every get.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from typing import Protocol

from kvmesh.shared import protocol
from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.errors import ProtocolError
from kvmesh.shared.keys import ChunkKey
from kvmesh.shared.stream_wire import (
    OP_GET,
    OP_HELLO,
    OP_PUT,
    StreamClosed,
    StreamError,
    recv_message,
    recv_request_head,
    send_reply,
    send_reply_and_data,
    tune_socket,
)

log = logging.getLogger(__name__)

TICKET_TTL_SECS = 30.0


class HeldChunk(Protocol):
    """A chunk a source holds for one send: its meta (checksum set) and bytes."""

    @property
    def meta(self) -> protocol.ChunkMeta: ...

    def data(self) -> memoryview: ...


class ChunkSource(Protocol):
    """Where a stream server's gets read from: a held chunk stays valid (its bytes unchanged) until released."""

    def acquire(self, key: ChunkKey, caller: str) -> HeldChunk | None: ...

    def release(self, chunk: HeldChunk) -> None: ...


class _Refused(Exception):
    """A connection closed for one of the server's bounds; the message is its log line."""


class StreamServer:
    """Serves gets of a ChunkSource on a TCP port, to clients holding a ticket (a subclass may take puts too:
    `_put`).

    Each connection is one task on the server's loop, handling its requests in order. A request's transfer
    (header, bytes and reply) must finish within `transfer_timeout` seconds, or the connection is closed:
    a stalled receiver costs its own connection, never the store.

    Bounds, so that a TCP peer without a ticket (or an idle one with it) costs little: at most
    `max_connections` open at once (past it a new connection is closed at once); the hello must arrive within
    `hello_timeout` seconds and announce at most `hello_max_bytes`; a greeted connection with no request for
    `idle_timeout` seconds is closed (the client opens a new one). A put announcing more than `max_chunk_bytes`
    is refused before any of its bytes is read (and its connection closed: the stream is out of step), and a put
    makes room in the store only as its bytes arrive (store.py). Each is counted in `counters`.
    """

    def __init__(self, source: ChunkSource, host: str, port: int = 0, transfer_timeout: float = 30.0, *,
                 max_connections: int = 256, hello_timeout: float = 10.0, hello_max_bytes: int = 4096,
                 idle_timeout: float = 300.0, max_chunk_bytes: int = 256 * 1024 * 1024) -> None:
        self.source = source
        self.host = host
        self.port = port
        self.transfer_timeout = transfer_timeout
        self.max_connections = max_connections
        self.hello_timeout = hello_timeout
        self.hello_max_bytes = hello_max_bytes
        self.idle_timeout = idle_timeout
        self.max_chunk_bytes = max_chunk_bytes
        self.counters = {"stream_refused_over_cap": 0, "stream_hello_timeouts": 0, "stream_hellos_too_large": 0,
                         "stream_bad_tickets": 0, "stream_idle_closed": 0, "stream_puts_too_large": 0}
        self._tickets: dict[bytes, tuple[float, str]] = {}  # ticket -> (expiry (monotonic), caller path)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    @property
    def listening(self) -> bool:
        return self._listener is not None

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

    def issue_ticket(self, caller: str) -> bytes:
        """A single-use ticket for one new connection of `caller` (its path), valid for TICKET_TTL_SECS."""
        now = time.monotonic()
        for ticket in [t for t, (expiry, _) in self._tickets.items() if expiry <= now]:
            del self._tickets[ticket]
        ticket = secrets.token_bytes(16)
        self._tickets[ticket] = (now + TICKET_TTL_SECS, caller)
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
        await cancel_and_wait(list(self._connections))

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
            if len(self._connections) >= self.max_connections:  # closed before we read a byte of it
                sock.close()
                self.counters["stream_refused_over_cap"] += 1
                log.warning("stream connection from %s closed: %d connections open (the cap, "
                            "--max-stream-connections)", peer, len(self._connections))
                continue
            tune_socket(sock)
            task = loop.create_task(self._serve(sock, peer))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket, peer: object) -> None:
        try:
            try:
                async with asyncio.timeout(self.hello_timeout):
                    client, caller = await self._hello(sock)
            except TimeoutError:
                self.counters["stream_hello_timeouts"] += 1
                raise _Refused(f"no valid hello within {self.hello_timeout:g}s (--stream-hello-timeout)") from None
            log.debug("stream connection from %s (%s, %s)", peer, client, caller)
            while True:
                try:
                    async with asyncio.timeout(self.idle_timeout):
                        op, size = await recv_request_head(sock)
                except StreamClosed:
                    log.debug("stream connection from %s closed by the client", peer)
                    return
                except TimeoutError:  # the client reconnects when it needs the store again
                    self.counters["stream_idle_closed"] += 1
                    log.info("stream connection from %s closed: idle for %gs (--stream-idle-timeout)", peer,
                             self.idle_timeout)
                    return
                async with asyncio.timeout(self.transfer_timeout):
                    if op == OP_PUT:
                        await self._put(sock, await recv_message(sock, size, protocol.PutRequest), caller)
                    elif op == OP_GET:
                        await self._get(sock, await recv_message(sock, size, protocol.GetRequest), caller)
                    else:
                        raise StreamError(f"unknown op {op!r}")
        except _Refused as exc:
            log.warning("stream connection from %s closed: %s", peer, exc)
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

    async def _hello(self, sock: socket.socket) -> tuple[str, str]:
        """The client's name and the caller its ticket was issued to."""
        op, size = await recv_request_head(sock)
        if op != OP_HELLO:
            raise StreamError(f"expected a hello, got op {op!r}")
        if size > self.hello_max_bytes:  # never read (or allocate) more than this before a valid ticket
            self.counters["stream_hellos_too_large"] += 1
            raise _Refused(f"hello of {size} bytes announced (the cap is {self.hello_max_bytes}, "
                           "--stream-hello-max-bytes)")
        hello = await recv_message(sock, size, protocol.StreamHello)
        expiry, caller = self._tickets.pop(hello.ticket, (None, ""))
        if expiry is None or expiry < time.monotonic():
            self.counters["stream_bad_tickets"] += 1
            await send_reply(sock, protocol.Ack(ok=False, error="unknown or expired stream ticket: ask for "
                                                               "a new one on the store's stream subject"))
            raise StreamError("bad ticket")
        await send_reply(sock, protocol.Ack())
        return hello.client, caller

    async def _put(self, sock: socket.socket, request: protocol.PutRequest, caller: str) -> None:
        """This server serves gets only: a put closes the connection (its bytes are not read)."""
        await send_reply(sock, protocol.Ack(ok=False, error="this stream serves gets only"))
        raise _Refused(f"a put of {request.meta.key.hex()} on a get-only stream")

    async def _get(self, sock: socket.socket, request: protocol.GetRequest, caller: str) -> None:
        chunk = self.source.acquire(request.key, caller)
        if chunk is None:
            await send_reply(sock, protocol.GetReply(found=False))
            return
        try:
            if request.capacity and chunk.meta.nbytes > request.capacity:
                await send_reply(sock, protocol.GetReply(
                    found=False, meta=chunk.meta,
                    error=f"chunk is {chunk.meta.nbytes} bytes, the buffer {request.capacity}"))
                return
            await send_reply_and_data(sock, protocol.GetReply(found=True, meta=chunk.meta), chunk.data())
        finally:
            self.source.release(chunk)
