"""Chunks encrypted at rest in the disk store and the remote store: sealed by the engine on the way in, opened on the
way out, so the stores hold only ciphertext and never a key (docs/security.md, "Encryption at rest").

`ChunkSealer` is the format, under a key derived from the engine's sharing domain (its name and secret): what a
store holds as a chunk's bytes is SEALED_MAGIC, the key id, the nonce, the plaintext's checksum, the chunk's bytes
encrypted with AES-256-GCM (shared/wire/aead.py, the Redis tier's construction) and the tag. The associated data
is the chunk key and its meta (token count, shape, dtype, format, size, checksum), so a chunk moved under another
key, or whose meta was changed, fails its tag. The store sees an ordinary chunk: the same meta, `nbytes` longer by
SEAL_OVERHEAD, `checksum` the xxh3 of the sealed bytes, which it verifies as always.

`SealedTier` wraps a store's client (disk.py, remote.py) with it. It seals into a staging slot of its own memory
pool, the one the store reads (for the disk store a shared segment lent to it, so the sealed bytes go to the store
in place, as a plain chunk's do), and the store reads a get into a staging slot from which the chunk is opened
straight into the caller's buffer: one AES-GCM pass each way, no other copy. A get the store did not answer keeps
its staging slot until the store settles (StoreMayWrite, passed on: the storage manager's bound on such gets
holds). A chunk that does not open (sealed
under another key: another domain or a rotated secret; a failed tag; not sealed: written before encryption or with
it off) is a miss, counted in the storage manager's stats (`sealed_miss_<why>`) and logged at most once per 10 s
per cause.

An engine with both stores seals a chunk once (`PutSeals`, shared by its two sealed tiers and their one staging
pool): the write-behind puts a chunk to both at once, and both get the same sealed bytes, nonce and all. Nothing
in a sealed chunk names its store (one key, the sharing domain's; the associated data is the chunk key and meta,
which both stores are given alike), so each opens it the same way; the same bytes under one nonce in two places
tell no more than two stores holding one chunk.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import struct
from typing import Any, AsyncIterator, Callable, TypeVar

import msgpack

from kvmesh.shared import protocol
from kvmesh.shared.rate_limited_log import RateLimitedLog
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.aead import KEY_ID_BYTES, NONCE_BYTES, TAG_BYTES, Aead, derive, framed
from kvmesh.shared.wire.keys import ChunkKey

from kvmesh.services.engine.tiers.base import NO_RETENTION, ChunkBuffer, Retention, StoreMayWrite, StoreTier
from kvmesh.services.engine.tiers.memory_pool import MemoryPool, Slot

log = logging.getLogger(__name__)

_T = TypeVar("_T")

SEALED_MAGIC = b"KVMSC\x01\x00\x00"  # a sealed chunk, version 1
_PREFIX = struct.Struct(f"<{len(SEALED_MAGIC)}s{KEY_ID_BYTES}s{NONCE_BYTES}sQ")  # magic, key id, nonce, checksum
SEAL_OVERHEAD = _PREFIX.size + TAG_BYTES  # what a sealed chunk adds to the chunk's bytes


class SealRejected(Exception):
    """A stored chunk that does not open under this engine's key. `why`: "unsealed" (no sealed chunk: written
    without encryption, or by an older KVMesh), "foreign" (sealed under another key: another sharing domain or a
    rotated secret), "tag" (moved under another key, its meta changed, forged or damaged)."""

    def __init__(self, why: str, message: str) -> None:
        super().__init__(message)
        self.why = why


class ChunkSealer:
    """Seals and opens chunks under the key of sharing domain `domain` with its `secret` (None: keyed by the domain's
    name alone, which catches chunks moved between keys or domains, but does not keep anyone from reading them)."""

    def __init__(self, domain: str, secret: bytes | None) -> None:
        self.domain = domain
        self.keyed = secret is not None
        root = derive(secret or b"", b"kvmesh chunks at rest\0" + framed(domain.encode()))
        self.key_id = derive(root, b"kvmesh chunks at rest key id")[:KEY_ID_BYTES]
        self._aead = Aead(derive(root, b"kvmesh chunks at rest key"))

    def seal_into(self, meta: protocol.ChunkMeta, data: memoryview, out: memoryview) -> protocol.ChunkMeta:
        """Seal the chunk `meta` describes (its bytes at the start of `data`) into `out` (at least meta.nbytes +
        SEAL_OVERHEAD long); the meta of what the store is to hold. Blocking: one pass over the bytes, then the
        store's checksum over the sealed ones."""
        sealed = out[:meta.nbytes + SEAL_OVERHEAD]
        nonce = self._aead.seal_into(data[:meta.nbytes], _associated(meta), sealed[_PREFIX.size:])
        _PREFIX.pack_into(sealed, 0, SEALED_MAGIC, self.key_id, nonce, meta.checksum)
        return dataclasses.replace(meta, nbytes=len(sealed), checksum=chunk_file.checksum(sealed))

    def open_into(self, key: ChunkKey, stored: protocol.ChunkMeta, sealed: memoryview,
                  out: memoryview) -> protocol.ChunkMeta:
        """Open the chunk of `key` a store answered (`stored`, its bytes at the start of `sealed`) into `out`; the
        chunk's own meta. SealRejected when it is not a chunk this engine sealed under `key`."""
        if stored.nbytes < SEAL_OVERHEAD or bytes(sealed[:len(SEALED_MAGIC)]) != SEALED_MAGIC:
            raise SealRejected("unsealed", f"chunk {key.hex()} is not sealed (stored without encryption, or by an "
                                           "older KVMesh)")
        _, key_id, nonce, plain_checksum = _PREFIX.unpack_from(sealed)
        if key_id != self.key_id:
            raise SealRejected("foreign", f"chunk {key.hex()} is sealed under another key (another sharing domain, "
                                          "or a secret since rotated)")
        meta = dataclasses.replace(stored, key=key, nbytes=stored.nbytes - SEAL_OVERHEAD, checksum=plain_checksum)
        if meta.nbytes > len(out):
            raise SealRejected("tag", f"chunk {key.hex()}: {meta.nbytes} bytes do not fit a buffer of {len(out)}")
        if not self._aead.open_into(nonce, sealed[_PREFIX.size:stored.nbytes], _associated(meta), out[:meta.nbytes]):
            raise SealRejected("tag", f"chunk {key.hex()} fails its tag (moved from another key, its meta changed, "
                                      "forged or damaged)")
        return meta


