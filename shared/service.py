"""Running a mesh service process: health answers, signal handling, and a clean stop.

Every service (controller, disk store, remote store) answers `HealthRequest` on its own health subject and
on `Subjects.PING_ALL`. `run_until_signalled` runs an async service body until SIGTERM/SIGINT, then lets
it close its resources; `service_main` is the whole thin `__main__` of a service around it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any, Awaitable, Callable, TypeVar

from nats.aio.client import Client as NatsClient

from kvmesh.shared import bus, protocol
from kvmesh.shared.errors import KVMeshError

Options = TypeVar("Options")

log = logging.getLogger(__name__)


async def serve_health(nc: NatsClient, service: str, service_id: str, path: str,
                       details: Callable[[], dict[str, Any]] | None = None) -> None:
    """Answer health requests for `service_id` on its own subject (`Subjects.health(path)`, `path` its producer
    path or `controller`) and on the ping-all subject."""

    async def answer(_: protocol.HealthRequest) -> protocol.HealthReply:
        return protocol.HealthReply(service=service, service_id=service_id,
                                    details={"pid": os.getpid(), **(details() if details else {})})

    await bus.serve(nc, protocol.Subjects.health(path), protocol.HealthRequest, answer)
    await bus.serve(nc, protocol.Subjects.PING_ALL, protocol.HealthRequest, answer)


async def ping_all(nc: NatsClient, wait: float = 0.5) -> list[protocol.HealthReply]:
    """Every service's health reply that arrives within `wait` seconds."""
    inbox = nc.new_inbox()
    replies: list[protocol.HealthReply] = []
    sub = await nc.subscribe(inbox)
    await nc.publish(protocol.Subjects.PING_ALL, protocol.encode(protocol.HealthRequest()), reply=inbox)
    deadline = asyncio.get_running_loop().time() + wait
    try:
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:
                break
            try:
                replies.append(protocol.decode(msg.data, protocol.HealthReply))
            except Exception as exc:
                log.warning("ignored a bad health reply: %s", exc)
    finally:
        await sub.unsubscribe()
    return replies


async def run_until_signalled(body: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `body(stop_event)`; SIGTERM or SIGINT sets the event, and `body` returns after cleaning up."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await body(stop)


def configure_logging(level: str | None = None) -> None:
    """Log at `level` (a --log-level flag), else $KVMESH_LOG_LEVEL, else INFO: a flag beats the environment."""
    logging.basicConfig(level=(level or os.environ.get("KVMESH_LOG_LEVEL") or "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def service_main(label: str, parser: argparse.ArgumentParser,
                 options_from_args: Callable[[argparse.Namespace], Options],
                 body: Callable[[Options, asyncio.Event], Awaitable[None]], argv: list[str] | None = None) -> None:
    """A service's `__main__`: parse flags (`--log-level` among them), log, run `body(options, stop)` until
    SIGTERM/SIGINT. A KVMeshError (a bad flag, NATS rejecting us, ...) ends the process with its message on
    stderr and exit code 2."""
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        options = options_from_args(args)
        asyncio.run(run_until_signalled(lambda stop: body(options, stop)))
    except KVMeshError as exc:
        print(f"{label}: {exc}", file=sys.stderr)
        sys.exit(2)
