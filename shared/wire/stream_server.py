"""The serving end of the stream data path (see shared/wire/stream_wire.py): chunks of a `ChunkSource` sent over TCP
to clients holding a single-use ticket, which they got on NATS (so the port serves exactly whom NATS authorises).

Used by the remote store (services/remote_store/stream_server.py adds its puts) and by an engine serving its CPU
tier to peers (services/engine/agents/peer_server.py, gets only, with `ClientBounds`). A connection acts for the
caller its ticket was issued to (`issue_ticket`): the source sees that caller's path on every get.

Threads: the server runs on one event loop; `issue_ticket` may be called from another thread (the engine's NATS
loop hands out tickets for a server on a loop of its own).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.shared import protocol
from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.errors import ProtocolError
from kvmesh.shared.protocol import principal_of
from kvmesh.shared.rate_limited_log import RateLimitedLog
from kvmesh.shared.tls import describe_tls_error
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.tls_socket import MAX_FRAME_BYTES, ChannelError, ClosedBeforeKeys, TlsSocket
from kvmesh.shared.wire.stream_wire import (
    OP_GET,
    OP_HELLO,
    OP_PUT,
    REQUEST_HEAD,
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


@dataclass(frozen=True)
class OptionNames:
    """The options that set a server's bounds, as its log lines and refusals name them."""

    max_connections: str = "--max-stream-connections"
    hello_timeout: str = "--stream-hello-timeout"
    hello_max_bytes: str = "--stream-hello-max-bytes"
    idle_timeout: str = "--stream-idle-timeout"
    max_pending: str = ""
    max_pending_per_address: str = ""
    max_connections_per_caller: str = ""
    ticket_max_bytes: str = ""
    ticket_bytes_per_s: str = ""


@dataclass(frozen=True)
class ClientBounds:
    """Bounds of a port that clients without a ticket can reach (the engine's P2P stream), beyond the server's.

    Pending connections (accepted, no valid ticket yet) are counted apart from greeted ones: at most
    `max_pending` in all and `max_pending_per_address` from one source address. A new connection past a cap
    closes the oldest pending connection of its own address (past the total: of the address with the most), never
    a greeted one: silent connections only ever push out their own kind, and a client that greets at once gets
    in. Greeted connections: at most the server's `max_connections`, and `max_connections_per_caller` of one
    principal (the ticket's caller's, e.g. `engine.<instance>`), which also bounds its unused tickets (a new one
    drops its oldest). One ticket's connection receives at most `ticket_max_bytes` (closed after the reply that
    reaches it: the client asks NATS for a new ticket) at `ticket_bytes_per_s` at most (replies wait their turn).
    """

    max_pending: int = 32
    max_pending_per_address: int = 8
    max_connections_per_caller: int = 4
    ticket_max_bytes: int = 4 * 1024**3
    ticket_bytes_per_s: float = 4e9


class TicketBudget:
    """What one ticket's connection may still receive, and when its next reply may start (`ClientBounds`).

    Pacing: a reply of n bytes lets the next one start n / rate seconds after it started, so over any run of
    replies the rate stays under `bytes_per_s`; the first goes at once, and a reply waits before its chunk is
    taken (a wait holds no slot)."""

    def __init__(self, max_bytes: int, bytes_per_s: float) -> None:
        self.left = max_bytes
        self.bytes_per_s = bytes_per_s
        self._next_start = 0.0

    def wait_s(self, now: float) -> float:
        """Seconds until the next reply may start."""
        return max(0.0, self._next_start - now)

    def spend(self, nbytes: int, started: float) -> None:
        """A reply of `nbytes` that started at `started` (monotonic)."""
        self._next_start = started + nbytes / self.bytes_per_s
        self.left -= nbytes

    @property
    def spent(self) -> bool:
        return self.left <= 0


@dataclass
class _Connection:
    sock: socket.socket
    address: str  # the source address
    principal: str | None = None  # set once greeted: its ticket's caller's principal
    budget: TicketBudget | None = field(default=None, repr=False)


class _Refused(Exception):
    """A connection closed for one of the server's bounds; the message is its log line."""


