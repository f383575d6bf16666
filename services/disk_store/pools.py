"""The disk store's side of pool lending (shared/wire/pool_wire.py has the protocol): a Unix socket where engine
workers of this host lend their CPU pools, and the table of pools they lent, by token.

Runs on the store's event loop. A pool stays mapped while its engine's connection is open; when it closes, the
pool is dropped (views an I/O thread still uses keep the mapping until they are released: shared/wire/shm.py). The
store's end of a connection closes only after every get writing into its pool has finished (or with the
process): so an engine that sees it close knows nothing of this store writes into that pool any more.
Bounds: at most `max_pools` connections at once (registered or still saying hello), a hello of at most
`hello_max_bytes` that must arrive within `hello_timeout` seconds. Nothing a peer sends can stop the store:
every failure refuses that one connection, with the reason in the answer and the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.shared.errors import ConfigError, StoreError
from kvmesh.shared.wire.pool_wire import decode_hello, encode_reply, peer_uid, socket_path, trusted_uid
from kvmesh.shared.wire.shm import SharedSegment

log = logging.getLogger(__name__)


class PoolRefused(Exception):
    """A connection's pool is not taken (the reason says why)."""


@dataclass(eq=False)
class LentPool:
    caller: str  # the caller path that registered it: only its requests may name the token
    segment: SharedSegment
    # pooled gets that may write into the segment now (accepted, their readinto not returned yet), by get id;
    # each future resolves when that write is over (reader.py)
    writing: dict[int, "asyncio.Future[None]"] = field(default_factory=dict)
    # get ids the engine cancelled before they arrived -> their deadline (store's clock): refused on arrival
    cancelled: dict[int, float] = field(default_factory=dict)


