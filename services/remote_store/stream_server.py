"""The store end of the stream data path (see shared/wire/stream_wire.py): the generic server
(shared/wire/stream_server.py) serving gets of the MemoryStore, plus puts into it.

A connection acts for the caller that asked for its ticket on NATS (`Subjects.store(store_id, "stream", caller)`):
its puts record that caller's claims, as puts on NATS do.
"""

from __future__ import annotations

import socket

import xxhash

from kvmesh.services.remote_store.store import RESERVE_STEP, MemoryStore, PutRefused
from kvmesh.shared import protocol
from kvmesh.shared.wire.stream_server import StreamServer, _Refused
from kvmesh.shared.wire.stream_wire import TRAILER, StreamError, drain, recv_exactly, send_reply


class StoreStreamServer(StreamServer):
    """Gets and puts of a MemoryStore (see StreamServer for the bounds; `max_chunk_bytes` bounds a put)."""

    source: MemoryStore

    async def _put(self, sock: socket.socket, request: protocol.PutRequest, caller: str) -> None:
        meta = request.meta
        if meta.nbytes > self.max_chunk_bytes:  # never read (or make room for) a size merely announced
            self.counters["stream_puts_too_large"] += 1
            error = (f"put of {meta.nbytes} bytes announced; this store takes chunks of at most "
                     f"{self.max_chunk_bytes} bytes (--max-chunk-bytes)")
            await send_reply(sock, protocol.Ack(ok=False, error=error))
            raise _Refused(error)
        try:
            chunk = await self.source.begin_put(meta, caller, ahead=RESERVE_STEP)
        except PutRefused as exc:
            if meta.nbytes < 0:
                raise StreamError(f"put of {meta.nbytes} bytes") from None
            await drain(sock, meta.nbytes + TRAILER.size)
            await send_reply(sock, protocol.Ack(ok=False, error=str(exc)))
            return
        self.source.retain(request, caller)  # taken when it lands (a chunk held already: now)
        if chunk is None:  # already held: the bytes are the same (keys name content)
            await drain(sock, meta.nbytes + TRAILER.size)
            await send_reply(sock, protocol.Ack())
            return
        hasher = xxhash.xxh3_64()
        trailer = bytearray(TRAILER.size)
        view = chunk.data()
        try:
            for start in range(0, len(view), RESERVE_STEP):  # room for each step before its bytes are read
                self.source.make_room(chunk, start + RESERVE_STEP)
                await recv_exactly(sock, view[start:start + RESERVE_STEP], hasher)
            await recv_exactly(sock, memoryview(trailer))
        except PutRefused as exc:  # no room left (pins): aborted; skip the rest of its bytes
            await drain(sock, len(view) - start + TRAILER.size)
            await send_reply(sock, protocol.Ack(ok=False, error=str(exc)))
            return
        except BaseException:
            self.source.abort_put(chunk)
            raise
        try:
            self.source.commit_put(chunk, claimed=TRAILER.unpack(trailer)[0], digest=hasher.intdigest())
        except PutRefused as exc:
            await send_reply(sock, protocol.Ack(ok=False, error=str(exc)))
            return
        await send_reply(sock, protocol.Ack())

