"""The engine's side of lending its CPU pool to the disk store of its host (`PoolLink`, one per disk-store client).

The protocol, and what both sides share, is shared/wire/pool_wire.py; the store's side is services/disk_store/pools.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.shared.errors import ConfigError
from kvmesh.shared.wire.pool_wire import REPLY_MAX_BYTES, encode_hello, peer_uid, socket_path, trusted_uid
from kvmesh.shared.wire.shm import SharedSegment

log = logging.getLogger(__name__)

RETRY_SECS = 5.0  # after a failed registration, chunk bytes go inline this long before the next try


class PoolUnavailable(Exception):
    """The pool cannot be lent to the store (the reason says why); chunk bytes then travel inline."""


@dataclass(eq=False)
class Registration:
    """One pool lent to the store: the open connection, and the token requests name it by."""

    sock: socket.socket
    token: str
    size: int
    alive: bool = True
    # The store's end closed (EOF or reset): the store process exited, or it dropped the pool after its last
    # write into it (services/disk_store/pools.py). Either way nothing of that store writes into the pool any
    # more. Set once.
    store_gone: bool = False
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set with store_gone (on the client's loop)

    def peer_closed(self) -> bool:
        """Non-blocking: whether the store's end has closed (peeks; reads nothing). False while the connection is
        open and quiet, and for a connection this side closed (then nothing can be told from it)."""
        if self.store_gone:
            return True
        if not self.alive:
            return False
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # reset: the store's end is gone
            data = b""
        if data:
            return False  # the store sent something (it never does): not a close
        self.store_gone = True
        self.gone.set()
        return True

    def close(self) -> None:
        self.alive = False
        self.sock.close()


def register(store_id: str, caller: str, segment: SharedSegment, timeout: float, scope: str = "") -> Registration:
    """Blocking: lend `segment` to the store `store_id` (on the NATS server `scope`) for `caller`;
    PoolUnavailable with the reason."""
    if segment.fd is None:
        raise PoolUnavailable("the pool has no descriptor (closed)")
    try:
        path = socket_path(store_id, scope)
    except (ConfigError, OSError) as exc:
        raise PoolUnavailable(str(exc)) from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except OSError as exc:  # missing: no store on this host, or an old one
            raise PoolUnavailable(f"no pool socket at {path} ({exc.strerror or exc})") from None
        uid = peer_uid(sock)
        if not trusted_uid(uid):
            raise PoolUnavailable(f"the process behind {path} runs as uid {uid}, not as us ({os.getuid()}) or root")
        try:
            socket.send_fds(sock, [encode_hello(caller)], [segment.fd])
        except OSError as exc:  # a store that refuses at once (--max-pools) closes before reading: its reason waits
            answer = _refusal(sock)
            if answer is None:
                raise exc
        else:
            answer = json.loads(sock.recv(REPLY_MAX_BYTES) or b"{}")
        if not isinstance(answer, dict) or not isinstance(answer.get("token"), str):
            error = answer.get("error") if isinstance(answer, dict) else None
            raise PoolUnavailable(f"the store refused the pool: {error or 'no answer'}")
        sock.settimeout(None)
        return Registration(sock, answer["token"], int(answer.get("size", 0)))
    except (OSError, ValueError) as exc:  # a reset, a timeout, a garbled answer
        sock.close()
        raise PoolUnavailable(f"lending the pool to {path} failed: {exc}") from None
    except BaseException:
        sock.close()
        raise


def _refusal(sock: socket.socket) -> dict[str, object] | None:
    """The reply a store sent before it closed the connection, or None when there is none to read."""
    try:
        sock.setblocking(False)
        answer = json.loads(sock.recv(REPLY_MAX_BYTES) or b"null")
    except (OSError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


class PoolLink:
    """One disk-store client's registrations, by pool; on the client's event loop.

    `token(segment)` registers the pool on first use and answers its token, or None when the pool cannot be
    lent (the client then sends bytes inline; the reason is logged once, and registering is tried again after
    RETRY_SECS). A registration whose connection the store closed (it restarted) is made again on next use.
    """

    def __init__(self, store_id: str, caller: str, timeout: float, scope: Callable[[], str] = lambda: "") -> None:
        self.store_id = store_id
        self.caller = caller
        self.timeout = timeout
        self.scope = scope  # the NATS server we share with the store (asked at each registration: it may change)
        self._registrations: dict[SharedSegment, Registration] = {}
        self._lock = asyncio.Lock()
        self._retry_at = 0.0
        self._reason: str | None = None  # why pools are not lent now (logged once per change)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop watching the connections

    async def token(self, segment: SharedSegment) -> str | None:
        registration = await self.registration(segment)
        return registration.token if registration is not None else None

    async def registration(self, segment: SharedSegment) -> Registration | None:
        """`segment`'s live registration (made now if needed), or None when the pool cannot be lent."""
        registration = self._registrations.get(segment)
        if registration is not None and registration.alive:
            return registration
        async with self._lock:  # one registration at a time: concurrent first puts share it
            registration = self._registrations.get(segment)
            if registration is not None and registration.alive:
                return registration
            if time.monotonic() < self._retry_at:
                return None
            try:
                registration = await asyncio.to_thread(register, self.store_id, self.caller, segment,
                                                       self.timeout, self.scope())
            except PoolUnavailable as exc:
                self._retry_at = time.monotonic() + RETRY_SECS
                if str(exc) != self._reason:
                    log.warning("disk store %s: chunk bytes go inline (no shared pool): %s", self.store_id, exc)
                    self._reason = str(exc)
                return None
        if self._reason is not None:
            log.info("disk store %s: pool shared again", self.store_id)
            self._reason = None
        self._registrations[segment] = registration
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(registration.sock.fileno(), self._closed_by_store, registration)
        return registration

    def _closed_by_store(self, registration: Registration) -> None:
        """The store never writes after its answer: readable means it closed the connection (or misbehaves)."""
        registration.peer_closed()  # records a close (only a real one) before our end goes too
        self._forget(registration)
        log.info("disk store %s closed its pool connection; the pool is lent again on next use", self.store_id)

    def _forget(self, registration: Registration) -> None:
        if not registration.alive:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(registration.sock.fileno())
        registration.close()

    def close(self) -> None:
        """Take every pool back (the store unmaps them)."""
        for registration in self._registrations.values():
            self._forget(registration)
        self._registrations.clear()