class PoolRegistry:
    """The pool socket of store `store_id` and the pools lent on it."""

    def __init__(self, store_id: str, max_pools: int, hello_max_bytes: int, hello_timeout: float) -> None:
        self.store_id = store_id
        self.max_pools = max_pools
        self.hello_max_bytes = hello_max_bytes
        self.hello_timeout = hello_timeout
        self.path: Path | None = None  # None: not listening (engines then send bytes inline)
        self.counters: dict[str, int] = dict.fromkeys(("pools_registered", "pools_refused", "pools_dropped"), 0)
        self._pools: dict[str, LentPool] = {}  # token -> pool
        self._listener: socket.socket | None = None
        self._bound_inode: int | None = None  # the socket file we made (close removes it only if still ours)
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting: asyncio.Task[None] | None = None
        self._connections = 0
        self.scope = ""

    async def start(self, scope: str = "") -> None:
        """Listen for the engines on the NATS server `scope` (`bus.server_scope`); without a usable socket
        directory the store serves on, without pools (logged)."""
        self.scope = scope
        try:
            path = socket_path(self.store_id, scope)
            if _answers(path):  # never take the socket of a live store: its engines' pools would come to us
                raise OSError(f"another disk store with id {self.store_id} serves {path}; give each store of a "
                              "host its own --store-id")
            path.unlink(missing_ok=True)  # a previous run's socket, in our own private directory
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
        except (ConfigError, OSError) as exc:
            log.warning("disk store %s: no pool socket (%s); engines will send chunk bytes inline", self.store_id, exc)
            return
        os.chmod(path, 0o600)
        self._bound_inode = _inode(path)
        listener.listen(16)
        listener.setblocking(False)
        self._listener, self.path = listener, path
        self._accepting = self._spawn(self._accept())
        log.info("disk store %s: engines lend their pools on %s", self.store_id, path)

    async def follow(self, scope: str) -> None:
        """The store is now on the NATS server `scope` (it reconnected to a restarted server, which has a new id):
        listen where the engines of that server look. Pools lent before stay lent."""
        if scope == self.scope:
            return  # the same server, or another server of the same cluster
        log.info("disk store %s: now on another NATS server; moving the pool socket", self.store_id)
        await self._stop_listening()
        self.path = None
        await self.start(scope)

    def lent(self, token: str, caller: str) -> LentPool:
        """The pool `caller` lent as `token`; StoreError when there is none."""
        pool = self._pools.get(token)
        if pool is None or pool.caller != caller:
            raise StoreError(f"pool {token[:8]!r}... is not lent by {caller} on this store (unknown token, or its "
                             "engine's connection closed)")
        return pool

    def view(self, token: str, caller: str, offset: int, nbytes: int) -> memoryview:
        """`nbytes` bytes at `offset` of the pool `caller` lent as `token`; StoreError saying what is wrong."""
        pool = self.lent(token, caller)
        if offset < 0 or nbytes < 0 or offset + nbytes > pool.segment.size:
            raise StoreError(f"range [{offset}, {offset + nbytes}) is outside the pool's {pool.segment.size} bytes")
        return pool.segment.buf[offset:offset + nbytes]

    def details(self) -> dict[str, Any]:
        return {"pool_socket": str(self.path) if self.path else None, "pools": len(self._pools), **self.counters}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        await self._stop_listening()
        for pool in self._pools.values():
            pool.segment.close()
        self._pools.clear()

    async def _stop_listening(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.wait([self._accepting])
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.path is not None and self._bound_inode is not None and _inode(self.path) == self._bound_inode:
            self.path.unlink()  # ours still: a store started since with the same id keeps its own
        self._bound_inode = None

    # ---- connections ---------------------------------------------------------------------------------------
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of descriptors: keep listening
                log.warning("disk store %s: accepting a pool connection failed: %s", self.store_id, exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            if self._connections >= self.max_pools:
                self._refuse(conn, f"the store holds {self.max_pools} pools already (--max-pools)")
                conn.close()
                continue
            self._connections += 1
            self._spawn(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        """One engine's connection: its hello and pool, then wait for it to close, then drop the pool."""
        loop = asyncio.get_running_loop()
        token: str | None = None
        try:
            try:
                caller, segment = await asyncio.wait_for(self._hello(conn), self.hello_timeout)
            except asyncio.TimeoutError:
                raise PoolRefused(f"no hello within {self.hello_timeout}s (--pool-hello-timeout)") from None
            token = secrets.token_hex(16)
            self._pools[token] = LentPool(caller, segment)
            self.counters["pools_registered"] += 1
            log.info("disk store %s: %s lent a pool of %d bytes", self.store_id, caller, segment.size)
            await loop.sock_sendall(conn, encode_reply(token=token, size=segment.size))
            await loop.sock_recv(conn, 1)  # the engine sends nothing more: EOF (or anything) ends the loan
        except PoolRefused as exc:
            self._refuse(conn, str(exc))
        except OSError as exc:  # reset by the peer: it is gone
            log.debug("disk store %s: pool connection failed: %s", self.store_id, exc)
        finally:
            self._connections -= 1
            pool = self._pools.pop(token, None) if token is not None else None  # no new get can name it
            try:
                if pool is not None and pool.writing:
                    # Our end of the connection closes only once no get writes into the pool: an engine that sees
                    # it close knows its slots are safe to reuse (services/engine/tiers/disk.py).
                    await asyncio.wait(list(pool.writing.values()))
            finally:
                conn.close()
            if pool is not None:
                pool.segment.close()
                self.counters["pools_dropped"] += 1
                log.info("disk store %s: %s took its pool back (connection closed)", self.store_id, pool.caller)

    async def _hello(self, conn: socket.socket) -> tuple[str, SharedSegment]:
        uid = peer_uid(conn)
        if not trusted_uid(uid):
            raise PoolRefused(f"the peer runs as uid {uid}, not as the store's user ({os.getuid()}) or root")
        while True:
            await _readable(conn)
            try:
                # one descriptor: the kernel closes any further ones and says so with MSG_CTRUNC
                data, fds, flags, _ = socket.recv_fds(conn, self.hello_max_bytes + 1, 1)
                break
            except BlockingIOError:
                continue
        try:
            if not data:
                raise PoolRefused("the connection closed before its hello")
            if len(data) > self.hello_max_bytes:
                raise PoolRefused(f"the hello is over {self.hello_max_bytes} bytes (--pool-hello-max-bytes)")
            if flags & socket.MSG_CTRUNC or len(fds) != 1:
                raise PoolRefused("the hello must carry exactly one descriptor (the pool)")
            try:
                caller = decode_hello(data)
                return caller, SharedSegment.adopt(fds.pop())  # adopt closes the descriptor
            except (ValueError, OSError) as exc:
                raise PoolRefused(str(exc)) from None
        finally:
            for fd in fds:
                os.close(fd)

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        self.counters["pools_refused"] += 1
        log.warning("disk store %s: refused a pool: %s", self.store_id, reason)
        try:
            conn.send(encode_reply(error=f"disk store {self.store_id}: {reason}"))
        except OSError:
            pass  # the peer is gone or not reading: the log has it

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _readable(sock: socket.socket) -> None:
    """Wait until `sock` has something to read (or is closed)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def _answers(path: Path) -> bool:
    """Whether a process listens on the Unix socket at `path` now."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None
