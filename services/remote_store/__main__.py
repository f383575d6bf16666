"""`python -m kvmesh.services.remote_store`: one remote-store partition (RemoteBackend), until SIGTERM/SIGINT.

    python -m kvmesh.services.remote_store --nats-url URL --max-size-gb F --partition I --partitions N \
        --store-id ID [--cache-policy LRU|LFU|FIFO|MRU] [--persist-dir DIR] \
        [--nats-token T | --nats-user U --nats-password P | --nats-nkey-seed F]

Process: the main thread runs one asyncio event loop (NATS handlers, stream connections, the index; see
service.py); worker threads fault in buffers and do the persistence file I/O.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.shared.bus import normalize_url
from kvmesh.shared.config import GB
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.eviction import POLICY_NAMES
from kvmesh.shared.nats_auth import add_nats_auth_flags, nats_auth_from_args
from kvmesh.shared.service import service_main
from kvmesh.services.remote_store.service import RemoteStoreOptions, run_remote_store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.services.remote_store",
                                     description="KVMesh remote store (RemoteBackend): one key partition")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS to join")
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
    parser.add_argument("--log-level", default="INFO")
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
    return RemoteStoreOptions(
        store_id=args.store_id or f"remote-{args.partition}", capacity_bytes=int(args.max_size_gb * GB),
        nats_url=normalize_url(args.nats_url), auth=nats_auth_from_args(args), partition=args.partition,
        num_partitions=args.partitions, cache_policy=args.cache_policy,
        persist_dir=Path(args.persist_dir) if args.persist_dir else None,
        fsync=not args.no_fsync, stream_host=args.stream_host, stream_port=args.stream_port,
        advertise_host=args.advertise_host, transfer_timeout=args.transfer_timeout)


def main(argv: list[str] | None = None) -> None:
    service_main("remote store", build_parser(), options_from_args, run_remote_store, argv)


if __name__ == "__main__":
    main()
