"""How the scheduler finds its workers: a small rendezvous file per rank.

Each worker writes one when its KV caches are registered (`publish_worker`, named after the EngineCore pid, our
parent): its keying parameters (model, chunk format, chunk size) and where it answers the scheduler's lookups.
The scheduler reads its children's files (`find_workers`); files of a vLLM killed before its shutdown ran are
pruned (`prune_stale`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.shared.messaging.credentials import private_dir, runtime_dir
from kvmesh.shared.processes import pid_alive
from kvmesh.shared.wire.keys import KeyParams

if TYPE_CHECKING:
    from kvmesh.services.engine.core.cache_engine import CacheEngine


# ---- what a worker tells the scheduler ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PublishedWorker:
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
    worker_id: str = ""  # its id on the mesh (a PD producer names its workers to the consumer: adapter/pd.py)

    @property
    def key_params(self) -> KeyParams:
        return KeyParams(self.model, self.kv_format, self.key_world_size, self.key_rank, self.domain)

    @classmethod
    def of(cls, engine: "CacheEngine", lookup_id: str) -> "PublishedWorker":
        params, config = engine.key_params, engine.config
        return cls(rank=engine.rank, pid=os.getpid(), instance_id=config.lmcache_instance_id, lookup_id=lookup_id,
                   nats_url=engine.nats_url,
                   model=params.model, kv_format=params.kv_format, key_world_size=params.world_size,
                   key_rank=params.rank, chunk_size=config.chunk_size, save_unfull_chunk=config.save_unfull_chunk,
                   has_lower=engine.storage is not None and engine.storage.has_lower, domain=params.domain,
                   worker_id=engine.worker_id)


# ---- rendezvous files -----------------------------------------------------------------------------------------------
def rendezvous_dir() -> Path:
    return runtime_dir()


def rendezvous_path(scheduler_pid: int, rank: int) -> Path:
    return rendezvous_dir() / f"engine-{scheduler_pid}-r{rank}.json"


def publish_worker(info: PublishedWorker) -> Path:
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


def find_workers(world_size: int) -> list[PublishedWorker]:
    """Scheduler side: the published workers that are our children (stale files of dead pids are ignored)."""
    found = []
    for rank in range(world_size):
        try:
            info = PublishedWorker(**json.loads(rendezvous_path(os.getpid(), rank).read_text()))
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
