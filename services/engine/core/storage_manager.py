"""The storage manager: the engine's tiers as one ordered list (CPU tier, disk store, remote store), and
everything that walks them.

Threads: `enqueue_write_behind`, `acquire_prefix`, `lookup`, `prefetch` and `note_hits` are called from vLLM's
threads and never block longer than their timeout; all store traffic runs on the NATS loop thread
(`NatsLoop`), which also runs the write-behind workers and the batched recency refresh. Reads from the CPU tier
never touch NATS.

One walk: `locate` finds where the held prefix of some chunks lives, as consecutive runs per tier (the CPU
tier checked first at every position, then each lower tier in order with one `contains` for all the keys
still to place). A lookup sums the runs; a fetch (`fetch`, used by retrieves and prefetches) then reads the
lower runs into pool slots without asking the stores again. One dispatch: `command` runs the controller's
pin / unpin / clear / lookup on whichever tier the location names (`Tier` in services/engine/tiers/base.py), and
move / copy from one tier to another (`move`).

Data path of one chunk: pool slot (filled by the paged gather) -> CPU tier -> write-behind queue -> checksum of
the slot's bytes (a worker thread; every store put carries one and the stores refuse bytes that do not match it)
-> each lower store's `put` (the disk store reads the slot in place through shared memory). Back: a lower
store's `get_into` fills a fresh slot (the bytes verified against their checksum on the way; a get the disk
store did not answer in time raises StoreMayWrite, and the slot is quarantined, never reused, until the store
can no longer write into it: `_quarantine`, docs/architecture.md "A slot lent to a store") -> the meta checked
against what the key must hold (`CheckMeta`: key, token count, KV format, dtype, size, shape; else a miss, one
rate-limited WARNING naming the difference, counted in `stats["fetch_bad_meta"]`, recomputed) -> CPU
tier (when `local_cpu`) -> paged scatter into vLLM's cache. A hit, in any tier, refreshes the chunk's recency
in every lower tier (batched, `touch`), so the stores do not evict the chunks the CPU tier serves most.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.chunk_file import checksum
from kvmesh.services.engine.tiers.memory_pool import Slot
from kvmesh.services.engine.mesh.nats_loop import NatsLoop
from kvmesh.services.engine.tiers.cpu import ChunkRef, LocalCPUBackend
from kvmesh.shared.config import EngineConfig
from kvmesh.shared.keys import ChunkKey, ChunkSpan
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, LOCATIONS, PEER, REMOTE, TIER_OPS, ChunkMeta
from kvmesh.shared.rate_limited_log import RateLimitedLog
from kvmesh.services.engine.tiers.base import StoreMayWrite, StoreTier, Tier
from kvmesh.services.engine.tiers.peer import PeerTier

log = logging.getLogger(__name__)

# The cache engine API names the CPU tier "Hot" in lookup's search_range (docs/compatibility.md).
LOCATION_ALIASES = {"Hot": LOCAL_CPU, "LocalCPUBackend": LOCAL_CPU, "LocalDiskBackend": LOCAL_DISK,
                    "RemoteBackend": REMOTE, "P2PBackend": PEER}
ALL_LOCATIONS = frozenset((*LOCATIONS, PEER))
TOUCH_BATCH = 10_000  # keys per touch request
# a store holding this many quarantined slots (it may still write into them) is lent no more: misses at once
MAX_QUARANTINED_SLOTS = 8
# what a loaded chunk's meta says differently from what its span's key must hold; None when it matches
CheckMeta = Callable[[ChunkSpan, ChunkMeta], "str | None"]


@dataclass(frozen=True)
class Run:
    """spans[begin:end] are held at `location` (the tier that will serve them)."""

    location: str
    begin: int
    end: int


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
    """Tiered lookup, retrieval, write-behind and commands over the CPU tier and the lower stores' clients.

    Invariant: a retrieval's hits are prefix-contiguous (chunk i is returned only if chunks 0..i-1 are), and
    each returned `ChunkRef` carries one slot reference owned by the caller.
    """

    def __init__(self, cpu: LocalCPUBackend, loop: NatsLoop | None, config: EngineConfig,
                 expect_lower: Sequence[str] = ()) -> None:
        self.cpu = cpu
        self.loop = loop
        self.config = config
        # locations configured below the CPU tier (clients appear once NATS is up); PEER among them is no store
        self.expect_lower = tuple(expect_lower)
        # The walk order: the CPU tier, then the stores below it (disk before remote), then the peers' CPU tiers
        # (`set_lower`, once NATS is up).
        self._tiers: tuple[LocalCPUBackend, *tuple[StoreTier, ...]] = (cpu,)
        self._stores: tuple[StoreTier, ...] = ()  # the tiers writes go to: the walk's, less the peers
        self._queue: collections.deque[_WriteJob] = collections.deque()
        self._queue_lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._known_held: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self._known_lock = threading.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._writing = 0  # jobs popped and not finished (loop thread only)
        # chunks a fetch is reading (or a prefetch is about to read) from a lower tier -> (that fetch, a future
        # resolved once the chunk is in the CPU tier or the fetch gave up). Loop thread only.
        self._inflight: dict[ChunkKey, tuple[object, asyncio.Future[None]]] = {}
        self._hits: set[ChunkKey] = set()  # keys served since the last recency refresh of the lower tiers
        self._hits_lock = threading.Lock()
        self._rlog = RateLimitedLog(log)
        self.stats = collections.Counter[str]()
        # slots a store may still write into (StoreMayWrite), per location: out of use until settled (loop thread)
        self._quarantined: collections.Counter[str] = collections.Counter()
        self._quarantines: set[asyncio.Task[None]] = set()

    # ---- the tiers (loop thread) -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the write-behind workers and the recency refresh on the NATS loop."""
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._writer(), name=f"kvmesh-write-behind-{i}")
                       for i in range(self.config.write_behind_workers)]
        self._tasks.append(asyncio.create_task(self._refresh_recency(), name="kvmesh-touch"))

    def set_lower(self, stores: Sequence[StoreTier], peers: StoreTier | None = None) -> None:
        """The tiers below the CPU tier, in walk order (`tiers.build.lower_tiers`), each sending as this rank
        (`CacheEngine.store_caller`), and the peers' CPU tiers last (`tiers.peer.PeerTier`: read, never written)."""
        self._stores = tuple(stores)
        self._tiers = (self.cpu, *stores, *((peers,) if peers is not None else ()))

    def lower(self, location: str) -> StoreTier | None:
        """The client of a tier below the CPU tier (a store, or the peers)."""
        return next((tier for tier in self._tiers[1:] if tier.location == location), None)

    def tier(self, location: str) -> Tier | None:
        return next((tier for tier in self._tiers if tier.location == location), None)

    @property
    def has_lower(self) -> bool:
        """Something to look up below the CPU tier (a store, or peers)."""
        return bool(self.expect_lower)

    @property
    def has_stores(self) -> bool:
        """A store to write chunks to below the CPU tier (peers take no writes)."""
        return any(location != PEER for location in self.expect_lower)

    def lower_ready(self) -> bool:
        return len(self._tiers) > 1 and self.loop is not None and self.loop.connected

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        self._drain_queue()
        for client in self._tiers[1:]:
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

    # ---- the walk (loop thread) ------------------------------------------------------------------------------
    async def locate(self, spans: Sequence[ChunkSpan], wanted: frozenset[str] = ALL_LOCATIONS) -> list[Run]:
        """Where the held prefix of `spans` lives, as consecutive runs (the tiers in walk order at every
        position: the CPU tier every time, each lower tier once per position it is tried at)."""
        runs: list[Run] = []
        keys = [span.key for span in spans]
        exhausted: dict[str, int] = {}  # location -> position at which it said it does not hold the key
        pos = 0
        while pos < len(keys):
            progressed = False
            for tier in self._tiers:
                location = tier.location
                if location not in wanted or exhausted.get(location) == pos:
                    continue
                if tier is self.cpu:  # no NATS, and chunks a fetch in flight is bringing count as held
                    held = self._cpu_prefix(keys, pos)
                else:
                    held = await tier.contains(keys[pos:])
                    exhausted[location] = pos + held
                    if held < len(keys) - pos and location != PEER:
                        self._forget_held(keys[pos + held:])  # a store dropped some: the next put sends them again
                if held:
                    runs.append(Run(location, pos, pos + held))
                    pos += held
                    progressed = True
                    break
            if not progressed:
                break
        return runs

    def _cpu_prefix(self, keys: Sequence[ChunkKey], pos: int) -> int:
        """How many keys from `pos` are in the CPU tier or on their way there (a fetch in flight claimed them:
        a fetch waits for those instead of asking the stores again)."""
        count = pos + self.cpu.prefix(keys[pos:])
        while count < len(keys) and (keys[count] in self._inflight or keys[count] in self.cpu):
            count += 1
        return count - pos

    def lookup(self, spans: Sequence[ChunkSpan], locations: Sequence[str] | None = None) -> int:
        """vLLM thread: how many leading `spans` are held across the searched tiers (a prefix count)."""
        wanted = _normalize_locations(locations)
        held = self.cpu.prefix(s.key for s in spans) if LOCAL_CPU in wanted else 0
        if held == len(spans) or not (wanted - {LOCAL_CPU}) or not self.lower_ready():
            return held
        assert self.loop is not None

        async def walk() -> int:
            runs = await self.locate(spans, wanted)
            return runs[-1].end if runs else 0

        return self.loop.call(walk(), self.config.request_timeout_secs + 0.5, default=held)

    async def lookup_and_prefetch(self, spans: Sequence[ChunkSpan], check: CheckMeta) -> int:
        """Loop thread: the held prefix of `spans` over every tier, in chunks; the chunks found in a lower tier
        start moving into the CPU tier at once, from the runs already located (the stores are not asked twice)."""
        runs = await self.locate(spans)
        lower_runs = [run for run in runs if run.location != LOCAL_CPU]
        if lower_runs and self.cpu.keep:
            owner = object()
            # claimed before the next await: a retrieve that comes next waits for these chunks instead of
            # reading them a second time
            self._claim(owner, [span.key for run in lower_runs for span in spans[run.begin:run.end]])
            task = asyncio.get_running_loop().create_task(self._prefetch(spans, lower_runs, check, owner))
            task.add_done_callback(_log_failure)
        return runs[-1].end if runs else 0

    async def _prefetch(self, spans: Sequence[ChunkSpan], runs: list[Run], check: CheckMeta,
                        owner: object) -> None:
        for ref in await self.fetch(spans, check, owner, runs):
            ref.release()  # the CPU tier keeps its own reference

    def prefetch(self, spans: Sequence[ChunkSpan], check: CheckMeta) -> None:
        """vLLM thread: start loading the held prefix of `spans` from below into the CPU tier; returns at once."""
        if not self.cpu.keep or not self.lower_ready() or self.cpu.prefix(s.key for s in spans) == len(spans):
            return
        assert self.loop is not None
        self.loop.submit(self.lookup_and_prefetch(spans, check)).add_done_callback(_log_failure)

    # ---- retrieval (vLLM thread, then the loop) --------------------------------------------------------------
    def acquire_prefix(self, spans: Sequence[ChunkSpan], check: CheckMeta) -> list[ChunkRef]:
        """References to the longest prefix of `spans` held in any tier, fetching from below into the pool.

        CPU hits cost no NATS round trip; the rest is fetched on the NATS loop within `blocking_timeout_secs`
        (a timeout or a dead mesh just ends the prefix there: the caller recomputes the rest).
        """
        refs: list[ChunkRef] = []
        for span in spans:
            ref = self._checked(span, self.cpu.acquire(span.key), check)
            if ref is None:
                break
            refs.append(ref)
        if len(refs) < len(spans) and self.lower_ready():
            refs += self._fetch_rest(spans[len(refs):], check)
        self.note_hits([ref.meta.key for ref in refs])
        return refs

    def _fetch_rest(self, spans: Sequence[ChunkSpan], check: CheckMeta) -> list[ChunkRef]:
        assert self.loop is not None
        job = _FetchJob()
        timeout = self.config.blocking_timeout_secs
        more = self.loop.call(self._fetch_for(job, spans, check), timeout, default=None, cancel=False)
        if more is None:
            with job.lock:
                if job.result is not None:  # finished just as we gave up
                    more = job.result
                else:
                    job.abandoned = True
            if more is None:
                self.stats["fetch_timeout"] += 1
                self._rlog.warning("fetch_timeout", "fetching chunks from the lower tiers took longer than %.1fs "
                                   "(blocking_timeout_secs): served a shorter hit", timeout)
                return []
        return more

    async def _fetch_for(self, job: _FetchJob, spans: Sequence[ChunkSpan], check: CheckMeta) -> list[ChunkRef]:
        refs: list[ChunkRef] = []
        try:
            refs = await self.fetch(spans, check)
        finally:
            with job.lock:
                abandoned = job.abandoned
                if not abandoned:
                    job.result = refs
            if abandoned:  # the waiter is gone: the chunks stay in the CPU tier (fetch put them there) or go
                for ref in refs:
                    ref.release()
        return refs

    async def fetch(self, spans: Sequence[ChunkSpan], check: CheckMeta, owner: object | None = None,
                    runs: list[Run] | None = None) -> list[ChunkRef]:
        """Loop thread: references to the held prefix of `spans` (within `runs`, located now if not given).

        Chunks fetched from below are also made resident in the CPU tier when it keeps chunks. A chunk that
        another fetch (usually a prefetch) is reading is waited for, not read twice. `owner` names this fetch
        in the in-flight table (a prefetch claims its keys before it starts).
        """
        owner = owner if owner is not None else object()
        refs: list[ChunkRef] = []
        try:
            for run in runs if runs is not None else await self.locate(spans):
                pos = run.begin
                while pos < run.end:  # what is (or is about to be) resident needs no store
                    ref = await self._resident(spans[pos], owner, check)
                    if ref is None:
                        break
                    refs.append(ref)
                    pos += 1
                if pos == run.end:
                    continue
                client = self.lower(run.location)
                if client is None:  # a CPU run whose chunk is gone (evicted, or its fetch failed): ask below once
                    if runs is None:
                        lower = [Run(r.location, r.begin + pos, r.end + pos)
                                 for r in await self.locate(spans[pos:], ALL_LOCATIONS - {LOCAL_CPU})]
                        refs += await self.fetch(spans, check, owner, lower)
                    return refs
                got = await self._get_many(client, spans[pos:run.end], check, owner)
                refs += got
                if pos + len(got) < run.end:  # pool full or a failed read: the prefix ends here
                    return refs
            return refs
        finally:
            self._settle(owner, [span.key for span in spans])

    async def _resident(self, span: ChunkSpan, owner: object, check: CheckMeta) -> ChunkRef | None:
        """The chunk from the CPU tier, after waiting for another fetch of it that is in flight; checked."""
        key = span.key
        ref = self.cpu.acquire(key)
        claim = self._inflight.get(key)
        if ref is None and claim is not None and claim[0] is not owner and self.cpu.keep:
            await asyncio.shield(claim[1])
            ref = self.cpu.acquire(key)
        return self._checked(span, ref, check)

    def _checked(self, span: ChunkSpan, ref: ChunkRef | None, check: CheckMeta) -> ChunkRef | None:
        """`ref`, a CPU-tier chunk, if it is what `span` must hold here; else None (released, counted in
        `stats["cpu_bad_meta"]`, logged once per cause): no pairing of a key with the wrong span is scattered."""
        if ref is None:
            return None
        mismatch = check(span, ref.meta)
        if mismatch is None:
            return ref
        ref.release()
        self.stats["cpu_bad_meta"] += 1
        self._rlog.warning(f"cpu_bad_meta {mismatch.split(' ', 1)[0]}", "the CPU tier's chunk %s has %s: treated "
                           "as a miss (load error, recomputed)", span.key.hex(), mismatch)
        return None

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

    async def _get_many(self, client: StoreTier, spans: Sequence[ChunkSpan], check: CheckMeta,
                        owner: object) -> list[ChunkRef]:
        """Read `spans` from one store into fresh slots, `fetch_concurrency` reads in flight; the successful prefix.

        A sliding window: the next read starts as soon as the oldest one ends, not when a whole batch has (a batch
        waits for its slowest read, and the pipe to the store runs dry at every batch's end).
        """
        got: list[ChunkRef] = []
        window: collections.deque[tuple[ChunkSpan, Slot, asyncio.Task[ChunkMeta | None]]] = collections.deque()
        loop = asyncio.get_running_loop()
        started = 0
        pool_full = False  # no read starts after it; those in flight still count
        failed = False  # a miss or a failure: the prefix ends there, the reads in flight behind it are dropped
        try:
            while True:
                while (not (failed or pool_full) and started < len(spans)
                       and len(window) < self.config.fetch_concurrency):
                    slot = self.cpu.allocate()
                    if slot is None:
                        pool_full = True
                        self.stats["fetch_no_memory"] += 1
                        self._rlog.warning("fetch_pool_full", "CPU pool full (every chunk pinned or in use): a "
                                           "retrieve from %s returned a shorter hit", client.location)
                        break
                    span = spans[started]
                    started += 1
                    self._claim(owner, [span.key])
                    window.append((span, slot, loop.create_task(self._get_one(client, span, slot, check))))
                if not window:
                    break
                span, slot, task = window[0]
                await asyncio.wait((task,))  # never raises the read's error, and a cancel here leaves it running
                window.popleft()
                if task.cancelled():  # only a stop cancels a read: its slot stays held, like those below
                    raise asyncio.CancelledError
                result = None if task.exception() is not None else task.result()
                if failed or result is None:
                    # A miss, or a client's exception: nothing writes into the slot after either. A store that
                    # may (the disk store, through the lent pool) raised StoreMayWrite, and _get_one holds the
                    # slot for that. The remote store's stream reads with loop.sock_recv_into on this loop (a
                    # read that is cancelled or timed out cannot land later: the kernel copies only inside that
                    # loop callback), and the Redis tier awaits its decode thread to the end.
                    failed = True
                    slot.release()
                else:
                    got.append(ChunkRef(result, slot))
                    if self.cpu.keep:
                        self.cpu.put(result, slot.ref())
                self._settle(owner, [span.key])
        except BaseException:  # cancelled: the reads in flight are cancelled and their slots stay held (never
            for _, _, task in window:  # reused): we are stopping
                task.cancel()
            raise
        finally:
            self._settle(owner, [span.key for span, _, _ in window])
        self._count_reads(client.location, got)
        return got

    def _count_reads(self, location: str, refs: Sequence[ChunkRef]) -> None:
        """Chunks read from a lower tier (the metrics' per-tier read counts and bytes)."""
        self.stats[f"fetched_{location}"] += len(refs)
        self.stats[f"read_bytes_{location}"] += sum(ref.meta.nbytes for ref in refs)

    async def _get_one(self, client: StoreTier, span: ChunkSpan, slot: Slot, check: CheckMeta) -> ChunkMeta | None:
        """`span`'s chunk into `slot`; None on a miss. The caller releases its slot reference on None as always:
        when the store may still write into the slot, the quarantine holds a reference of its own."""
        location = client.location
        if self._quarantined[location] >= MAX_QUARANTINED_SLOTS:  # a stalled store must not drain the pool
            self.stats["fetch_store_stalled"] += 1
            self._rlog.warning("store_stalled", "%s holds %d slots it may still write into: answering misses "
                               "from it until it settles them", location, self._quarantined[location])
            return None
        try:
            meta = await client.get_into(span.key, slot.chunk_buffer())
        except StoreMayWrite as exc:
            self._quarantine(location, slot.ref(), exc)
            return None
        if meta is None:
            return None
        mismatch = check(span, meta)
        if mismatch is not None:  # never scattered into vLLM's blocks: the hit ends here and vLLM recomputes
            self.stats["fetch_bad_meta"] += 1
            self._rlog.warning("bad_meta", "%s returned chunk %s with %s: treated as a miss (load error, "
                               "recomputed)", client.location, span.key.hex(), mismatch)
            if isinstance(client, PeerTier):  # that peer is not asked for this chain again
                client.distrust(span.key)
            return None
        return meta

    def _quarantine(self, location: str, slot: Slot, exc: StoreMayWrite) -> None:
        """Hold `slot` (one reference, taken by the caller) until the store that may write into it has settled:
        then release it. Not a time limit: a store stopped now may resume at any later time."""
        self._quarantined[location] += 1
        self.stats["slots_quarantined"] += 1
        self.stats["slots_quarantined_now"] += 1
        self._rlog.warning("quarantined", "%s; its pool slot stays out of use until the store can no longer "
                           "write into it (%d slots so)", exc, self.stats["slots_quarantined_now"])

        async def end() -> None:
            try:
                settled = await exc.settled()
            except Exception:  # a bug: the slot stays held (safe), and we say so
                log.exception("waiting for %s to settle a get failed; its slot stays out of use", location)
                return
            if settled:
                self._quarantined[location] -= 1
                self.stats["slots_quarantined_now"] -= 1
                slot.release()
            # else: the client closed first (the engine is stopping): the slot stays held for good

        task = asyncio.get_running_loop().create_task(end(), name="kvmesh-slot-quarantine")
        self._quarantines.add(task)
        task.add_done_callback(self._quarantines.discard)

    # ---- recency: hits refresh the lower tiers (batched, off the hot path) ---------------------------------------
    def note_hits(self, keys: Sequence[ChunkKey]) -> None:
        """Any thread: these chunks were just served; the lower tiers hear of it at the next refresh."""
        if keys and self._stores:
            with self._hits_lock:
                self._hits.update(keys)

    async def _refresh_recency(self) -> None:
        while True:
            await asyncio.sleep(self.config.touch_interval_secs)
            await self.flush_hits()

    async def flush_hits(self) -> None:
        """Loop thread: tell every lower tier about the hits noted since the last flush (and wait for them)."""
        with self._hits_lock:
            keys, self._hits = list(self._hits), set()
        if keys and self.lower_ready():
            # in parts well under the stores' keys-per-request bound (--max-keys-per-request, 100,000 by default)
            for start in range(0, len(keys), TOUCH_BATCH):
                part = keys[start:start + TOUCH_BATCH]
                await asyncio.gather(*(client.touch(part) for client in self._stores), return_exceptions=True)

    # ---- the controller's commands (loop thread) -----------------------------------------------------------------
    async def command(self, op: str, location: str, spans: Sequence[ChunkSpan], ttl_secs: float | None = None,
                      states: Sequence[ChunkSpan] = ()) -> int:
        """pin / unpin / clear / lookup at `location`, for whichever tier it names; tokens affected (or held).
        A pin or unpin covers the recurrent `states` after the chunks too (a model with Mamba / linear-attention
        layers resumes only from one); the count is the chunks'.

        Raises ValueError for an unknown op or location and LookupError for a location this engine does not
        have (or whose client is not connected yet).
        """
        if op not in TIER_OPS:
            raise ValueError(f"unknown op {op!r} (known: {', '.join(TIER_OPS)})")
        if location not in LOCATIONS:
            raise ValueError(f"unknown location {location!r} (known: {', '.join(LOCATIONS)})")
        tier = self.tier(location)
        if tier is None:
            raise LookupError(f"no {location} configured here (or its store client is not connected)")
        keys = [span.key for span in spans]
        num_tokens = [span.num_tokens for span in spans]
        state_keys = [span.key for span in states]
        state_tokens = [span.num_tokens for span in states]
        if op == "pin":
            pinned = await tier.pin(keys, num_tokens, ttl_secs)
            if states:  # the held prefix of them, as for chunks: with align mode a state at every chunk end held
                await tier.pin(state_keys, state_tokens, ttl_secs)
            return pinned
        if op == "unpin":
            unpinned = await tier.unpin(keys, num_tokens)
            if states:
                await tier.unpin(state_keys, state_tokens)
            return unpinned
        if op == "clear":
            return await tier.clear()
        return sum(span.num_tokens for span in spans[:await tier.contains(keys)])

    async def move(self, spans: Sequence[ChunkSpan], source: str, target: str, keep_source: bool,
                   check: CheckMeta) -> int:
        """Copy the contiguous prefix of `spans` held at `source` to `target` (both this worker's tiers, or
        `source` PEER: the peer's CPU tier the peer tier names for these keys, `PeerTier.assume_holder`), one
        chunk at a time through a pool slot; unless `keep_source`, the copied chunks then leave `source`. The
        tokens copied. Only the CPU tier may be left: a store is shared, and removing a chunk there would take
        it from every instance (ValueError)."""
        for location in (source, target):
            if location not in LOCATIONS and not (location == source == PEER):
                raise ValueError(f"unknown location {location!r} (known: {', '.join(LOCATIONS)})")
            if self.tier(location) is None:
                raise LookupError(f"no {location} configured here (or its store client is not connected)"
                                  + (": P2P is off (enable_p2p)" if location == PEER else ""))
        if source == target:
            raise ValueError(f"source and target are both {source}")
        if not keep_source and source != LOCAL_CPU:
            raise ValueError(f"{source} is shared with other instances: moving out of it would remove their "
                             "chunks too; copy instead (should_copy)")
        moved: list[ChunkSpan] = []
        for span in spans:
            ref = await self._read(source, span, check)
            if ref is None or not await self._write_to(target, ref):
                break
            moved.append(span)
        if not keep_source:
            for span in moved:
                self.cpu.remove(span.key)
        return sum(span.num_tokens for span in moved)

    def evict(self, spans: Sequence[ChunkSpan]) -> int:
        """Drop these chunks from the CPU tier (pinned or not; the lower tiers keep theirs); the tokens dropped."""
        return sum(span.num_tokens for span in spans if self.cpu.remove(span.key))

    async def _read(self, location: str, span: ChunkSpan, check: CheckMeta) -> ChunkRef | None:
        """One chunk of `location` in a slot the caller owns a reference of; None on a miss."""
        if location == LOCAL_CPU:
            return self.cpu.acquire(span.key)
        slot = self.cpu.allocate()
        if slot is None:
            return None
        store = self.lower(location)
        assert store is not None  # move checked it
        meta = await self._get_one(store, span, slot, check)
        if meta is None:
            slot.release()
            return None
        ref = ChunkRef(meta, slot)
        self._count_reads(location, [ref])
        return ref

    async def _write_to(self, location: str, ref: ChunkRef) -> bool:
        """Hand `ref` (and its slot reference) to `location`: True once it holds the chunk."""
        if location == LOCAL_CPU:
            return self.cpu.put(ref.meta, ref.slot) or ref.meta.key in self.cpu
        try:
            buffer = ref.slot.chunk_buffer(ref.meta.nbytes)
            digest = await asyncio.to_thread(checksum, buffer.view[:ref.meta.nbytes])
            store = self.lower(location)
            assert store is not None  # move checked it
            return await store.put(dataclasses.replace(ref.meta, checksum=digest), buffer) is True
        finally:
            ref.release()

    # ---- known-held: chunks every lower tier has (so a store does not gather and send them again) ------------
    def known_held(self, key: ChunkKey) -> bool:
        with self._known_lock:
            return key in self._known_held

    def _remember_held(self, key: ChunkKey) -> None:
        with self._known_lock:
            self._known_held[key] = None
            self._known_held.move_to_end(key)
            while len(self._known_held) > self.config.known_held_keys:
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
        if not self.lower_ready():
            slot.release()
            self.stats["write_behind_skipped_offline"] += 1
            self._rlog.warning("offline", "write-behind skipped: NATS or the stores are not reachable; chunks "
                               "stay on the CPU tier only")
            return False
        with self._queue_lock:
            full = len(self._queue) >= self.config.store_queue_size
            if not full:
                self._queue.append(_WriteJob(meta, slot))
        if full:
            slot.release()
            self.stats["write_behind_skipped_full"] += 1
            self._rlog.warning("queue_full", "write-behind queue full (%d chunks, store_queue_size): skipped a "
                               "chunk; the lower tiers are slower than the stores arriving",
                               self.config.store_queue_size)
            return False
        assert self.loop is not None
        self.loop.call_soon(self._poke)
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
        clients = self._stores
        if not clients or self.loop is None or not self.loop.connected:
            self.stats["write_behind_dropped_offline"] += 1
            return
        buffer = job.slot.chunk_buffer(job.meta.nbytes)
        # Once per chunk, off the loop: the stores verify the bytes they receive against it before holding them.
        digest = await asyncio.to_thread(checksum, buffer.view[:job.meta.nbytes])
        meta = dataclasses.replace(job.meta, checksum=digest)
        results = await asyncio.gather(*(c.put(meta, buffer) for c in clients), return_exceptions=True)
        for client, result in zip(clients, results):
            if result is True:
                self.stats[f"written_bytes_{client.location}"] += meta.nbytes
            else:
                self.stats[f"put_failed_{client.location}"] += 1
        if all(r is True for r in results):
            self._remember_held(job.meta.key)
            self.stats["write_behind_done"] += 1
        else:
            self.stats["write_behind_failed"] += 1
            self._rlog.warning("put_failed", "write-behind of a chunk to %s failed (%s)",
                               ", ".join(c.location for c, r in zip(clients, results) if r is not True),
                               "; ".join(str(r) for r in results if r is not True))

    async def wait_idle(self, timeout: float) -> bool:
        """Loop thread: until the write-behind queue is empty and no job runs (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.queue_depth or self._writing:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True


def _normalize_locations(locations: Sequence[str] | None) -> frozenset[str]:
    if locations is None:
        return ALL_LOCATIONS
    out = set()
    for name in locations:
        if name not in LOCATION_ALIASES:
            raise ValueError(f"search_range: unknown location {name!r} (known: {', '.join(LOCATION_ALIASES)})")
        out.add(LOCATION_ALIASES[name])
    return frozenset(out)


def _log_failure(future: "concurrent.futures.Future[object] | asyncio.Future[object]") -> None:
    try:
        exc = future.exception()
    except BaseException:  # cancelled at close
        return
    if exc is not None:
        log.warning("prefetch failed: %s", exc)
