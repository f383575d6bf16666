"""Builds one worker's engine: the composition root of everything below the connector.

`build_engine` makes, for a KV layout: the memory pool and the CPU tier on it, the paged copier, the chunk hasher
(its key parameters fixed by the layout and the sharing domain), the storage manager, and with the mesh the
engine's NATS loop, the worker agent, the peer server (enable_p2p) and the lower tiers' clients (once NATS is
first reached, in the walk order of tiers/registry.py). `WorkerMesh` is the engine's place on the mesh: the
connection (joined or embedded), its registration and what closes with it. `SchedulerLink` is what a worker's
engine offers its scheduler (the CPU tier's events, lookups, the rendezvous file).

Only this module wires the floors together (services/engine/__init__.py): `core/` never builds its own parts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from nats.aio.client import Client as NatsClient

from kvmesh.services.engine.agents.lookup_server import LookupServer, lookup_id_for
from kvmesh.services.engine.agents.peer_server import PeerServer
from kvmesh.services.engine.agents.rendezvous import PublishedWorker, publish_worker
from kvmesh.services.engine.agents.worker_agent import WorkerAgent
from kvmesh.services.engine.config.engine_auth import engine_auth
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core.cache_engine import CacheEngine, KVCaches
from kvmesh.services.engine.core.kv_layout import KVLayout, detect_layout
from kvmesh.services.engine.core.paged_copy import PagedCopier
from kvmesh.services.engine.core.storage_manager import StorageManager
from kvmesh.services.engine.mesh.domain import engine_credentials_file, engine_domain, key_domain
from kvmesh.services.engine.mesh.embedded import MeshConnection, MeshPlan
from kvmesh.services.engine.mesh.nats_loop import NatsLoop
from kvmesh.services.engine.mesh.side_cpus import move_to_side_cpus
from kvmesh.services.engine.tiers.cpu import EvictionHolder, LocalCPUBackend, TierListener
from kvmesh.services.engine.tiers.memory_pool import MemoryPool
from kvmesh.services.engine.tiers.redis_values import resolve_auth
from kvmesh.services.engine.tiers.registry import TierPlan, TierSite, configured_locations, lower_tiers
from kvmesh.services.engine.tiers.sealed import ChunkSealer
from kvmesh.shared import protocol
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.eviction import Clock
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.credentials import DEFAULT_DOMAIN, SharingDomain, credentials_for
from kvmesh.shared.protocol import PEER, worker_id_for
from kvmesh.shared.wire.keys import ChunkHasher, ChunkKey, KeyParams
from kvmesh.shared.wire.kv_events import ChunkDescription
from kvmesh.shared.wire.redis_keys import RedisAuth
from kvmesh.shared.tls import server_context_of
from kvmesh.shared.wire.stream_server import ClientBounds

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # where the P2P stream listens unless p2p_host says otherwise
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def build_engine(config: EngineConfig, key_params: KeyParams, layout: KVLayout, *, use_mesh: bool = True,
                 device: torch.device | str | None = None, use_shm: bool = True,
                 clock: Clock = time.monotonic) -> CacheEngine:
    """One worker's engine for `layout`. `use_mesh=False` runs without NATS at all (CPU tier only: tests,
    benchmarks). `clock` is the CPU tier's (its pins' TTLs expire on it; tests pass one they advance by hand)."""
    # The worker's place in its instance; the keys may name another shard (MLA: one for all ranks).
    world_size, rank = key_params.world_size, key_params.rank
    # Tagged with this process (and engine): replicas keeping the same lmcache_instance_id stay distinct.
    worker_id = worker_id_for(config.lmcache_instance_id, world_size, rank, f"{os.getpid()}-{secrets.token_hex(3)}")
    layout.check_chunk_size(config.chunk_size)
    key_params, writes_lower_tiers = _layout_keys(key_params, layout, rank)
    # with state layers, chunks and states each in a slot of their own size (memory_pool.py: size classes)
    pool = MemoryPool(config.max_local_cpu_bytes, layout.chunk_nbytes(config.chunk_size), use_shm=use_shm,
                      state_nbytes=layout.chunk_nbytes(layout.state_block, state=True) if layout.has_state else 0,
                      thread_setup=move_to_side_cpus)  # its page faulting keeps off vLLM's compute cores
    cpu = LocalCPUBackend(pool, keep=config.local_cpu, policy=config.cache_policy, clock=clock,
                          retained_share=config.retained_cpu_share)
    copier = PagedCopier(layout, device)
    connection = _join_mesh(config, world_size, worker_id) if use_mesh else None
    domain = SharingDomain()
    auth = None
    if connection is not None:
        auth = credentials_for(connection.url, protocol.Principal.engine(config.lmcache_instance_id),
                               engine_auth(config))
        # after credentials_for: the credentials file it provisions records the engine's sharing domain
        try:
            domain = engine_domain(config, connection.url)
        except ConfigError as exc:
            log.error("cache engine %s: %s; keys and stores of the default sharing domain", worker_id, exc)
        key_params = dataclasses.replace(key_params, domain=key_domain(domain))
        if domain.name != DEFAULT_DOMAIN:
            log.info("cache engine %s: sharing domain %s", worker_id, domain.name)
    hasher = ChunkHasher(key_params, config.chunk_size, config.save_unfull_chunk)
    lower: list[str] = []
    nats_loop = None
    tier_plan = TierPlan(config)  # only an engine on the mesh builds lower tiers (WorkerMesh)
    if connection is not None:
        plan = connection.plan
        tier_plan = TierPlan(config, plan.disk_store, tuple(plan.remote_stores), plan.redis)
        lower = configured_locations(tier_plan)
        nats_loop = NatsLoop(worker_id)
    storage = StorageManager(cpu, nats_loop, config, lower)
    _warn_about(config, lower)
    engine = CacheEngine(config, key_params, layout, worker_id=worker_id, world_size=world_size, rank=rank,
                         writes_lower_tiers=writes_lower_tiers, hasher=hasher, pool=pool, cpu=cpu, copier=copier,
                         storage=storage, nats_loop=nats_loop)
    if connection is not None and nats_loop is not None:
        mesh = WorkerMesh(engine, connection, nats_loop, domain.name, tier_plan, _sealer(config, domain, tier_plan))
        engine.mesh = mesh
        mesh.connect(auth)
    state = f", state {layout.chunk_nbytes(layout.state_block, state=True) / 2**20:.2f} MiB" \
        if layout.has_state else ""
    states = f" or {pool.num_slabs * pool.parts_per_slab[pool.class_of(state=True)]} states" if layout.has_state else ""
    log.info("cache engine %s: chunk %d tokens = %.2f MiB%s (%s), CPU pool %d chunks%s%s%s", worker_id,
             config.chunk_size, layout.chunk_nbytes(config.chunk_size) / 2**20, state, layout.chunk_format(),
             pool.num_slots, states, " (shared memory)" if pool.segment is not None else "",
             f", mesh {connection.url} ({connection.plan.mode})" if connection is not None else "")
    return engine


def engine_for_caches(config: EngineConfig, key_params: KeyParams, kv_caches: KVCaches, block_size: int,
                      backend_name: str | None = None, *, cpu_isa: str | None = None, **options: object) -> CacheEngine:
    """`build_engine` for the layout of vLLM's caches (`detect_layout`; `cpu_isa` overrides the CPU attention ISA
    that would otherwise be asked from vLLM). `options` are build_engine's."""
    caches = dict(kv_caches) if isinstance(kv_caches, Mapping) else {str(i): c for i, c in enumerate(kv_caches)}
    layout = detect_layout(caches, block_size, backend_name, cpu_isa=cpu_isa)
    options.setdefault("device", next(iter(caches.values())).device)
    return build_engine(config, key_params, layout, **options)  # type: ignore[arg-type]


