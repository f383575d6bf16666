"""`python -m kvmesh.services.disk_store`: the disk store of this host, until SIGTERM/SIGINT.

Process: one asyncio event loop (NATS handlers, index) on the main thread, plus the store's writer, staging
and I/O threads. Flags: see options.py (`--dir`, `--max-size-gb`, `--store-id`, `--nats-url`, `--config`).
"""

from __future__ import annotations

import asyncio
import sys

from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.service import configure_logging, run_until_signalled
from kvmesh.services.disk_store.options import build_parser, options_from_args
from kvmesh.services.disk_store.service import run_disk_store


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        options = options_from_args(args)
        asyncio.run(run_until_signalled(lambda stop: run_disk_store(options, stop)))
    except KVMeshError as exc:
        print(f"disk store: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
