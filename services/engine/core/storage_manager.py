"""The storage manager: the CPU tier plus the lower tiers (disk store, remote store) behind NATS clients.

Threads: `enqueue_write_behind`, `acquire_prefix`, `lookup` and `prefetch` are called from vLLM's threads and
never block longer than their timeout; all store traffic runs on the NATS loop thread (`NatsLoop`), which
also runs the write-behind workers. Reads from the CPU tier never touch NATS.

Data path of one chunk: pool slot (filled by the paged gather) -> CPU tier -> write-behind queue -> each
lower store's `put` (the disk store reads the slot in place through shared memory). Back: a lower store's
`get_into` fills a fresh slot -> CPU tier (when `local_cpu`) -> paged scatter into vLLM's cache.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvmesh.services.engine.tiers.cpu import ChunkRef, LocalCPUBackend
from kvmesh.services.engine.core.memory_pool import Slot
from kvmesh.services.engine.mesh.nats_loop import NatsLoop
from kvmesh.shared.keys import ChunkKey, ChunkSpan
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE, ChunkMeta
from kvmesh.shared.store_client import ChunkStoreClient

log = logging.getLogger(__name__)

KNOWN_HELD_MAX = 200_000  # keys remembered as written to every lower tier (~40 B each)
GETS_IN_FLIGHT = 4  # concurrent get_into per fetch: lets a store overlap reads without flooding it
WRITERS = 2  # concurrent write-behind jobs
# Seed 003 names the CPU tier "Hot" in lookup's search_range.
LOCATION_ALIASES = {"Hot": LOCAL_CPU, "LocalCPUBackend": LOCAL_CPU, "LocalDiskBackend": LOCAL_DISK,
                    "RemoteBackend": REMOTE}


class RateLimitedLog:
    """Logs a message at most once per `interval` seconds per key, counting what it held back."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e9) < self._interval:
                self._suppressed[key] += 1
                return
            self._last[key] = now
            held_back = self._suppressed.pop(key, 0)
        suffix = f" ({held_back} more like this since the last report)" if held_back else ""
        self._log.warning(msg + suffix, *args)


@dataclass
class _WriteJob:
    meta: ChunkMeta
    slot: Slot  # holds one reference for the job


