"""The tiers below an engine's CPU tier as one ordered registry (`LOWER_TIERS`), in walk order: the disk store,
then the remote tier (KVMesh's remote store, or the engine's own Redis / Valkey client), then the peers' CPU
tiers (enable_p2p). Each entry says whether the engine's config and store ids name its tier, and builds its
client once NATS is reached, as vLLM's OffloadingSpecFactory and LMCache's backend list do: no tier is built on
the side. The assembly hands in what the clients need (store ids, the Redis MAC key, the peers' domain and
caller, the key that seals the stores' chunks); nothing here imports the mesh."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.tiers.base import StoreTier
from kvmesh.services.engine.tiers.disk import DiskStoreClient
from kvmesh.services.engine.tiers.peer import PeerTier
from kvmesh.services.engine.tiers.redis import RedisTier
from kvmesh.services.engine.tiers.memory_pool import MemoryPool
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.services.engine.tiers.sealed import SEAL_OVERHEAD, ChunkSealer, PutSeals, SealedTier
from kvmesh.shared.protocol import LOCAL_DISK, PEER, REMOTE
from kvmesh.shared.tls import client_context_of
from kvmesh.shared.wire.redis_keys import RedisAuth


@dataclass(frozen=True)
class TierPlan:
    """Which lower tiers an engine has: its config and the store ids of its mesh plan (known before NATS is)."""

    config: EngineConfig
    disk_store: str | None = None  # the host's disk store id; None: no disk tier
    remote_stores: tuple[str, ...] = ()  # the remote partitions' store ids (with `redis`, the Redis tier's one)
    redis: bool = False  # remote_url is Redis / Valkey: the remote tier is the engine's own client


@dataclass(frozen=True)
class TierSite:
    """What the clients are built with once NATS is first reached (loop thread)."""

    nc: NatsClient
    caller: str  # the stores record this rank's claims under it, and clear only those (`CacheEngine.store_caller`)
    redis_auth: RedisAuth | None  # the Redis tier's MAC key (`resolve_auth`)
    domain: str  # the engine's sharing domain: peers are asked inside it only
    worker_id: str
    peer_caller: str  # the worker agent's path: the peer tier asks the controller and peers from it
    stats: collections.Counter[str]  # the storage manager's counters (the peer tier's num_p2p_*, sealed_miss_*)
    sealer: ChunkSealer | None = None  # seals the disk and remote stores' chunks (`encrypt_stores`); None: plain
    slot_nbytes: int = 0  # the CPU pool's slot: the largest chunk a store is asked to put or get


@dataclass(frozen=True)
class LowerTier:
    location: str
    configured: Callable[[TierPlan], bool]
    build: Callable[[TierPlan, TierSite], StoreTier]


def _sealed(tiers: list[StoreTier], plan: TierPlan, site: TierSite) -> list[StoreTier]:
    """`tiers` with the disk and remote stores' clients sealing their chunks with `site.sealer` (if any), staged in
    one pool of their own (shared memory when the disk store is among them: it reads the pool in place, as the CPU
    pool): one slot per put the engine runs at once (a chunk put to both stores is sealed once, `PutSeals`) and per
    get from each of them."""
    stores = [i for i, tier in enumerate(tiers) if isinstance(tier, (DiskStoreClient, RemoteStoreClient))]
    if site.sealer is None or not stores:
        return tiers
    slots = plan.config.write_behind_workers + plan.config.fetch_concurrency * len(stores)
    slot_nbytes = site.slot_nbytes + SEAL_OVERHEAD
    shared = any(isinstance(tiers[i], DiskStoreClient) for i in stores)
    staging = MemoryPool(slots * (slot_nbytes + 4096), slot_nbytes, use_shm=shared, pin=False)
    seals = PutSeals()
    sealed = list(tiers)
    for i in stores:
        sealed[i] = SealedTier(tiers[i], site.sealer, staging, site.stats, seals)
    return sealed


def _disk(plan: TierPlan, site: TierSite) -> StoreTier:
    assert plan.disk_store is not None
    config = plan.config
    return DiskStoreClient(site.nc, plan.disk_store, site.caller, request_timeout=config.request_timeout_secs,
                           data_timeout=config.disk_data_timeout_secs)


def _remote(plan: TierPlan, site: TierSite) -> StoreTier:
    config = plan.config
    if plan.redis:  # the engine's own client of Redis / Valkey: no remote store on the mesh
        tier = RedisTier.from_config(config, site.caller, site.redis_auth)
        tier.start()
        return tier
    return RemoteStoreClient(site.nc, list(plan.remote_stores), site.caller,
                             request_timeout=config.request_timeout_secs,
                             min_transfer_rate=config.remote_min_transfer_mb_per_s * 1e6,
                             retry_interval=config.remote_retry_interval_secs,
                             max_connections=config.remote_stream_connections,
                             tls=client_context_of(config.remote_tls_ca, "remote_tls_ca"))


def _peers(plan: TierPlan, site: TierSite) -> StoreTier:
    config = plan.config
    return PeerTier(site.nc, site.domain, site.worker_id, site.peer_caller, site.stats,
                    request_timeout=config.request_timeout_secs,
                    min_transfer_rate=config.remote_min_transfer_mb_per_s * 1e6,
                    retry_interval=config.remote_retry_interval_secs, max_connections=config.p2p_stream_connections,
                    hint_wait=config.pd_hint_wait_secs, tls=client_context_of(config.p2p_tls_ca, "p2p_tls_ca"))


# The walk order below the CPU tier. The peers come last: they are read, never written (the write-behind skips them).
LOWER_TIERS: tuple[LowerTier, ...] = (
    LowerTier(LOCAL_DISK, lambda plan: bool(plan.disk_store), _disk),
    LowerTier(REMOTE, lambda plan: bool(plan.remote_stores), _remote),
    LowerTier(PEER, lambda plan: plan.config.enable_p2p, _peers),
)


def configured_locations(plan: TierPlan) -> list[str]:
    """The locations of the lower tiers `plan` names, in walk order (their clients come once NATS is up)."""
    return [tier.location for tier in LOWER_TIERS if tier.configured(plan)]


def lower_tiers(plan: TierPlan, site: TierSite) -> list[StoreTier]:
    """Loop thread, once NATS is first reached: one client per lower tier `plan` names, in walk order, the stores'
    sealing their chunks when `site.sealer` is set. A Redis tier is started here (`RedisTier.start`)."""
    return _sealed([tier.build(plan, site) for tier in LOWER_TIERS if tier.configured(plan)], plan, site)
