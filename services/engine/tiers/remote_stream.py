"""The client end of the stream data path (see shared/wire/stream_wire.py), on the engine's NATS loop.

Imports nothing of the store: loading the engine (vLLM's connector) never loads server code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, TypeVar

import xxhash

from kvmesh.shared import protocol
from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.tls import describe_tls_error
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.stream_wire import (
    OP_GET,
    OP_HELLO,
    OP_PUT,
    TRAILER,
    StreamError,
    recv_exactly,
    recv_reply,
    send_request,
    sendall,
    tune_socket,
)
from kvmesh.shared.wire.tls_socket import TlsSocket

if TYPE_CHECKING:
    from kvmesh.services.engine.tiers.base import StoreLink

log = logging.getLogger(__name__)
T = TypeVar("T")


class StreamConnection:
    """One open, greeted connection to a store; one request at a time. Any error leaves it unusable."""

    def __init__(self, sock: socket.socket | TlsSocket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.uses = 0

    @classmethod
    async def open(cls, offer: protocol.StreamOffer, client: str,
                   tls: ssl.SSLContext | None = None) -> "StreamConnection":
        """Connect to the offered address and present the ticket (the caller bounds the time). With `tls` (a
        client context: shared/tls.py) the port must speak TLS with a certificate it verifies; without, a port
        that speaks only TLS is refused before a byte is sent: either way, never a plaintext hello where TLS is
        asked for."""
        where = f"{offer.host}:{offer.port}"
        if offer.tls and tls is None:
            raise StreamError(f"{where} takes TLS connections only, and no CA is configured to verify it "
                              "(remote_tls_ca, p2p_tls_ca)")
        if tls is not None and not offer.tls:
            raise StreamError(f"{where} is a plaintext stream port, and TLS is configured: not connecting")
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (await loop.getaddrinfo(offer.host, offer.port,
                                                                  type=socket.SOCK_STREAM))[0]
        raw = socket.socket(family, kind, proto)
        sock: socket.socket | TlsSocket = raw
        try:
            tune_socket(raw)
            await loop.sock_connect(raw, address)
            if tls is not None:
                try:
                    sock = await TlsSocket.wrap(raw, tls, server_side=False, server_hostname=offer.host)
                except ssl.SSLError as exc:
                    raise StreamError(f"{where}: {describe_tls_error(exc)}") from None
            await send_request(sock, OP_HELLO, protocol.StreamHello(ticket=offer.ticket, client=client))
            ack = await recv_reply(sock, protocol.Ack)
            if not ack.ok:
                raise StreamError(f"{offer.host}:{offer.port} refused the stream: {ack.error}")
        except BaseException:
            raw.close()
            raise
        return cls(sock, where)

    async def put(self, meta: protocol.ChunkMeta, data: memoryview, priority: int = 0,
                  lease_secs: float = 0.0) -> protocol.Ack:
        """Send a chunk; the store's answer (ok=False with a reason when it refused the chunk).

        meta.checksum (which the engine computed over the bytes) follows them as the trailer; the store
        verifies the bytes it received against it before it holds the chunk. `priority` / `lease_secs`: the
        storing request's retention.
        """
        self.uses += 1
        await send_request(self.sock, OP_PUT, protocol.PutRequest(meta=meta, priority=priority,
                                                                  lease_secs=lease_secs))
        await sendall(self.sock, data)
        await sendall(self.sock, TRAILER.pack(meta.checksum))
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

    @property
    def worn(self) -> bool:
        """Whether the connection has carried so much under its TLS frame keys that a new one must replace it."""
        return isinstance(self.sock, TlsSocket) and self.sock.worn

    def close(self) -> None:
        self.sock.close()


class StreamPool:
    """Kept-open connections to one store; at most `max_connections` in use at once.

    `negotiate` asks the store (over NATS) for an offer; each new connection needs a fresh one. After any
    failure the idle connections are closed too: they most likely point at a store that went away.
    """

    def __init__(self, negotiate: Callable[[], Awaitable[protocol.StreamOffer]], client: str,
                 max_connections: int = 4, tls: ssl.SSLContext | None = None) -> None:
        self._negotiate = negotiate
        self._tls = tls
        self._client = client
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[StreamConnection] = []
        self._closed = False

    @contextlib.asynccontextmanager
    async def connection(self, timeout: float | None = None) -> AsyncIterator[StreamConnection]:
        """A connection for one request; it returns to the pool only if the request completed. `timeout` bounds
        the request from the moment a connection is free (opening it included), not the wait for one: the
        requests ahead are each bounded themselves, and a queue behind a busy far end is not its failure."""
        async with self._slots:
            async with asyncio.timeout(timeout):
                connection = self._idle.pop() if self._idle else await self._open()
                try:
                    yield connection
                except BaseException:
                    connection.close()
                    self.reset()
                    raise
            if self._closed or connection.worn:
                connection.close()
            else:
                self._idle.append(connection)

    async def _open(self) -> StreamConnection:
        offer = await self._negotiate()
        return await StreamConnection.open(offer, self._client, self._tls)

    def reset(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def close(self) -> None:
        self._closed = True
        self.reset()


async def on_stream(pool: StreamPool, link: "StoreLink", timeout: float,
                    op: Callable[[StreamConnection], Awaitable[T]]) -> T | None:
    """Run `op` on a kept connection of `pool` within `timeout` seconds once a connection is free; None on any
    failure (`link` records the far end's state: a failure rests it, an answer revives it).

    A kept connection may point at a server that restarted since: a failure on one is retried once on a fresh
    connection before the far end counts as down.
    """
    if link.resting:
        return None
    for attempt in (1, 2):
        reused = False
        try:
            async with pool.connection(timeout) as connection:
                reused = connection.uses > 0
                result = await op(connection)
        except TimeoutError:
            link.failed(f"no answer on the stream within {timeout:.1f}s")
            return None
        except (KVMeshError, OSError) as exc:  # StreamError, MeshUnavailable (negotiation), socket errors
            if attempt == 1 and reused:
                log.debug("%s: kept connection failed (%s); retrying on a new one", link.label, exc)
                continue
            link.failed(exc)
            return None
        except Exception as exc:  # never let a store or peer problem reach vLLM
            log.exception("%s: unexpected stream error", link.label)
            link.failed(exc)
            return None
        link.answered()
        return result
    return None
