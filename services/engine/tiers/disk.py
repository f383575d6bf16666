"""The engine's client of its host's disk store: `DiskStoreClient`, a `StoreTier` over NATS.

Runs on the engine's NATS event loop (all methods are coroutines). Bulk bytes: when the ChunkBuffer lies in the
engine's shared pool, the pool is lent to the store once over its Unix socket (pool_lending.py), then only
(pool token, offset) travel on NATS and the store copies the bytes out (put) or reads the file straight into
the pool (get). Otherwise the bytes go inline in the message (small chunks, a pool in process memory, or a
store that takes no pool: on another host, or older; limited by NATS max_payload).

A put returns True once the store holds the bytes and has verified them against meta.checksum (which every
put must carry): the buffer may be reused immediately, and the chunk becomes visible to contains/get when its
file is complete, shortly after. Nothing here raises on a dead or slow store: it logs once per change of
reachability (a shared StoreLink, as the remote store's client) and answers miss / False / 0, with one
exception. A get into the pool that gets no answer (`data_timeout`) may still be served by a store that was
only stalled, into a slot the engine would by then have reused: `get_into` raises StoreMayWrite instead, whose
`settled()` resolves once that store can no longer write there (it acked `cancel_get` for the get's id, or its
end of the pool socket closed). The caller keeps the slot out of use until then (storage_manager.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

from nats.aio.client import Client as NatsClient

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.engine.tiers.base import (NO_RETENTION, ChunkBuffer, Retention, StoreLink, StoreMayWrite,
                                                Unanswered)
from kvmesh.services.engine.tiers.pool_lending import PoolLink, Registration
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)

T = TypeVar("T")


class DiskStoreClient:
    """StoreTier of one disk store, for `caller` (a path: an engine worker's `Principal.engine(instance).producer(
    worker)`; its puts are claimed by it and its `clear` takes back only them). `data_timeout` bounds put/get
    (they may wait for disk or staging)."""

    location = protocol.LOCAL_DISK

    def __init__(self, nc: NatsClient, store_id: str, caller: str, request_timeout: float = 2.0,
                 data_timeout: float | None = None) -> None:
        self.nc = nc
        self.store_id = store_id
        self.store_ids = [store_id]
        self.request_timeout = request_timeout
        self.data_timeout = data_timeout if data_timeout is not None else max(request_timeout, 10.0)
        self._link = StoreLink(store_id, f"disk store {store_id}", log, caller)  # asked every time: on this host
        self._pools = PoolLink(store_id, caller, request_timeout, scope=lambda: bus.server_scope(nc))
        self._next_get_id = 0  # get ids: unique per client (the store keys its gets by caller and pool)
        self._closed = False

    # ---- StoreTier ------------------------------------------------------------------------------
    async def put(self, meta: protocol.ChunkMeta, buffer: ChunkBuffer,
                  retention: Retention = NO_RETENTION) -> bool:
        token = await self._pool_token(buffer)
        if token is not None:
            request = protocol.PutRequest(meta=meta, pool=token, pool_offset=buffer.pool_offset,
                                          priority=retention.priority, lease_secs=retention.lease_secs() or 0.0)
        else:
            if meta.nbytes + protocol.INLINE_HEADROOM > self.nc.max_payload:
                self._link.refused(f"chunk of {meta.nbytes} bytes is too big to send inline (NATS max_payload "
                                   f"{self.nc.max_payload}) and the buffer is not in a pool the store took")
                return False
            request = protocol.PutRequest(meta=meta, data=bytes(buffer.view[:meta.nbytes]),
                                          priority=retention.priority, lease_secs=retention.lease_secs() or 0.0)
        reply = await self._request("put", request, protocol.Ack, self.data_timeout)
        if reply is None:
            return False
        if not reply.ok:
            self._link.refused(reply.error or "put refused")
        else:
            self._link.accepted()
        return reply.ok

    async def get_into(self, key: ChunkKey, buffer: ChunkBuffer) -> protocol.ChunkMeta | None:
        """The chunk into `buffer`; None on a miss. A pooled get that got no answer raises StoreMayWrite (the
        store may still serve it into the pool later): its `settled()` says when the buffer is safe again."""
        registration = await self._pools.registration(buffer.pool) if buffer.pool is not None else None
        token = registration.token if registration is not None else None
        if registration is not None:
            self._next_get_id += 1
            get_id, deadline = self._next_get_id, time.monotonic() + self.data_timeout
            request = protocol.GetRequest(key=key, pool=registration.token, pool_offset=buffer.pool_offset,
                                          capacity=len(buffer.view), get_id=get_id, deadline=deadline)
            try:
                reply = await self._link.exchange(self.nc, "get", request, protocol.GetReply, self.data_timeout)
            except Unanswered as exc:
                raise StoreMayWrite(f"disk store {self.store_id}: get {get_id} of {key.hex()} unanswered ({exc})",
                                    lambda: self._settled(registration, get_id, deadline)) from None
        else:
            request = protocol.GetRequest(key=key, capacity=len(buffer.view))
            reply = await self._request("get", request, protocol.GetReply, self.data_timeout)
        if reply is None or not reply.found or reply.meta is None:
            if reply is not None and reply.error:
                log.debug("disk store %s: get %s: %s", self.store_id, key.hex(), reply.error)
            return None
        meta = reply.meta
        if meta.key != key or meta.nbytes > len(buffer.view):
            log.warning("disk store %s: get %s answered a mismatching chunk (%s, %d bytes)", self.store_id,
                        key.hex(), meta.key.hex(), meta.nbytes)
            return None
        if token is None:
            data = reply.data or b""
            if len(data) != meta.nbytes or chunk_file.checksum(data) != meta.checksum:
                log.warning("disk store %s: inline data of %s is damaged; treating it as a miss", self.store_id,
                            key.hex())
                return None
            buffer.view[:meta.nbytes] = data
        return meta

    async def contains(self, keys: list[ChunkKey]) -> int:
        reply = await self._request("contains", protocol.ChunkKeys(keys=keys), protocol.ContainsReply)
        return reply.prefix if reply is not None else 0

    async def pin(self, keys: list[ChunkKey], num_tokens: list[int], ttl_secs: float | None = None) -> int:
        # A pin may wait for chunks still being written: allow for that on top of the control timeout.
        reply = await self._request("pin", protocol.ChunkKeys(keys=keys, num_tokens=num_tokens, ttl_secs=ttl_secs),
                                    protocol.CommandReply, self.request_timeout + 5.0)
        return reply.num_tokens if reply is not None else 0

    async def unpin(self, keys: list[ChunkKey], num_tokens: list[int]) -> int:
        reply = await self._request("unpin", protocol.ChunkKeys(keys=keys, num_tokens=num_tokens),
                                    protocol.CommandReply)
        return reply.num_tokens if reply is not None else 0

    async def touch(self, keys: list[ChunkKey]) -> None:
        await self._request("touch", protocol.ChunkKeys(keys=keys), protocol.Ack)

    async def remove(self, keys: list[ChunkKey]) -> int:
        reply = await self._request("remove", protocol.ChunkKeys(keys=keys), protocol.CommandReply)
        return reply.num_chunks if reply is not None else 0

    async def clear(self) -> int:
        """Take back this caller's claims; the tokens of the chunks it no longer claims."""
        reply = await self._request("clear", protocol.ClearRequest(), protocol.CommandReply)
        return reply.num_tokens if reply is not None else 0

    async def stats(self) -> list[protocol.StatsReply]:
        reply = await self._request("stats", protocol.StatsRequest(), protocol.StatsReply)
        return [reply] if reply is not None else []

    # ---- extras ----------------------------------------------------------------------------------------
    async def wait_written(self, timeout: float = 30.0, poll: float = 0.005) -> bool:
        """Wait until the store has no write in flight (every accepted put is on disk or failed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = await self.stats()
            if stats and stats[0].details.get("pending_writes", 1) == 0:
                return True
            await asyncio.sleep(poll)
        return False

    async def close(self) -> None:
        """Take the lent pools back (the store unmaps them). Gets still unsettled stay so for good (their
        buffers are never reused: the engine is stopping)."""
        self._closed = True
        self._pools.close()

    async def _settled(self, registration: Registration, get_id: int, deadline: float) -> bool:
        """Once the store can no longer write into the pool for get `get_id`: True when it acked our cancel_get,
        or when its end of the pool connection closed (it exited, or dropped the pool after its last write).
        Asks again every request_timeout meanwhile. False if this client closes first (nothing can be known
        then). A refusal is no ack: a store that does not know the token (another process with the same id)
        cannot promise anything about what the one we lent it to does."""
        cancel = protocol.CancelGet(pool=registration.token, get_id=get_id, deadline=deadline)
        gone = asyncio.ensure_future(registration.gone.wait())
        try:
            while not self._closed:
                if registration.peer_closed():
                    return True
                asked_at = time.monotonic()
                ask = asyncio.ensure_future(self._link.exchange(self.nc, "cancel_get", cancel, protocol.Ack,
                                                                self.request_timeout))
                await asyncio.wait([ask, gone], return_when=asyncio.FIRST_COMPLETED)
                if gone.done():
                    ask.cancel()
                    return True
                try:
                    reply = ask.result()
                    why = reply.error if reply is not None else "the store is resting"
                except Unanswered as exc:
                    reply, why = None, str(exc)
                if reply is not None and reply.ok:
                    return True
                log.debug("disk store %s: cancel of get %d not acked (%s); asking again", self.store_id, get_id, why)
                # at most once per request_timeout (a store with no responder answers at once)
                await asyncio.wait([gone], timeout=max(0.0, asked_at + self.request_timeout - time.monotonic()))
            return False
        finally:
            gone.cancel()

    # ---- plumbing --------------------------------------------------------------------------------------
    async def _pool_token(self, buffer: ChunkBuffer) -> str | None:
        """The token of the pool holding `buffer` (lending it first), or None: send the bytes inline."""
        return await self._pools.token(buffer.pool) if buffer.pool is not None else None

    async def _request(self, op: str, message: object, reply_type: type[T], timeout: float | None = None) -> T | None:
        return await self._link.request(self.nc, op, message, reply_type, timeout or self.request_timeout)