@dataclass
class _FetchJob:
    """Hand-over between a vLLM thread waiting for a fetch and the coroutine doing it.

    If the waiter gives up (timeout), the coroutine still owns what it fetched and parks it in the CPU tier
    (or frees it) when it ends; a slot a store may still be writing into is never handed out early.
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    result: list[ChunkRef] | None = None


class StorageManager:
    """Tiered lookup, retrieval and write-behind over the CPU tier and the lower stores' clients.

    Invariant: a retrieval's hits are prefix-contiguous (chunk i is returned only if chunks 0..i-1 are), and
    each returned `ChunkRef` carries one slot reference owned by the caller.
    """

    def __init__(self, cpu: LocalCPUBackend, mesh: NatsLoop | None, queue_size: int, request_timeout: float,
                 blocking_timeout: float, expect_lower: Sequence[str] = ()) -> None:
        self.cpu = cpu
        self.mesh = mesh
        self.queue_size = queue_size
        self.request_timeout = request_timeout
        self.blocking_timeout = blocking_timeout
        self.expect_lower = tuple(expect_lower)  # locations configured (clients appear once NATS is up)
        self._clients: dict[str, ChunkStoreClient] = {}  # location -> client, disk before remote
        self._queue: collections.deque[_WriteJob] = collections.deque()
        self._queue_lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._known_held: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self._known_lock = threading.Lock()
        self._writers: list[asyncio.Task[None]] = []
        self._writing = 0  # jobs popped and not finished (loop thread only)
        # chunks a fetch is reading (or a prefetch is about to read) from a lower tier -> (that fetch, a future
        # resolved once the chunk is in the CPU tier or the fetch gave up). Loop thread only.
        self._inflight: dict[ChunkKey, tuple[object, asyncio.Future[None]]] = {}
        self._rlog = RateLimitedLog(log)
        self.stats = collections.Counter[str]()

    # ---- wiring (loop thread) --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the write-behind workers on the NATS loop."""
        self._wake = asyncio.Event()
        self._writers = [asyncio.create_task(self._writer(), name=f"kvmesh-write-behind-{i}") for i in range(WRITERS)]

    def set_clients(self, clients: dict[str, ChunkStoreClient]) -> None:
        self._clients = {loc: clients[loc] for loc in (LOCAL_DISK, REMOTE) if loc in clients}

    def client(self, location: str) -> ChunkStoreClient | None:
        return self._clients.get(location)

    @property
    def has_lower(self) -> bool:
        return bool(self.expect_lower)

    def _lower_ready(self) -> bool:
        return bool(self._clients) and self.mesh is not None and self.mesh.connected

    async def stop(self) -> None:
        for task in self._writers:
            task.cancel()
        for task in self._writers:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._writers = []
        self._drain_queue()
        for client in self._clients.values():
            close = getattr(client, "close", None)  # the remote client keeps stream connections open
            if close is not None:
                try:
                    await close()
                except Exception as exc:
                    log.debug("closing the %s client failed: %s", client.location, exc)

    def _drain_queue(self) -> None:
        with self._queue_lock:
            jobs, self._queue = list(self._queue), collections.deque()
        for job in jobs:
            job.slot.release()

    # ---- known-held: chunks every lower tier has (so a store does not gather and send them again) ------------
    def known_held(self, key: ChunkKey) -> bool:
        with self._known_lock:
            return key in self._known_held

    def _remember_held(self, key: ChunkKey) -> None:
        with self._known_lock:
            self._known_held[key] = None
            self._known_held.move_to_end(key)
            while len(self._known_held) > KNOWN_HELD_MAX:
                self._known_held.popitem(last=False)

    def _forget_held(self, keys: Sequence[ChunkKey]) -> None:
        with self._known_lock:
            for key in keys:
                self._known_held.pop(key, None)

    # ---- write-behind (enqueue: vLLM thread; workers: loop thread) --------------------------------------------
    def enqueue_write_behind(self, meta: ChunkMeta, slot: Slot) -> bool:
        """Queue a chunk for the lower tiers; takes over one slot reference (released on False too).

        Never blocks: a full queue or an unreachable mesh skips the chunk (logged, rate-limited).
        """
        if not self._lower_ready():
            slot.release()
            self.stats["write_behind_skipped_offline"] += 1
            self._rlog.warning("offline", "write-behind skipped: NATS or the stores are not reachable; chunks "
                               "stay on the CPU tier only")
            return False
        with self._queue_lock:
            if len(self._queue) >= self.queue_size:
                full = True
            else:
                full = False
                self._queue.append(_WriteJob(meta, slot))
        if full:
            slot.release()
            self.stats["write_behind_skipped_full"] += 1
            self._rlog.warning("queue_full", "write-behind queue full (%d chunks, store_queue_size): skipped a "
                               "chunk; the lower tiers are slower than the stores arriving", self.queue_size)
            return False
        assert self.mesh is not None
        self.mesh.call_soon(self._poke)
        return True

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    @property
    def queue_depth(self) -> int:
        with self._queue_lock:
            return len(self._queue)

    async def _writer(self) -> None:
        assert self._wake is not None
        while True:
            with self._queue_lock:
                job = self._queue.popleft() if self._queue else None
            if job is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._writing += 1
            try:
                await self._write(job)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("write-behind of chunk %s failed", job.meta.key.hex())
            finally:
                self._writing -= 1
                self.cpu.drop_staged(job.meta.key, job.slot)  # staging only: the CPU copy has served its purpose
                job.slot.release()

    async def _write(self, job: _WriteJob) -> None:
        clients = list(self._clients.values())
        if not clients or self.mesh is None or not self.mesh.connected:
            self.stats["write_behind_dropped_offline"] += 1
            return
        buffer = job.slot.chunk_buffer(job.meta.nbytes)
        results = await asyncio.gather(*(c.put(job.meta, buffer) for c in clients), return_exceptions=True)
        ok = all(r is True for r in results)
        if ok:
            self._remember_held(job.meta.key)
            self.stats["write_behind_done"] += 1
        else:
            self.stats["write_behind_failed"] += 1
            self._rlog.warning("put_failed", "write-behind of a chunk to %s failed (%s)",
                               ", ".join(loc for loc, r in zip(self._clients, results) if r is not True),
                               "; ".join(str(r) for r in results if r is not True))

    async def wait_idle(self, timeout: float) -> bool:
        """Loop thread: until the write-behind queue is empty and no job runs (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.queue_depth or self._writing:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    # ---- retrieval (vLLM thread) -----------------------------------------------------------------------------
    def acquire_prefix(self, spans: Sequence[ChunkSpan],
                       validate: Callable[[ChunkSpan, ChunkMeta], bool]) -> list[ChunkRef]:
        """References to the longest prefix of `spans` held in any tier, fetching from below into the pool.

        CPU hits cost no NATS round trip; the rest is fetched on the NATS loop within `blocking_timeout`
        (a timeout or a dead mesh just ends the prefix there: the caller recomputes the rest).
        """
        refs: list[ChunkRef] = []
        for span in spans:
            ref = self.cpu.acquire(span.key)
            if ref is None:
                break
            refs.append(ref)
        if len(refs) == len(spans) or not self._lower_ready():
            return refs
        assert self.mesh is not None
        job = _FetchJob()
        rest = list(spans[len(refs):])
        more = self.mesh.call(self._fetch_for(job, rest, validate), self.blocking_timeout, default=None, cancel=False)
        if more is None:
            with job.lock:
                if job.result is not None:  # finished just as we gave up
                    more = job.result
                else:
                    job.abandoned = True
            if more is None:
                self._rlog.warning("fetch_timeout", "fetching chunks from the lower tiers took longer than %.1fs "
                                   "(blocking_timeout_secs): served a shorter hit", self.blocking_timeout)
                return refs
        return refs + more

    async def _fetch_for(self, job: _FetchJob, spans: list[ChunkSpan],
                         validate: Callable[[ChunkSpan, ChunkMeta], bool]) -> list[ChunkRef]:
        refs: list[ChunkRef] = []
        try:
            refs = await self.fetch(spans, validate)
        finally:
            with job.lock:
                if not job.abandoned:
                    job.result = refs
                    abandoned = False
                else:
                    abandoned = True
            if abandoned:  # the waiter is gone: the chunks stay in the CPU tier (fetch put them there) or go
                for ref in refs:
                    ref.release()
        return refs

    async def fetch(self, spans: Sequence[ChunkSpan], validate: Callable[[ChunkSpan, ChunkMeta], bool],
                    owner: object | None = None) -> list[ChunkRef]:
        """Loop thread: the held prefix of `spans`, tier by tier (CPU, disk, remote, and CPU again...).

        Chunks fetched from below are also made resident in the CPU tier when it keeps chunks. A chunk that
        another fetch (usually a prefetch) is reading is waited for, not read twice. `owner` names this fetch
        in the in-flight table (a prefetch claims its keys before it starts).
        """
        owner = owner if owner is not None else object()
        refs: list[ChunkRef] = []
        pos = 0
        # exhausted[location] = position at which that store said it does not hold the key
        exhausted: dict[str, int] = {}
        try:
            while pos < len(spans):
                key = spans[pos].key
                ref = self.cpu.acquire(key)
                if ref is not None:
                    refs.append(ref)
                    pos += 1
                    continue
                claim = self._inflight.get(key)
                if claim is not None and claim[0] is not owner and self.cpu.keep:
                    await asyncio.shield(claim[1])  # then look in the CPU tier again
                    if key in self.cpu:
                        continue
                progressed = False
                for location, client in list(self._clients.items()):
                    if exhausted.get(location) == pos:
                        continue
                    keys = [s.key for s in spans[pos:]]
                    held = await client.contains(keys)
                    exhausted[location] = pos + held
                    if held < len(keys):
                        self._forget_held(keys[held:])
                    if held == 0:
                        continue
                    got = await self._get_many(client, spans[pos:pos + held], validate, owner)
                    refs.extend(got)
                    pos += len(got)
                    if len(got) < held:  # pool full or a failed read: the prefix ends here
                        return refs
                    progressed = True
                    break
                if not progressed:
                    break
            return refs
        finally:
            self._settle(owner, [s.key for s in spans])

    def _claim(self, owner: object, keys: Sequence[ChunkKey]) -> None:
        loop = asyncio.get_running_loop()
        for key in keys:
            if key not in self._inflight:
                self._inflight[key] = (owner, loop.create_future())

    def _settle(self, owner: object, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            claim = self._inflight.get(key)
            if claim is not None and claim[0] is owner:
                del self._inflight[key]
                claim[1].set_result(None)

    async def _get_many(self, client: ChunkStoreClient, spans: Sequence[ChunkSpan],
                        validate: Callable[[ChunkSpan, ChunkMeta], bool], owner: object) -> list[ChunkRef]:
        """Read `spans` from one store into fresh slots, a few at a time; the successful prefix."""
        got: list[ChunkRef] = []
        for start in range(0, len(spans), GETS_IN_FLIGHT):
            batch = spans[start:start + GETS_IN_FLIGHT]
            slots: list[Slot] = []
            for _ in batch:
                slot = self.cpu.allocate()
                if slot is None:
                    break
                slots.append(slot)
            if len(slots) < len(batch):
                self.stats["fetch_no_memory"] += 1
                self._rlog.warning("fetch_pool_full", "CPU pool full (every chunk pinned or in use): a retrieve "
                                   "from %s returned a shorter hit", client.location)
            keys = [span.key for span in batch]
            self._claim(owner, keys[:len(slots)])
            try:
                results = await asyncio.gather(*(self._get_one(client, span, slot, validate)
                                                 for span, slot in zip(batch, slots)), return_exceptions=True)
                failed = False
                for span, slot, result in zip(batch, slots, results):
                    if failed or not isinstance(result, ChunkMeta):
                        failed = True
                        if isinstance(result, ChunkMeta) or result is None:
                            slot.release()
                        else:  # an exception or a timeout: the store may still write late; free the slot later
                            self._release_later(slot)
                        continue
                    got.append(ChunkRef(result, slot))
                    if self.cpu.keep:
                        self.cpu.put(result, slot.ref())
            finally:
                self._settle(owner, keys)
            if failed or len(slots) < len(batch):
                break
        self.stats[f"fetched_{client.location}"] += len(got)
        return got

    async def _get_one(self, client: ChunkStoreClient, span: ChunkSpan, slot: Slot,
                       validate: Callable[[ChunkSpan, ChunkMeta], bool]) -> ChunkMeta | None:
        meta = await client.get_into(span.key, slot.chunk_buffer())
        if meta is None:
            return None
        if meta.key != span.key or not validate(span, meta):
            self._rlog.warning("bad_meta", "%s returned chunk %s with unexpected metadata %s: treated as a miss",
                               client.location, span.key.hex(), meta)
            return None
        return meta

    def _release_later(self, slot: Slot) -> None:
        # A store that missed our deadline may still be writing into this slot through shared memory.
        asyncio.get_running_loop().call_later(max(self.request_timeout, 1.0), slot.release)

    # ---- lookup and prefetch ---------------------------------------------------------------------------------
    def lookup(self, spans: Sequence[ChunkSpan], locations: Sequence[str] | None = None) -> int:
        """vLLM thread: how many leading `spans` are held across the searched tiers (a prefix count)."""
        wanted = _normalize_locations(locations)
        pos = self.cpu.prefix(s.key for s in spans) if LOCAL_CPU in wanted else 0
        if pos == len(spans) or not (wanted - {LOCAL_CPU}) or not self._lower_ready():
            return pos
        assert self.mesh is not None
        return self.mesh.call(self._lookup_lower(spans, pos, wanted), self.request_timeout + 0.5, default=pos)

    async def _lookup_lower(self, spans: Sequence[ChunkSpan], pos: int, wanted: frozenset[str]) -> int:
        exhausted: dict[str, int] = {}
        while pos < len(spans):
            if LOCAL_CPU in wanted and spans[pos].key in self.cpu:
                pos += 1
                continue
            progressed = False
            for location, client in list(self._clients.items()):
                if location not in wanted or exhausted.get(location) == pos:
                    continue
                keys = [s.key for s in spans[pos:]]
                held = await client.contains(keys)
                exhausted[location] = pos + held
                if held < len(keys):
                    self._forget_held(keys[held:])  # a store dropped some: the next store sends them again
                if held:
                    pos += held
                    progressed = True
                    break
            if not progressed:
                break
        return pos

    def prefetch(self, spans: Sequence[ChunkSpan], validate: Callable[[ChunkSpan, ChunkMeta], bool]) -> None:
        """Start loading the held prefix of `spans` from below into the CPU tier; returns at once."""
        if not self.cpu.keep or not self._lower_ready():
            return
        start = self.cpu.prefix(s.key for s in spans)
        if start == len(spans):
            return
        assert self.mesh is not None

        async def run() -> None:
            owner = object()
            # claimed before the first await: a retrieve submitted after this prefetch waits for these chunks
            # instead of reading them a second time
            self._claim(owner, [s.key for s in spans[start:]])
            for ref in await self.fetch(spans[start:], validate, owner):
                ref.release()  # the CPU tier keeps its own reference

        future = self.mesh.submit(run())
        future.add_done_callback(_log_failure)


def _normalize_locations(locations: Sequence[str] | None) -> frozenset[str]:
    if locations is None:
        return frozenset((LOCAL_CPU, LOCAL_DISK, REMOTE))
    out = set()
    for name in locations:
        if name not in LOCATION_ALIASES:
            raise ValueError(f"search_range: unknown location {name!r} (known: {', '.join(LOCATION_ALIASES)})")
        out.add(LOCATION_ALIASES[name])
    return frozenset(out)


def _log_failure(future: "concurrent.futures.Future[None]") -> None:
    try:
        exc = future.exception()
    except BaseException:  # cancelled at close
        return
    if exc is not None:
        log.warning("prefetch failed: %s", exc)
