"""The disk store's operations: put here, get and cancel_get in reader.py; contains, pin, unpin, remove, clear,
wipe and stats are the shared `IndexOps` over this store's index (service.py wires them, with the hooks below).

Who runs what: every method runs on the store's asyncio event loop thread, which alone touches the index
(a `ChunkIndex[Entry]`, the same bookkeeping as the remote store's) and the lent pools. Blocking work goes
to threads: copies and file writes to `ChunkWriter` (one staging-copy thread, `writer_threads` writer threads),
reads, deletions and the pins and claims files to the I/O pool (`reader_threads`). The NATS wiring is in
service.py; this class never sees a subject.

The data path of a put: the engine's pool slice (the pool lent over the pool socket: pools.py) -> (memcpy,
hashing each piece) staging buffer -> checksum verified against the meta's -> room reserved -> answer
"accepted" -> writer thread: chunk file `<tmp>` + fsync + rename -> the key becomes held (visible) -> admission
event. A put without a checksum, or whose
bytes do not match it, is refused before anything is reserved: it evicts nothing and is never admitted.
With `durable_puts` the answer waits for the file instead: written, fsync'd, renamed into place, directory
fsync'd (write-through, staging unused), and, when the map names several sharing domains, the claims file
saved, so an accepted put survives a crash or power loss.
Every put records its caller's claim on the chunk, also when the chunk is already held or being written (then
only the claim is new); the claims file follows within a second (files.py). Where several sharing domains use
the store, a chunk file the claims file does not name at start (put in that second before a crash) is deleted:
the claim names the chunk's sharing domain, and a chunk of unknown domain must not come back readable by the
default one.
Gets and their cancels are reader.py's (`ChunkReader`).
A request names a pool by the token its engine got when lending it, never by a path: the store opens no file
that a message names.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from kvmesh.shared import protocol

from kvmesh.services.disk_store import files, snapshot
from kvmesh.services.disk_store.index import Entry, check_key
from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.pools import PoolRegistry
from kvmesh.services.disk_store.reader import ChunkReader
from kvmesh.services.disk_store.writer import ChunkWriter, StagingBuffer, StagingPool, WriteFaults
from kvmesh.shared.errors import StoreError
from kvmesh.shared.eviction import Clock
from kvmesh.shared.messaging.sharing_domains import DomainMap
from kvmesh.shared.store_kit.chunk_index import ChunkIndex, ForeignChunk, SpaceRefused
from kvmesh.shared.store_kit.retention_restore import restore_retention
from kvmesh.shared.store_kit.state_file import StoreState
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)

PIN_WAIT_SECS = 5.0  # a pin waits this long for chunks of the request that are still being written


class DiskStore:
    """One directory of chunk files with its index. `open()` first (blocking, before serving), `close()` last.

    The index's `on_admit(key)` / `on_evict(key)` are called as keys become visible or stop being visible (the
    service points them at its AdmissionReporter). Gets are its `reader`'s.
    """

    def __init__(self, options: DiskStoreOptions, faults: WriteFaults | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.options = options
        self.root = options.root
        # pin TTLs expire on `clock` (persisted as wall-clock times: index.py)
        self.index: ChunkIndex[Entry] = ChunkIndex(options.capacity_bytes, policy=options.cache_policy, clock=clock)
        self.faults = faults or WriteFaults.from_env()
        self.started_at = time.time()
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts_accepted", "puts_duplicate", "puts_refused", "writes_done", "write_errors", "gets", "hits",
             "corrupt_dropped", "checksum_failures", "evicted", "puts_pool", "puts_inline", "gets_pool",
             "gets_inline", "gets_late", "gets_cancelled", "get_cancels", "get_cancels_refused",
             "snapshot_files_dropped", "snapshot_files_added", "snapshot_retentions_dropped"), 0)
        self.last_write_error: str | None = None
        self.scan_report: chunk_file.ScanReport | None = None  # the start-up scan's counts (not its chunk list)
        self._lock_fd: int | None = None
        self._writer: ChunkWriter | None = None
        self._io: ThreadPoolExecutor | None = None
        self._staging = StagingPool(0)
        self.pools = PoolRegistry(options.store_id, options.max_pools, options.pool_hello_max_bytes,
                                  options.pool_hello_timeout_secs)
        self._writes: dict[ChunkKey, asyncio.Future[None]] = {}  # pending key -> resolves when it lands
        self._deleting: dict[ChunkKey, asyncio.Future[Any]] = {}  # key -> its file deletion in flight
        self._background: set[asyncio.Future[Any]] = set()
        self._snapshots: asyncio.Future[None] | None = None  # the periodic index snapshot
        self._snapshot_write: asyncio.Future[int] | None = None  # the latest write of one
        # Files a start took from the snapshot (`_trusted`; `_unchecked` of them not yet checked: stat, then header
        # where it changed: `check_snapshot_files`); a key rewritten meanwhile (`_rewritten`: a commit) is skipped,
        # its file being the store's own by then.
        self._trusted = snapshot.Records([], [], [])
        self._unchecked = 0
        self._rewritten: set[ChunkKey] = set()
        # Started from a complete snapshot: the directory is listed later, for files copied in behind the store.
        # Keys put or deleted since the start are noted meanwhile (`_touched`): the listing may be older.
        self._unlisted = False
        self._touched: set[ChunkKey] = set()
        self._verification: asyncio.Future[None] | None = None
        self.state = StoreState(self.root, self.index)
        self.domains = DomainMap(None)  # callers' sharing domains (the service sets the store's map)
        self.reader = ChunkReader(options.store_id, self.root, self.index, self.pools, self.counters,
                                  lambda caller: self.domains.domain_of(caller))  # the map as it is at each get

    # ---- life cycle ------------------------------------------------------------------------------------
    def open(self) -> chunk_file.ScanReport:
        """Lock the directory, rebuild the index (from its snapshot as far as it checks out, else from the files'
        headers: snapshot.py), restore pins and claims, trim to the cap. Blocking."""
        self._lock_fd = files.lock_directory(self.root)
        # The scan and the load make a few container objects per file and no cycles: the collector's passes over
        # them were a third of a start at 10^5 files (benchmarks/scale.py), so it waits until they are done.
        collecting = gc.isenabled()
        gc.disable()
        try:
            found = snapshot.scan(self.root)  # the index snapshot where it checks out, else the headers
            self.index.load_many(found.held)  # least recently used first
            report, self._trusted = found.report, found.trusted
            self._unchecked = len(found.trusted)
            self._unlisted = not found.listed
            retained, self.counters["snapshot_retentions_dropped"] = found.retained, found.retention_dropped
            del found
        finally:
            if collecting:
                gc.enable()
        restored = self.state.restore(several_domains=self.domains.names_other_domains())
        for key, _ in restored.strays:  # put just before a crash: its sharing domain is unknown
            chunk_file.unlink_chunk(self.root, key)
        refused = self.index.retains_refused
        share = self.options.bounds.retained_share
        retained_now = sum(restore_retention(self.index, kept.key, kept.owner, kept.priority, kept.lease_end, share)
                           for kept in retained)  # before the trim: it evicts unretained chunks first
        for key, _ in self.index.trim_to_capacity():  # the cap shrank since the last run (never drops a pin;
            chunk_file.unlink_chunk(self.root, key)  # claims of trimmed chunks are skipped at the next start)
            self.counters["evicted"] += 1
        self.scan_report = report
        self._writer = ChunkWriter(self.root, self.options.writer_threads, self.options.fsync, self.faults,
                                   sync_directory=self.options.durable_puts)
        self._io = ThreadPoolExecutor(max_workers=self.options.reader_threads, thread_name_prefix="disk-io")
        self.state.executor = self.reader.io = self._io
        # durable puts are answered after their file, so the bytes stay in the engine's memory until then
        self._staging = StagingPool(0 if self.options.durable_puts else self.options.staging_bytes)
        log.info("disk store %s: %s holds %d chunks, %d bytes of %d, %s eviction (scan %.3fs, index snapshot %s, "
                 "%d files taken from it, their stat checked in the background; deleted %d tmp, %d bad files; %d "
                 "pins and claims of %d chunks restored; %d retentions restored, %d past their owner's share, %d "
                 "out of bounds; %d chunks put just before a crash dropped)", self.options.store_id, self.root,
                 len(self.index), self.index.used_bytes, self.options.capacity_bytes, self.index.policy_name,
                 report.seconds, report.snapshot, report.trusted, report.removed_tmp, report.removed_corrupt,
                 restored.pinned, restored.claimed, retained_now,
                 self.index.retains_refused - refused, self.counters["snapshot_retentions_dropped"],
                 len(restored.strays))
        return report

    async def close(self, drain_timeout: float = 30.0) -> None:
        """Finish accepted writes (up to `drain_timeout`), save pins and claims, stop threads, release the
        directory."""
        if not await self.flush(drain_timeout):
            log.warning("disk store: %d writes still pending at close", len(self._writes))
        for task in (self._snapshots, self._verification):
            if task is not None:
                task.cancel()
                await asyncio.wait([task])
        if self._background:
            await asyncio.wait(list(self._background), timeout=drain_timeout)
        await self.state.close()
        if self._io is not None:  # opened: the next start reads this instead of every file's header
            # complete when no write is pending and the directory was listed: the next start need not list it
            await self.save_snapshot(complete=not self._writes and not self._unlisted)
        if self._writer is not None:
            self._writer.shutdown()
        if self._io is not None:
            self._io.shutdown(wait=True)
        self._staging.close()
        await self.pools.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def flush(self, timeout: float) -> bool:
        """Wait until every accepted write has landed or failed; False if some are still running."""
        deadline = time.monotonic() + timeout
        while self._writes:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.wait(list(self._writes.values()), timeout=left)
        return True

    # ---- put -------------------------------------------------------------------------------------------
    async def put(self, request: protocol.PutRequest, caller: str) -> protocol.Ack:
        """Take a chunk from `caller` (its path: the chunk's claim).

        "ok" means the bytes are staged and match their checksum; the chunk is held once its file is complete.
        With `durable_puts`, "ok" means the file is complete and durable (module docstring).
        """
        meta = request.meta
        try:
            check_key(meta.key)
            if meta.nbytes < 0 or meta.num_tokens < 0:
                raise StoreError(f"bad sizes: nbytes={meta.nbytes}, num_tokens={meta.num_tokens}")
            chunk_file.check_meta(meta)
            source = self._put_source(request, caller)
        except (StoreError, ValueError) as exc:
            return self._refuse(meta.key, str(exc))
        key = meta.key
        try:
            if self._known(key, caller):
                self.counters["puts_duplicate"] += 1
                self._retain(request, caller)
                return protocol.Ack()
        except ForeignChunk as exc:  # never lands in, nor replaces, another domain's chunk
            return self._refuse(key, str(exc))

        staging: StagingBuffer | None = None
        # Inline data is staged too (one memory bound, one behaviour); a chunk bigger than all of the staging
        # memory is written through instead. Staging and verifying come before reserving, so that waiting for
        # staging room, or bytes that fail their checksum, evict nothing.
        try:
            if self._staging.enabled and meta.nbytes <= self._staging.capacity_bytes:
                staging = await self._staging.acquire(meta.nbytes, self.options.staging_wait_secs)
                if staging is None:
                    return self._refuse(key, f"write queue full ({self._staging.in_use} bytes staged)")
                assert self._writer is not None
                digest = await self._writer.copy(staging.view, source)
            else:  # write-through: the engine waits for the answer, so its bytes stay put until the file is written
                digest = await self._in_io(chunk_file.checksum, source)
            entry = Entry(nbytes=meta.nbytes, file_bytes=len(chunk_file.encode_header(meta)) + meta.nbytes,
                          num_tokens=meta.num_tokens)
            answer = self._admit(meta, digest, entry, caller)
        except Exception as exc:
            answer = self._refuse(key, f"reading the bytes failed: {exc}")
        if answer is not None:
            if staging is not None:
                await self._staging.release(staging)
            return answer
        self._retain(request, caller)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writes[key] = done
        self.counters["puts_accepted"] += 1
        if staging is not None:
            self._spawn(self._write(meta, entry, staging.view, staging, done))
            return protocol.Ack()
        error = await self._write(meta, entry, source, None, done)  # write-through: answer once the file is complete
        if error is None and self.options.durable_puts and self.domains.names_other_domains():
            # and its claim, which names its sharing domain: with several domains, a chunk the claims file does
            # not name is dropped at start (StoreState.restore)
            try:
                await self.state.save_now()
            except OSError as exc:
                error = f"the chunk's file is written but its claim could not be saved: {exc}"
        return protocol.Ack(ok=error is None, error=error)

    def _retain(self, request: protocol.PutRequest, caller: str) -> None:
        """The put's retention, within the caller's principal's `--retained-share` (ChunkIndex.retain_put)."""
        self.index.retain_put(request.meta.key, caller, request.priority, request.lease_secs,
                              self.options.bounds.retained_share)

    def _admit(self, meta: protocol.ChunkMeta, digest: int, entry: Entry, caller: str) -> protocol.Ack | None:
        """Verify the staged bytes' `digest` and reserve room for them; the reply if the put ends here (refused,
        or a duplicate after all), None when the write may go ahead. No await: nothing changes in between."""
        key = meta.key
        if digest != meta.checksum:
            self.counters["checksum_failures"] += 1
            return self._refuse(key, f"the bytes do not match their checksum (the meta says {meta.checksum:#x}, "
                                     f"the bytes hash to {digest:#x})")
        try:
            if self._known(key, caller):  # another put of the key won while these bytes were staged
                return protocol.Ack()
            self._check_free_space(entry.file_bytes)
            # on_evict tells the reporter; files deleted below
            victims = self.index.reserve(key, entry, caller, domain=self.domains.domain_of(caller))
        except (SpaceRefused, StoreError, OSError) as exc:  # ForeignChunk is a StoreError
            return self._refuse(key, str(exc))
        self._evicted([victim for victim, _ in victims])
        return None

    def _known(self, key: ChunkKey, caller: str) -> bool:
        """Whether the key is held or being written: the same key is the same bytes, so one file, and the put
        only adds `caller`'s claim. A write in flight is kept even if a removal meanwhile had discarded it.
        ForeignChunk when another sharing domain holds or writes the key."""
        domain = self.domains.domain_of(caller)
        self.index.check_domain(key, domain)
        if self.index.touch(key, domain) is None and not self.index.revive(key, domain):
            return False
        self.index.claim(key, caller, domain)
        self.save_soon()
        return True

    def _put_source(self, request: protocol.PutRequest, caller: str) -> memoryview:
        nbytes = request.meta.nbytes
        if request.data is not None:
            error = self.options.bounds.inline_too_large(len(request.data))
            if error is not None:
                raise StoreError(error)
            if len(request.data) != nbytes:
                raise StoreError(f"inline data is {len(request.data)} bytes, meta says {nbytes}")
            self.counters["puts_inline"] += 1
            return memoryview(request.data)
        if request.pool:
            view = self.pools.view(request.pool, caller, request.pool_offset, nbytes)
            self.counters["puts_pool"] += 1
            return view
        raise StoreError("put without data: neither a pool nor inline data given")

    def _check_free_space(self, nbytes: int) -> None:
        if self.faults.no_space_check:
            return
        stat = os.statvfs(self.root)
        free = stat.f_bavail * stat.f_frsize - self.index.reserved_bytes  # writes in flight still to land
        if free - nbytes < self.options.min_free_bytes:
            raise StoreError(f"disk full: {max(free, 0)} bytes free on {self.root}, chunk needs {nbytes}")

    async def _write(self, meta: protocol.ChunkMeta, entry: Entry, data: memoryview, staging: StagingBuffer | None,
                     done: asyncio.Future[None]) -> str | None:
        """Write one accepted chunk and make it visible; returns an error text, or None on success."""
        key = meta.key
        assert self._writer is not None
        try:
            deleting = self._deleting.get(key)
            if deleting is not None:  # an older file of this key is being deleted: let that finish first
                await asyncio.wait([deleting])
            await self._writer.write(meta, data)
        except Exception as exc:
            self.index.abort(key, entry)
            self.counters["write_errors"] += 1
            if self.last_write_error is None:
                log.error("disk store: writing chunk %s failed: %s (no file kept; the store goes on)",
                          key.hex(), exc)
            self.last_write_error = f"{type(exc).__name__}: {exc}"
            return f"write of chunk {key.hex()} failed: {self.last_write_error}"
        else:
            self.counters["writes_done"] += 1
            if self.last_write_error is not None:
                log.info("disk store: writes succeed again")
                self.last_write_error = None
            if self._unchecked:
                self._rewritten.add(key)  # its file is now the one just written, not the recorded one
            if self._unlisted:
                self._touched.add(key)
            if self.index.commit(key, entry):
                self.save_soon()  # its claim
            else:  # removed or cleared while it was being written
                self._delete_files([key])
            return None
        finally:
            if staging is not None:
                await self._staging.release(staging)
            if self._writes.get(key) is done:
                del self._writes[key]
            if not done.done():
                done.set_result(None)

    def _refuse(self, key: bytes, reason: str) -> protocol.Ack:
        self.counters["puts_refused"] += 1
        log.debug("put of %s refused: %s", key.hex() if isinstance(key, bytes) else key, reason)
        return protocol.Ack(ok=False, error=f"disk store {self.options.store_id}: put refused: {reason}")

    # ---- the hooks of the shared control ops (IndexOps) -----------------------------------------------
    async def settle(self, keys: list[ChunkKey]) -> None:
        """Before a pin: chunks still being written are about to be held; wait for them (up to PIN_WAIT_SECS)
        rather than pin a short prefix."""
        waits = [self._writes[k] for k in keys if k in self._writes]
        if waits:
            await asyncio.wait(waits, timeout=PIN_WAIT_SECS)

    def free(self, removed: list[tuple[ChunkKey, Entry]]) -> None:
        """Chunks removed or cleared from the index: delete their files."""
        self._delete_files([key for key, _ in removed])

    def details(self) -> dict[str, Any]:
        return {
            "dir": str(self.root), "location": protocol.LOCAL_DISK, "pending_writes": len(self._writes),
            "reserved_bytes": self.index.reserved_bytes, "staged_bytes": self._staging.in_use,
            "staging_capacity": self._staging.capacity_bytes, "fsync": self.options.fsync,
            "snapshot_files_unchecked": self._unchecked + int(self._unlisted),
            "durable_puts": self.options.durable_puts, "retains_refused": self.index.retains_refused,
            "last_write_error": self.last_write_error, **self.counters, **self.pools.details(),
        }

    # ---- background file work --------------------------------------------------------------------------
    def _evicted(self, keys: list[ChunkKey]) -> None:
        self.counters["evicted"] += len(keys)  # never pinned ones: the pins file stays as it is
        self._delete_files(keys)

    def _delete_files(self, keys: list[ChunkKey]) -> None:
        """Delete files on the I/O pool; a later write of one of these keys waits for its deletion."""
        if not keys:
            return
        future = asyncio.ensure_future(self._in_io(_unlink_all, self.root, list(keys)))
        for key in keys:
            self._deleting[key] = future
        if self._unlisted:
            self._touched.update(keys)

        def forget(done: asyncio.Future[Any]) -> None:
            for key in keys:
                if self._deleting.get(key) is done:
                    del self._deleting[key]
            if not done.cancelled() and done.exception() is not None:
                log.warning("disk store: deleting %d chunk files failed: %s", len(keys), done.exception())

        future.add_done_callback(forget)
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    # ---- the index snapshot (snapshot.py) ---------------------------------------------------------------
    async def _index_added(self, recorded: list[ChunkKey]) -> None:
        """After a start from a complete snapshot: list the directory (on the I/O pool) and index the chunk files
        no record names (copied in behind the store) that pass the header checks; delete the others. Keys the
        store put or deleted since the start are left alone (the listing may predate them). Then trim to the cap."""
        added, misplaced = await self._in_io(snapshot.find_added, self.root, recorded)
        bad, loaded = [], 0
        for key, entry in added:
            if key in self._touched or self.index.is_known(key) or key in self._writes or key in self._deleting:
                continue  # the store's own since the start
            if entry is None:
                bad.append(key)
            else:
                self.index.load(key, entry)
                loaded += 1
        self._unlisted = False
        self._touched.clear()
        self._delete_files(bad)
        victims = [key for key, _ in self.index.trim_to_capacity()]
        self._evicted(victims)
        self.counters["snapshot_files_added"] += loaded
        self.counters["snapshot_files_dropped"] += len(bad) + misplaced
        if loaded or bad or misplaced:
            log.warning("disk store %s: %d chunk files no snapshot record names were found after the start: %d "
                        "indexed, %d bad or misplaced ones deleted", self.options.store_id, loaded + len(bad) + misplaced,
                        loaded, len(bad) + misplaced)

    def start_checks(self) -> asyncio.Future[None] | None:
        """Check, on the running loop, the stat of the files the start took from the snapshot (`snapshot.py`); the
        task doing it (None: nothing to check)."""
        if self._trusted or self._unlisted:
            self._verification = asyncio.ensure_future(self.check_snapshot_files())
        return self._verification

    async def check_snapshot_files(self, batch: int = 4096) -> None:
        """Stat every file the start took from its snapshot record, a batch at a time on the I/O pool, while the
        store serves. A file that is no longer the one recorded (gone, another size or mtime) and whose header
        now fails the checks, or names other sizes than its record, is dropped from the index and deleted
        (`snapshot_files_dropped`); one that passes with the same sizes stays (read since the snapshot, which
        changed its mtime; a read still verifies its bytes). Keys evicted, removed or rewritten meanwhile are
        left alone: their file is no longer the recorded one."""
        start, dropped = time.perf_counter(), 0
        trusted, self._trusted = self._trusted, snapshot.Records([], [], [])
        if self._unlisted:
            await self._index_added(trusted.keys)
        for first in range(0, len(trusted), batch):
            part = [column[first:first + batch] for column in (trusted.keys, trusted.entries, trusted.mtime_ns)]
            for key, now in await self._in_io(snapshot.check_trusted, self.root, *part):
                held = self.index.held(key)
                if key in self._rewritten or held is None or held == now:
                    continue
                log.debug("disk store: chunk %s is not the file its snapshot record describes (%s); dropping it",
                          key.hex(), "now a bad or missing file" if now is None else f"now {now}")
                dropped += 1
                self.index.remove(key)
                self._delete_files([key])
                self.counters["snapshot_files_dropped"] += 1
            self._unchecked -= len(part[0])
        self._rewritten.clear()
        log.log(logging.WARNING if dropped else logging.INFO,
                "disk store %s: checked the %d files taken from the index snapshot in %.3fs: %d were not the file "
                "their record describes and were dropped", self.options.store_id, len(trusted),
                time.perf_counter() - start, dropped)

    def start_snapshots(self) -> None:
        """Write the index snapshot every `snapshot_interval_secs` (0: only at close), on the running loop."""
        if self.options.snapshot_interval_secs > 0:
            self._snapshots = asyncio.ensure_future(self._snapshot_loop(self.options.snapshot_interval_secs))

    async def _snapshot_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.save_snapshot()

    async def save_snapshot(self, complete: bool = False) -> None:
        """Write the index snapshot of the chunks held now (`complete`: no write can land after it); a failure is
        logged (start-up then scans more). One write at a time: a periodic one cancelled by close still runs in
        its thread until it is done."""
        if self._snapshot_write is not None:
            await asyncio.wait([self._snapshot_write])
        write = self._snapshot_write = asyncio.ensure_future(
            self._in_io(snapshot.write_snapshot, self.root, self.index.held_items(), complete,
                        self.index.retentions()))
        try:
            count = await asyncio.shield(write)
        except OSError as exc:
            log.warning("disk store: writing the index snapshot failed: %s", exc)
        else:
            log.debug("disk store: index snapshot of %d chunks written", count)

    def save_soon(self) -> None:
        """Rewrite the pins and claims files in the background if they changed (bursts coalesce; the claims
        file at most once per CLAIMS_SAVE_INTERVAL)."""
        self.state.save_soon()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _in_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)


def _unlink_all(root: Path, keys: list[ChunkKey]) -> int:
    return sum(chunk_file.unlink_chunk(root, key) for key in keys)