class SchedulerLink:
    """What a worker's engine offers its scheduler once vLLM registered its KV caches: the CPU tier's admissions
    and evictions (to `cpu_events`, sent with every step's output for the scheduler's mirror; with `holder`, the
    chunks it evicts held until the scheduler saw them: adapter/cpu_mirror.py), the answers to its
    lower-tier lookups on NATS (agents/lookup_server.py) and the rendezvous file that names both
    (agents/rendezvous.py). `close` takes them back (the lookup subscription closes with the engine's NATS)."""

    def __init__(self, engine: CacheEngine, cpu_events: TierListener, holder: EvictionHolder | None = None) -> None:
        self._engine, self._cpu_events, self._holder = engine, cpu_events, holder
        engine.cpu.listen(cpu_events)
        if holder is not None:  # evictions held until the scheduler saw them (adapter/cpu_mirror.py)
            engine.cpu.hold_evictions(holder)
        lookup_id = lookup_id_for(engine.worker_id)
        self._lookups = LookupServer(engine, engine.nats_loop, lookup_id) if engine.nats_loop is not None else None
        self._rendezvous: Path | None = publish_worker(PublishedWorker.of(engine, lookup_id))

    def close(self) -> None:
        self._lookups = None
        if self._rendezvous is not None:
            self._rendezvous.unlink(missing_ok=True)
            self._rendezvous = None
        self._engine.cpu.unlisten(self._cpu_events)
        if self._holder is not None:
            self._engine.cpu.hold_evictions(None)
            self._holder.seen(None)


