"""The engine's client of the remote store: `RemoteStoreClient`, a StoreTier over every partition.

Runs on the engine's NATS event loop thread (all methods are coroutines). Each key goes to the replica that
owns its partition (shared/wire/partition.py; `store_ids` in partition order). Control ops (contains, pin, unpin,
remove, clear, stats) are NATS requests, sent to the partitions concerned in parallel and combined. Chunk bytes
go on direct TCP streams (remote_stream.py): per replica a few connections, negotiated over NATS once and kept.

Nothing here raises on a store problem: a dead, unreachable or refusing replica answers miss / False / 0 for its own keys, is
logged once per change of state, and is not asked again for `retry_interval` seconds (so a vanished host
costs one timeout, not one per call). Every wait is bounded: `request_timeout` for control ops and stream
set-up, plus `nbytes / min_transfer_rate` for a chunk's bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from nats.aio.client import Client as NatsClient

from kvmesh.shared import protocol

from kvmesh.services.engine.tiers.base import NO_RETENTION, ChunkBuffer, Retention, StoreLink, byte_view
from kvmesh.services.engine.tiers.remote_stream import StreamConnection, StreamPool, on_stream
from kvmesh.shared.messaging import bus
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.partition import partition_of

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Replica:
    """One partition's store as this client sees it: its state (StoreLink) and its kept stream connections."""

    link: StoreLink
    pool: StreamPool

    @property
    def store_id(self) -> str:
        return self.link.store_id


