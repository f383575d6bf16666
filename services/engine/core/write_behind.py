"""Write-behind: chunks the CPU tier admitted, sent on to every store below it off vLLM's threads, and the
known-held set those sends leave behind.

Threads: `enqueue` is called from vLLM's threads and never blocks (a full queue or an unreachable mesh skips the
chunk, logged rate-limited); the workers (`write_behind_workers` of them) run on the NATS loop thread
(`NatsLoop`). Data path of one chunk: pool slot -> queue -> checksum of the slot's bytes (a worker thread; every
store put carries one and the stores refuse bytes that do not match it) -> each store's `put` (the disk store reads
the slot in place through shared memory).

Yielding to vLLM: the writers run on the NATS loop thread of vLLM's worker process, and every Python step they
take while a forward runs makes vLLM's model thread wait for the GIL when its next torch op returns (measured:
the save's own Python on that thread 3-5x slower, a cold Qwen3-Next prompt 1.24-1.31x vLLM's with the sealed disk
store; benchmarks/cold_path.py). Starting jobs only between forwards was not enough: a job started in the few
milliseconds between two steps of a chunked prefill runs on through the next forward (still 1.31x; 1.06x with
every job held past the prefill). So a job starts once vLLM has run no forward for `write_behind_idle_secs`
(`forward_started` / `forward_ended`, called by the worker connector on vLLM's model thread; an engine no vLLM
drives is idle), unless it has waited `write_behind_defer_secs` already, or the queue presses (half of
`store_queue_size`, or a quarter of the CPU pool's slots: queued chunks cannot be evicted). So deferring never
makes the queue skip a chunk nor the pool refuse a save, and under steady load every chunk is still written, at
most that much later. A job that started runs to its end.

Known-held: the chunks every store took (`known_held`), so a store does not gather and send them again; the walk
forgets those a store says it dropped (`forget`). Bounded by `known_held_keys`, oldest first.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.mesh.nats_loop import NatsLoop
from kvmesh.services.engine.tiers.base import NO_RETENTION, Retention, StoreTier
from kvmesh.services.engine.tiers.cpu import LocalCPUBackend
from kvmesh.services.engine.tiers.memory_pool import Slot
from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.protocol import ChunkMeta
from kvmesh.shared.rate_limited_log import RateLimitedLog
from kvmesh.shared.wire.chunk_file import checksum
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)


@dataclass
class _WriteJob:
    meta: ChunkMeta
    slot: Slot  # holds one reference for the job
    queued_at: float  # time.monotonic() of its enqueue
    retention: Retention = NO_RETENTION  # the storing request's, carried with each put
    store_to: frozenset[str] | None = None  # the only locations written (its kv_store_tiers; None: all)


class WriteBehind:
    """The write-behind queue and its workers, and the known-held set. `stores` answers the stores a chunk goes
    to now (none until NATS is first reached), `ready` whether they are reachable; `stats` is the storage
    manager's (its `write_behind_*`, `written_bytes_<location>` and `put_failed_<location>` counts)."""

    def __init__(self, cpu: LocalCPUBackend, loop: NatsLoop | None, config: EngineConfig,
                 stores: Callable[[], Sequence[StoreTier]], ready: Callable[[], bool],
                 stats: collections.Counter[str]) -> None:
        self.cpu = cpu
        self.loop = loop
        self.config = config
        self.stats = stats
        self._stores = stores
        self._ready = ready
        self._queue: collections.deque[_WriteJob] = collections.deque()
        self._queue_lock = threading.Lock()
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._writing = 0  # jobs popped and not finished (loop thread only)
        self._pending: collections.Counter[ChunkKey] = collections.Counter()  # queued or being written (queue lock)
        self._known_held: collections.OrderedDict[ChunkKey, None] = collections.OrderedDict()
        self._known_lock = threading.Lock()
        self._rlog = RateLimitedLog(log)
        self._in_forward = False  # written by vLLM's model thread, read by the writers (plain values: no lock)
        self._forward_ended_at = float("-inf")  # time.monotonic() of the last forward's end (none yet: idle)
        self.held_back = 0  # writers waiting for vLLM to be idle (loop thread counts, others read)
        self._go: asyncio.Event | None = None  # set when a job is queued: held-back writers look again

    # ---- vLLM's forwards (vLLM's model thread) ----------------------------------------------------------------
    def forward_started(self) -> None:
        self._in_forward = True

    def forward_ended(self) -> None:
        self._forward_ended_at = time.monotonic()
        self._in_forward = False

    async def _until_vllm_idle(self, job: _WriteJob) -> None:
        """Loop thread: until vLLM has run no forward for write_behind_idle_secs, the job has waited
        write_behind_defer_secs, or the queue presses (module docstring). Polled every write_behind_idle_secs:
        no wake-up from vLLM's threads."""
        assert self._go is not None
        idle_secs = self.config.write_behind_idle_secs
        while True:
            now = time.monotonic()
            idle_for = -1.0 if self._in_forward else now - self._forward_ended_at
            left = job.queued_at + self.config.write_behind_defer_secs - now
            if idle_for >= idle_secs or left <= 0 or self._pressing(self.queue_depth):
                return
            idle_for = max(idle_for, 0.0)
            self._go.clear()  # set when the queue presses
            self.held_back += 1
            try:
                await asyncio.wait_for(self._go.wait(), min(left, idle_secs - idle_for))
            except asyncio.TimeoutError:
                pass
            finally:
                self.held_back -= 1

    # ---- the workers (loop thread) ---------------------------------------------------------------------------
    def start(self) -> list[asyncio.Task[None]]:
        """Start the workers on the running loop."""
        self._wake = asyncio.Event()
        self._go = asyncio.Event()
        self._tasks = [asyncio.create_task(self._writer(), name=f"kvmesh-write-behind-{i}")
                       for i in range(self.config.write_behind_workers)]
        return self._tasks

    async def stop(self) -> None:
        """Stop the workers; the chunks still queued are dropped (their slots released)."""
        await cancel_and_wait(self._tasks)
        self._tasks = []
        with self._queue_lock:
            jobs, self._queue = list(self._queue), collections.deque()
            self._pending.clear()
        for job in jobs:
            job.slot.release()

    # ---- known-held: chunks every store has ------------------------------------------------------------------
    def known_held(self, key: ChunkKey) -> bool:
        with self._known_lock:
            return key in self._known_held

    def _remember_held(self, key: ChunkKey) -> None:
        with self._known_lock:
            self._known_held[key] = None
            self._known_held.move_to_end(key)
            while len(self._known_held) > self.config.known_held_keys:
                self._known_held.popitem(last=False)

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """A store dropped these: the next put sends them again."""
        with self._known_lock:
            for key in keys:
                self._known_held.pop(key, None)

    # ---- the queue ---------------------------------------------------------------------------------------------
    def enqueue(self, meta: ChunkMeta, slot: Slot, retention: Retention = NO_RETENTION,
                store_to: frozenset[str] | None = None) -> bool:
        """vLLM thread: queue a chunk for the stores (those at `store_to` only, when set), with the storing
        request's `retention`; takes over one slot reference (released on False too).

        Never blocks: a full queue or an unreachable mesh skips the chunk (logged, rate-limited).
        """
        if not self._ready():
            slot.release()
            self.stats["write_behind_skipped_offline"] += 1
            self._rlog.warning("offline", "write-behind skipped: NATS or the stores are not reachable; chunks "
                               "stay on the CPU tier only")
            return False
        with self._queue_lock:
            full = len(self._queue) >= self.config.store_queue_size
            if not full:
                self._queue.append(_WriteJob(meta, slot, time.monotonic(), retention, store_to))
                self._pending[meta.key] += 1
                depth = len(self._queue)
        if full:
            slot.release()
            self.stats["write_behind_skipped_full"] += 1
            self._rlog.warning("queue_full", "write-behind queue full (%d chunks, store_queue_size): skipped a "
                               "chunk; the lower tiers are slower than the stores arriving",
                               self.config.store_queue_size)
            return False
        assert self.loop is not None
        # The loop is woken for the first job only (a writer takes it and waits out its time, looking at vLLM's
        # idleness itself) and once the queue presses: each wake-up is GIL time vLLM's model thread waits for, and
        # this runs after every forward of a prefill.
        if depth == 1 or self._pressing(depth):
            self.loop.call_soon(self._poke)
        return True

    def _pressing(self, depth: int) -> bool:
        """Whether a queue of `depth` jobs starts them during a forward too (module docstring)."""
        return depth * 2 >= self.config.store_queue_size or depth * 4 >= self.cpu.pool.num_slots

    def _poke(self) -> None:
        """Loop thread: the idle writers take queued jobs, the held-back ones look again whether to start."""
        if self._wake is not None:
            self._wake.set()
        if self._go is not None:
            self._go.set()

    def pending(self, key: ChunkKey) -> bool:
        """Whether a job for the chunk is queued or being written."""
        with self._queue_lock:
            return key in self._pending

    def _done(self, key: ChunkKey) -> None:
        with self._queue_lock:
            self._pending[key] -= 1
            if self._pending[key] <= 0:
                del self._pending[key]

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
                await self._until_vllm_idle(job)
                await self._write(job)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("write-behind of chunk %s failed", job.meta.key.hex())
            finally:
                self._writing -= 1
                self.cpu.drop_staged(job.meta.key, job.slot)  # staging only: the CPU copy has served its purpose
                job.slot.release()
                self._done(job.meta.key)

    async def _write(self, job: _WriteJob) -> None:
        clients = [c for c in self._stores() if job.store_to is None or c.location in job.store_to]
        if not clients or self.loop is None or not self.loop.connected:
            self.stats["write_behind_dropped_offline"] += 1
            return
        buffer = job.slot.chunk_buffer(job.meta.nbytes)
        # Once per chunk, off the loop: the stores verify the bytes they receive against it before holding them.
        digest = await asyncio.to_thread(checksum, buffer.view[:job.meta.nbytes])
        meta = dataclasses.replace(job.meta, checksum=digest)
        results = await asyncio.gather(*(c.put(meta, buffer, job.retention) for c in clients),
                                       return_exceptions=True)
        for client, result in zip(clients, results):
            if result is True:
                self.stats[f"written_bytes_{client.location}"] += meta.nbytes
            else:
                self.stats[f"put_failed_{client.location}"] += 1
        if all(r is True for r in results):
            if len(clients) == len(self._stores()):  # every store took it (its kv_store_tiers may name fewer)
                self._remember_held(job.meta.key)
            self.stats["write_behind_done"] += 1
        else:
            self.stats["write_behind_failed"] += 1
            self._rlog.warning("put_failed", "write-behind of a chunk to %s failed (%s)",
                               ", ".join(c.location for c, r in zip(clients, results) if r is not True),
                               "; ".join(str(r) for r in results if r is not True))

    async def wait_idle(self, timeout: float) -> bool:
        """Loop thread: until the queue is empty and no job runs (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.queue_depth or self._writing:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True