class StreamServer:
    """Serves gets of a ChunkSource on a TCP port, to clients holding a ticket (a subclass may take puts too:
    `_put`).

    Each connection is one task on the server's loop, handling its requests in order. A request's transfer
    (header, bytes and reply) must finish within `transfer_timeout` seconds, or the connection is closed:
    a stalled receiver costs its own connection, never the store.

    Bounds, so that a TCP peer without a ticket (or an idle one with it) costs little: the hello must arrive within
    `hello_timeout` seconds and announce at most `hello_max_bytes`; a greeted connection with no request for
    `idle_timeout` seconds is closed (the client opens a new one). Without `client_bounds`, at most
    `max_connections` are open at once, greeted or not (past it a new connection is closed at once); with them,
    `max_connections` counts greeted connections and `ClientBounds` says the rest. A put announcing more than
    `max_chunk_bytes` is refused before any of its bytes is read (and its connection closed: the stream is out of
    step), and a put makes room in the store only as its bytes arrive (store.py). Each is counted in `counters`;
    `names` are the options that set them, as log lines and refusals name them.
    """

    def __init__(self, source: ChunkSource, host: str, port: int = 0, transfer_timeout: float = 30.0, *,
                 max_connections: int = 256, hello_timeout: float = 10.0, hello_max_bytes: int = 4096,
                 idle_timeout: float = 300.0, max_chunk_bytes: int = 256 * 1024 * 1024,
                 client_bounds: ClientBounds | None = None, names: OptionNames = OptionNames(),
                 tls: ssl.SSLContext | None = None) -> None:
        """`tls`: a server context (shared/tls.py `server_context`): every connection starts with a TLS handshake,
        within `hello_timeout`; one that fails (a plaintext client, a client that does not trust the certificate)
        is closed, counted in `stream_tls_refused` and logged saying why. After it the bytes travel in AES-GCM
        frames (shared/wire/tls_socket.py); a frame that fails (its tag, its length, cut short) closes the
        connection, counted in `stream_frames_refused` and logged."""
        self.source = source
        self.tls = tls
        self.host = host
        self.port = port
        self.transfer_timeout = transfer_timeout
        self.max_connections = max_connections
        self.hello_timeout = hello_timeout
        self.hello_max_bytes = hello_max_bytes
        self.idle_timeout = idle_timeout
        self.max_chunk_bytes = max_chunk_bytes
        self.client_bounds = client_bounds
        self.names = names
        self.counters = {"stream_refused_over_cap": 0, "stream_hello_timeouts": 0, "stream_hellos_too_large": 0,
                         "stream_bad_tickets": 0, "stream_idle_closed": 0, "stream_puts_too_large": 0,
                         "stream_pending_closed": 0, "stream_refused_caller_cap": 0, "stream_tickets_spent": 0,
                         "stream_replies_paced": 0, "stream_tickets_issued": 0, "stream_tls_refused": 0,
                         "stream_frames_refused": 0}
        self._tickets: dict[bytes, tuple[float, str]] = {}  # ticket -> (expiry (monotonic), caller path)
        self._tickets_of: dict[str, dict[bytes, None]] = {}  # principal -> its unused tickets, oldest first
        self._tickets_lock = threading.Lock()  # issue_ticket may run on another thread
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        # source address -> its connections without a valid ticket yet, oldest first
        self._pending: dict[str, dict[asyncio.Task[None], None]] = {}
        self._pending_count = 0
        self._greeted: collections.Counter[str] = collections.Counter()  # principal -> greeted connections
        self._greeted_count = 0
        self._rlog = RateLimitedLog(log)

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    @property
    def pending_count(self) -> int:
        """Connections that have not presented a valid ticket yet."""
        return self._pending_count

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
        """A single-use ticket for one new connection of `caller` (its path), valid for TICKET_TTL_SECS. With
        `client_bounds`, a principal holds at most `max_connections_per_caller` unused ones (its oldest goes)."""
        now = time.monotonic()
        ticket = secrets.token_bytes(16)
        with self._tickets_lock:
            for old in [t for t, (expiry, _) in self._tickets.items() if expiry <= now]:
                self._forget_ticket(old)
            if self.client_bounds is not None:
                unused = self._tickets_of.setdefault(principal_of(caller), {})
                while len(unused) >= self.client_bounds.max_connections_per_caller:
                    self._forget_ticket(next(iter(unused)))
                unused[ticket] = None
            self._tickets[ticket] = (now + TICKET_TTL_SECS, caller)
            self.counters["stream_tickets_issued"] += 1
        return ticket

    def _take_ticket(self, ticket: bytes) -> str | None:
        """The caller of a valid, unused ticket (now used), else None."""
        with self._tickets_lock:
            expiry, caller = self._tickets.get(ticket, (None, ""))
            if expiry is None:
                return None
            self._forget_ticket(ticket)
        return caller if expiry >= time.monotonic() else None

    def _forget_ticket(self, ticket: bytes) -> None:
        _, caller = self._tickets.pop(ticket)
        unused = self._tickets_of.get(principal_of(caller))
        if unused is not None:
            unused.pop(ticket, None)
            if not unused:
                del self._tickets_of[principal_of(caller)]

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

    # ---- connections ---------------------------------------------------------------------------------------
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
            if self.client_bounds is None and len(self._connections) >= self.max_connections:
                sock.close()  # closed before we read a byte of it
                self.counters["stream_refused_over_cap"] += 1
                self._rlog.warning("cap", "stream connection from %s closed: %d connections open (the cap, %s)",
                                   peer, len(self._connections), self.names.max_connections)
                continue
            tune_socket(sock)
            address = peer[0] if isinstance(peer, tuple) else str(peer)
            if self.client_bounds is not None:
                self._make_pending_room(address, self.client_bounds)
            task = loop.create_task(self._serve(sock, peer))
            self._connections[task] = _Connection(sock, address)
            self._pending.setdefault(address, {})[task] = None
            self._pending_count += 1
            task.add_done_callback(self._ended)

    def _make_pending_room(self, address: str, bounds: ClientBounds) -> None:
        """Close the pending connection a new one from `address` replaces, if a cap is reached (ClientBounds)."""
        same = self._pending.get(address, {})
        if len(same) >= bounds.max_pending_per_address:
            victim, cap = next(iter(same)), f"{bounds.max_pending_per_address} from {address} " \
                                             f"({self.names.max_pending_per_address})"
        elif self._pending_count >= bounds.max_pending:
            victim = next(iter(max(self._pending.values(), key=len)))
            cap = f"{bounds.max_pending} in all ({self.names.max_pending})"
        else:
            return
        self._leave_pending(victim)
        victim.cancel()  # its socket is closed once the task has ended (`_ended`), never under a pending read
        self.counters["stream_pending_closed"] += 1
        self._rlog.warning("pending", "stream connection from %s closed before its hello: a newer one took its "
                           "place (connections without a ticket yet: at most %s)",
                           self._connections[victim].address, cap)

    def _leave_pending(self, task: asyncio.Task[None]) -> None:
        connection = self._connections[task]
        same = self._pending.get(connection.address)
        if same is not None and same.pop(task, 0) is None:
            self._pending_count -= 1
            if not same:
                del self._pending[connection.address]

    def _greet(self, task: asyncio.Task[None], caller: str) -> str | None:
        """A connection presented a valid ticket of `caller`: it counts as greeted, or why it may not."""
        self._leave_pending(task)
        bounds = self.client_bounds
        principal = principal_of(caller)
        if bounds is not None:
            if self._greeted_count >= self.max_connections:
                self.counters["stream_refused_over_cap"] += 1
                return f"{self._greeted_count} connections open (the cap, {self.names.max_connections})"
            if self._greeted[principal] >= bounds.max_connections_per_caller:
                self.counters["stream_refused_caller_cap"] += 1
                return (f"{principal} has {self._greeted[principal]} connections open (the cap per caller, "
                        f"{self.names.max_connections_per_caller})")
        connection = self._connections[task]
        connection.principal = principal
        if bounds is not None:
            connection.budget = TicketBudget(bounds.ticket_max_bytes, bounds.ticket_bytes_per_s)
        self._greeted[principal] += 1
        self._greeted_count += 1
        return None

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._leave_pending(task)
        connection = self._connections.pop(task)
        connection.sock.close()
        if connection.principal is not None:
            self._greeted_count -= 1
            self._greeted[connection.principal] -= 1
            if not self._greeted[connection.principal]:
                del self._greeted[connection.principal]

    async def _serve(self, raw: socket.socket, peer: object) -> None:
        task = asyncio.current_task()
        assert task is not None
        sock: socket.socket | TlsSocket = raw
        try:
            try:
                async with asyncio.timeout(self.hello_timeout):
                    if self.tls is not None:
                        sock = await self._handshake(raw)
                        # never read (or allocate) a frame longer than a hello can be before a valid ticket
                        sock.max_frame_bytes = REQUEST_HEAD.size + self.hello_max_bytes
                    client, caller = await self._hello(sock)
                    if isinstance(sock, TlsSocket):
                        sock.max_frame_bytes = MAX_FRAME_BYTES
            except TimeoutError:
                self.counters["stream_hello_timeouts"] += 1
                raise _Refused(f"no valid hello within {self.hello_timeout:g}s ({self.names.hello_timeout})") \
                    from None
            refusal = self._greet(task, caller)
            if refusal is not None:
                await send_reply(sock, protocol.Ack(ok=False, error=f"stream connection refused: {refusal}"))
                raise _Refused(refusal)
            await send_reply(sock, protocol.Ack())
            budget = self._connections[task].budget
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
                    log.info("stream connection from %s closed: idle for %gs (%s)", peer, self.idle_timeout,
                             self.names.idle_timeout)
                    return
                async with asyncio.timeout(self.transfer_timeout):
                    if op == OP_PUT:
                        await self._put(sock, await recv_message(sock, size, protocol.PutRequest), caller)
                    elif op == OP_GET:
                        await self._get(sock, await recv_message(sock, size, protocol.GetRequest), caller, budget)
                    else:
                        raise StreamError(f"unknown op {op!r}")
                if budget is not None and budget.spent:  # the client asks NATS for a new ticket
                    self.counters["stream_tickets_spent"] += 1
                    log.debug("stream connection from %s closed: its ticket's %d bytes are spent (%s)", peer,
                              self.client_bounds.ticket_max_bytes if self.client_bounds else 0,
                              self.names.ticket_max_bytes)
                    return
        except _Refused as exc:
            self._rlog.warning("refused", "stream connection from %s closed: %s", peer, exc)
        except ChannelError as exc:
            self.counters["stream_frames_refused"] += 1
            self._rlog.warning("refused", "stream connection from %s closed: a bad encrypted frame: %s", peer, exc)
        except StreamError as exc:
            self._rlog.warning("dropped", "stream connection from %s dropped: %s", peer, exc)
        except ProtocolError as exc:
            self._rlog.warning("bad", "stream connection from %s dropped: bad message: %s", peer, exc)
        except TimeoutError:
            log.warning("stream connection from %s dropped: a transfer took longer than %gs (peer too slow "
                        "or gone)", peer, self.transfer_timeout)
        except OSError as exc:
            log.info("stream connection from %s dropped: %s", peer, exc)
        except Exception:  # a bug here must cost one connection, never the store
            log.exception("stream connection from %s failed", peer)
        finally:
            raw.close()

    async def _handshake(self, raw: socket.socket) -> TlsSocket:
        assert self.tls is not None
        try:
            return await TlsSocket.wrap(raw, self.tls, server_side=True)
        except ClosedBeforeKeys as exc:  # a client that left after the handshake (e.g. a certificate probe)
            raise StreamClosed(f"TLS port: {exc.strerror or exc}") from None
        except (ssl.SSLError, ConnectionError) as exc:
            self.counters["stream_tls_refused"] += 1
            raise _Refused(f"TLS port: {describe_tls_error(exc)}") from None

    async def _hello(self, sock: socket.socket | TlsSocket) -> tuple[str, str]:
        """The client's name and the caller its ticket was issued to."""
        op, size = await recv_request_head(sock)
        if op != OP_HELLO:
            raise StreamError(f"expected a hello, got op {op!r}")
        if size > self.hello_max_bytes:  # never read (or allocate) more than this before a valid ticket
            self.counters["stream_hellos_too_large"] += 1
            raise _Refused(f"hello of {size} bytes announced (the cap is {self.hello_max_bytes}, "
                           f"{self.names.hello_max_bytes})")
        hello = await recv_message(sock, size, protocol.StreamHello)
        caller = self._take_ticket(hello.ticket)
        if caller is None:
            self.counters["stream_bad_tickets"] += 1
            await send_reply(sock, protocol.Ack(ok=False, error="unknown or expired stream ticket: ask for "
                                                               "a new one on the store's stream subject"))
            raise StreamError("bad ticket")
        return hello.client, caller

    async def _put(self, sock: socket.socket, request: protocol.PutRequest, caller: str) -> None:
        """This server serves gets only: a put closes the connection (its bytes are not read)."""
        await send_reply(sock, protocol.Ack(ok=False, error="this stream serves gets only"))
        raise _Refused(f"a put of {request.meta.key.hex()} on a get-only stream")

    async def _get(self, sock: socket.socket, request: protocol.GetRequest, caller: str,
                   budget: TicketBudget | None = None) -> None:
        if budget is not None:
            wait = budget.wait_s(time.monotonic())
            if wait > 0:
                self.counters["stream_replies_paced"] += 1
                await asyncio.sleep(wait)
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
            started = time.monotonic()
            await send_reply_and_data(sock, protocol.GetReply(found=True, meta=chunk.meta), chunk.data())
            if budget is not None:
                budget.spend(chunk.meta.nbytes, started)
        finally:
            self.source.release(chunk)
