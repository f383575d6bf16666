"""The remote store's memory: chunk bytes in recycled buffers, indexed by ChunkIndex (eviction policy under a cap,
pins).

Runs in the store process, on its one asyncio event loop: the stream connections (stream_server.py) and the NATS
handlers (service.py) all call in from that loop, so nothing here takes a lock. Worker threads only fault in
new buffers (buffers.py), read files at start and write/delete files (persistence.py); they touch a chunk's
bytes only while the chunk's `users` count says so.

A put is two steps around the bytes' arrival: `begin_put` checks the chunk, reserves room (evicting the policy's
victims) and hands out a faulted buffer; a stream put reserves only RESERVE_STEP bytes there, and the rest as its
bytes arrive (`make_room`), so a put that announces a size and never sends the bytes evicts no more than a step's
worth; `commit_put` verifies the bytes against the meta's checksum (which every
put carries) and only then makes the chunk visible; bytes that fail it are never held, served or reported
(`abort_put` also if the bytes never came). Every put records its caller's claim (shared/store_kit/chunk_index.py), also
on a chunk already held. With `persist_dir` the pins, claims and puts' retention (kv_priority, lease) are saved
beside the chunk files (shared/store_kit/state_file.py: pin, unpin, remove, clear and wipe are answered once the
files hold their effect; puts' claims and retention follow within a second), else a restart starts with none. A get `acquire`s a chunk, sends its bytes, and
`release`s it: an eviction meanwhile only marks the chunk dropped, and its buffer is recycled when the last user
lets go.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvmesh.shared import protocol

from kvmesh.services.remote_store import persistence
from kvmesh.services.remote_store.buffers import BufferPool, size_class
from kvmesh.shared.errors import StoreError
from kvmesh.shared.messaging.sharing_domains import DomainMap
from kvmesh.shared.store_kit.chunk_index import ChunkIndex, ForeignChunk, SpaceRefused
from kvmesh.shared.store_kit.state_file import StoreState
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KEY_BYTES, ChunkKey
from kvmesh.shared.wire.partition import partition_of

log = logging.getLogger(__name__)

MAX_SPARE_BYTES = 256 * 1024 * 1024  # faulted buffers kept for the next puts (at most 1/8 of the capacity)
RESERVE_STEP = 8 * 1024 * 1024  # how far ahead of a stream put's bytes its room is made


class PutRefused(StoreError):
    """A put the store cannot take: wrong partition, bad meta, no room, or bytes that fail their checksum."""


@dataclass(eq=False)
class StoredChunk:
    """One chunk: its meta and its bytes (the first `meta.nbytes` of `buffer`).

    `users` counts the sends and file writes reading `buffer`; `dropped` is set when the chunk leaves the
    index, and the buffer goes back to the pool once both say nobody needs it.
    """

    meta: protocol.ChunkMeta
    charge: int  # the buffer's size: what the chunk counts against the capacity
    buffer: np.ndarray | None = None
    users: int = 0
    dropped: bool = False

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    def data(self) -> memoryview:
        assert self.buffer is not None, f"chunk {self.meta.key.hex()} has no buffer"
        return memoryview(self.buffer)[: self.meta.nbytes]


@dataclass
class StoreCounters:
    puts: int = 0
    put_bytes: int = 0
    duplicate_puts: int = 0
    refused_puts: int = 0
    gets: int = 0
    get_hits: int = 0
    get_bytes: int = 0
    checksum_failures: int = 0
    retentions_dropped: int = 0  # persisted retentions read back out of bounds (dropped, or lease end clamped)
    started_at: float = field(default_factory=time.time)


class MemoryStore:
    """Chunks of one key partition in memory, under `capacity_bytes`, optionally mirrored in `persist_dir`."""

    def __init__(self, capacity_bytes: int, partition: int = 0, num_partitions: int = 1,
                 persist_dir: Path | None = None, fsync: bool = True, cache_policy: str = "LRU",
                 on_admit: Callable[[ChunkKey], None] | None = None,
                 on_evict: Callable[[ChunkKey], None] | None = None, prefault_bytes: int = 0,
                 fault_ahead_bytes: int = 0) -> None:
        if not 0 <= partition < num_partitions:
            raise ValueError(f"partition {partition} is not in 0..{num_partitions - 1}")
        if not 0 <= prefault_bytes <= capacity_bytes:
            raise ValueError(f"prefault of {prefault_bytes} bytes: must be between 0 and the capacity "
                             f"({capacity_bytes})")
        if fault_ahead_bytes < 0:
            raise ValueError(f"fault-ahead margin of {fault_ahead_bytes} bytes: must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.partition = partition
        self.num_partitions = num_partitions
        self.index: ChunkIndex[StoredChunk] = ChunkIndex(capacity_bytes, policy=cache_policy)
        self.domains = DomainMap(None)  # callers' sharing domains (the service sets the store's map)
        self.retained_share = 0.5  # of the capacity, what one principal's retained puts may keep (--retained-share)
        if on_admit is not None:
            self.index.on_admit = on_admit
        if on_evict is not None:
            self.index.on_evict = on_evict
        self.pool = BufferPool(max_spare_bytes=min(capacity_bytes // 8, MAX_SPARE_BYTES),
                               fault_ahead_bytes=fault_ahead_bytes)
        self.prefault_bytes = prefault_bytes
        self.persister = persistence.Persister(persist_dir, self.release, fsync) if persist_dir else None
        self.state = StoreState(persist_dir, self.index, keeps_retention=True) if persist_dir is not None else None
        self.counters = StoreCounters()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    async def open(self) -> int:
        """Fault in the prefault arena, load the persisted chunks, their pins and their claims (if any) and start
        persisting; the number of chunks loaded."""
        # counted as free room until carved (`_free_room`, trim); faulted further ahead in the background
        await self.pool.prefault(self.prefault_bytes, self.capacity_bytes)
        loaded = 0
        if self.persister is not None and self.state is not None:
            loaded = await self._load(self.persister.root)
            restored = await asyncio.to_thread(self.state.restore, self.domains.names_other_domains(),
                                               self.retained_share)
            self.free(restored.strays)  # put just before a crash: their sharing domain is unknown
            self.counters.retentions_dropped = restored.retention_dropped
            if restored.retained or restored.retention_dropped:
                log.info("restored the retention of %d chunks from %s; %d persisted retentions out of bounds",
                         restored.retained, self.persister.root, restored.retention_dropped)
            loaded = len(self.index)
            self.persister.start()
        self.pool.fault_ahead(self._fault_room())  # the first puts find faulted memory, the store serving meanwhile
        return loaded

    async def close(self) -> None:
        if self.persister is not None:
            await self.persister.stop()
        if self.state is not None:
            await self.state.close()
        await self.pool.close()

    def save_soon(self) -> None:
        """Persist the pins and claims in the background if they changed (and the store persists)."""
        if self.state is not None:
            self.state.save_soon()

    async def save_now(self) -> None:
        """Return once the pins and claims files hold the index as it is (at once when the store does not
        persist); OSError if they could not be written."""
        if self.state is not None:
            await self.state.save_now()

    async def _load(self, root: Path) -> int:
        """Read back the newest chunk files that fit the capacity, oldest first (so LRU order survives)."""
        found = (await asyncio.to_thread(chunk_file.scan_directory, root)).chunks
        keep: list[chunk_file.FoundChunk] = []
        total, dropped = 0, 0
        for item in reversed(found):  # newest first
            charge = size_class(item.meta.nbytes)
            if partition_of(item.meta.key, self.num_partitions) != self.partition or total + charge > self.capacity_bytes:
                dropped += 1  # not ours any more (partitions changed) or past the capacity: a cache may forget
                self._delete_file(item.meta.key)
                continue
            keep.append(item)
            total += charge
        for item in reversed(keep):
            buffer = await self.pool.get(item.meta.nbytes)
            try:
                meta = await asyncio.to_thread(chunk_file.read_chunk_into, item.path, memoryview(buffer))
            except Exception as exc:
                log.warning("dropping persisted chunk %s: %s", item.path, exc)
                self.pool.give(buffer)
                self._delete_file(item.meta.key)
                dropped += 1
                continue
            self.index.load(meta.key, StoredChunk(meta, len(buffer), buffer))
        self.pool.trim(self._free_room())  # what the chunks did not take of the arena stays within the capacity
        if found:
            log.info("loaded %d persisted chunks (%d bytes) from %s; dropped %d", len(self.index),
                     self.index.used_bytes, root, dropped)
        return len(self.index)

    # ---- puts --------------------------------------------------------------------------------------------
    def check_put(self, meta: protocol.ChunkMeta) -> None:
        """Raise PutRefused naming the problem if this store must not hold `meta`'s chunk."""
        if len(meta.key) != KEY_BYTES:
            raise PutRefused(f"chunk key must be {KEY_BYTES} bytes, got {len(meta.key)}")
        owner = partition_of(meta.key, self.num_partitions)
        if owner != self.partition:
            raise PutRefused(f"chunk {meta.key.hex()} belongs to partition {owner} of {self.num_partitions}, "
                             f"this store is partition {self.partition} (clients disagree on the partitions?)")
        if meta.nbytes <= 0 or size_class(meta.nbytes) > self.capacity_bytes:
            raise PutRefused(f"chunk {meta.key.hex()}: {meta.nbytes} bytes does not fit a store of "
                             f"{self.capacity_bytes} bytes")
        try:
            chunk_file.check_meta(meta)
        except StoreError as exc:
            raise PutRefused(str(exc)) from None

    async def begin_put(self, meta: protocol.ChunkMeta, caller: str, ahead: int | None = None) -> StoredChunk | None:
        """Reserve room and a buffer for `meta`'s bytes put by `caller` (its path: the chunk's claim); None if
        the chunk is already held or arriving (drop the bytes: only the claim is new). `ahead`: reserve only
        this many bytes of room now, `make_room` the rest as the bytes arrive (None: all of it).

        Raises PutRefused. On success the caller fills `chunk.data()` and calls commit_put or abort_put.
        """
        self.check_put(meta)
        domain = self.domains.domain_of(caller)
        try:
            if self.index.claim(meta.key, caller, domain):
                self.index.touch(meta.key, domain)
                self.counters.duplicate_puts += 1
                self.save_soon()
                return None
        except ForeignChunk as exc:  # never lands in, nor replaces, another domain's chunk
            self.counters.refused_puts += 1
            raise PutRefused(f"remote store: put refused: {exc}") from None
        chunk = StoredChunk(meta, size_class(meta.nbytes))
        try:
            evicted = self.index.reserve(meta.key, chunk, caller, None if ahead is None else min(ahead, chunk.charge),
                                         domain)
        except SpaceRefused as exc:
            self.counters.refused_puts += 1
            raise PutRefused(str(exc)) from None
        for _, victim in evicted:
            self._drop(victim)  # a victim's buffer becomes a spare, usually of this very size class
        buffer = self.pool.take(meta.nbytes)
        self.pool.trim(self._free_room())  # the other spares never push memory past the capacity
        if buffer is None:
            try:
                buffer = await self.pool.get(meta.nbytes)
            except BaseException as exc:  # out of memory, or the store stopping: give the room back
                self.index.abort(meta.key, chunk)
                if isinstance(exc, MemoryError):
                    raise PutRefused(f"chunk {meta.key.hex()}: out of memory for {meta.nbytes} bytes") from None
                raise
        self.pool.fault_ahead(self._fault_room())  # the next puts find faulted memory (while the arena lasts)
        self.pool.fill_ahead(meta.nbytes, self._free_room())  # else the next chunk of a stream finds a spare ready
        chunk.buffer = buffer
        return chunk

    def retain(self, request: protocol.PutRequest, caller: str) -> None:
        """A put's retention (the storing request's kv_priority and lease), within the caller's principal's
        `retained_share` of the store (ChunkIndex.retain_put). Call once the put is begun (or found held)."""
        self.index.retain_put(request.meta.key, caller, request.priority, request.lease_secs, self.retained_share)
        self.save_soon()  # a held chunk's retention (one in flight: saved with its claim when it lands)

    def make_room(self, chunk: StoredChunk, upto: int) -> None:
        """Reserve room for the first `upto` bytes of a put begun with `ahead` (evicting as begin_put does);
        call before receiving them. Raises PutRefused (the put is then aborted) when pins leave no room."""
        try:
            evicted = self.index.grow(chunk.meta.key, chunk, upto)
        except SpaceRefused as exc:
            self.counters.refused_puts += 1
            self.abort_put(chunk)
            raise PutRefused(str(exc)) from None
        for _, victim in evicted:
            self._drop(victim)
        self.pool.trim(self._free_room())  # spares never take the room this put now holds

    def commit_put(self, chunk: StoredChunk, claimed: int | None = None, digest: int | None = None) -> None:
        """The bytes are in: verify them and make the chunk visible. Raises PutRefused on a checksum mismatch
        (the chunk is then dropped, never held).

        `digest` is the checksum computed over the bytes as they arrived (computed here when not given); it
        must equal the meta's, and so must `claimed`, the stream's trailer, when given.
        """
        meta = chunk.meta
        if digest is None:
            digest = chunk_file.checksum(chunk.data())
        if digest != meta.checksum or (claimed is not None and claimed != meta.checksum):
            self.abort_put(chunk)
            raise self._mismatch(meta, digest)
        self.make_room(chunk, chunk.charge)  # all of it, if the receiver made room only for the bytes
        if not self.index.commit(meta.key, chunk):
            self._drop(chunk, had_file=False)  # removed or cleared while the bytes were arriving: never held
            return
        self.counters.puts += 1
        self.counters.put_bytes += meta.nbytes
        self.save_soon()  # its claim
        if self.persister is not None:
            chunk.users += 1  # the file write reads the buffer; Persister calls release() after it
            self.persister.write(chunk)

    def abort_put(self, chunk: StoredChunk) -> None:
        self.index.abort(chunk.meta.key, chunk)
        self._drop(chunk, had_file=False)

    async def put_bytes(self, meta: protocol.ChunkMeta, data: bytes | memoryview, caller: str) -> None:
        """A whole put from bytes at hand (the inline NATS path). Raises PutRefused.

        The bytes are verified before any room is made: a put that fails its checksum evicts nothing. (A stream
        put makes room as it begins, before its bytes arrive; failing bytes are dropped at `commit_put`.)
        """
        if len(data) != meta.nbytes:
            raise PutRefused(f"chunk {meta.key.hex()}: {len(data)} bytes sent, the meta says {meta.nbytes}")
        self.check_put(meta)
        digest = chunk_file.checksum(data)
        if digest != meta.checksum:
            raise self._mismatch(meta, digest)
        chunk = await self.begin_put(meta, caller)
        if chunk is not None:
            chunk.data()[:] = data
            self.commit_put(chunk, digest=digest)  # `data` is immutable bytes or the caller's, unchanged meanwhile

    def _mismatch(self, meta: protocol.ChunkMeta, digest: int) -> PutRefused:
        self.counters.checksum_failures += 1
        return PutRefused(f"chunk {meta.key.hex()}: the bytes received do not match their checksum (the meta "
                          f"says {meta.checksum:#x}, the bytes hash to {digest:#x})")

    # ---- gets --------------------------------------------------------------------------------------------
    def acquire(self, key: ChunkKey, caller: str) -> StoredChunk | None:
        """A chunk held in `caller`'s sharing domain, marked in use (call `release` when its bytes are sent); None
        on a miss (another domain's chunk is one)."""
        self.counters.gets += 1
        chunk = self.index.touch(key, self.domains.domain_of(caller))
        if chunk is None:
            return None
        chunk.users += 1
        self.counters.get_hits += 1
        self.counters.get_bytes += chunk.meta.nbytes
        return chunk

    def release(self, chunk: StoredChunk) -> None:
        chunk.users -= 1
        if chunk.dropped and chunk.users == 0:
            self._recycle(chunk)

    # ---- control (the ops themselves are the shared IndexOps over `index`; service.py wires them) ------------
    def free(self, removed: list[tuple[ChunkKey, StoredChunk]]) -> None:
        """Chunks removed, cleared or wiped from the index: delete their files, recycle their buffers when
        unused."""
        for _, chunk in removed:
            self._drop(chunk)

    def details(self) -> dict[str, Any]:
        c = self.counters
        return {
            "partition": self.partition, "num_partitions": self.num_partitions,
            "reserved_bytes": self.index.reserved_bytes, "puts_in_flight": self.index.in_flight_count,
            "retains_refused": self.index.retains_refused, "retentions_dropped": self.counters.retentions_dropped,
            "spare_bytes": self.pool.spare_bytes, "buffers_allocated": self.pool.allocated,
            "prefaulted_bytes": self.pool.prefaulted_bytes, "arena_bytes": self.pool.arena_bytes,
            "persist_dir": str(self.persister.root) if self.persister else None,
            "pending_writes": self.persister.pending if self.persister else 0,
            "persist_failures": self.persister.failures if self.persister else 0,
            "puts": c.puts, "put_bytes": c.put_bytes, "duplicate_puts": c.duplicate_puts,
            "refused_puts": c.refused_puts, "gets": c.gets, "get_hits": c.get_hits, "get_bytes": c.get_bytes,
            "checksum_failures": c.checksum_failures, "started_at": c.started_at,
        }

    # ---- internals ---------------------------------------------------------------------------------------
    def _free_room(self) -> int:
        return self.capacity_bytes - self.index.used_bytes - self.index.reserved_bytes

    def _fault_room(self) -> int:
        """The free room less what the puts in flight have yet to reserve (as their bytes arrive): faulting that
        ahead would only be handed back as they make room."""
        arriving = sum(chunk.charge for _, chunk in self.index.in_flight_items())
        return self._free_room() - max(0, arriving - self.index.reserved_bytes)

    def _drop(self, chunk: StoredChunk, had_file: bool = True) -> None:
        """`chunk` left the index (evicted, removed, discarded): delete its file, recycle its buffer when free.

        Only a chunk that was held can have a file; a put that never became visible must not queue a delete,
        which could land after (and destroy) the file of a later put of the same key.
        """
        chunk.dropped = True
        if had_file:
            self._delete_file(chunk.meta.key)
        if chunk.users == 0:
            self._recycle(chunk)

    def _delete_file(self, key: ChunkKey) -> None:
        if self.persister is not None:
            self.persister.delete(key)

    def _recycle(self, chunk: StoredChunk) -> None:
        buffer, chunk.buffer = chunk.buffer, None
        if buffer is not None:
            self.pool.give(buffer)
