"""Where the engine finds NATS: join a configured mesh, or bring one up inside vLLM's process tree.

Decision (`plan_mesh`), first match wins:
  1. `nats_url` set -> join it.
  2. `controller_url` set (the quickstarts' "localhost:9001": the NATS the controller embeds) -> join it.
  3. `remote_url` is a NATS URL ("nats://host:port") -> join that NATS; the remote stores live there.
  4. nothing configured (the disk-offload setup, docs/compatibility.md) -> embed: a NATS server from the wheel on a free loopback port, a disk store
     process when `local_disk` is set, and `remote_partitions` remote-store processes when `remote_url` names
     another supported scheme (LMCache's "lm://localhost:65432", "kvmesh://"): served by embedded remote stores
     of `remote_size` (config.py refuses the schemes KVMesh cannot serve).
A Redis / Valkey `remote_url` (shared/wire/redis_url.py) is no remote store on the mesh: the engine talks to Redis
itself (services/engine/tiers/redis.py), so no remote-store process is started or expected (`redis` is set;
`remote_stores` names the tier `redis-<redis_key_prefix>`, so the controller sends RemoteBackend commands).
When joining, nothing is spawned: the mesh's own disk store (`disk-<hostname>`) and remote stores
(`remote-0..n-1`) are expected there.

Threads: an embedded mesh is started and stopped by its own daemon thread ("kvmesh-embedded-mesh"): the
children's parent-death signal is tied to the thread that spawned them, so that thread must live as long as
the mesh, longer than any one engine's loop thread. One embedded mesh per process (a refcounted registry):
several engine workers in one vLLM process share it; the last `release()` stops it. Across the worker processes
of one host (tensor parallelism), a file lock (`HostClaim`) lets the first run the store processes and the
others join its NATS, so one directory never gets two disk stores. Ranks of one instance with no store
processes share one NATS too (a claim named after their parent, vLLM's EngineCore), so the scheduler reaches
every rank through the one NATS it connects to.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.config.lmcache_keys import NATS_SCHEMES, url_scheme
from kvmesh.services.engine.mesh.side_cpus import move_to_side_cpus
from kvmesh.shared.messaging.bus import normalize_url
from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec
from kvmesh.shared.ops.store_commands import disk_store, remote_stores
from kvmesh.shared.protocol import disk_store_id, redis_store_id, remote_store_id
from kvmesh.shared.wire.redis_url import is_redis_url

log = logging.getLogger(__name__)

JOIN, EMBED = "join", "embed"
SERVICES_READY_TIMEOUT = 30.0


@dataclass(frozen=True)
class MeshPlan:
    """How this engine reaches the mesh, and which stores it uses there."""

    mode: str  # JOIN or EMBED
    nats_url: str | None  # JOIN: where; EMBED: None until started
    disk_store: str | None  # store id of this host's disk store, if local_disk is set
    remote_stores: list[str] = field(default_factory=list)  # remote partitions' store ids, if remote_url is set
    services: list[ServiceSpec] = field(default_factory=list)  # EMBED: processes to run
    reason: str = ""
    redis: bool = False  # remote_url is Redis / Valkey: the remote tier is the engine's own RedisTier


def is_nats_url(url: str) -> bool:
    return url_scheme(url) in NATS_SCHEMES


def plan_mesh(config: EngineConfig) -> MeshPlan:
    disk = disk_store_id() if config.local_disk else None
    redis = is_redis_url(config.remote_url)
    remotes = ([redis_store_id(config.redis_key_prefix)] if redis else
               [remote_store_id(i) for i in range(config.remote_partitions)] if config.remote_url else [])
    if config.nats_url:
        return MeshPlan(JOIN, normalize_url(config.nats_url), disk, remotes, redis=redis, reason="nats_url")
    if config.controller_url:
        return MeshPlan(JOIN, normalize_url(config.controller_url), disk, remotes, redis=redis,
                        reason="controller_url")
    if config.remote_url and is_nats_url(config.remote_url):
        return MeshPlan(JOIN, normalize_url(config.remote_url), disk, remotes, reason="remote_url is a NATS URL")
    services: list[ServiceSpec] = []
    if disk is not None:
        assert config.local_disk_path is not None
        services.append(disk_store(config.local_disk_path, config.max_local_disk_bytes, disk, config.cache_policy))
    if remotes and not redis:
        services += remote_stores(config.remote_size_bytes, config.remote_partitions, config.cache_policy,
                                  config.remote_prefault_bytes)
    return MeshPlan(EMBED, None, disk, remotes, services, redis=redis,
                    reason="no nats_url, controller_url or NATS remote_url")


class EmbeddedMesh:
    """NATS plus service processes, owned by one long-lived thread of this process."""

    def __init__(self, services: list[ServiceSpec]) -> None:
        self.services = services
        self.url: str | None = None
        self.services_ready = threading.Event()  # set once the services answered health (or failed to)
        self.services_ok = False
        self.pids: list[int] = []  # NATS and service processes, for health checks and tests
        self._error: BaseException | None = None
        self._url_known = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-embedded-mesh", daemon=True)

    def start(self, timeout: float = 15.0) -> str:
        """Start NATS (waiting for it) and the services (in the background); the NATS URL."""
        self._thread.start()
        if not self._url_known.wait(timeout):
            self._stop.set()
            raise TimeoutError(f"embedded NATS did not start within {timeout:.0f}s")
        if self._error is not None:
            raise self._error
        assert self.url is not None
        return self.url

    def _run(self) -> None:
        move_to_side_cpus()  # NATS and the stores it starts inherit this thread's CPUs
        mesh = LocalMesh(self.services)
        try:
            self.url = mesh.start_nats()
        except BaseException as exc:
            self._error = exc
            self._url_known.set()
            self.services_ready.set()
            return
        self.pids = mesh.pids
        self._url_known.set()
        try:
            if self.services and not self._stop.is_set():
                try:
                    mesh.start_services(ready_timeout=SERVICES_READY_TIMEOUT)
                    self.services_ok = True
                    log.info("embedded mesh: NATS %s with %s", self.url,
                             ", ".join(s.service_id for s in self.services))
                except Exception as exc:
                    log.error("embedded mesh: could not start %s (%s); the engine runs without them",
                              ", ".join(s.service_id for s in self.services), exc)
                self.pids = mesh.pids
            else:
                self.services_ok = True
                log.info("embedded mesh: NATS %s (no store processes configured)", self.url)
            self.services_ready.set()
            self._stop.wait()
        finally:
            self.services_ready.set()
            mesh.stop()
            log.info("embedded mesh stopped")

    def stop(self, timeout: float = SERVICES_READY_TIMEOUT + 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


class HostClaim:
    """Which process of this host runs the embedded mesh for a given set of store services.

    vLLM with tensor parallelism runs one worker process per rank; each would otherwise start its own NATS and
    its own disk store on the same directory. The first process to take an exclusive `flock` on a file named by
    the services runs the mesh and writes its NATS URL there; the others read the URL and join. The kernel drops
    the lock when its holder dies, so a stale URL is recognised (the file is no longer locked) and replaced.
    """

    def __init__(self, services: list[ServiceSpec], scope: str = "") -> None:
        identity = scope + "|" + "|".join(f"{s.module} {' '.join(s.args)}" for s in services)
        digest = hashlib.sha1(identity.encode()).hexdigest()[:16]
        self.path = Path(tempfile.gettempdir()) / f"kvmesh-mesh-{os.getuid()}-{digest}.lock"
        self._fd: int | None = None

    def try_own(self) -> bool:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            try:  # the previous owner may have unlinked the file between our open and our lock: lock the new one
                current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        self._fd = fd
        return True

    def publish(self, url: str) -> None:
        assert self._fd is not None
        os.pwrite(self._fd, url.encode(), 0)

    def owner_url(self) -> str | None:
        """The owner's NATS URL; None while it has not written one, or when nobody owns the claim."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held exclusively: an owner is alive
                return os.pread(fd, 4096, 0).decode(errors="replace").strip() or None
            fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it: whatever it says is stale
            return None
        finally:
            os.close(fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            self.path.unlink(missing_ok=True)  # while locked: try_own's inode check covers a racing opener
            os.close(fd)


@dataclass
class _Share:
    """This process's use of an embedded mesh: run here (`mesh`) or joined from another process (`mesh` None)."""

    url: str
    mesh: EmbeddedMesh | None
    claim: HostClaim | None
    refs: int = 0


class _Registry:
    """The process's one embedded mesh, shared by every engine worker in it (and, through `HostClaim`, by the
    worker processes of one vLLM instance on this host)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._share: _Share | None = None
        atexit.register(self._at_exit)

    def acquire(self, plan: MeshPlan, timeout: float = 30.0, world_size: int = 1) -> _Share:
        with self._lock:
            if self._share is None:
                self._share = self._start_or_join(plan, timeout, world_size)
            elif self._share.mesh is not None and ([s.service_id for s in self._share.mesh.services]
                                                   != [s.service_id for s in plan.services]):
                log.warning("embedded mesh already running with %s; this worker asked for %s and shares it",
                            [s.service_id for s in self._share.mesh.services], [s.service_id for s in plan.services])
            self._share.refs += 1
            return self._share

    @staticmethod
    def _start_or_join(plan: MeshPlan, timeout: float, world_size: int) -> _Share:
        if not plan.services and world_size == 1:  # nothing to share between processes: a NATS of our own
            mesh = EmbeddedMesh([])
            return _Share(mesh.start(), mesh, None)
        # store processes: one set per host; ranks without stores: one NATS per instance (the ranks' parent)
        claim = HostClaim(plan.services, scope="" if plan.services else f"instance-{os.getppid()}")
        deadline = time.monotonic() + timeout
        while True:
            if claim.try_own():
                mesh = EmbeddedMesh(plan.services)
                try:
                    url = mesh.start()
                except BaseException:
                    claim.release()
                    raise
                claim.publish(url)
                return _Share(url, mesh, claim)
            url = claim.owner_url()
            if url:
                log.info("embedded mesh of this host is run by another process (%s); joining %s", claim.path, url)
                return _Share(url, None, None)
            if time.monotonic() > deadline:
                raise TimeoutError(f"another process holds {claim.path} but published no NATS URL "
                                   f"within {timeout:.0f}s")
            time.sleep(0.05)  # the owner is starting NATS (a fraction of a second)

    def release(self, share: _Share) -> None:
        with self._lock:
            share.refs -= 1
            if share.refs > 0 or share is not self._share:
                return
            self._share = None
        self._stop(share)

    @staticmethod
    def _stop(share: _Share) -> None:
        if share.mesh is not None:
            share.mesh.stop()
        if share.claim is not None:
            share.claim.release()

    def current(self) -> EmbeddedMesh | None:
        """The mesh this process runs (None if none, or if it joined another process's)."""
        with self._lock:
            return self._share.mesh if self._share is not None else None

    def users(self) -> int:
        """How many engines of this process use the embedded mesh."""
        with self._lock:
            return self._share.refs if self._share is not None else 0

    def _at_exit(self) -> None:
        share, self._share = self._share, None
        if share is not None:
            self._stop(share)


registry = _Registry()


class MeshConnection:
    """What one engine holds: the plan, the NATS URL, and (embed mode) its share of the embedded mesh."""

    def __init__(self, config: EngineConfig, world_size: int = 1) -> None:
        self.plan = plan_mesh(config)
        self._share: _Share | None = None
        if self.plan.mode == EMBED:
            self._share = registry.acquire(self.plan, world_size=world_size)
            self.url: str = self._share.url
        else:
            assert self.plan.nats_url is not None
            self.url = self.plan.nats_url
            log.info("engine joins the mesh at %s (%s)", self.url, self.plan.reason)

    @property
    def embedded(self) -> EmbeddedMesh | None:
        return self._share.mesh if self._share is not None else None

    def close(self) -> None:
        share, self._share = self._share, None
        if share is not None:
            registry.release(share)
