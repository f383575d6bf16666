"""Encrypted stream sockets: a TLS handshake, then the bytes in AES-256-GCM frames keyed inside that TLS session.

What is TLS: the handshake only (`ssl.SSLObject` on memory BIOs, driven by the event loop's `sock_*` calls: the
stream code reads into preallocated buffers with `loop.sock_recv_into`, which an asyncio stream cannot do). It
does what TLS is good at: the client verifies the server's certificate against its CA and host name, a plaintext
peer or a server signed by another CA fails it (`ssl.SSLError`; shared/tls.py `describe_tls_error` says why), and
it gives both ends a confidential channel to the authenticated other end.

What is not: the bulk bytes. Python's ssl record layer moved them at ~1 GB/s per core (16 KiB records, a copy in
and out of the BIOs), a third of the same stream in clear (benchmarks/remote_store_tls.py), while `cryptography`'s
AES-256-GCM seals and opens several GB/s on one core. So, inside the established TLS session, each end sends
RANDOM_BYTES fresh random bytes; both derive one key per direction from the two with HKDF-SHA256 (`session_keys`),
stop using the SSLObject, and from then on every `sendall` travels as frames

    [u32 BE length n, in clear and authenticated as associated data][n bytes of ciphertext][16-byte GCM tag]

with the nonce a per-direction frame counter (never sent: each end counts, so a replayed, reordered, dropped or
foreign frame fails its tag). 0 < n <= `max_frame_bytes` (MAX_FRAME_BYTES; a server lowers it until the client's
hello is valid). Anything else (a failed tag, a length out of bounds, the stream ending inside a frame) raises
`ChannelError` and closes the socket. `sendall` seals FRAME_BYTES at a time, each frame while the one before it
is still on its way; `recv_into` decrypts straight into the caller's buffer when a whole frame fits in it.

The switch leaves no TLS bytes behind: each end sends its random right after its own handshake and sends no frame
before it has the other's, and while it waits for it, it reads the socket one TLS record at a time, so nothing
past the other's random (its first frame) can enter the SSLObject; a TLS byte left over at the switch is an error.
No close_notify is sent: after the randoms, the connection carries frames only.

Keys are not updated: a connection that has moved KEY_RETIRE_BYTES in either direction is `worn` (its owner opens
a new one instead of reusing it), and one frame past KEY_MAX_BYTES is refused (docs/security.md, "TLS across
hosts", says why these bounds). `TlsSocket.wrap(sock, context, server_side, server_hostname)` runs the handshake
and the key exchange; then `recv_into` / `sendall` / `close` / `version` as before. `stream_wire.recv_into` /
`stream_wire.sendall` take either this or a plain socket.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvmesh.shared.errors import StoreError

HANDSHAKE_RECV_BYTES = 64 * 1024  # handshake bytes read from the socket at once
RANDOM_BYTES = 32  # each end's contribution to the frame keys, sent inside TLS
PROTOCOL = b"kvmesh stream frames v1"  # names the construction in the key derivation
FRAME_BYTES = 1024 * 1024  # plaintext sealed per frame by `sendall` (measured: benchmarks/remote_store_tls.py)
MAX_FRAME_BYTES = 4 * 1024 * 1024  # a longer announced frame is not our protocol
LENGTH = struct.Struct(">I")
TAG_BYTES = 16
HEAD_READ_BYTES = 64 * 1024  # asked of the socket when no frame head is at hand: a small frame and what follows
NONCE = struct.Struct(">4xQ")  # 12 bytes: the frame counter (it cannot wrap: KEY_MAX_BYTES bounds it far below)
KEY_RETIRE_BYTES = 1 << 36  # 64 GiB one way: the connection is not reused past this (`worn`)
KEY_MAX_BYTES = 1 << 38  # 256 GiB one way: no frame past this under one key
TLS_RECORD_HEAD = struct.Struct(">BHH")  # content type, version, length
TLS_RECORD_MAX_BYTES = 2 ** 14 + 2048  # the largest TLS ciphertext record (RFC 5246)


class ClosedBeforeKeys(ssl.SSLEOFError):
    """The peer completed the TLS handshake, then closed (cleanly or not) before the stream keys: a client that
    left (a probe of the certificate), not a refused one."""


class ChannelError(StoreError):
    """A frame failed (tag, length, truncation): the connection is closed; nothing of it reached the caller."""


def session_keys(client_random: bytes, server_random: bytes) -> tuple[bytes, bytes]:
    """The client-to-server and server-to-client keys, from both ends' randoms (HKDF-SHA256: the protocol's name
    as salt, the roles in the info, so one direction's key never equals the other's)."""
    secret = client_random + server_random

    def key(direction: bytes) -> bytes:
        return HKDF(hashes.SHA256(), 32, salt=PROTOCOL, info=PROTOCOL + b" " + direction).derive(secret)

    return key(b"client to server"), key(b"server to client")


class TlsSocket:
    """A connected non-blocking socket after a TLS handshake and the frame key exchange (the module docstring)."""

    def __init__(self, sock: socket.socket, version: str | None, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self._version = version
        self._sealer, self._opener = AESGCM(send_key), AESGCM(recv_key)
        self.sent_bytes = self.received_bytes = 0  # plaintext, each under its own key
        self._sent_frames = self._received_frames = 0
        # Buffers grow to the frames met (a connection that carries only small messages stays small).
        self._tx = [memoryview(bytearray(0)), memoryview(bytearray(0))]  # sealed frames: two in flight at most
        self._rx = memoryview(bytearray(HEAD_READ_BYTES))  # a frame received, and the next one's start
        self._rx_have = 0
        self._plain = memoryview(bytearray(0))  # a frame longer than the caller's buffer
        self._plain_at = self._plain_end = 0
        self._broken: str | None = None
        self.max_frame_bytes = MAX_FRAME_BYTES  # a server lowers it until the client proved itself

    @classmethod
    async def wrap(cls, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                   server_hostname: str | None = None) -> "TlsSocket":
        """The TLS handshake, then the key exchange inside it; `ssl.SSLError` if either fails."""
        handshake = _Handshake(sock, context, server_side, server_hostname)
        await handshake.run()
        mine = os.urandom(RANDOM_BYTES)
        theirs = await handshake.exchange(mine)
        client_to_server, server_to_client = session_keys(*((theirs, mine) if server_side else (mine, theirs)))
        send_key, recv_key = ((server_to_client, client_to_server) if server_side
                              else (client_to_server, server_to_client))
        return cls(sock, handshake.ssl.version(), send_key, recv_key)

    def version(self) -> str | None:
        """The TLS version of the handshake (e.g. "TLSv1.3")."""
        return self._version

    @property
    def worn(self) -> bool:
        """Whether this connection has carried enough under its keys that a new one should replace it."""
        return max(self.sent_bytes, self.received_bytes) >= KEY_RETIRE_BYTES

    async def recv_into(self, view: memoryview) -> int:
        """Decrypted bytes into `view`: how many (0 at the end of the stream, between frames). A whole frame
        that fits is decrypted straight into `view`; a longer one into a buffer the next calls read from."""
        if self._plain_at == self._plain_end:
            size = await self._next_frame()
            if size == 0:
                return 0
            if len(view) >= size:
                self._open(size, view[:size])
                return size
            self._plain = _grown(self._plain, size, 0)
            self._open(size, self._plain[:size])
            self._plain_at, self._plain_end = 0, size
        count = min(len(view), self._plain_end - self._plain_at)
        view[:count] = self._plain[self._plain_at:self._plain_at + count]
        self._plain_at += count
        return count

    async def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """`data` in frames of FRAME_BYTES. Each frame is sealed while the one before it still waits in the
        socket (two send buffers): the receiver gets the next frame as soon as it has taken the last."""
        view = memoryview(data).cast("B")
        loop = asyncio.get_running_loop()
        unsent = b""
        for start in range(0, len(view), FRAME_BYTES):
            frame = self._seal(view[start:start + FRAME_BYTES])
            if unsent:
                await loop.sock_sendall(self.sock, unsent)
            unsent = frame[self._send_now(frame):]
        if unsent:
            await loop.sock_sendall(self.sock, unsent)

    def _send_now(self, frame: memoryview) -> int:
        """As much of `frame` as the socket takes without waiting: how many bytes."""
        try:
            return self.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            return 0

    def close(self) -> None:
        self.sock.close()

    # ---- frames -----------------------------------------------------------------------------------------------
    def _seal(self, piece: memoryview) -> memoryview:
        """`piece` as one frame in a send buffer (valid until the call after next)."""
        self._check()
        size = len(piece)
        if self.sent_bytes + size > KEY_MAX_BYTES:
            raise self._fail(f"{KEY_MAX_BYTES} bytes sent under one key: reconnect")
        end = LENGTH.size + size + TAG_BYTES
        tx = self._tx[self._sent_frames % 2] = _grown(self._tx[self._sent_frames % 2], end, 0)
        LENGTH.pack_into(tx, 0, size)
        self._sealer.encrypt_into(NONCE.pack(self._sent_frames), piece, tx[:LENGTH.size], tx[LENGTH.size:end])
        self._sent_frames += 1
        self.sent_bytes += size
        return tx[:end]

    async def _next_frame(self) -> int:
        """Read the next frame whole into the receive buffer: its plaintext length (0: the stream ended)."""
        self._check()
        if not await self._receive(LENGTH.size, HEAD_READ_BYTES):
            if self._rx_have == 0:
                return 0
            raise self._fail(f"the connection closed inside a frame's length ({self._rx_have} of 4 bytes)")
        (size,) = LENGTH.unpack_from(self._rx, 0)
        if not 0 < size <= self.max_frame_bytes:
            raise self._fail(f"a frame of {size} bytes announced (frames hold 1 to {self.max_frame_bytes} bytes "
                             "here)")
        end = LENGTH.size + size + TAG_BYTES
        self._rx = _grown(self._rx, end + LENGTH.size, self._rx_have)  # room for the next frame's length too
        if not await self._receive(end, end + LENGTH.size):
            raise self._fail(f"the connection closed inside a frame ({self._rx_have} of {end} bytes)")
        if self.received_bytes + size > KEY_MAX_BYTES:
            raise self._fail(f"{KEY_MAX_BYTES} bytes received under one key")
        return size

    async def _receive(self, need: int, upto: int) -> bool:
        """Read until the receive buffer holds `need` bytes, asking the socket for up to `upto`; False when the
        stream ends first."""
        loop = asyncio.get_running_loop()
        while self._rx_have < need:
            count = await loop.sock_recv_into(self.sock, self._rx[self._rx_have:upto])
            if count == 0:
                return False
            self._rx_have += count
        return True

    def _open(self, size: int, out: memoryview) -> None:
        """Decrypt the frame at the head of the receive buffer into `out`, and drop it from the buffer."""
        end = LENGTH.size + size + TAG_BYTES
        try:
            self._opener.decrypt_into(NONCE.pack(self._received_frames), self._rx[LENGTH.size:end],
                                      self._rx[:LENGTH.size], out)
        except InvalidTag:
            raise self._fail(f"frame {self._received_frames} failed its authentication tag (altered, replayed, "
                             "reordered, or not of this session)") from None
        self._received_frames += 1
        self.received_bytes += size
        left = self._rx_have - end
        if left:  # the next frame's start, read with this one
            self._rx[:left] = bytes(self._rx[end:self._rx_have])
        self._rx_have = left

    def _check(self) -> None:
        if self._broken is not None:
            raise ChannelError(f"the connection failed earlier: {self._broken}")

    def _fail(self, reason: str) -> ChannelError:
        """Close the connection; the error to raise."""
        self._broken = reason
        self.sock.close()
        return ChannelError(reason)


def _grown(buffer: memoryview, size: int, keep: int) -> memoryview:
    """`buffer` if it holds `size` bytes, else a new one that does, starting with `buffer`'s first `keep`."""
    if len(buffer) >= size:
        return buffer
    grown = memoryview(bytearray(size))
    grown[:keep] = buffer[:keep]
    return grown


