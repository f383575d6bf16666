"""NATS plumbing shared by every service: connecting, serving typed request handlers, typed requests.

`connect()` returns a nats-py client. Its first connect either succeeds or raises MeshUnavailable saying why
(credentials rejected, no server); after that it reconnects forever (unless told not to) and logs each change
of state once, never per request, and never a close its owner asked for. `serve()` subscribes a handler that
receives a decoded message and returns a reply message; garbage is logged and dropped, a handler's exception
becomes an error reply, never a dead subscription. `serve_from()` does the same for a handler that also takes
the message's subject (on a wildcard subscription, its last tokens say who sent it). `request()` sends a typed
request and decodes the typed reply, raising MeshUnavailable on timeout or no responder.

All of it runs on the caller's asyncio event loop (nats-py's callbacks too).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import json
import logging
import math
import os
import socket
import time
import urllib.parse
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError, SlowConsumerError, TimeoutError as NatsTimeoutError

from kvmesh.shared import protocol

from kvmesh.shared.errors import ConfigError, MeshUnavailable, NoResponder, ProtocolError
from kvmesh.shared.messaging import nats_url
from kvmesh.shared.messaging.nats_permissions import inbox_prefix, permissions
from kvmesh.shared.tls import client_context, describe_tls_error, is_tls_error

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Rep = TypeVar("Rep")

# Slow subscribers must not silently lose messages: nats-py drops past these limits (a store sets its own bytes
# limit for its ops, --request-queue-mb; drops are counted in MeshClient.dropped and logged).
PENDING_MSGS_LIMIT = 1_000_000
PENDING_BYTES_LIMIT = 1024 * 1024 * 1024

# How long a service process waits at start for a NATS that is still starting (compose, `kvmesh up`).
SERVICE_CONNECT_WAIT = 30.0
RETRY_INTERVAL = 0.5  # between connection attempts to one server (first connect and reconnects)
# How long a first connect keeps trying credentials every server rejected: one just given them (`kvmesh
# credentials`, an engine's provisioning) may not have loaded them yet (nats_auth_retry_secs, --nats-auth-retry-secs).
AUTH_RETRY_SECS = 10.0


@dataclass(frozen=True)
class NatsAuth:
    """Credentials, all optional: user/password, a token, an nkey seed file or a NATS .creds file (JWT), the
    inbox prefix replies come to (a mesh with per-principal permissions gives each its own), how long a first
    connect retries them while every server rejects them (`connect`), and the TLS CA file the servers are
    verified against (with a client certificate and key where the servers ask for one): with `tls_ca` the
    connection is TLS or nothing."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkey_seed: str | None = None
    creds_file: str | None = None
    inbox_prefix: str | None = None
    auth_retry_secs: float = AUTH_RETRY_SECS
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> "NatsAuth":
        """A KVMesh credentials file (JSON: user, password, inbox_prefix; shared/messaging/credentials.py); ConfigError
        naming the file when it cannot be read or is open to other users."""
        file = Path(path)
        try:
            if file.stat().st_mode & 0o077:
                raise ConfigError(f"NATS credentials file {file} is readable by other users; chmod 600 it")
            entry = json.loads(file.read_text())
            return cls(user=str(entry["user"]), password=str(entry["password"]),
                       inbox_prefix=entry.get("inbox_prefix"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"NATS credentials file {file}: {type(exc).__name__}: {exc}") from None

    def or_none(self) -> "NatsAuth | None":
        """None when this names no credentials at all."""
        return self if (self.user or self.token or self.nkey_seed or self.creds_file) else None

    def describe(self) -> str:
        """Which kinds of credentials, never their values (for messages and logs)."""
        kinds = [kind for kind, value in (("user/password", self.user), ("token", self.token),
                                          ("nkey seed", self.nkey_seed), ("creds file", self.creds_file)) if value]
        return (" + ".join(kinds) or "no credentials") + (f" as {self.user}" if self.user else "")

    def connect_options(self) -> dict[str, Any]:
        """The credentials as nats-py's connect() takes them. A user named like a mesh principal (`engine.x`,
        `operator`, ...) gets that principal's inbox prefix unless one is given: its permissions allow no other."""
        options: dict[str, Any] = {}
        if self.user:
            options.update(user=self.user, password=self.password or "")
        if self.token:
            options["token"] = self.token
        if self.nkey_seed:
            options["nkeys_seed"] = self.nkey_seed
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        inbox_prefix = self.inbox_prefix or os.environ.get(INBOX_PREFIX_ENV) or _principal_inbox(self.user)
        if inbox_prefix:
            options["inbox_prefix"] = inbox_prefix
        if self.tls_ca:
            options["tls"] = client_context(self.tls_ca, self.tls_cert, self.tls_key)
        return options


INBOX_PREFIX_ENV = "KVMESH_NATS_INBOX_PREFIX"


def _principal_inbox(user: str | None) -> str | None:
    """`_INBOX.<user>` when `user` is a principal path of KVMesh's generated permissions, else None."""
    if not user:
        return None
    try:
        permissions(user)
    except ValueError:
        return None
    return inbox_prefix(user)


class MeshClient(NatsClient):
    """nats-py's client, knowing when its owner closes it: a close or drain asked for is not a lost connection.

    `dropped` counts, per subscription, the messages nats-py dropped because that subscription's queue was
    full (its pending limits): the connection itself stays up and keeps reading. `permission_violations`
    counts what the server refused this client (its NATS permissions). `reconnect_hooks` run after
    each reconnection (the server may be another one now: `server_scope` may have changed).
    """

    closing = False

    def __init__(self, require_tls: bool = False) -> None:
        super().__init__()
        self.require_tls = require_tls  # refuse a server that does not offer TLS (never send credentials in clear)
        self.dropped: collections.Counter[Subscription] = collections.Counter()
        self.reconnect_hooks: list[Callable[[], Awaitable[None]]] = []
        self.permission_violations = 0  # publishes and subscriptions the server refused (`count_refusal`)

    def count_refusal(self, name: str, error: Exception) -> None:
        """The server refused a publish or subscription this client's permissions do not allow (it stays up)."""
        self.permission_violations += 1
        count = self.permission_violations
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th... refusal
            log.warning("%s: NATS refused: %s (%d refusals so far)", name, error, count)

    def count_drop(self, name: str, error: SlowConsumerError) -> None:
        self.dropped[error.sub] += 1
        count = self.dropped[error.sub]
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th... drop: a flood logs a few lines, not one per message
            log.warning("%s: dropped a message on %s: the subscription's queue is full (%d dropped so far)",
                        name, error.subject, count)

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        """nats-py upgrades to TLS only when the server's INFO requires it, so a server (or someone in between)
        that leaves it out would get the CONNECT, credentials included, in clear: a client that requires TLS
        refuses such a server, and upgrades where TLS is only offered."""
        if initial_connection and self.require_tls:
            if not (info.get("tls_required") or info.get("tls_available")):
                raise PlaintextServerError("the NATS server does not offer TLS (a plaintext port); refusing to "
                                           "send credentials in clear")
            info["tls_required"] = True
        await super()._process_info(info, initial_connection)

    async def flush(self, timeout: int = 10) -> None:
        """Wait until the server has processed everything sent so far, subscriptions just made included.

        nats-py 2.16 writes flush's PING straight to the socket, ahead of the commands still in its pending
        buffer, so the PONG could come back before the server had seen a SUB sent just before (a store that
        "served" then answered no-responders to the first request): the buffer is written out first."""
        if self.is_connected:
            await asyncio.wait_for(self._flush_pending(force_flush=True), timeout)
        await super().flush(timeout)

    def forget_failed_tls_upgrade(self) -> None:
        """A failed TLS upgrade (a first connect's or a reconnect's) closed the socket beneath nats-py's plaintext
        stream writer, whose wait_closed() would then never return (asyncio's start_tls took the socket over), so
        closing the client would hang: nothing is left to close, so forget it."""
        transport = getattr(self, "_transport", None)
        writer = getattr(transport, "_io_writer", None)
        if writer is not None and writer.transport.is_closing():
            transport._io_writer = None  # type: ignore[union-attr]

    async def close(self) -> None:
        self.closing = True
        self.forget_failed_tls_upgrade()
        await super().close()

    async def drain(self) -> None:
        self.closing = True
        await super().drain()


class PlaintextServerError(ConnectionError):
    """A client that requires TLS met a NATS server that does not offer it."""


async def connect(url: str, name: str, auth: NatsAuth | None = None, connect_timeout: float = 2.0,
                  allow_reconnect: bool = True, first_connect_wait: float | None = None,
                  **options: Any) -> NatsClient:
    """Connect to NATS at `url` (comma-separated for a cluster) as `name`.

    The first connect raises MeshUnavailable naming the URL and the reason: once every server of the list has
    rejected the credentials for `auth.auth_retry_secs` (nats-server loads new users in the background after a
    reload, so a principal just added may be refused a moment; one server of a cluster that rejects them makes
    it try the others first; the first rejection is logged once), and when no server answers within
    `first_connect_wait` seconds (a NATS that is still starting is waited for). `first_connect_wait=None` waits as long as
    reconnecting is allowed: for ever with `allow_reconnect` (the engine connects in the background and may be
    cancelled), not at all without. After the first success the client reconnects for ever if
    `allow_reconnect`. Of several servers, a first connect tries each before it gives up (nats-py alone tries
    one when it may not reconnect).
    """
    auth = auth or NatsAuth()
    servers = nats_url.split(url)
    if first_connect_wait is None:
        first_connect_wait = math.inf if allow_reconnect else 0.0
    deadline = time.monotonic() + first_connect_wait
    auth_deadline = time.monotonic() + auth.auth_retry_secs
    loop = asyncio.get_running_loop()
    state = {"first": True, "connected": False, "waiting_logged": False, "refused_logged": False, "refused": False}
    require_tls = bool(auth.tls_ca) or any(server.startswith("tls://") for server in servers)
    nc = MeshClient(require_tls)
    verdict: asyncio.Future[Any] = loop.create_future()  # the error that makes the first connect give up
    # Servers that rejected the credentials: retrying cannot help once every server of the list did, but one of a
    # cluster may still lack a user the others have (not reloaded yet), so the others are tried first.
    rejected: set[str] = set()

    def refused_for_good(exc: BaseException) -> bool:
        """Whether `exc` rejects the credentials, every server has, and for `auth_retry_secs` now."""
        if not _rejects_credentials(exc):
            return False
        server = getattr(nc, "_current_server", None)
        rejected.add(str(server.uri.netloc) if server is not None else "")
        if len(rejected) < len(servers):
            return False
        if time.monotonic() >= auth_deadline:
            state["refused"] = True
            return True
        rejected.clear()  # each server gets another round
        if not state["refused_logged"]:
            state["refused_logged"] = True
            log.warning("%s: NATS %s rejected %s (%s); retrying for up to %gs in case the server has not loaded them "
                        "yet (nats_auth_retry_secs)", name, url, auth.describe(), exc, auth.auth_retry_secs)
        return False

    async def on_error(exc: Exception) -> None:
        if isinstance(exc, SlowConsumerError):
            nc.count_drop(name, exc)
        elif "permissions violation" in str(exc).lower():
            nc.count_refusal(name, exc)
        elif not state["first"]:
            log.debug("%s: NATS client error: %s", name, exc)
        elif not verdict.done() and (_refuses_tls(exc) or refused_for_good(exc) or
                                     (not _rejects_credentials(exc) and time.monotonic() >= deadline)):
            verdict.set_result(exc)
        elif not state["waiting_logged"]:
            state["waiting_logged"] = True
            log.info("%s: NATS %s not reachable yet (%s); retrying", name, url, _reason(exc, connect_timeout))

    async def on_disconnected() -> None:
        if nc.closing or not state["connected"]:  # closed by its owner, or already reported
            return
        state["connected"] = False
        if nc.is_closed:  # without reconnects, or the server closed it on purpose
            log.warning("%s: connection to NATS %s lost (%s); not reconnecting", name, url, nc.last_error)
        else:
            log.warning("%s: disconnected from NATS %s; reconnecting in the background", name, url)

    async def on_reconnected() -> None:
        state["connected"] = True
        log.info("%s: reconnected to NATS %s", name, url)
        for hook in nc.reconnect_hooks:
            try:
                await hook()
            except Exception:  # a hook's failure must not break the connection's callbacks
                log.exception("%s: a reconnection hook failed", name)

    # Without reconnects nats-py tries only one server of a list: each attempt here gets the next one instead.
    turn = None if allow_reconnect else itertools.cycle(servers)
    tried = 1
    settings: dict[str, Any] = dict(
        servers=servers if turn is None else [next(turn)], name=name, connect_timeout=connect_timeout, allow_reconnect=allow_reconnect,
        max_reconnect_attempts=-1, reconnect_time_wait=RETRY_INTERVAL, disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected, error_cb=on_error, pending_size=64 * 1024 * 1024,
        **auth.connect_options(), **options)
    while True:
        # The attempt runs beside the verdict: nats-py itself retries a server that is not up yet for ever.
        attempt: asyncio.Future[Any] = asyncio.ensure_future(nc.connect(**settings))
        try:
            await asyncio.wait({attempt, verdict}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled
            await _abandon(nc, attempt)
            raise
        if attempt.done() and not attempt.cancelled() and attempt.exception() is None:
            state["first"], state["connected"] = False, True
            return nc
        await _abandon(nc, attempt)
        error = verdict.result() if verdict.done() else attempt.exception()
        assert error is not None
        if _rejects_credentials(error) and state["refused"]:
            raise MeshUnavailable(
                f"NATS {url} rejected {name} ({auth.describe()}) for {auth.auth_retry_secs:g}s: {error}; pass the "
                "server's credentials (--nats-credentials, --nats-token, --nats-user/--nats-password, "
                "--nats-nkey-seed or --nats-creds-file, or $KVMESH_NATS_*; docs/security.md)")
        if _refuses_tls(error):  # a certificate, or a server without TLS, does not change by retrying
            raise MeshUnavailable(f"NATS {url} refused for {name}: {_tls_reason(error)}; pass the CA that signed the "
                                  "server's certificate (--nats-tls-ca, $KVMESH_NATS_TLS_CA, nats_tls_ca) and a tls:// "
                                  "URL (docs/security.md)")
        if (not _rejects_credentials(error) and time.monotonic() >= deadline
                and (turn is None or tried >= len(servers))):
            waited = f" within {first_connect_wait:g}s" if first_connect_wait > 0 else ""
            raise MeshUnavailable(f"cannot reach NATS at {url} for {name}{waited}: {_reason(error, connect_timeout)}")
        # Without reconnects nats-py gave up after one failed handshake: a fresh client tries again.
        nc = MeshClient(require_tls)
        if turn is not None:
            settings["servers"] = [next(turn)]
            verdict = loop.create_future()  # the last server's error says nothing of this one
            tried += 1
            if (tried - 1) % len(servers):  # the next server of this round, at once
                continue
        await asyncio.sleep(RETRY_INTERVAL)


async def _abandon(nc: MeshClient, attempt: asyncio.Future[Any]) -> None:
    """Stop a first connect that did not succeed and close its client (its socket may be open mid-handshake)."""
    attempt.cancel()
    try:
        await attempt
    except BaseException:  # its failure is reported by connect(); cancellation was ours
        pass
    try:
        await nc.close()
    except Exception as exc:
        log.debug("closing an abandoned NATS connection failed: %s", exc)


def _rejects_credentials(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "authorization" in text or "authentication" in text


def _refuses_tls(exc: BaseException) -> bool:
    return isinstance(exc, PlaintextServerError) or is_tls_error(exc)


def _tls_reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, PlaintextServerError) else describe_tls_error(exc)


def _reason(exc: BaseException, connect_timeout: float) -> str:
    """Why a connection attempt failed, in words: nothing listening, no answer, or nats-py's own error."""
    text = str(exc)
    if isinstance(exc, ConnectionRefusedError) or "refused" in text.lower() or "connect call failed" in text.lower():
        return f"nothing is listening there ({text})"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return f"no answer within {connect_timeout:g}s"
    return f"{type(exc).__name__}: {text}"


def server_scope(nc: NatsClient) -> str:
    """A short name of the NATS mesh `nc` is connected to ("" when unknown): clients of one server, or of any
    server of one NATS cluster, share it, so a host-local resource keyed by it (a disk store's pool socket) is
    never another mesh's. A cluster is named by its cluster name, not by the server: its clients may sit on
    different servers, and move to another when theirs dies (two clusters on one host need distinct names)."""
    info = getattr(nc, "_server_info", {}) or {}
    name = f"cluster:{info['cluster']}" if info.get("cluster") else str(info.get("server_id") or "")
    return hashlib.blake2b(name.encode(), digest_size=6).hexdigest() if name else ""


def normalize_url(address: str) -> str:
    """'localhost:9001' or 'nats://h:p' -> a NATS URL (each of several comma-separated ones:
    shared/messaging/nats_url.py)."""
    return nats_url.normalize(address)


def route_address(url: str) -> str | None:
    """The local address this host uses to reach the (first) NATS server: clients of NATS can reach it too.

    A UDP `connect` only asks the kernel for a route; no packet is sent.
    """
    parsed = urllib.parse.urlsplit(nats_url.split(url)[0])
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            parsed.hostname or "127.0.0.1", parsed.port or nats_url.DEFAULT_PORT, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as exc:
        log.warning("could not find the route to NATS %s (%s)", url, exc)
        return None


async def serve(nc: NatsClient, subject: str, request_type: type[Req],
                handler: Callable[[Req], Awaitable[Any]], queue: str = "", max_concurrent: int = 1,
                pending_bytes_limit: int = PENDING_BYTES_LIMIT) -> Subscription:
    """Answer requests on `subject`: decode as `request_type`, await `handler`, reply with what it returns.

    A handler returning None sends no reply (for fire-and-forget publishes). Undecodable messages are
    logged and dropped; handler exceptions are logged and answered with `Ack(ok=False, error=...)`.
    `max_concurrent` > 1 runs up to that many handlers at once (each in a task; further messages wait in the
    subscription's queue); 1 handles the subject's messages one at a time, in order. Messages arriving while
    `pending_bytes_limit` bytes wait in that queue are dropped (and counted: MeshClient.dropped).
    """
    return await serve_from(nc, subject, request_type, lambda request, _subject: handler(request), queue,
                            max_concurrent, pending_bytes_limit)


async def serve_from(nc: NatsClient, subject: str, request_type: type[Req],
                     handler: Callable[[Req, str], Awaitable[Any]], queue: str = "",
                     max_concurrent: int = 1, pending_bytes_limit: int = PENDING_BYTES_LIMIT) -> Subscription:
    """`serve()`, with `handler(request, msg_subject)`: the subject each message came on, which for a wildcard
    `subject` says who sent it (NATS permissions bind a subject's last tokens to one principal)."""

    async def on_message(msg: Msg) -> None:
        try:
            request = protocol.decode(msg.data, request_type)
        except ProtocolError as exc:
            log.warning("dropped a bad message on %s: %s", msg.subject, exc)
            if msg.reply:
                await _respond(msg, protocol.Ack(ok=False, error=f"bad request: {exc}"))
            return
        try:
            reply = await handler(request, msg.subject)
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
    subscription = await nc.subscribe(subject, queue=queue, cb=callback, pending_msgs_limit=PENDING_MSGS_LIMIT,
                                      pending_bytes_limit=pending_bytes_limit)
    if max_concurrent > 1:
        _HANDLERS[subscription] = running
    return subscription


# The handler tasks still running for a subscription `serve_from` answers concurrently (its own drain does not
# wait for them: it ends once the callback that started them returned).
_HANDLERS: "weakref.WeakKeyDictionary[Subscription, set[asyncio.Task[None]]]" = weakref.WeakKeyDictionary()


async def drain(subscription: Subscription) -> None:
    """Stop `subscription` taking messages, answer those it already holds, and wait for its handlers still
    running: once this returns, closing its connection loses no reply."""
    await subscription.drain()
    running = _HANDLERS.get(subscription)
    if running:
        await asyncio.gather(*running, return_exceptions=True)


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
        raise NoResponder(f"no responder on {subject}") from None
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
