"""The disk store's gets: a chunk file read straight into the pool slice its engine lent (or inline), and the
engine's cancels of its pooled gets.

A get: index hit -> I/O thread `readinto` straight into the engine's pool slice, checksum verified ->
answer with the chunk's meta. Inline `data` replaces the pool for small chunks or clients without a lent pool.
A pooled get carries the engine's get id and deadline: on arrival it is refused, writing nothing, if it is past
its deadline or was cancelled (`cancel_get`, a tombstone kept on the lent pool until the deadline); else it is
registered as writing into the pool until its readinto returns, and a `cancel_get` of it is answered only then.
So once the engine has its cancel acked, that get never writes into the slot again (services/engine/core/
storage_manager.py quarantines the slot until then).
A chunk file found corrupt or gone is dropped from the index (unless a newer put replaced it meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from kvmesh.shared import protocol

from kvmesh.services.disk_store.index import Entry, check_key
from kvmesh.services.disk_store.pools import LentPool, PoolRegistry
from kvmesh.shared.errors import StoreError
from kvmesh.shared.store_kit.chunk_index import ChunkIndex
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)

# cancelled gets remembered per lent pool until their deadline; a cancel past it is refused (the engine then
# keeps its slot out of use and asks again): a bound on what a caller can make the store hold
MAX_CANCELLED_GETS = 4096


class ChunkReader:
    """The `get` and `cancel_get` handlers of a disk store (its `reader`), on the store's event loop thread, which
    alone touches the index and the lent pools; reads run on the store's I/O pool (`io`, set when it opens).

    `counters` is the store's dict (gets, hits, corrupt_dropped, gets_* and get_cancels*); `domain_of` maps a
    caller to its sharing domain. `max_inline_bytes` caps inline GetReply data (NATS max_payload).
    """

    def __init__(self, store_id: str, root: Path, index: ChunkIndex[Entry], pools: PoolRegistry,
                 counters: dict[str, int], domain_of: Callable[[str], str]) -> None:
        self.store_id = store_id
        self.root = root
        self.index = index
        self.pools = pools
        self.counters = counters
        self.domain_of = domain_of
        self.max_inline_bytes = 1024 * 1024 - protocol.INLINE_HEADROOM
        self.io: ThreadPoolExecutor | None = None

    async def get(self, request: protocol.GetRequest, caller: str) -> protocol.GetReply:
        """Read a chunk into the pool `caller` lent (or inline)."""
        self.counters["gets"] += 1
        key = request.key
        try:
            check_key(key)
        except StoreError as exc:
            return protocol.GetReply(found=False, error=str(exc))
        domain = self.domain_of(caller)
        entry = self.index.visible(key, domain)
        if entry is None:  # also another domain's chunk: a miss, as if absent
            return protocol.GetReply(found=False)
        inline: bytearray | None = None
        pool: LentPool | None = None
        try:
            if request.pool:
                if request.capacity < entry.nbytes:
                    raise StoreError(f"buffer of {request.capacity} bytes is too small for {entry.nbytes}")
                out = self.pools.view(request.pool, caller, request.pool_offset, entry.nbytes)
                if request.get_id:
                    pool = self.pools.lent(request.pool, caller)
                    refusal = self._admit_get(pool, request)
                    if refusal is not None:
                        return protocol.GetReply(found=False, error=refusal)
                self.counters["gets_pool"] += 1
            else:
                if entry.nbytes > self.max_inline_bytes:
                    raise StoreError(f"chunk of {entry.nbytes} bytes is over the inline limit "
                                     f"({self.max_inline_bytes}): lend a pool")
                inline = bytearray(entry.nbytes)
                out = memoryview(inline)
                self.counters["gets_inline"] += 1
        except StoreError as exc:
            return protocol.GetReply(found=False, error=str(exc))
        self.index.touch(key, domain)
        try:
            if pool is not None:  # admitted above, with no await since: registered as it starts
                meta = await self._write_into(pool, request.get_id, _read_chunk, self.root, key, out)
            else:
                meta = await asyncio.get_running_loop().run_in_executor(self.io, _read_chunk, self.root, key, out)
        except chunk_file.CorruptChunkFile as exc:
            self.counters["corrupt_dropped"] += 1
            log.warning("disk store: dropping corrupt chunk %s: %s", key.hex(), exc)
            self.index.drop(key, entry)  # _read_chunk deleted the file (if no newer one replaced it)
            return protocol.GetReply(found=False, error=f"corrupt chunk file dropped: {exc}")
        except FileNotFoundError:
            log.warning("disk store: the file of chunk %s vanished; forgetting it", key.hex())
            self.index.drop(key, entry)
            return protocol.GetReply(found=False, error="chunk file vanished")
        except (OSError, StoreError) as exc:
            return protocol.GetReply(found=False, error=f"read of {key.hex()} failed: {exc}")
        self.counters["hits"] += 1
        return protocol.GetReply(found=True, meta=meta, data=bytes(inline) if inline is not None else None)

    def _admit_get(self, pool: LentPool, request: protocol.GetRequest) -> str | None:
        """Why a pooled get may not write into `pool`, or None. The caller registers it (`_write_into`) with no
        await in between, so no cancel_get can come between the checks and the registration: a cancel either
        finds the get registered (and waits for its write) or leaves a tombstone that this check finds."""
        get_id = request.get_id
        if pool.cancelled.pop(get_id, None) is not None:
            self.counters["gets_cancelled"] += 1
            return f"get {get_id} was cancelled by its engine before it arrived"
        if time.monotonic() > request.deadline:
            self.counters["gets_late"] += 1
            return f"get {get_id} arrived after its deadline (the engine has given up on it)"
        if get_id in pool.writing:
            return f"get {get_id} is already being served (get ids must be unique)"
        return None

    async def _write_into(self, pool: LentPool, get_id: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` (which writes into `pool`) on the I/O pool, registered in `pool.writing[get_id]` from the
        call (before its first await) until the thread is done with it, not until this coroutine ends: a
        cancelled handler leaves a thread that may still be writing."""
        assert self.io is not None
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        pool.writing[get_id] = done

        def ended() -> None:
            if pool.writing.get(get_id) is done:
                del pool.writing[get_id]
            if not done.done():
                done.set_result(None)

        def ended_in_thread(_: object) -> None:
            try:
                loop.call_soon_threadsafe(ended)
            except RuntimeError:  # the loop is closed: the process is ending
                pass

        try:
            work = self.io.submit(fn, *args)
        except BaseException:
            ended()
            raise
        work.add_done_callback(ended_in_thread)
        return await asyncio.wrap_future(work)

    async def cancel_get(self, request: protocol.CancelGet, caller: str) -> protocol.Ack:
        """The engine gave up on its get `request.get_id`: answer ok only once that get can no longer write into
        the pool (its write is over, or it will be refused on arrival). Scoped to the caller's own pool."""
        self.counters["get_cancels"] += 1
        try:
            pool = self.pools.lent(request.pool, caller)
        except StoreError as exc:  # not our pool (another store process lent it, or it was taken back)
            self.counters["get_cancels_refused"] += 1
            return protocol.Ack(ok=False, error=f"disk store {self.store_id}: {exc}")
        writing = pool.writing.get(request.get_id)
        if writing is not None:
            await asyncio.shield(writing)  # its readinto is over when this resolves
            return protocol.Ack()
        now = time.monotonic()
        if now > request.deadline:  # should it still arrive, the deadline check refuses it
            return protocol.Ack()
        for get_id, deadline in list(pool.cancelled.items()):
            if now > deadline:
                del pool.cancelled[get_id]
        if len(pool.cancelled) >= MAX_CANCELLED_GETS:
            self.counters["get_cancels_refused"] += 1
            return protocol.Ack(ok=False, error=(f"disk store {self.store_id}: {len(pool.cancelled)} "
                                                 "cancelled gets of this pool pending already; ask again later"))
        pool.cancelled[request.get_id] = request.deadline
        return protocol.Ack()


def _read_chunk(root: Path, key: ChunkKey, out: memoryview) -> protocol.ChunkMeta:
    """I/O thread: read a chunk file into `out`, verify it, and mark it recently used for the next start."""
    path = chunk_file.chunk_path(root, key)
    stat = path.stat()
    try:
        meta = chunk_file.read_chunk_into(path, out)
        if meta.key != key:
            raise chunk_file.CorruptChunkFile(f"{path}: header names key {meta.key.hex()}")
    except chunk_file.CorruptChunkFile:
        chunk_file.unlink_chunk(root, key, only_inode=stat.st_ino)  # not a newer file written meanwhile
        raise
    try:
        # mtime = last use: the LRU order across restarts (atime is not reliable under noatime/relatime,
        # and the start-up scan's own reads would bump it).
        os.utime(path)
    except OSError:
        pass
    return meta
