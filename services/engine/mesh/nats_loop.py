"""The engine's one background asyncio loop thread, and its NATS connection.

Threads: `NatsLoop` owns a daemon thread ("kvmesh-mesh-<name>") running an asyncio loop. Every NATS
operation of the engine (store clients, worker agent, admission reporter, write-behind) runs there. vLLM's
threads never await anything: they `submit()` coroutines (fire and forget) or `call()` them and wait with a
bounded timeout, getting a fallback value (a miss) when NATS is slow or down.

Connection: `connect()` starts a background task that connects to NATS (retrying until it succeeds; the very
first connect may find no server) and then runs the registered on-connect callbacks once (store clients,
worker agent). After that nats-py reconnects by itself forever; state changes are logged once each.
`close()` stops the callbacks' services, closes the connection and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

from nats.aio.client import Client as NatsClient

from kvmesh.services.engine.mesh.side_cpus import move_to_side_cpus
from kvmesh.shared.errors import MeshUnavailable
from kvmesh.shared.messaging import bus

log = logging.getLogger(__name__)

T = TypeVar("T")
OnConnected = Callable[[NatsClient], Awaitable[None]]
OnClose = Callable[[], Awaitable[None]]


class NatsLoop:
    """A background event loop plus the NATS client that lives on it.

    Invariant: `nc` is None until the first connect succeeded, then the same client for the loop's life
    (nats-py reconnects it in place); `connected` says whether it is connected right now.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.nc: NatsClient | None = None
        self.url: str | None = None
        self._on_connected: list[OnConnected] = []
        self._on_close: list[OnClose] = []
        self._connect_task: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._first_connect = asyncio.Event()  # set on the loop once the first connect succeeded
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-mesh-{name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0):
            raise RuntimeError(f"{name}: NATS loop thread did not start")

    def _run(self) -> None:
        move_to_side_cpus()  # before any I/O thread or process is started from here
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def connected(self) -> bool:
        nc = self.nc
        return nc is not None and nc.is_connected

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # ---- running coroutines from other threads ---------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; the returned future completes when it does."""
        if self._closed:
            coro.close()
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            future.set_exception(RuntimeError(f"{self.name}: NATS loop is closed"))
            return future
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float, default: T, cancel: bool = True) -> T:
        """Run `coro` on the loop and wait at most `timeout` seconds; `default` on timeout or error.

        With `cancel=False` a late coroutine is left to finish on the loop (for work whose result must be
        cleaned up by the coroutine itself, e.g. a fetch that owns memory slots).
        """
        if self.in_loop_thread:
            coro.close()
            raise RuntimeError("NatsLoop.call from the loop thread would deadlock")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if cancel:
                future.cancel()
            return default
        except Exception as exc:
            log.debug("%s: mesh call failed: %s", self.name, exc)
            return default

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """Run a plain callback on the loop (thread-safe); ignored once closed."""
        if not self._closed:
            try:
                self.loop.call_soon_threadsafe(callback, *args)
            except RuntimeError:  # loop closed meanwhile
                pass

    # ---- connection ------------------------------------------------------------------------------------------
    def on_connected(self, callback: OnConnected) -> None:
        """Run `callback(nc)` on the loop once the first connect succeeds (at once if it already has)."""
        self.call_soon(self._add_on_connected, callback)

    def _add_on_connected(self, callback: OnConnected) -> None:
        if self.nc is None:
            self._on_connected.append(callback)  # _connect runs it, on this thread, after the first connect
        else:
            self.loop.create_task(self._run_on_connected(callback, self.nc))

    async def _run_on_connected(self, callback: OnConnected, nc: NatsClient) -> None:
        try:
            await callback(nc)
        except Exception:
            log.exception("%s: on-connect step failed", self.name)

    def on_close(self, callback: OnClose) -> None:
        """Run `callback()` on the loop at close, before the connection closes (reverse registration order)."""
        self._on_close.append(callback)

    def connect(self, url: str, auth: bus.NatsAuth | None = None) -> None:
        """Connect in the background; returns at once."""
        self.url = url
        self.call_soon(self._start_connect, url, auth)

    def _start_connect(self, url: str, auth: bus.NatsAuth | None) -> None:
        self._connect_task = self.loop.create_task(self._connect(url, auth))

    async def _connect(self, url: str, auth: bus.NatsAuth | None) -> None:
        started = time.monotonic()
        # nats-py's connect() with reconnects on keeps retrying the first connect until a server answers (and
        # can be cancelled at close); a timer says once, in the log, that we are still waiting.
        warn = self.loop.call_later(2.0, lambda: log.warning(
            "%s: NATS at %s is not reachable yet; the engine serves from its CPU tier and keeps trying in the "
            "background", self.name, url))
        try:
            nc = await bus.connect(url, name=self.name, auth=auth, connect_timeout=1.0)
        except MeshUnavailable as exc:  # e.g. credentials rejected for nats_auth_retry_secs
            log.error("%s: %s; the engine serves without the mesh (CPU tier only)", self.name, exc)
            return
        finally:
            warn.cancel()
        self.nc = nc
        self._first_connect.set()
        log.info("%s: connected to NATS %s after %.2fs", self.name, url, time.monotonic() - started)
        callbacks, self._on_connected = self._on_connected, []
        for callback in callbacks:
            await self._run_on_connected(callback, nc)

    async def first_connection(self, timeout: float) -> bool:
        """On the loop: wait (at most `timeout` s) for the first connect; whether there is a connection now."""
        try:
            await asyncio.wait_for(self._first_connect.wait(), timeout)
        except TimeoutError:
            pass
        return self.connected

    def wait_connected(self, timeout: float) -> bool:
        """Block until connected (tests, embedded start-up); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.connected:
                return True
            time.sleep(0.01)
        return self.connected

    # ---- shutdown --------------------------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Stop services (on-close callbacks), close NATS, stop the loop and join the thread."""
        if self._closed:
            return
        try:
            future = asyncio.run_coroutine_threadsafe(self._shutdown(timeout), self.loop)
            future.result(timeout + 1.0)
        except Exception as exc:
            log.warning("%s: mesh shutdown was not clean: %s", self.name, exc)
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s: NATS loop thread did not stop within %.0fs", self.name, timeout)

    async def _shutdown(self, timeout: float) -> None:
        if self._connect_task is not None and not self._connect_task.done():
            self._connect_task.cancel()
            try:
                await self._connect_task
            except (asyncio.CancelledError, Exception):
                pass
        for callback in reversed(self._on_close):
            try:
                await asyncio.wait_for(callback(), timeout / 2)
            except Exception as exc:
                log.debug("%s: close step failed: %s", self.name, exc)
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.nc.close(), timeout / 2)
            except Exception as exc:
                log.debug("%s: NATS close failed: %s", self.name, exc)
        # anything still running (late fetches, write-behind) is cancelled so the loop can stop
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout / 2)
