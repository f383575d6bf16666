"""The storage manager: the engine's tiers as one ordered list (CPU tier, disk store, remote store, peers), and
the walk and fetch over them.

Threads: `acquire_prefix`, `lookup` and `prefetch` are called from vLLM's threads and never block
longer than their timeout; all store traffic runs on the NATS loop thread (`NatsLoop`), which also runs the
write-behind workers and the batched recency refresh. Reads from the CPU tier never touch NATS.

One walk: `locate` finds where the held prefix of some chunks lives, as consecutive runs per tier (the CPU
tier checked first at every position, then each lower tier in order with one `contains` for all the keys
still to place). A lookup sums the runs; a fetch (`fetch`, used by retrieves and prefetches) then reads the
lower runs into pool slots without asking the stores again. Beside the walk, each in a module of its own: the
write-behind and the known-held set (`write_behind`, core/write_behind.py), the controller's commands on these
tiers (`commands`, core/tier_commands.py), the recency refresh (`recency`, core/recency.py), and the slots a store
may still write into (`quarantine`, core/slot_quarantine.py).

Data path of one chunk back from a store: a lower store's `get_into` fills a fresh slot (the bytes verified
against their checksum on the way; a get the disk store did not answer in time raises StoreMayWrite, and the
slot is quarantined, never reused, until the store can no longer write into it: `quarantine`,
docs/architecture.md "A slot lent to a store") -> the meta checked against what the key must hold (`CheckMeta`:
key, token count, KV format, dtype, size, shape; else a miss, one rate-limited WARNING naming the difference,
counted in `stats["fetch_bad_meta"]`, recomputed) -> CPU tier (when `local_cpu`) -> paged scatter into vLLM's
cache. A hit, in any tier, refreshes the chunk's recency in every lower tier (batched, `touch`: `recency`).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Sequence

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core.recency import RecencyRefresh
from kvmesh.services.engine.core.slot_quarantine import SlotQuarantine
from kvmesh.services.engine.core.tier_commands import CheckMeta, TierCommands
from kvmesh.services.engine.core.write_behind import WriteBehind
from kvmesh.services.engine.mesh.nats_loop import NatsLoop
from kvmesh.services.engine.tiers.base import StoreMayWrite, StoreTier, Tier
from kvmesh.services.engine.tiers.cpu import ChunkRef, LocalCPUBackend
from kvmesh.services.engine.tiers.memory_pool import Slot
from kvmesh.services.engine.tiers.peer import PeerTier
from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.protocol import LOCAL_CPU, LOCATIONS, PEER, ChunkMeta
from kvmesh.shared.rate_limited_log import RateLimitedLog
from kvmesh.shared.wire.keys import ChunkKey, ChunkSpan

log = logging.getLogger(__name__)

ALL_LOCATIONS = frozenset((*LOCATIONS, PEER))


@dataclass(frozen=True)
class Run:
    """spans[begin:end] are held at `location` (the tier that will serve them)."""

    location: str
    begin: int
    end: int


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
    """Tiered lookup and retrieval over the CPU tier and the lower tiers' clients (with `write_behind` and
    `commands` beside them).

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
        self._tasks: list[asyncio.Task[None]] = []
        # chunks a fetch is reading (or a prefetch is about to read) from a lower tier -> (that fetch, a future
        # resolved once the chunk is in the CPU tier or the fetch gave up). Loop thread only.
        self._inflight: dict[ChunkKey, tuple[object, asyncio.Future[None]]] = {}
        self._prefetching = 0  # chunks the requests' lookups' prefetches are still reading (loop thread)
        self._rlog = RateLimitedLog(log)
        self.stats = collections.Counter[str]()
        # slots a store may still write into (StoreMayWrite): out of use until settled (loop thread)
        self.quarantine = SlotQuarantine(self.stats, log)
        # the chunks admitted on their way to the stores, and those every store took
        self.write_behind = WriteBehind(cpu, loop, config, lambda: self._stores, self.lower_ready, self.stats)
        self.commands = TierCommands(self)  # the controller's commands on these tiers
        self.recency = RecencyRefresh(config, lambda: self._stores, self.lower_ready)  # hits touch the stores

    # ---- the tiers (loop thread) -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the write-behind workers and the recency refresh on the NATS loop."""
        self._tasks = [*self.write_behind.start(),
                       asyncio.create_task(self.recency.run(), name="kvmesh-touch")]

    def set_lower(self, lower: Sequence[StoreTier]) -> None:
        """The tiers below the CPU tier, in walk order (`tiers.registry.lower_tiers`): the stores, each sending as
        this rank (`CacheEngine.store_caller`), and the peers' CPU tiers last (read, never written)."""
        self._stores = tuple(tier for tier in lower if tier.location != PEER)
        self._tiers = (self.cpu, *lower)

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
        await self.write_behind.stop()
        for client in self._tiers[1:]:
            close = getattr(client, "close", None)  # the remote client keeps stream connections open
            if close is not None:
                try:
                    await close()
                except Exception as exc:
                    log.debug("closing the %s client failed: %s", client.location, exc)

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
                        # a store dropped some: the next put sends them again
                        self.write_behind.forget(keys[pos + held:])
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

    def lookup(self, spans: Sequence[ChunkSpan], wanted: frozenset[str] = ALL_LOCATIONS) -> int:
        """vLLM thread: how many leading `spans` are held across the `wanted` tiers (a prefix count)."""
        held = self.cpu.prefix(s.key for s in spans) if LOCAL_CPU in wanted else 0
        if held == len(spans) or not (wanted - {LOCAL_CPU}) or not self.lower_ready():
            return held
        assert self.loop is not None

        async def walk() -> int:
            runs = await self.locate(spans, wanted)
            return runs[-1].end if runs else 0

        return self.loop.call(walk(), self.config.request_timeout_secs + 0.5, default=held)

    async def lookup_and_prefetch(self, spans: Sequence[ChunkSpan], check: CheckMeta, prefetch_from: int = 0,
                                  for_request: bool = False, wanted: frozenset[str] = ALL_LOCATIONS) -> int:
        """Loop thread: the held prefix of `spans` over every tier, in chunks; the chunks found in a lower tier
        start moving into the CPU tier at once, from the runs already located (the stores are not asked twice),
        except those that end at or before token `prefetch_from`: vLLM's own prefix cache holds them, no load
        reads them. `for_request`: a request's lookup, whose prefetch takes the first chunks that fit in
        `prefetch_cpu_share` of the CPU tier beside the chunks other lookups prefetched that no load has read
        yet (its load reads the rest). Only the `wanted` tiers are looked in (a request's kv_load_tiers); without
        the CPU tier nothing is prefetched: that request's load reads the wanted tier itself, never the CPU tier."""
        runs = await self.locate(spans, wanted)
        if LOCAL_CPU not in wanted:
            return runs[-1].end if runs else 0
        skip = sum(1 for span in spans if span.end <= prefetch_from)
        lower_runs = [Run(run.location, max(run.begin, skip), run.end) for run in runs
                      if run.location != LOCAL_CPU and run.end > skip]
        room = self._prefetch_room() if for_request else len(spans)
        lower_runs = _first_chunks(lower_runs, room)
        if lower_runs and self.cpu.keep:
            owner = object()
            # claimed before the next await: a retrieve that comes next waits for these chunks instead of
            # reading them a second time
            self._claim(owner, [span.key for run in lower_runs for span in spans[run.begin:run.end]])
            task = asyncio.get_running_loop().create_task(self._prefetch(spans, lower_runs, check, owner,
                                                                         for_request))
            task.add_done_callback(_log_failure)
        return runs[-1].end if runs else 0

    def _prefetch_room(self) -> int:
        """How many chunks a request's lookup may prefetch now (`prefetch_cpu_share`)."""
        share = int(self.config.prefetch_cpu_share * self.cpu.pool.num_slots)
        return max(0, share - self.cpu.unread_prefetched - self._prefetching)

    async def _prefetch(self, spans: Sequence[ChunkSpan], runs: list[Run], check: CheckMeta,
                        owner: object, for_request: bool) -> None:
        reserved = sum(run.end - run.begin for run in runs) if for_request else 0
        self._prefetching += reserved
        try:
            for ref in await self.fetch(spans, check, owner, runs, prefetched=for_request):
                ref.release()  # the CPU tier keeps its own reference
        finally:
            self._prefetching -= reserved

    def prefetch(self, spans: Sequence[ChunkSpan], check: CheckMeta) -> None:
        """vLLM thread: start loading the held prefix of `spans` from below into the CPU tier; returns at once."""
        if not self.cpu.keep or not self.lower_ready() or self.cpu.prefix(s.key for s in spans) == len(spans):
            return
        assert self.loop is not None
        self.loop.submit(self.lookup_and_prefetch(spans, check)).add_done_callback(_log_failure)

    # ---- retrieval (vLLM thread, then the loop) --------------------------------------------------------------
    def acquire_prefix(self, spans: Sequence[ChunkSpan], check: CheckMeta,
                       wanted: frozenset[str] = ALL_LOCATIONS) -> list[ChunkRef]:
        """References to the longest prefix of `spans` held in the `wanted` tiers (a request's kv_load_tiers),
        fetching from below into the pool.

        CPU hits cost no NATS round trip; the rest is fetched on the NATS loop within `blocking_timeout_secs`
        (a timeout or a dead mesh just ends the prefix there: the caller recomputes the rest).
        """
        refs: list[ChunkRef] = []
        for span in spans if LOCAL_CPU in wanted else ():
            ref = self.checked_cpu(span, self.cpu.acquire(span.key), check)
            if ref is None:
                break
            refs.append(ref)
        if len(refs) < len(spans) and wanted - {LOCAL_CPU} and self.lower_ready():
            refs += self._fetch_rest(spans[len(refs):], check, wanted)
        self.recency.note_hits([ref.meta.key for ref in refs])
        return refs

    def _fetch_rest(self, spans: Sequence[ChunkSpan], check: CheckMeta,
                    wanted: frozenset[str] = ALL_LOCATIONS) -> list[ChunkRef]:
        assert self.loop is not None
        job = _FetchJob()
        timeout = self.config.blocking_timeout_secs
        more = self.loop.call(self._fetch_for(job, spans, check, wanted), timeout, default=None, cancel=False)
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

    async def _fetch_for(self, job: _FetchJob, spans: Sequence[ChunkSpan], check: CheckMeta,
                         wanted: frozenset[str] = ALL_LOCATIONS) -> list[ChunkRef]:
        refs: list[ChunkRef] = []
        try:
            refs = await self.fetch(spans, check, wanted=wanted)
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
                    runs: list[Run] | None = None, prefetched: bool = False,
                    wanted: frozenset[str] = ALL_LOCATIONS) -> list[ChunkRef]:
        """Loop thread: references to the held prefix of `spans` (within `runs`, located now in the `wanted`
        tiers if not given).

        Chunks fetched from below are also made resident in the CPU tier when it keeps chunks (`prefetched`: as a
        request's lookup prefetch, LocalCPUBackend.put). A chunk that another fetch (usually a prefetch) is
        reading is waited for, not read twice. `owner` names this fetch in the in-flight table (a prefetch claims
        its keys before it starts). Without LOCAL_CPU in `wanted` (a request's kv_load_tiers leave it out) the
        CPU tier is never read: every chunk comes from the wanted tier through a fresh pool slot (and is then
        admitted to the CPU tier like any chunk read from below, docs/config.md).
        """
        owner = owner if owner is not None else object()
        refs: list[ChunkRef] = []
        from_cpu = LOCAL_CPU in wanted
        try:
            for run in runs if runs is not None else await self.locate(spans, wanted):
                pos = run.begin
                while from_cpu and pos < run.end:  # what is (or is about to be) resident needs no store
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
                                 for r in await self.locate(spans[pos:], wanted - {LOCAL_CPU})]
                        refs += await self.fetch(spans, check, owner, lower, prefetched, wanted)
                    return refs
                got = await self._get_many(client, spans[pos:run.end], check, owner, prefetched)
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
        return self.checked_cpu(span, ref, check)

    def checked_cpu(self, span: ChunkSpan, ref: ChunkRef | None, check: CheckMeta) -> ChunkRef | None:
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
                        owner: object, prefetched: bool = False) -> list[ChunkRef]:
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
                    slot = self.cpu.allocate(spans[started].state)
                    if slot is None:
                        pool_full = True
                        self.stats["fetch_no_memory"] += 1
                        self._rlog.warning("fetch_pool_full", "CPU pool full (every chunk pinned or in use): a "
                                           "retrieve from %s returned a shorter hit", client.location)
                        break
                    span = spans[started]
                    started += 1
                    self._claim(owner, [span.key])
                    window.append((span, slot, loop.create_task(self.read_into(client, span, slot, check))))
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
                    # may (the disk store, through the lent pool) raised StoreMayWrite, and read_into holds the
                    # slot for that. The remote store's stream reads with loop.sock_recv_into on this loop (a
                    # read that is cancelled or timed out cannot land later: the kernel copies only inside that
                    # loop callback), and the Redis tier awaits its decode thread to the end.
                    failed = True
                    slot.release()
                else:
                    got.append(ChunkRef(result, slot))
                    if self.cpu.keep:
                        self.cpu.put(result, slot.ref(), prefetched)
                self._settle(owner, [span.key])
        except BaseException:  # cancelled: the reads in flight are cancelled and their slots stay held (never
            for _, _, task in window:  # reused): we are stopping
                task.cancel()
            raise
        finally:
            self._settle(owner, [span.key for span, _, _ in window])
        self.count_reads(client.location, got)
        return got

    def count_reads(self, location: str, refs: Sequence[ChunkRef]) -> None:
        """Chunks read from a lower tier (the metrics' per-tier read counts and bytes)."""
        self.stats[f"fetched_{location}"] += len(refs)
        self.stats[f"read_bytes_{location}"] += sum(ref.meta.nbytes for ref in refs)

    async def read_into(self, client: StoreTier, span: ChunkSpan, slot: Slot, check: CheckMeta) -> ChunkMeta | None:
        """`span`'s chunk into `slot`; None on a miss. The caller releases its slot reference on None as always:
        when the store may still write into the slot, the quarantine holds a reference of its own."""
        if self.quarantine.stalled(client.location):  # a stalled store must not drain the pool
            return None
        try:
            meta = await client.get_into(span.key, slot.chunk_buffer())
        except StoreMayWrite as exc:
            self.quarantine.hold(client.location, slot.ref(), exc)
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


def _first_chunks(runs: Sequence[Run], count: int) -> list[Run]:
    """The first `count` chunks of `runs`, as runs."""
    first: list[Run] = []
    for run in runs:
        if count <= 0:
            break
        first.append(Run(run.location, run.begin, min(run.end, run.begin + count)))
        count -= run.end - run.begin
    return first


def _log_failure(future: "concurrent.futures.Future[object] | asyncio.Future[object]") -> None:
    try:
        exc = future.exception()
    except BaseException:  # cancelled at close
        return
    if exc is not None:
        log.warning("prefetch failed: %s", exc)
