"""`python -m kvmesh.services.remote_store`: one remote-store partition (RemoteBackend), until SIGTERM/SIGINT.

    python -m kvmesh.services.remote_store --help     (flags: options.py)

Process: the main thread runs one asyncio event loop (NATS handlers, stream connections, the index; see
service.py); worker threads fault in buffers and do the persistence file I/O.
"""

from __future__ import annotations

from kvmesh.services.remote_store.options import build_parser, options_from_args
from kvmesh.services.remote_store.service import run_remote_store
from kvmesh.shared.ops.service import service_main


def main(argv: list[str] | None = None) -> None:
    service_main("remote store", build_parser(), options_from_args, run_remote_store, argv)


if __name__ == "__main__":
    main()
