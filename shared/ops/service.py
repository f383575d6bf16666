"""Running a mesh service process: health answers, signal handling, and a clean stop.

Every service (controller, disk store, remote store, engine worker) answers `HealthRequest` on its own health
subject and on `Subjects.PING_ALL`, naming its path in the reply. Every principal hears the ping-all, so a reply
to it proves nothing about its sender; only the principal at `path` may subscribe to `Subjects.health(path)`
(shared/messaging/nats_permissions.py), so `ping_all` believes a reply only once a request there is answered, and
reports what that path is (an engine's path is an engine whatever its reply claims). `run_until_signalled` runs an async
service body until SIGTERM/SIGINT, then lets it close its resources; `service_main` is the whole thin `__main__`
of a service around it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import dataclasses
import os
import re
import signal
import sys
from typing import Any, Awaitable, Callable, TypeVar

from nats.aio.client import Client as NatsClient

from kvmesh.shared import options_cli, protocol

from kvmesh.shared.errors import KVMeshError, MeshUnavailable, ProtocolError
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.nats_auth import add_nats_auth_flags

Options = TypeVar("Options")

log = logging.getLogger(__name__)


async def serve_health(nc: NatsClient, service: str, service_id: str, path: str,
                       details: Callable[[], dict[str, Any]] | None = None) -> None:
    """Answer health requests for `service_id` on its own subject (`Subjects.health(path)`, `path` its producer
    path or `controller`) and on the ping-all subject."""

    async def answer(_: protocol.HealthRequest) -> protocol.HealthReply:
        return protocol.HealthReply(service=service, service_id=service_id, path=path,
                                    details={"pid": os.getpid(), **(details() if details else {})})

    await bus.serve(nc, protocol.Subjects.health(path), protocol.HealthRequest, answer)
    await bus.serve(nc, protocol.Subjects.PING_ALL, protocol.HealthRequest, answer)


# A path a health subject may end in: `controller`, or a producer path `engine|store.<token>.<token>`.
_HEALTH_PATH = re.compile(r"controller|(engine|store)\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")
STORE_SERVICES = ("disk_store", "remote_store")


async def ping_all(nc: NatsClient, wait: float = 0.5) -> list[protocol.HealthReply]:
    """Every service that answers the ping-all within `wait` seconds, each as its own health subject confirms
    it (`confirm_health`, within max(wait, 1) s more); replies naming no path or a path that does not answer
    are dropped (logged)."""
    paths: dict[str, None] = {}  # in order of arrival, each once
    inbox = nc.new_inbox()
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
                reply = protocol.decode(msg.data, protocol.HealthReply)
            except Exception as exc:
                log.warning("ignored a bad health reply: %s", exc)
                continue
            if _HEALTH_PATH.fullmatch(reply.path):
                paths[reply.path] = None
            else:
                log.warning("ignored a ping-all reply from %s %r naming no path it could be asked on (%r)",
                            reply.service, reply.service_id, reply.path)
    finally:
        await sub.unsubscribe()
    confirmed = await asyncio.gather(*(confirm_health(nc, path, max(wait, 1.0)) for path in paths))
    return [reply for reply in confirmed if reply is not None]


async def confirm_health(nc: NatsClient, path: str, timeout: float) -> protocol.HealthReply | None:
    """The health reply of the principal at `path`, asked on its own subject, as what that path can be: the
    path's role is the service (a store keeps its claimed kind of store), and a producer's `service_id` must be
    the one its path names, else the path's token stands in. None (logged) when nothing answers there."""
    try:
        reply = await bus.request(nc, protocol.Subjects.health(path), protocol.HealthRequest(),
                                  protocol.HealthReply, timeout=timeout)
    except (MeshUnavailable, ProtocolError) as exc:
        log.warning("a ping-all reply named %s, which does not answer on its own health subject (%s): dropped",
                    path, exc)
        return None
    role, _, rest = path.partition(".")
    service, service_id = reply.service, reply.service_id
    if role == "controller":
        service = "controller"
    else:
        if role == "engine" or service not in STORE_SERVICES:
            service = role
        token = rest.rsplit(".", 1)[-1]
        if not service_id or protocol.Subjects.token(service_id) != token:
            service_id = token
    if (service, service_id) != (reply.service, reply.service_id):
        log.warning("%s answered health as %s %r: shown as %s %r", path, reply.service, reply.service_id, service,
                    service_id)
    return dataclasses.replace(reply, service=service, service_id=service_id, path=path)


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


def store_parser(prog: str, description: str, options: type) -> argparse.ArgumentParser:
    """A store service's flags: its options dataclass (shared/options_cli.py), `--log-level` and the NATS
    credentials flags."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    options_cli.add_flags(parser, options)
    parser.add_argument("--log-level", help="log level (default: $KVMESH_LOG_LEVEL, else INFO)")
    add_nats_auth_flags(parser)
    return parser


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
