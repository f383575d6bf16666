"""NATS plumbing shared by every service: connecting, serving typed request handlers, typed requests.

`connect()` returns a nats-py client that reconnects forever and logs state changes once each (not per
request). `serve()` subscribes a handler that receives a decoded message and returns a reply message;
garbage is logged and dropped, a handler's exception becomes an error reply, never a dead subscription.
`request()` sends a typed request and decodes the typed reply, raising MeshUnavailable on timeout or no
responder.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError

from kvmesh.shared import protocol
from kvmesh.shared.errors import MeshUnavailable, ProtocolError

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Rep = TypeVar("Rep")

# Slow subscribers must not silently lose messages: nats-py drops past these limits (DESIGN.md §4).
PENDING_MSGS_LIMIT = 1_000_000
PENDING_BYTES_LIMIT = 1024 * 1024 * 1024


@dataclass(frozen=True)
class NatsAuth:
    """Credentials, all optional: user/password, a token, or an nkey seed file."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkey_seed: str | None = None


async def connect(url: str, name: str, auth: NatsAuth | None = None, connect_timeout: float = 2.0,
                  allow_reconnect: bool = True, **options: Any) -> NatsClient:
    """Connect to NATS at `url` (comma-separated for a cluster), reconnecting forever after the first success."""
    auth = auth or NatsAuth()
    state = {"connected": True}

    async def on_disconnected() -> None:
        if state["connected"]:
            state["connected"] = False
            log.warning("%s: disconnected from NATS %s; reconnecting in the background", name, url)

    async def on_reconnected() -> None:
        state["connected"] = True
        log.info("%s: reconnected to NATS %s", name, url)

    async def on_error(exc: Exception) -> None:
        log.debug("%s: NATS client error: %s", name, exc)

    credentials: dict[str, Any] = {}
    if auth.user:
        credentials.update(user=auth.user, password=auth.password or "")
    if auth.token:
        credentials["token"] = auth.token
    if auth.nkey_seed:
        credentials["nkeys_seed"] = auth.nkey_seed
    return await nats.connect(
        servers=[u.strip() for u in url.split(",")], name=name, connect_timeout=connect_timeout,
        allow_reconnect=allow_reconnect, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
        disconnected_cb=on_disconnected, reconnected_cb=on_reconnected, error_cb=on_error,
        pending_size=64 * 1024 * 1024, **credentials, **options,
    )


def normalize_url(address: str) -> str:
    """'localhost:9001' or 'nats://h:p' -> a NATS URL."""
    address = address.strip()
    return address if "://" in address else f"nats://{address}"


async def serve(nc: NatsClient, subject: str, request_type: type[Req],
                handler: Callable[[Req], Awaitable[Any]], queue: str = "", max_concurrent: int = 1) -> Subscription:
    """Answer requests on `subject`: decode as `request_type`, await `handler`, reply with what it returns.

    A handler returning None sends no reply (for fire-and-forget publishes). Undecodable messages are
    logged and dropped; handler exceptions are logged and answered with `Ack(ok=False, error=...)`.
    `max_concurrent` > 1 runs up to that many handlers at once (each in a task; further messages wait in the
    subscription's queue); 1 handles the subject's messages one at a time, in order.
    """

    async def on_message(msg: Msg) -> None:
        try:
            request = protocol.decode(msg.data, request_type)
        except ProtocolError as exc:
            log.warning("dropped a bad message on %s: %s", msg.subject, exc)
            if msg.reply:
                await _respond(msg, protocol.Ack(ok=False, error=f"bad request: {exc}"))
            return
        try:
            reply = await handler(request)
        except Exception as exc:  # a handler bug must not kill the subscription
            log.exception("handler for %s failed", msg.subject)
            reply = protocol.Ack(ok=False, error=f"{type(exc).__name__}: {exc}")
        if reply is not None and msg.reply:
            await _respond(msg, reply)

    callback = on_message
    if max_concurrent > 1:
        slots = asyncio.Semaphore(max_concurrent)
        running: set[asyncio.Task[None]] = set()

        def finished(task: asyncio.Task[None]) -> None:
            running.discard(task)
            slots.release()

        async def on_message_concurrently(msg: Msg) -> None:
            await slots.acquire()  # back pressure: delivery pauses while max_concurrent handlers run
            task = asyncio.ensure_future(on_message(msg))
            running.add(task)  # keep a reference until done
            task.add_done_callback(finished)

        callback = on_message_concurrently
    return await nc.subscribe(subject, queue=queue, cb=callback,
                              pending_msgs_limit=PENDING_MSGS_LIMIT, pending_bytes_limit=PENDING_BYTES_LIMIT)


async def _respond(msg: Msg, reply: Any) -> None:
    try:
        await msg.respond(protocol.encode(reply))
    except Exception as exc:
        log.warning("could not reply on %s: %s", msg.subject, exc)


async def request(nc: NatsClient, subject: str, message: Any, reply_type: type[Rep], timeout: float) -> Rep:
    """Send `message` to `subject` and decode the reply as `reply_type`.

    Raises MeshUnavailable (timeout, no responder, not connected) or ProtocolError (bad reply). An error
    `Ack` in place of the expected reply is raised as MeshUnavailable with the responder's message.
    """
    try:
        msg = await nc.request(subject, protocol.encode(message), timeout=timeout)
    except (NatsTimeoutError, asyncio.TimeoutError):
        raise MeshUnavailable(f"no reply on {subject} within {timeout:g}s") from None
    except NoRespondersError:
        raise MeshUnavailable(f"no responder on {subject}") from None
    except Exception as exc:  # connection closed / reconnecting
        raise MeshUnavailable(f"request on {subject} failed: {type(exc).__name__}: {exc}") from None
    if reply_type is not protocol.Ack:
        try:
            ack = protocol.decode(msg.data, protocol.Ack)
        except ProtocolError:
            pass
        else:
            raise MeshUnavailable(f"{subject}: {ack.error or 'request refused'}")
    return protocol.decode(msg.data, reply_type)


async def publish(nc: NatsClient, subject: str, message: Any) -> None:
    await nc.publish(subject, protocol.encode(message))