def _associated(meta: protocol.ChunkMeta) -> bytes:
    """The associated data of a chunk: its key and every field of its meta."""
    return b"kvmesh sealed chunk\0" + msgpack.packb(
        [meta.key, meta.num_tokens, list(meta.shape), meta.dtype, meta.fmt, meta.nbytes, meta.checksum],
        use_bin_type=True)


@dataclasses.dataclass
class _Seal:
    sealing: asyncio.Task[tuple[Slot | None, protocol.ChunkMeta, ChunkBuffer]]
    users: int = 0


class PutSeals:
    """The seals of the puts in flight, by key id and associated data: a put of a chunk whose seal is under way
    (the same chunk put to the other store at the same time) waits for that seal and hands its store the same
    sealed bytes. The staging slot is released when the last of those puts ends. Tiers that share their seals
    share their staging pool too (in shared memory when one is the disk store's: it reads the sealed bytes in
    place)."""

    def __init__(self) -> None:
        self._seals: dict[tuple[bytes, bytes], _Seal] = {}

    @contextlib.asynccontextmanager
    async def sealed(self, tier: "SealedTier", meta: protocol.ChunkMeta,
                     buffer: ChunkBuffer) -> AsyncIterator[tuple[protocol.ChunkMeta, ChunkBuffer]]:
        """The chunk `meta` describes (in `buffer`), sealed by `tier` or by a put of it already under way: the
        meta and bytes its store is to hold, good until the block ends."""
        name = (tier.sealer.key_id, _associated(meta))
        seal = self._seals.get(name)
        if seal is None:  # a task of its own: a put cancelled while sealing does not fail the others waiting for it
            seal = self._seals[name] = _Seal(asyncio.ensure_future(tier.seal(meta, buffer)))
        seal.users += 1
        try:
            _, stored, staged = await asyncio.shield(seal.sealing)
            yield stored, staged
        finally:
            seal.users -= 1
            if seal.users == 0:
                del self._seals[name]
                seal.sealing.add_done_callback(_release_staging)  # at once when it is done


def _release_staging(sealing: asyncio.Task[tuple[Slot | None, protocol.ChunkMeta, ChunkBuffer]]) -> None:
    if not sealing.cancelled() and sealing.exception() is None:
        slot = sealing.result()[0]
        if slot is not None:
            slot.release()


