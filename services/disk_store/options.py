"""The disk store's settings: command-line flags, falling back to the LMCache config (`--config` or
LMCACHE_CONFIG_FILE / LMCACHE_* variables) for `local_disk`, `max_local_disk_size`, `nats_url` and
`cache_policy` when flags are absent.

    python -m kvmesh.services.disk_store --nats-url URL --dir PATH --max-size-gb F --store-id ID \
        [--cache-policy LRU|LFU|FIFO|MRU] [--nats-token T | --nats-user U --nats-password P | --nats-nkey-seed F]

The NATS credentials are the same flags (and KVMESH_NATS_* variables) as the remote store's: shared/nats_auth.py.
One definition both ways: `build_parser` + `options_from_args` read the flags, `DiskStoreOptions.to_args` writes
them for whoever starts a store process (`kvmesh up`, the engine's embedded mesh); a store started with every
setting as a flag reads no LMCache config.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.shared.bus import NatsAuth, normalize_url
from kvmesh.shared.config import CONFIG_FILE_VAR, GB, EngineConfig
from kvmesh.shared.credentials import add_domains_flag, domains_file_from_args
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.eviction import POLICY_NAMES
from kvmesh.shared.local_mesh import ServiceSpec
from kvmesh.shared.nats_auth import add_nats_auth_flags, nats_auth_from_args
from kvmesh.shared.nats_url import argument as nats_url_argument
from kvmesh.shared.protocol import disk_store_id
from kvmesh.shared.store_bounds import StoreBounds, add_store_bound_flags, store_bounds_from_args

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class DiskStoreOptions:
    root: Path
    capacity_bytes: int
    store_id: str
    nats_url: str = DEFAULT_NATS_URL
    auth: NatsAuth = field(default_factory=NatsAuth)
    cache_policy: str = "LRU"  # which chunk files are deleted first when the cap is reached (shared/eviction/)
    fsync: bool = True  # fsync each chunk file before it becomes visible (survives power loss, not only crashes)
    writer_threads: int = 1  # one sequential writer matches a single disk best (measured: see benchmarks/)
    reader_threads: int = 4
    staging_bytes: int = 512 * 1024 * 1024  # 0 = write-through: a put is answered once its file is written
    staging_wait_secs: float = 5.0  # how long a put waits for staging room before it is refused
    min_free_bytes: int = 0  # refuse puts that would leave less free space on the filesystem
    max_pools: int = 64  # engine pools lent at once on the pool socket (pools.py), hellos in progress included
    pool_hello_max_bytes: int = 4096  # the largest hello a pool connection may send
    pool_hello_timeout_secs: float = 5.0  # how long a new pool connection may take to send its hello
    durable_puts: bool = False  # answer a put only once its file is durable (fsync'd, renamed, directory fsync'd)
    bounds: StoreBounds = field(default_factory=StoreBounds)  # what NATS clients can push on (shared/store_bounds.py)
    domains_file: Path | None = None  # the sharing domains map (None: beside the store's credentials, if any)

    def to_args(self) -> list[str]:
        """The flags that start a store with these options (`--nats-url` and credentials excepted)."""
        args = ["--dir", str(self.root), "--max-size-gb", repr(self.capacity_bytes / GB), "--store-id", self.store_id,
                "--cache-policy", self.cache_policy, "--writer-threads", str(self.writer_threads),
                "--reader-threads", str(self.reader_threads), "--staging-mb", repr(self.staging_bytes / 2**20),
                "--max-pools", str(self.max_pools), "--pool-hello-max-bytes", str(self.pool_hello_max_bytes),
                "--pool-hello-timeout", repr(self.pool_hello_timeout_secs), *self.bounds.to_args()]
        if not self.fsync:
            args.append("--no-fsync")
        if self.durable_puts:
            args.append("--durable-puts")
        if self.domains_file is not None:
            args += ["--domains-file", str(self.domains_file)]
        return args

    def service_spec(self) -> ServiceSpec:
        """How `kvmesh up` and the engine's embedded mesh start this store."""
        return ServiceSpec("kvmesh.services.disk_store", self.to_args(), self.store_id)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.services.disk_store",
                                     description="KVMesh disk store (LocalDiskBackend) of this host")
    parser.add_argument("--nats-url", type=nats_url_argument, help=f"NATS to join, a cluster's servers comma-separated (default: the config's nats_url/controller_url, "
                                           f"else {DEFAULT_NATS_URL})")
    parser.add_argument("--dir", help="chunk directory, a path or file:// URL (default: the config's local_disk)")
    parser.add_argument("--max-size-gb", type=float, help="size cap in GB (default: max_local_disk_size)")
    parser.add_argument("--store-id", help="store id (default: disk-<hostname>)")
    parser.add_argument("--config", help=f"LMCache YAML config (default: ${CONFIG_FILE_VAR})")
    parser.add_argument("--cache-policy", type=str.upper, choices=POLICY_NAMES,
                        help="eviction order (default: the config's cache_policy, else LRU)")
    parser.add_argument("--writer-threads", type=int, default=1, help="threads writing chunk files (default 1)")
    parser.add_argument("--reader-threads", type=int, default=4,
                        help="threads reading chunk files; also the gets handled at once (default 4)")
    parser.add_argument("--staging-mb", type=float, default=512.0,
                        help="memory for accepted puts not yet on disk; 0 = answer puts after the write")
    parser.add_argument("--no-fsync", action="store_true", help="do not fsync chunk files (faster, not durable)")
    parser.add_argument("--max-pools", type=int, default=64,
                        help="engine pools lent on the pool socket at once, hellos in progress included (default 64)")
    parser.add_argument("--pool-hello-max-bytes", type=int, default=4096,
                        help="the largest hello a pool connection may send (default 4096)")
    parser.add_argument("--pool-hello-timeout", type=float, default=5.0,
                        help="seconds a new pool connection may take to send its hello (default 5)")
    parser.add_argument("--durable-puts", action="store_true",
                        help="answer a put only once its chunk file is written, fsync'd and renamed into place "
                             "(directory fsync'd); default: once the bytes are staged in memory")
    add_store_bound_flags(parser)
    add_domains_flag(parser)
    parser.add_argument("--log-level", help="log level (default: $KVMESH_LOG_LEVEL, else INFO)")
    add_nats_auth_flags(parser)
    return parser


