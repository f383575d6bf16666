"""The remote store's settings: `RemoteStoreOptions`, whose fields declare their command-line flags
(shared/options_cli.py).

    python -m kvmesh.services.remote_store --nats-url URL --max-size-gb F --partition I --partitions N \
        --store-id ID [--cache-policy LRU|LFU|FIFO|MRU] [--persist-dir DIR] \
        [--nats-token T | --nats-user U --nats-password P | --nats-nkey-seed F]
    python -m kvmesh.services.remote_store --nats-url URL --redis-url redis://HOST:PORT [--redis-key-prefix P]

Whoever starts a store passes what it decides as flags (shared/ops/store_commands.py: `kvmesh up`, the engine's
embedded mesh); `build_parser` + `options_from_args` read them, `RemoteStoreOptions.to_args` writes them.
Credentials are never flags written by `to_args`: they travel in the environment (shared/messaging/nats_auth.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.shared import options_cli
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.eviction import POLICY_NAMES
from kvmesh.shared.messaging.bus import NatsAuth, normalize_url
from kvmesh.shared.messaging.nats_auth import nats_auth_from_args
from kvmesh.shared.tls import server_context
from kvmesh.shared.messaging.nats_url import DEFAULT_URL, argument as nats_url_argument
from kvmesh.shared.messaging.sharing_domains import domains_file_of, domains_file_option
from kvmesh.shared.ops.service import store_parser
from kvmesh.shared.options_cli import DEFAULT, GB, group, option
from kvmesh.shared.protocol import redis_store_id, remote_store_id
from kvmesh.shared.store_kit.store_bounds import StoreBounds
from kvmesh.shared.wire.redis_keys import PREFIX_RULE, prefix_ok
from kvmesh.shared.wire.redis_url import CLUSTER, parse_redis_url

DEFAULT_MAX_CHUNK_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class RemoteStoreOptions:
    store_id: str = option("--store-id", "store id (default remote-<partition>)")
    capacity_bytes: int = option("--max-size-gb", f"memory cap in GB (default {DEFAULT})", 4 * GB, scale=GB)
    nats_url: str = option("--nats-url", "NATS to join (several servers of a cluster: comma-separated)",
                           DEFAULT_URL, type=nats_url_argument, written=False)  # the starter adds it
    auth: NatsAuth = field(default_factory=NatsAuth)
    partition: int = option("--partition", "this replica's partition (0-based)", 0)
    num_partitions: int = option("--partitions", "number of partitions (replicas)", 1)
    # which chunks go first when the cap is reached (shared/eviction/)
    cache_policy: str = option("--cache-policy", f"eviction order under the cap (default {DEFAULT})", "LRU",
                               type=str.upper, choices=POLICY_NAMES)
    persist_dir: Path | None = option("--persist-dir", "keep chunk files here so a restart keeps the data", None,
                                      convert=Path)
    fsync: bool = option("--no-fsync", "do not fsync persisted files (faster, less durable)", True, negated=True)
    # where the stream listens; None = the address this host reaches NATS from
    stream_host: str | None = option(
        "--stream-host", "address the chunk stream listens on (default: the address this host reaches NATS from)",
        None)
    # 0 = any free port (it is advertised in the StreamOffer)
    stream_port: int = option("--stream-port", "stream port (default: any free port)", 0)
    stream_tls_cert: Path | None = option(
        "--stream-tls-cert", "serve the stream port over TLS only, with this certificate (with --stream-tls-key)",
        None, convert=Path)
    stream_tls_key: Path | None = option(
        "--stream-tls-key", "key file of --stream-tls-cert (mode 0600)", None, convert=Path)
    # the address clients connect to; None = the listening one (or the route)
    advertise_host: str | None = option(
        "--advertise-host", "address clients should connect to (default: the listening one)", None)
    transfer_timeout: float = option(
        "--transfer-timeout", "seconds one chunk transfer may take before its connection is dropped", 30.0)
    max_stream_connections: int = option(
        "--max-stream-connections", "stream connections open at once; past it new ones are closed at once", 256)
    stream_hello_timeout: float = option(
        "--stream-hello-timeout", "seconds a new stream connection has to present a valid ticket", 10.0)
    stream_hello_max_bytes: int = option(
        "--stream-hello-max-bytes", "largest hello (ticket message) read before the ticket is checked", 4096)
    stream_idle_timeout: float = option(
        "--stream-idle-timeout", "seconds a stream connection may go without a request before it is closed", 300.0)
    max_chunk_bytes: int = option(  # the largest chunk a put may announce (stream or inline)
        "--max-chunk-bytes", "largest chunk a put may announce; a larger one is refused before its bytes are read",
        DEFAULT_MAX_CHUNK_BYTES)
    # memory faulted in at start, new buffers carved from it (buffers.Arena); <= capacity
    prefault_bytes: int = option(
        "--prefault-gb", "GB of memory faulted in at start (at most --max-size-gb), so puts into an empty store "
        "need no page faults (default 0: memory is faulted as chunks arrive)", 0, scale=GB)
    # faulted, uncarved arena memory kept ahead of the puts by a worker thread (buffers.BufferPool.fault_ahead)
    fault_ahead_bytes: int = option(
        "--fault-ahead-gb", f"GB of memory kept faulted in ahead of the puts by a background thread, within "
        f"--max-size-gb, so puts into an empty store need no page faults without sizing --prefault-gb "
        f"(default {DEFAULT}; 0: off)", GB, scale=GB)
    bounds: StoreBounds = group(StoreBounds)  # what NATS clients can push on (shared/store_kit/store_bounds.py)
    # the sharing domains map (None: beside the store's credentials, if any)
    domains_file: Path | None = domains_file_option()
    heartbeat_interval: float = 2.0
    # Redis mode (redis_watch.py): report what a Redis remote tier holds instead of holding chunks
    redis_url: str | None = option(
        "--redis-url", "Redis mode: report to the controller what this Redis / Valkey remote tier holds (an engine "
        "remote_url form, standalone or sentinel) instead of holding chunks", None)
    redis_key_prefix: str = option(
        "--redis-key-prefix", f"Redis mode: the engines' redis_key_prefix (default {DEFAULT}; store id "
        "redis-<prefix>)", "kvmesh")
    redis_timeout: float = option(
        "--redis-timeout", f"Redis mode: seconds a Redis connect or command may take (default {DEFAULT})", 2.0)

    def to_args(self) -> list[str]:
        """The flags that start a store with these options (`--nats-url` and credentials excepted)."""
        return options_cli.to_args(self)


def build_parser() -> argparse.ArgumentParser:
    return store_parser("python -m kvmesh.services.remote_store",
                        "KVMesh remote store (RemoteBackend): one key partition", RemoteStoreOptions)


def options_from_args(args: argparse.Namespace) -> RemoteStoreOptions:
    if args.max_size_gb <= 0:
        raise ConfigError(f"--max-size-gb: must be > 0, got {args.max_size_gb}")
    if args.partitions < 1 or not 0 <= args.partition < args.partitions:
        raise ConfigError(f"--partition {args.partition} / --partitions {args.partitions}: need 0 <= partition "
                          "< partitions")
    if args.transfer_timeout <= 0:
        raise ConfigError(f"--transfer-timeout: must be > 0, got {args.transfer_timeout}")
    for flag, value in (("--max-stream-connections", args.max_stream_connections),
                        ("--stream-hello-timeout", args.stream_hello_timeout),
                        ("--stream-hello-max-bytes", args.stream_hello_max_bytes),
                        ("--stream-idle-timeout", args.stream_idle_timeout),
                        ("--max-chunk-bytes", args.max_chunk_bytes)):
        if value <= 0:
            raise ConfigError(f"{flag}: must be > 0, got {value}")
    if not 0 <= args.prefault_gb <= args.max_size_gb:
        raise ConfigError(f"--prefault-gb: must be between 0 and --max-size-gb ({args.max_size_gb:g}), "
                          f"got {args.prefault_gb:g}")
    if not args.fault_ahead_gb >= 0:  # also NaN
        raise ConfigError(f"--fault-ahead-gb: must be >= 0 (0: off), got {args.fault_ahead_gb:g}")
    if args.redis_timeout <= 0:
        raise ConfigError(f"--redis-timeout: must be > 0, got {args.redis_timeout}")
    if not prefix_ok(args.redis_key_prefix):
        raise ConfigError(f"--redis-key-prefix: {PREFIX_RULE}, got {args.redis_key_prefix!r}")
    if args.redis_url is not None:
        target = parse_redis_url(args.redis_url)  # a ConfigError naming what is wrong with the URL
        if target.mode == CLUSTER:
            raise ConfigError("--redis-url: Redis mode watches one server (standalone or sentinel), not a cluster")
    if (args.stream_tls_cert is None) != (args.stream_tls_key is None):
        raise ConfigError("--stream-tls-cert and --stream-tls-key go together")
    if args.stream_tls_cert is not None:
        try:
            server_context(args.stream_tls_cert, args.stream_tls_key)
        except ConfigError as exc:
            raise ConfigError(f"--stream-tls-cert: {exc}") from None
    env = dict(os.environ)
    values = options_cli.values(RemoteStoreOptions, args, env)
    values["bounds"].check()
    default_id = redis_store_id(args.redis_key_prefix) if args.redis_url else remote_store_id(args.partition)
    return RemoteStoreOptions(**{
        **values, "store_id": values["store_id"] or default_id, "nats_url": normalize_url(values["nats_url"]),
        "auth": nats_auth_from_args(args), "domains_file": domains_file_of(values["domains_file"], args, env)})