class SealedTier:
    """`inner` (a disk or remote store's client) with every chunk sealed by `sealer` on put and opened on get.
    `staging` holds the sealed bytes on their way (its slots SEAL_OVERHEAD larger than the CPU pool's; shared memory
    for the disk store, so it reads them in place); when every slot is in use a put or get stages in process memory
    instead. `stats` is the storage manager's counter (`sealed_chunks`: the seals made). Tiers given the same
    `seals` (and `staging`) seal a chunk put to them at once only once."""

    def __init__(self, inner: StoreTier, sealer: ChunkSealer, staging: MemoryPool,
                 stats: collections.Counter[str], seals: PutSeals | None = None) -> None:
        self.inner = inner
        self.location = inner.location
        self.sealer = sealer
        self.staging = staging
        self.counts = stats
        self.seals = seals if seals is not None else PutSeals()
        self._rlog = RateLimitedLog(log)

    def __getattr__(self, name: str) -> Any:  # the client's extras (store_ids, wait_written, ...)
        return getattr(self.inner, name)

    async def put(self, meta: protocol.ChunkMeta, buffer: ChunkBuffer, retention: Retention = NO_RETENTION) -> bool:
        async with self.seals.sealed(self, meta, buffer) as (stored, staged):
            return await self.inner.put(stored, staged, retention)

    async def seal(self, meta: protocol.ChunkMeta,
                   buffer: ChunkBuffer) -> tuple[Slot | None, protocol.ChunkMeta, ChunkBuffer]:
        """The chunk `meta` describes sealed into a staging slot (None: process memory; the caller releases it):
        the meta the store is to hold and the sealed bytes."""
        slot, staged = self._stage(meta.nbytes + SEAL_OVERHEAD)
        try:
            stored = await self._in_thread(self.sealer.seal_into, meta, buffer.view, staged.view)
        except Exception:
            if slot is not None:
                slot.release()
            raise
        # (cancelled, the slot stays held: the thread may still be writing into it, and only a stop cancels this)
        self.counts["sealed_chunks"] += 1
        return slot, stored, dataclasses.replace(staged, view=staged.view[:stored.nbytes])

    async def get_into(self, key: ChunkKey, buffer: ChunkBuffer) -> protocol.ChunkMeta | None:
        slot, staged = self._stage(len(buffer.view) + SEAL_OVERHEAD)
        release = slot
        try:
            try:
                stored = await self.inner.get_into(key, staged)
            except StoreMayWrite as exc:  # the store may still write into the staging slot: held until it settles
                release = None
                raise StoreMayWrite(str(exc), lambda stalled=exc: self._settled(slot, stalled)) from None
            if stored is None:
                return None
            try:
                return await self._in_thread(self.sealer.open_into, key, stored, staged.view, buffer.view)
            except SealRejected as exc:
                self.counts[f"sealed_miss_{exc.why}"] += 1
                self._rlog.warning(exc.why, "%s: %s: treated as a miss", self.location, exc)
                return None
        finally:
            if release is not None:
                release.release()

    async def _in_thread(self, call: Callable[..., _T], *args: Any) -> _T:
        """`call(*args)` on a worker thread, which reads or writes the staging pool: a cancelled caller does not stop
        it, and the pool is not unmapped under it (`MemoryPool.in_use`; a stopping engine closes the pool)."""
        def in_staging() -> _T:
            with self.staging.in_use():
                return call(*args)

        return await asyncio.to_thread(in_staging)

    def _stage(self, nbytes: int) -> tuple[Slot | None, ChunkBuffer]:
        """A staging slot (None: process memory) and its buffer, at least `nbytes` long."""
        slot = self.staging.allocate() if nbytes <= self.staging.slot_nbytes else None
        if slot is not None:
            return slot, slot.chunk_buffer()
        self.counts["sealed_staged_in_process_memory"] += 1
        return None, ChunkBuffer(view=memoryview(bytearray(nbytes)))

    @staticmethod
    async def _settled(slot: Slot | None, exc: StoreMayWrite) -> bool:
        settled = await exc.settled()
        if settled and slot is not None:  # else the client closed: the engine is stopping, the slot stays held
            slot.release()
        return settled

    # ---- the rest is the store's -----------------------------------------------------------------------------------
    async def contains(self, keys: list[ChunkKey]) -> int:
        return await self.inner.contains(keys)

    async def pin(self, keys: list[ChunkKey], num_tokens: list[int], ttl_secs: float | None = None) -> int:
        return await self.inner.pin(keys, num_tokens, ttl_secs)

    async def unpin(self, keys: list[ChunkKey], num_tokens: list[int]) -> int:
        return await self.inner.unpin(keys, num_tokens)

    async def touch(self, keys: list[ChunkKey]) -> None:
        await self.inner.touch(keys)

    async def remove(self, keys: list[ChunkKey]) -> int:
        return await self.inner.remove(keys)

    async def clear(self) -> int:
        return await self.inner.clear()

    async def stats(self) -> list[protocol.StatsReply]:
        return await self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()
        # the store took the lent staging pool back with the client's close; a pool shared with the other store's
        # tier is closed by the first close (the engine is stopping), the second finds it closed
        self.staging.close()