class _Handshake:
    """The TLS part: the handshake, then the randoms both ends exchange inside it."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None) -> None:
        self.sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                    server_hostname=server_hostname)

    async def run(self) -> None:
        scratch = bytearray(HANDSHAKE_RECV_BYTES)
        while True:
            try:
                self.ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                count = await asyncio.get_running_loop().sock_recv_into(self.sock, scratch)
                if count == 0:
                    raise ssl.SSLEOFError(ssl.SSL_ERROR_EOF, "the peer closed the connection during the TLS handshake")
                self._incoming.write(memoryview(scratch)[:count])
        await self._flush()

    async def exchange(self, mine: bytes) -> bytes:
        """Send `mine` through TLS, and return the other end's random (see the module docstring)."""
        self.ssl.write(mine)
        await self._flush()
        theirs = bytearray()
        while len(theirs) < RANDOM_BYTES:
            try:
                got = self.ssl.read(RANDOM_BYTES - len(theirs))
                if not got:  # the peer's close_notify: read answers nothing from then on (it raises only without one)
                    raise ClosedBeforeKeys(ssl.SSL_ERROR_EOF, "the peer closed TLS before the stream keys")
                theirs += got
            except ssl.SSLWantReadError:
                await self._flush()
                await self._read_record()
            except ssl.SSLZeroReturnError:
                raise ClosedBeforeKeys(ssl.SSL_ERROR_EOF, "the peer closed TLS before the stream keys") from None
        if self._incoming.pending or self._outgoing.pending:
            raise ssl.SSLError(ssl.SSL_ERROR_SSL, "TLS bytes beyond the stream key exchange: not our protocol")
        return bytes(theirs)

    async def _read_record(self) -> None:
        """One TLS record from the socket into the session, and not a byte more."""
        head = await self._recv_exactly(TLS_RECORD_HEAD.size)
        _, _, length = TLS_RECORD_HEAD.unpack(head)
        if length > TLS_RECORD_MAX_BYTES:
            raise ssl.SSLError(ssl.SSL_ERROR_SSL, f"a TLS record of {length} bytes announced: not TLS")
        self._incoming.write(head + await self._recv_exactly(length))

    async def _recv_exactly(self, size: int) -> bytes:
        buffer = bytearray(size)
        got = 0
        while got < size:
            count = await asyncio.get_running_loop().sock_recv_into(self.sock, memoryview(buffer)[got:])
            if count == 0:
                raise ClosedBeforeKeys(ssl.SSL_ERROR_EOF, "the peer closed the connection before the stream keys")
            got += count
        return bytes(buffer)

    async def _flush(self) -> None:
        pending = self._outgoing.read()
        if pending:
            await asyncio.get_running_loop().sock_sendall(self.sock, pending)