def options_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> DiskStoreOptions:
    env = dict(os.environ if environ is None else environ)
    if args.config:
        env[CONFIG_FILE_VAR] = args.config
    config: EngineConfig | None = None
    if args.dir is None or args.max_size_gb is None or args.nats_url is None or args.cache_policy is None:
        config = EngineConfig.from_env(env)
    if args.dir is not None:
        root = Path(args.dir.removeprefix("file://"))
    elif config is not None and config.local_disk_path is not None:
        root = config.local_disk_path
    else:
        raise ConfigError("disk store: no directory: pass --dir or set local_disk in the config")
    if args.max_size_gb is not None:
        if args.max_size_gb <= 0:
            raise ConfigError(f"--max-size-gb: must be > 0, got {args.max_size_gb}")
        capacity = round(args.max_size_gb * GB)
    else:
        assert config is not None
        capacity = config.max_local_disk_bytes
        if capacity <= 0:
            raise ConfigError("disk store: no size: pass --max-size-gb or set max_local_disk_size (> 0) in the config")
    nats_url = args.nats_url or (config and (config.nats_url or config.controller_url)) or DEFAULT_NATS_URL
    if args.writer_threads < 1 or args.reader_threads < 1 or args.staging_mb < 0:
        raise ConfigError("disk store: --writer-threads/--reader-threads must be >= 1, --staging-mb >= 0")
    if args.max_pools < 1 or args.pool_hello_max_bytes < 64 or not args.pool_hello_timeout > 0:
        raise ConfigError("disk store: --max-pools must be >= 1, --pool-hello-max-bytes >= 64, "
                          "--pool-hello-timeout > 0")
    if args.durable_puts and args.no_fsync:
        raise ConfigError("disk store: --durable-puts needs fsync: drop --no-fsync")
    return DiskStoreOptions(
        root=root, capacity_bytes=capacity, store_id=args.store_id or disk_store_id(),
        nats_url=normalize_url(nats_url), auth=nats_auth_from_args(args, env),
        cache_policy=args.cache_policy or (config.cache_policy if config is not None else "LRU"),
        fsync=not args.no_fsync, durable_puts=args.durable_puts,
        writer_threads=args.writer_threads, reader_threads=args.reader_threads,
        staging_bytes=round(args.staging_mb * 2**20), max_pools=args.max_pools,
        pool_hello_max_bytes=args.pool_hello_max_bytes, pool_hello_timeout_secs=args.pool_hello_timeout,
        bounds=store_bounds_from_args(args), domains_file=domains_file_from_args(args, env))