class RemoteStoreClient:
    """StoreTier of the remote store's partitions (`store_ids[i]` serves partition i), for `caller` (a path: an
    engine worker's `Principal.engine(instance).producer(worker)`; its puts, on NATS or on streams it asked for,
    are claimed by it, and its `clear` takes back only them)."""

    location = protocol.REMOTE

    def __init__(self, nc: NatsClient, store_ids: list[str], caller: str, request_timeout: float = 2.0, *,
                 min_transfer_rate: float = 100e6, retry_interval: float = 1.0, max_connections: int = 4,
                 tls: ssl.SSLContext | None = None) -> None:
        """`tls`: a client context trusting the stores' CA (shared/tls.py `client_context`): streams are TLS only."""
        if not store_ids:
            raise ValueError("RemoteStoreClient needs at least one store id")
        self.nc = nc
        self.store_ids = list(store_ids)
        self.request_timeout = request_timeout
        self.min_transfer_rate = min_transfer_rate  # bytes/s a chunk transfer may not fall below
        self.retry_interval = retry_interval
        self._name = f"{socket.gethostname()}:{os.getpid()}"
        self.caller = caller
        self._replicas = [_Replica(StoreLink(store_id, f"remote store {store_id}", log, caller, retry_interval),
                                   StreamPool(self._negotiator(store_id, caller), self._name, max_connections, tls))
                          for store_id in self.store_ids]

    # ---- routing -----------------------------------------------------------------------------------------
    def partition(self, key: ChunkKey) -> int:
        return partition_of(key, len(self._replicas))

    def _group(self, keys: list[ChunkKey]) -> dict[int, list[int]]:
        """Positions of `keys` per partition, each list in prefix order."""
        groups: dict[int, list[int]] = {}
        for position, key in enumerate(keys):
            groups.setdefault(self.partition(key), []).append(position)
        return groups

    # ---- StoreTier: bytes -------------------------------------------------------------------------
    async def put(self, meta: protocol.ChunkMeta, buffer: ChunkBuffer,
                  retention: Retention = NO_RETENTION) -> bool:
        replica = self._replicas[self.partition(meta.key)]
        data = byte_view(buffer.view)[: meta.nbytes]
        if len(data) != meta.nbytes:
            log.error("remote put of %s: buffer holds %d bytes, the meta says %d", meta.key.hex(), len(data),
                      meta.nbytes)
            return False
        lease_secs = retention.lease_secs() or 0.0
        ack = await self._on_stream(replica, meta.nbytes,
                                    lambda conn: conn.put(meta, data, retention.priority, lease_secs))
        if ack is None:
            return False
        if not ack.ok:
            replica.link.refused(f"chunk {meta.key.hex()}: {ack.error}")
            return False
        replica.link.accepted()
        return True

    async def get_into(self, key: ChunkKey, buffer: ChunkBuffer) -> protocol.ChunkMeta | None:
        replica = self._replicas[self.partition(key)]
        view = byte_view(buffer.view)
        reply = await self._on_stream(replica, len(view), lambda conn: conn.get_into(key, view))
        if reply is None or not reply.found:
            if reply is not None and reply.error:
                log.warning("remote store %s: get %s: %s", replica.store_id, key.hex(), reply.error)
            return None
        return reply.meta

    # ---- StoreTier: control -----------------------------------------------------------------------
    async def contains(self, keys: list[ChunkKey]) -> int:
        """The held prefix of `keys`: each partition reports the prefix of its own keys; the first key any
        partition lacks (or any unreachable partition owns) ends the combined prefix."""
        if not keys:
            return 0
        groups = self._group(keys)
        replies = await self._each(groups, lambda i, positions: self._request(
            i, "contains", protocol.ChunkKeys(keys=[keys[p] for p in positions]), protocol.ContainsReply))
        return min(_first_missing(positions, reply.prefix if reply else 0, len(keys))
                   for positions, reply in zip(groups.values(), replies))

    async def pin(self, keys: list[ChunkKey], num_tokens: list[int], ttl_secs: float | None = None) -> int:
        """Pin the contiguous held prefix of `keys` across partitions; the number of tokens pinned.

        Each partition pins its own held prefix; pins past the combined prefix are then taken back, so only
        the chunks a reader can actually use stay pinned.
        """
        if not keys:
            return 0
        groups = self._group(keys)
        tokens_of = _tokens_by_position(keys, num_tokens)
        replies = await self._each(groups, lambda i, positions: self._request(
            i, "pin", protocol.ChunkKeys(keys=[keys[p] for p in positions], num_tokens=[tokens_of[p] for p in positions],
                                         ttl_secs=ttl_secs), protocol.CommandReply))
        pinned = {i: positions[: reply.num_chunks if reply and reply.ok else 0]
                  for (i, positions), reply in zip(groups.items(), replies)}
        prefix = min(_first_missing(positions, len(pinned[i]), len(keys)) for i, positions in groups.items())
        extras = {i: [p for p in positions if p >= prefix] for i, positions in pinned.items()}
        extras = {i: positions for i, positions in extras.items() if positions}
        if extras:
            await self._each(extras, lambda i, positions: self._request(
                i, "unpin", protocol.ChunkKeys(keys=[keys[p] for p in positions],
                                               num_tokens=[tokens_of[p] for p in positions]), protocol.CommandReply))
        return sum(tokens_of[p] for p in range(prefix))

    async def unpin(self, keys: list[ChunkKey], num_tokens: list[int]) -> int:
        if not keys:
            return 0
        groups = self._group(keys)
        tokens_of = _tokens_by_position(keys, num_tokens)
        replies = await self._each(groups, lambda i, positions: self._request(
            i, "unpin", protocol.ChunkKeys(keys=[keys[p] for p in positions],
                                           num_tokens=[tokens_of[p] for p in positions]), protocol.CommandReply))
        return sum(reply.num_tokens for reply in replies if reply and reply.ok)

    async def touch(self, keys: list[ChunkKey]) -> None:
        await self._each(self._group(keys), lambda i, positions: self._request(
            i, "touch", protocol.ChunkKeys(keys=[keys[p] for p in positions]), protocol.Ack))

    async def remove(self, keys: list[ChunkKey]) -> int:
        if not keys:
            return 0
        groups = self._group(keys)
        replies = await self._each(groups, lambda i, positions: self._request(
            i, "remove", protocol.ChunkKeys(keys=[keys[p] for p in positions]), protocol.CommandReply))
        return sum(reply.num_chunks for reply in replies if reply and reply.ok)

    async def clear(self) -> int:
        """Take back this caller's claims in every partition; the tokens of the chunks it no longer claims."""
        replies = await asyncio.gather(*(self._request(i, "clear", protocol.ClearRequest(), protocol.CommandReply)
                                         for i in range(len(self._replicas))))
        return sum(reply.num_tokens for reply in replies if reply and reply.ok)

    async def stats(self) -> list[protocol.StatsReply]:
        replies = await asyncio.gather(*(self._request(i, "stats", protocol.StatsRequest(), protocol.StatsReply)
                                         for i in range(len(self._replicas))))
        return [reply for reply in replies if reply is not None]

    async def close(self) -> None:
        """Close the kept stream connections (the NATS connection is the caller's)."""
        for replica in self._replicas:
            replica.pool.close()

    # ---- plumbing ----------------------------------------------------------------------------------------
    def _negotiator(self, store_id: str, caller: str) -> Callable[[], Awaitable[protocol.StreamOffer]]:
        async def negotiate() -> protocol.StreamOffer:  # the ticket binds the stream to `caller`
            return await bus.request(self.nc, protocol.Subjects.store(store_id, "stream", caller),
                                     protocol.StreamRequest(client=self._name), protocol.StreamOffer,
                                     self.request_timeout)
        return negotiate

    async def _each(self, groups: dict[int, list[int]],
                    call: Callable[[int, list[int]], Awaitable[T | None]]) -> list[T | None]:
        """`call(partition, positions)` for every group at once; results in the groups' order."""
        return list(await asyncio.gather(*(call(i, positions) for i, positions in groups.items())))

    async def _request(self, partition: int, op: str, message: object, reply_type: type[T]) -> T | None:
        return await self._replicas[partition].link.request(self.nc, op, message, reply_type, self.request_timeout)

    async def _on_stream(self, replica: _Replica, nbytes: int,
                         op: Callable[[StreamConnection], Awaitable[T]]) -> T | None:
        return await on_stream(replica.pool, replica.link, self.request_timeout + nbytes / self.min_transfer_rate, op)


def _first_missing(positions: list[int], held: int, total: int) -> int:
    """The position of the first key of a partition that is not held (`total` when all of them are)."""
    return positions[held] if held < len(positions) else total


def _tokens_by_position(keys: list[ChunkKey], num_tokens: list[int]) -> list[int]:
    if len(num_tokens) != len(keys):
        raise ValueError(f"num_tokens has {len(num_tokens)} entries for {len(keys)} keys")
    return list(num_tokens)
