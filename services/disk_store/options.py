"""The disk store's settings: `DiskStoreOptions`, whose fields declare their command-line flags (shared/options_cli.py).

    python -m kvmesh.services.disk_store --dir PATH --max-size-gb F [--nats-url URL] [--store-id ID] \
        [--cache-policy LRU|LFU|FIFO|MRU] [--nats-token T | --nats-user U --nats-password P | --nats-nkey-seed F]

The NATS credentials are the same flags (and KVMESH_NATS_* variables) as the remote store's:
shared/messaging/nats_auth.py. A store takes its settings from its flags and its own variables only, never from an
engine's LMCache config: whoever starts one passes what it decides as flags (shared/ops/store_commands.py: `kvmesh up`,
the engine's embedded mesh); `build_parser` + `options_from_args` read them, `DiskStoreOptions.to_args` writes them.
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
from kvmesh.shared.messaging.nats_url import DEFAULT_URL, argument as nats_url_argument
from kvmesh.shared.messaging.sharing_domains import domains_file_of, domains_file_option
from kvmesh.shared.ops.service import store_parser
from kvmesh.shared.options_cli import DEFAULT, GB, group, option
from kvmesh.shared.protocol import disk_store_id
from kvmesh.shared.store_kit.store_bounds import StoreBounds

MiB = 2**20


@dataclass(frozen=True)
class DiskStoreOptions:
    root: Path = option("--dir", "chunk directory, a path or file:// URL (required)",
                        convert=lambda path: Path(path.removeprefix("file://")))
    capacity_bytes: int = option("--max-size-gb", "size cap in GB (required)", scale=GB)
    store_id: str = option("--store-id", "store id (default: disk-<hostname>)")
    nats_url: str = option("--nats-url", f"NATS to join, a cluster's servers comma-separated (default {DEFAULT})",
                           DEFAULT_URL, type=nats_url_argument, written=False)  # the starter adds it
    auth: NatsAuth = field(default_factory=NatsAuth)
    # which chunk files are deleted first when the cap is reached (shared/eviction/)
    cache_policy: str = option("--cache-policy", f"eviction order (default {DEFAULT})", "LRU", type=str.upper,
                               choices=POLICY_NAMES)
    # fsync each chunk file before it becomes visible (survives power loss, not only crashes)
    fsync: bool = option("--no-fsync", "do not fsync chunk files (faster, not durable)", True, negated=True)
    # one sequential writer matches a single disk best (measured: see benchmarks/)
    writer_threads: int = option("--writer-threads", f"threads writing chunk files (default {DEFAULT})", 1)
    reader_threads: int = option(
        "--reader-threads", f"threads reading chunk files; also the gets handled at once (default {DEFAULT})", 4)
    # 0 = write-through: a put is answered once its file is written
    staging_bytes: int = option(
        "--staging-mb", "memory for accepted puts not yet on disk; 0 = answer puts after the write",
        512 * MiB, scale=MiB)
    staging_wait_secs: float = 5.0  # how long a put waits for staging room before it is refused
    min_free_bytes: int = 0  # refuse puts that would leave less free space on the filesystem
    # engine pools lent at once on the pool socket (pools.py), hellos in progress included
    max_pools: int = option(
        "--max-pools", f"engine pools lent on the pool socket at once, hellos in progress included (default "
        f"{DEFAULT})", 64)
    pool_hello_max_bytes: int = option(
        "--pool-hello-max-bytes", f"the largest hello a pool connection may send (default {DEFAULT})", 4096)
    pool_hello_timeout_secs: float = option(
        "--pool-hello-timeout", f"seconds a new pool connection may take to send its hello (default {DEFAULT})", 5.0)
    # answer a put only once its file is durable (fsync'd, renamed, directory fsync'd)
    durable_puts: bool = option(
        "--durable-puts", "answer a put only once its chunk file is written, fsync'd and renamed into place "
        "(directory fsync'd); default: once the bytes are staged in memory", False)
    # the index snapshot (snapshot.py) a restart reads instead of every file's header; also written at close
    snapshot_interval_secs: float = option(
        "--snapshot-interval", "seconds between two index snapshots, which let a restart skip reading every chunk "
        f"file's header; 0 = only at a clean stop (default {DEFAULT})", 300.0)
    bounds: StoreBounds = group(StoreBounds)  # what NATS clients can push on (shared/store_kit/store_bounds.py)
    # the sharing domains map (None: beside the store's credentials, if any)
    domains_file: Path | None = domains_file_option()

    def to_args(self) -> list[str]:
        """The flags that start a store with these options (`--nats-url` and credentials excepted)."""
        return options_cli.to_args(self)


def build_parser() -> argparse.ArgumentParser:
    return store_parser("python -m kvmesh.services.disk_store",
                        "KVMesh disk store (LocalDiskBackend) of this host", DiskStoreOptions)


def options_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> DiskStoreOptions:
    env = dict(os.environ if environ is None else environ)
    values = options_cli.values(DiskStoreOptions, args, env)
    if values["root"] is None:
        raise ConfigError("disk store: no directory: pass --dir (a store reads no LMCache config)")
    if args.max_size_gb is None:
        raise ConfigError("disk store: no size: pass --max-size-gb (a store reads no LMCache config)")
    if args.max_size_gb <= 0:
        raise ConfigError(f"--max-size-gb: must be > 0, got {args.max_size_gb}")
    if args.writer_threads < 1 or args.reader_threads < 1 or args.staging_mb < 0:
        raise ConfigError("disk store: --writer-threads/--reader-threads must be >= 1, --staging-mb >= 0")
    if args.max_pools < 1 or args.pool_hello_max_bytes < 64 or not args.pool_hello_timeout > 0:
        raise ConfigError("disk store: --max-pools must be >= 1, --pool-hello-max-bytes >= 64, "
                          "--pool-hello-timeout > 0")
    if not args.snapshot_interval >= 0:
        raise ConfigError(f"--snapshot-interval: must be >= 0, got {args.snapshot_interval}")
    if args.durable_puts and args.no_fsync:
        raise ConfigError("disk store: --durable-puts needs fsync: drop --no-fsync")
    values["bounds"].check()
    return DiskStoreOptions(**{
        **values, "store_id": values["store_id"] or disk_store_id(), "nats_url": normalize_url(values["nats_url"]),
        "auth": nats_auth_from_args(args, env), "domains_file": domains_file_of(values["domains_file"], args, env)})
