"""The remote store's settings: `RemoteStoreOptions`, its command-line flags, and the flags that start one.

    python -m kvmesh.services.remote_store --nats-url URL --max-size-gb F --partition I --partitions N \
        --store-id ID [--cache-policy LRU|LFU|FIFO|MRU] [--persist-dir DIR] \
        [--nats-token T | --nats-user U --nats-password P | --nats-nkey-seed F]
    python -m kvmesh.services.remote_store --nats-url URL --redis-url redis://HOST:PORT [--redis-key-prefix P]

One definition both ways: `build_parser` + `options_from_args` read the flags, `RemoteStoreOptions.to_args`
writes them for whoever starts a store process (`kvmesh up`, the engine's embedded mesh). Credentials are
never flags written by `to_args`: they travel in the environment (shared/nats_auth.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.shared.bus import NatsAuth, normalize_url
from kvmesh.shared.config import GB
from kvmesh.shared.credentials import add_domains_flag, domains_file_from_args
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.eviction import POLICY_NAMES
from kvmesh.shared.local_mesh import ServiceSpec
from kvmesh.shared.nats_auth import add_nats_auth_flags, nats_auth_from_args
from kvmesh.shared.nats_url import argument as nats_url_argument
from kvmesh.shared.protocol import redis_store_id, remote_store_id
from kvmesh.shared.redis_keys import PREFIX_RULE, prefix_ok
from kvmesh.shared.redis_url import CLUSTER, parse_redis_url
from kvmesh.shared.store_bounds import StoreBounds, add_store_bound_flags, store_bounds_from_args

DEFAULT_MAX_CHUNK_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class RemoteStoreOptions:
    store_id: str
    capacity_bytes: int
    nats_url: str = "nats://127.0.0.1:4222"
    auth: NatsAuth = field(default_factory=NatsAuth)
    partition: int = 0
    num_partitions: int = 1
    cache_policy: str = "LRU"  # which chunks go first when the cap is reached (shared/eviction/)
    persist_dir: Path | None = None
    fsync: bool = True
    stream_host: str | None = None  # where the stream listens; None = the address this host reaches NATS from
    stream_port: int = 0  # 0 = any free port (it is advertised in the StreamOffer)
    advertise_host: str | None = None  # the address clients connect to; None = the listening one (or the route)
    transfer_timeout: float = 30.0  # seconds one chunk's transfer may take before its connection is closed
    max_stream_connections: int = 256  # open stream connections at once; past it new ones are closed at once
    stream_hello_timeout: float = 10.0  # seconds a new connection has to present a valid ticket
    stream_hello_max_bytes: int = 4096  # the largest hello read before its ticket is checked
    stream_idle_timeout: float = 300.0  # seconds a greeted connection may go without a request
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES  # the largest chunk a put may announce (stream or inline)
    prefault_bytes: int = 0  # memory faulted in at start, new buffers carved from it (buffers.Arena); <= capacity
    bounds: StoreBounds = field(default_factory=StoreBounds)  # what NATS clients can push on (shared/store_bounds.py)
    domains_file: Path | None = None  # the sharing domains map (None: beside the store's credentials, if any)
    heartbeat_interval: float = 2.0
    # Redis mode (redis_watch.py): report what a Redis remote tier holds instead of holding chunks
    redis_url: str | None = None
    redis_key_prefix: str = "kvmesh"
    redis_timeout: float = 2.0

    def to_args(self) -> list[str]:
        """The flags that start a store with these options (`--nats-url` and credentials excepted)."""
        args = ["--max-size-gb", repr(self.capacity_bytes / GB), "--partition", str(self.partition),
                "--partitions", str(self.num_partitions), "--store-id", self.store_id,
                "--cache-policy", self.cache_policy, "--transfer-timeout", repr(self.transfer_timeout),
                "--max-stream-connections", str(self.max_stream_connections),
                "--stream-hello-timeout", repr(self.stream_hello_timeout),
                "--stream-hello-max-bytes", str(self.stream_hello_max_bytes),
                "--stream-idle-timeout", repr(self.stream_idle_timeout),
                "--max-chunk-bytes", str(self.max_chunk_bytes), *self.bounds.to_args()]
        if self.prefault_bytes:
            args += ["--prefault-gb", repr(self.prefault_bytes / GB)]
        if self.persist_dir is not None:
            args += ["--persist-dir", str(self.persist_dir)]
        if not self.fsync:
            args.append("--no-fsync")
        if self.stream_host:
            args += ["--stream-host", self.stream_host]
        if self.stream_port:
            args += ["--stream-port", str(self.stream_port)]
        if self.advertise_host:
            args += ["--advertise-host", self.advertise_host]
        if self.domains_file is not None:
            args += ["--domains-file", str(self.domains_file)]
        return args

    def service_spec(self) -> ServiceSpec:
        """How `kvmesh up` and the engine's embedded mesh start this store."""
        return ServiceSpec("kvmesh.services.remote_store", self.to_args(), self.store_id)


