"""`python -m kvmesh.services.disk_store`: the disk store of this host, until SIGTERM/SIGINT.

Process: one asyncio event loop (NATS handlers, index) on the main thread, plus the store's writer, staging
and I/O threads. Flags: see options.py (`--dir`, `--max-size-gb`, `--store-id`, `--nats-url`, and the NATS
credentials `--nats-token | --nats-user/--nats-password | --nats-nkey-seed`).
"""

from __future__ import annotations

from kvmesh.services.disk_store.options import build_parser, options_from_args
from kvmesh.services.disk_store.service import run_disk_store
from kvmesh.shared.ops.service import service_main


def main(argv: list[str] | None = None) -> None:
    service_main("disk store", build_parser(), options_from_args, run_disk_store, argv)


if __name__ == "__main__":
    main()
