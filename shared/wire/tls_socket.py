"""TLS on the stream data path's sockets: an `ssl.SSLObject` over a non-blocking socket, driven by the event loop's
`sock_*` calls (the stream code reads into preallocated buffers with `loop.sock_recv_into`, which an asyncio
stream cannot do; an `ssl.SSLSocket` cannot be used with those calls).

`TlsSocket.wrap(sock, context, server_side, server_hostname)` runs the handshake; then `recv_into` and `sendall`
move bytes as the plain socket's loop calls would. `stream_wire.recv_into` / `stream_wire.sendall` take either.
A failed handshake raises `ssl.SSLError` (describe it with shared/tls.py `describe_tls_error`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl

RECV_BYTES = 1024 * 1024  # ciphertext read from the socket at once
SEND_BYTES = 1024 * 1024  # plaintext encrypted before it is handed to the socket


class TlsSocket:
    """A TLS session on a connected non-blocking socket (see the module docstring)."""

    def __init__(self, sock: socket.socket, sslobj: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO) -> None:
        self.sock = sock
        self._ssl = sslobj
        self._incoming = incoming
        self._outgoing = outgoing
        self._scratch = bytearray(RECV_BYTES)

    @classmethod
    async def wrap(cls, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                   server_hostname: str | None = None) -> "TlsSocket":
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        sslobj = context.wrap_bio(incoming, outgoing, server_side=server_side, server_hostname=server_hostname)
        tls = cls(sock, sslobj, incoming, outgoing)
        while True:
            try:
                sslobj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await tls._flush()
                if not await tls._fill():
                    raise ssl.SSLEOFError(ssl.SSL_ERROR_EOF, "the peer closed the connection during the TLS handshake")
        await tls._flush()
        return tls

    def version(self) -> str | None:
        return self._ssl.version()

    async def recv_into(self, view: memoryview) -> int:
        """Decrypted bytes into `view`: how many (0 at the end of the stream). One read returns one TLS record
        (16 KiB at most), so it reads on while the ciphertext at hand lasts: a chunk costs one await per
        socket read, not one per record."""
        got, size = 0, len(view)
        while got < size:
            try:
                count = self._ssl.read(size - got, view[got:])
                if count == 0:  # the peer's close_notify: read answers 0 from then on (it raises only without one)
                    return got
                got += count
            except ssl.SSLWantReadError:
                if got:
                    return got
                await self._flush()  # TLS 1.3 may answer something (a key update) before it reads on
                if not await self._fill():
                    return 0
            except ssl.SSLZeroReturnError:
                return got
        return got

    async def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), SEND_BYTES):
            self._ssl.write(view[start:start + SEND_BYTES])
            await self._flush()

    def close(self) -> None:
        self.sock.close()

    async def _flush(self) -> None:
        pending = self._outgoing.read()
        if pending:
            await asyncio.get_running_loop().sock_sendall(self.sock, pending)

    async def _fill(self) -> bool:
        """Ciphertext from the socket into the session; False at the end of the stream."""
        count = await asyncio.get_running_loop().sock_recv_into(self.sock, self._scratch)
        if count == 0:
            self._incoming.write_eof()
            return False
        self._incoming.write(memoryview(self._scratch)[:count])
        return True