def _layout_keys(key_params: KeyParams, layout: KVLayout, rank: int) -> tuple[KeyParams, bool]:
    """The key parameters for `layout`'s chunks, and whether this rank writes the lower tiers."""
    fmt = layout.chunk_format()
    if key_params.kv_format != fmt:
        if key_params.kv_format:
            log.warning("key_params.kv_format %r differs from the layout's chunk format %r; using the "
                        "layout's (chunks of different formats must never mix)", key_params.kv_format, fmt)
        key_params = dataclasses.replace(key_params, kv_format=fmt)
    if layout.replicated_across_ranks:
        # Every rank holds the same latent KV: one key for all ranks, and only rank 0 writes the shared
        # tiers, so they hold one copy, not world_size copies (LMCache's save_only_first_rank).
        return dataclasses.replace(key_params, world_size=1, rank=0), rank == 0
    return key_params, True


def _join_mesh(config: EngineConfig, world_size: int, worker_id: str) -> MeshConnection | None:
    try:  # joining needs nothing; embedding starts a NATS server (the one thing that can fail here)
        return MeshConnection(config, world_size)
    except Exception as exc:
        log.error("cache engine %s: no mesh (%s: %s); serving from the CPU tier only", worker_id,
                  type(exc).__name__, exc)
        return None


def _warn_about(config: EngineConfig, lower: list[str]) -> None:
    if config.enable_p2p and PEER not in lower:
        log.warning("enable_p2p is set but the engine has no mesh: no P2P (peers are found through the "
                    "controller on NATS)")
    if not config.local_cpu and not lower:
        log.warning("local_cpu is false and no lower tier (local_disk / remote_url) is configured: the "
                    "engine stores nothing")
    if config.force_skip_save:
        log.warning("force_skip_save (LMCACHE_FORCE_SKIP_SAVE) is set: the engine stores nothing, it only "
                    "loads what the tiers hold")


def _sealer(config: EngineConfig, domain: SharingDomain, plan: TierPlan) -> ChunkSealer | None:
    """What seals the chunks this engine puts in the disk store and the remote store (`encrypt_stores`): the key of
    its sharing domain. None when off. (A Redis tier seals its values itself: redis_values.py.)"""
    stores = bool(plan.disk_store) or (bool(plan.remote_stores) and not plan.redis)
    if not config.encrypt_stores:
        if stores:
            log.warning("encrypt_stores is false: chunks go to the disk / remote store in clear")
        return None
    if domain.secret is None and stores:
        log.warning("sharing domain %s has no secret (NATS credentials made before domains, or none): chunks in "
                    "the disk / remote store are sealed under a key anyone can derive, which catches chunks moved "
                    "between keys or domains but does not keep them from being read", domain.name)
    elif stores:
        log.info("chunks in the disk / remote store sealed under the key of sharing domain %s", domain.name)
    return ChunkSealer(domain.name, domain.secret)


