"""The tiers below an engine's CPU tier, built from its config and the store ids handed in, in walk order: the
disk store, then the remote tier (KVMesh's remote store, or the engine's own Redis / Valkey client)."""

from __future__ import annotations

from collections.abc import Sequence

from nats.aio.client import Client as NatsClient

from kvmesh.services.engine.tiers.base import StoreTier
from kvmesh.services.engine.tiers.disk import DiskStoreClient
from kvmesh.services.engine.tiers.redis import RedisTier
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.shared.config import EngineConfig
from kvmesh.shared.redis_keys import RedisAuth


def lower_tiers(nc: NatsClient, config: EngineConfig, caller: str, *, disk_store: str | None,
                remote_stores: Sequence[str], redis: bool, redis_auth: RedisAuth | None) -> list[StoreTier]:
    """Loop thread, once NATS is first reached: one client per lower tier, in walk order, each sending as `caller`
    (the stores record this rank's claims under it, and clear only those): the disk store `disk_store` (its store
    id; None: no disk tier), then the remote partitions `remote_stores` or, with `redis`, the engine's own Redis
    client. A Redis tier is started here (`RedisTier.start`); `redis_auth` is its MAC key (`resolve_auth`)."""
    tiers: list[StoreTier] = []
    if disk_store:
        tiers.append(DiskStoreClient(nc, disk_store, caller, request_timeout=config.request_timeout_secs,
                                     data_timeout=config.disk_data_timeout_secs))
    if redis:  # the engine's own client of Redis / Valkey: no remote store on the mesh
        tier = RedisTier.from_config(config, caller, redis_auth)
        tier.start()
        tiers.append(tier)
    elif remote_stores:
        tiers.append(RemoteStoreClient(
            nc, list(remote_stores), caller, request_timeout=config.request_timeout_secs,
            min_transfer_rate=config.remote_min_transfer_mb_per_s * 1e6,
            retry_interval=config.remote_retry_interval_secs, max_connections=config.remote_stream_connections))
    return tiers