def partitions(capacity_bytes: int, num_partitions: int, cache_policy: str = "LRU",
               prefault_bytes: int = 0) -> list[RemoteStoreOptions]:
    """The options of every partition of a remote store, each with `capacity_bytes` of memory of which
    `prefault_bytes` are faulted in at start."""
    return [RemoteStoreOptions(store_id=remote_store_id(i), capacity_bytes=capacity_bytes, partition=i,
                               num_partitions=num_partitions, cache_policy=cache_policy, prefault_bytes=prefault_bytes)
            for i in range(num_partitions)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.services.remote_store",
                                     description="KVMesh remote store (RemoteBackend): one key partition")
    parser.add_argument("--nats-url", type=nats_url_argument, default="nats://127.0.0.1:4222",
                        help="NATS to join (several servers of a cluster: comma-separated)")
    parser.add_argument("--max-size-gb", type=float, default=4.0, help="memory cap in GB (default 4)")
    parser.add_argument("--partition", type=int, default=0, help="this replica's partition (0-based)")
    parser.add_argument("--partitions", type=int, default=1, help="number of partitions (replicas)")
    parser.add_argument("--store-id", help="store id (default remote-<partition>)")
    parser.add_argument("--cache-policy", type=str.upper, choices=POLICY_NAMES, default="LRU",
                        help="eviction order under the cap (default LRU)")
    parser.add_argument("--persist-dir", help="keep chunk files here so a restart keeps the data")
    parser.add_argument("--no-fsync", action="store_true", help="do not fsync persisted files (faster, less durable)")
    parser.add_argument("--stream-host", help="address the chunk stream listens on (default: the address this "
                                              "host reaches NATS from)")
    parser.add_argument("--stream-port", type=int, default=0, help="stream port (default: any free port)")
    parser.add_argument("--advertise-host", help="address clients should connect to (default: the listening one)")
    parser.add_argument("--transfer-timeout", type=float, default=30.0,
                        help="seconds one chunk transfer may take before its connection is dropped")
    parser.add_argument("--max-stream-connections", type=int, default=256,
                        help="stream connections open at once; past it new ones are closed at once")
    parser.add_argument("--stream-hello-timeout", type=float, default=10.0,
                        help="seconds a new stream connection has to present a valid ticket")
    parser.add_argument("--stream-hello-max-bytes", type=int, default=4096,
                        help="largest hello (ticket message) read before the ticket is checked")
    parser.add_argument("--stream-idle-timeout", type=float, default=300.0,
                        help="seconds a stream connection may go without a request before it is closed")
    parser.add_argument("--max-chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES,
                        help="largest chunk a put may announce; a larger one is refused before its bytes are read")
    parser.add_argument("--prefault-gb", type=float, default=0.0,
                        help="GB of memory faulted in at start (at most --max-size-gb), so puts into an empty store "
                             "need no page faults (default 0: memory is faulted as chunks arrive)")
    add_store_bound_flags(parser)
    add_domains_flag(parser)
    parser.add_argument("--redis-url", help="Redis mode: report to the controller what this Redis / Valkey remote "
                                            "tier holds (an engine remote_url form, standalone or sentinel) "
                                            "instead of holding chunks")
    parser.add_argument("--redis-key-prefix", default="kvmesh",
                        help="Redis mode: the engines' redis_key_prefix (default kvmesh; store id redis-<prefix>)")
    parser.add_argument("--redis-timeout", type=float, default=2.0,
                        help="Redis mode: seconds a Redis connect or command may take (default 2)")
    parser.add_argument("--log-level", help="log level (default: $KVMESH_LOG_LEVEL, else INFO)")
    add_nats_auth_flags(parser)
    return parser


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
    if args.redis_timeout <= 0:
        raise ConfigError(f"--redis-timeout: must be > 0, got {args.redis_timeout}")
    if not prefix_ok(args.redis_key_prefix):
        raise ConfigError(f"--redis-key-prefix: {PREFIX_RULE}, got {args.redis_key_prefix!r}")
    if args.redis_url is not None:
        target = parse_redis_url(args.redis_url)  # a ConfigError naming what is wrong with the URL
        if target.mode == CLUSTER:
            raise ConfigError("--redis-url: Redis mode watches one server (standalone or sentinel), not a cluster")
    default_id = redis_store_id(args.redis_key_prefix) if args.redis_url else remote_store_id(args.partition)
    return RemoteStoreOptions(
        store_id=args.store_id or default_id, capacity_bytes=round(args.max_size_gb * GB),
        nats_url=normalize_url(args.nats_url), auth=nats_auth_from_args(args), partition=args.partition,
        num_partitions=args.partitions, cache_policy=args.cache_policy,
        persist_dir=Path(args.persist_dir) if args.persist_dir else None,
        fsync=not args.no_fsync, stream_host=args.stream_host, stream_port=args.stream_port,
        advertise_host=args.advertise_host, transfer_timeout=args.transfer_timeout,
        max_stream_connections=args.max_stream_connections, stream_hello_timeout=args.stream_hello_timeout,
        stream_hello_max_bytes=args.stream_hello_max_bytes, stream_idle_timeout=args.stream_idle_timeout,
        max_chunk_bytes=args.max_chunk_bytes, prefault_bytes=round(args.prefault_gb * GB),
        bounds=store_bounds_from_args(args), domains_file=domains_file_from_args(args, dict(os.environ)),
        redis_url=args.redis_url, redis_key_prefix=args.redis_key_prefix, redis_timeout=args.redis_timeout)