class WorkerMesh:
    """One engine's place on the mesh: its NATS connection (joined or embedded), the worker agent, the peer server
    (enable_p2p), and once NATS is first reached the lower tiers' clients (`tier_plan`'s, tiers/registry.py). The
    engine's `mesh`."""

    def __init__(self, engine: CacheEngine, connection: MeshConnection, nats_loop: NatsLoop, domain_name: str,
                 tier_plan: TierPlan, sealer: ChunkSealer | None = None) -> None:
        config = engine.config
        self.engine = engine
        self.connection = connection
        self.plan: MeshPlan = connection.plan
        self.tier_plan = tier_plan
        self.nats_loop = nats_loop
        self.domain_name = domain_name  # its sharing domain (the credentials'); P2P stays inside it
        self.sealer = sealer  # seals the stores' chunks under the domain's key (encrypt_stores)
        self.started_at = time.time()
        self.ip = bus.route_address(connection.url) or ""  # the address this host reaches NATS from
        storage = engine.storage
        self.agent = WorkerAgent(config.lmcache_instance_id, engine.worker_id, engine.hasher, storage.commands,
                                 self.registration, engine.meta_mismatch, lambda: storage.write_behind.queue_depth,
                                 heartbeat_interval=config.heartbeat_interval_secs,
                                 state_block=engine.layout.state_block)
        nats_loop.submit(storage.start()).result(5.0)
        nats_loop.on_connected(self._on_connected)
        nats_loop.on_close(self.agent.stop)
        nats_loop.on_close(storage.stop)
        self.peer_server: PeerServer | None = None  # this worker's CPU tier served to peers (enable_p2p)
        if config.enable_p2p:
            self.peer_server = self._peer_server()
            nats_loop.on_close(self.peer_server.stop)
        # after credentials_for: the credentials file it provisions may hold the Redis tier's secret
        self.redis_auth: RedisAuth | None = (resolve_auth(config, engine_credentials_file(config, connection.url))
                                             if self.plan.redis else None)

    @property
    def nats_url(self) -> str:
        return self.connection.url

    def connect(self, auth: object) -> None:
        self.nats_loop.connect(self.connection.url, auth)  # type: ignore[arg-type]

    def registered(self) -> bool:
        """Registered on the mesh and answering commands."""
        return self.agent.started

    def announce(self) -> None:
        """Tell the controller the registration changed (a new LoRA adapter), if registered already."""
        if self.agent.started:
            self.nats_loop.submit(self.agent.reporter.announce())

    def describe(self, key: ChunkKey, description: ChunkDescription) -> None:
        """Carry `description` with `key`'s next admission (thread-safe: the reporter locks)."""
        self.agent.reporter.describe(key, description)

    def close(self) -> None:
        self.connection.close()

    def registration(self) -> protocol.RegisterEngine:
        engine, config = self.engine, self.engine.config
        params = engine.key_params
        return protocol.RegisterEngine(
            worker_id=engine.worker_id, instance_id=config.lmcache_instance_id, model=params.model,
            kv_format=params.kv_format, world_size=engine.world_size, rank=engine.rank,
            chunk_size=config.chunk_size, save_unfull_chunk=config.save_unfull_chunk,
            disk_store=self.plan.disk_store, remote_stores=list(self.plan.remote_stores), started_at=self.started_at,
            kv_replicated=params.world_size != engine.world_size, lora_adapters=dict(engine.lora_adapters),
            host=socket.gethostname(), ip=self.ip, domain=params.domain,
            p2p=self.peer_server is not None and self.peer_server.server.listening,
            peer_endpoint=self.peer_server.endpoint if self.peer_server is not None else "")

    async def _on_connected(self, nc: NatsClient) -> None:
        """Loop thread, once NATS is first reached: store clients, then the worker agent."""
        engine = self.engine
        storage = engine.storage
        site = TierSite(nc, engine.store_caller, self.redis_auth, self.domain_name, engine.worker_id, self.agent.path,
                        storage.stats, self.sealer, storage.cpu.pool.slot_nbytes)
        storage.set_lower(lower_tiers(self.tier_plan, site))
        if self.peer_server is not None:
            try:
                await self.peer_server.start(nc)
            except OSError as exc:  # the port is taken, the host is not ours: serve without peers, say why
                log.error("cache engine %s: cannot serve peers on %s (%s; p2p_host / p2p_init_ports): this worker "
                          "loads from peers but serves none", engine.worker_id, self.peer_server.endpoint, exc)
                self.peer_server = None
        await self.agent.start(nc)

    def _peer_server(self) -> PeerServer:
        """The stream this worker serves its CPU tier on: `p2p_host` (default: loopback, peers on this host only;
        a wildcard such as 0.0.0.0 is told to peers as the address NATS is reached from), port
        `p2p_init_ports[rank]` (default: any free port)."""
        engine, config = self.engine, self.engine.config
        ports = config.p2p_init_ports or []
        if ports and len(ports) <= engine.rank:
            log.warning("p2p_init_ports lists %d port(s), none for rank %d: that rank listens on any free port",
                        len(ports), engine.rank)
        port = ports[engine.rank] if len(ports) > engine.rank else 0
        host = config.p2p_host or LOOPBACK
        advertised = (self.ip or LOOPBACK) if host in WILDCARD_HOSTS else host
        bounds = ClientBounds(max_pending=config.p2p_max_pending_connections,
                              max_pending_per_address=config.p2p_max_pending_per_address,
                              max_connections_per_caller=config.p2p_max_connections_per_peer,
                              ticket_max_bytes=config.p2p_ticket_max_bytes,
                              ticket_bytes_per_s=config.p2p_ticket_max_mb_per_s * 1e6)
        return PeerServer(engine.cpu, engine.storage.stats, config.lmcache_instance_id, engine.worker_id,
                          self.domain_name, host, advertised, port, max_connections=config.p2p_max_connections,
                          transfer_timeout=config.request_timeout_secs
                          + engine.pool.slot_nbytes / (config.remote_min_transfer_mb_per_s * 1e6),
                          hello_timeout=config.p2p_hello_timeout_secs, idle_timeout=config.p2p_idle_timeout_secs,
                          client_bounds=bounds,
                          tls=server_context_of(config.p2p_tls_cert, config.p2p_tls_key, "p2p_tls_cert", "p2p_tls_key"))


__all__ = ["WorkerMesh", "build_engine", "engine_for_caches"]
