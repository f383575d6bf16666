"""The controller process: one asyncio event loop running the NATS client, the maintenance task and uvicorn.

`ControllerService.start()` (in this order): refuse a REST API beyond loopback without a token (unless
--insecure-no-auth, then a WARNING), start the embedded nats-server when no NATS URL is given (a
child process on `monitor_port`, started from the calling thread, which must outlive it), connect to NATS,
subscribe (`ProducerFeed.start()`, which also says hello so producers re-register and full-sync), then serve the
REST API with `uvicorn.Server.serve()` as a task on the same loop. `stop()` undoes it in reverse. Signals
are the caller's business (`__main__` installs SIGTERM/SIGINT handlers that call `stop()`); uvicorn's own
signal capture is switched off so it cannot re-raise a signal past our cleanup.
"""

from __future__ import annotations

import asyncio
import os
import contextlib
import logging
import time
from typing import Any, Callable, Iterator

import uvicorn

from kvmesh.services.controller.api import create_app
from kvmesh.services.controller.config import ControllerConfig, is_loopback
from kvmesh.services.controller.core import ControllerCore
from kvmesh.services.controller.kv_event_stream import KVEventStream
from kvmesh.services.controller.producer_feed import ProducerFeed
from kvmesh.shared.errors import ConfigError, KVMeshError
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.credentials import credentials_for, domains_map
from kvmesh.shared.messaging.sharing_domains import DomainMap
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import CONTROLLER
from kvmesh.shared.tls import server_context

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 15.0
SHUTDOWN_TIMEOUT_S = 10.0


class _Server(uvicorn.Server):
    """uvicorn without its signal handling: the controller owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _client_host(host: str) -> str:
    """Where a local client reaches a server bound to `host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


class ControllerService:
    """A running controller: `await start()`, then `url`/`nats_url`; `await stop()` (or `async with`)."""

    def __init__(self, config: ControllerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.core = ControllerCore(config, clock)  # liveness, sync retries and heartbeat claims run on `clock`
        self.app = create_app(self.core)
        self.embedded: LocalMesh | None = None  # the NATS this controller embeds when given no NATS URL
        self.nc: Any = None
        self.feed: ProducerFeed | None = None
        self.kv_events: KVEventStream | None = None  # the fleet-wide KV event stream, when configured
        self._server: _Server | None = None
        self._server_task: asyncio.Task[None] | None = None
        self.port: int | None = None

    @property
    def nats_url(self) -> str:
        if self.config.nats_url:
            return self.config.nats_url
        assert self.embedded is not None and self.embedded.nats_url is not None, "not started"
        return self.embedded.nats_url

    @property
    def url(self) -> str:
        assert self.port is not None, "not started"
        host = _client_host(self.config.host)
        scheme = "https" if self.config.tls_cert is not None else "http"
        return f"{scheme}://[{host}]:{self.port}" if ":" in host else f"{scheme}://{host}:{self.port}"

    async def start(self) -> "ControllerService":
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        config = self.config
        # Before anything listens: an API open beyond loopback is refused unless the operator says so, every time.
        exposure = config.exposure_error()
        if exposure is not None:
            raise ConfigError(f"controller not started: {exposure}")
        events_error = config.kv_events_error()
        if events_error is not None:
            raise ConfigError(f"controller not started: {events_error}")
        if config.insecure_no_auth and not config.auth_token:
            log.warning("--insecure-no-auth: the REST API on %s has no token; anyone who reaches it can look up, "
                        "pin, unpin, move and clear", config.host)
        if not config.nats_url:
            # Blocking for the ~0.1 s the server takes to listen; it must be started from this (long-lived)
            # thread, since the child dies with the thread that started it.
            self.embedded = LocalMesh([], nats_port=config.monitor_port or None, nats_host=config.nats_host)
            self.embedded.start_nats()
        url = bus.normalize_url(self.nats_url)
        auth = (self.embedded.auth(CONTROLLER) if self.embedded is not None
                else credentials_for(url, CONTROLLER, config.nats_auth))
        self.nc = await bus.connect(url, name=f"kvmesh-{self.core.controller_id}", auth=auth)
        self.core.router.nc = self.nc
        self.feed = ProducerFeed(self.nc, self.core.table, self.core.controller_id, clock=self.core.clock,
                                 tick_interval_s=config.tick_interval_s, health_details=self._health_details,
                                 domains=self._domains(url),
                                 sync_requests_per_principal=config.sync_requests_per_principal)
        self.core.feed = self.feed
        if config.kv_events_port is not None:  # before the feed ingests anything: every change is published
            if config.kv_events_public and not is_loopback(config.kv_events_host):
                log.warning("--kv-events-public: the KV event stream on %s is open to anyone who reaches it",
                            config.kv_events_host)
            self.kv_events = KVEventStream(self.core.table, config.kv_events_host, config.kv_events_port,
                                           config.kv_events_replay_port, config.kv_events_buffer,
                                           config.kv_events_chunks)
            self.kv_events.start()
            self.core.kv_events = self.kv_events
        await self.feed.start()
        uv_config = uvicorn.Config(self.app, host=config.host, port=config.port, loop="none", lifespan="off",
                                   access_log=False, log_level="warning", timeout_keep_alive=30,
                                   http="httptools" if _has("httptools") else "h11",
                                   ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key)
        if config.tls_cert is not None and config.tls_key is not None:
            uv_config.load()
            uv_config.ssl = server_context(config.tls_cert, config.tls_key)  # TLS 1.2+, follows its files (rotation)
        self._server = _Server(uv_config)
        self._server_task = asyncio.create_task(self._serve(), name="controller-http")
        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if self._server_task.done():
                raise KVMeshError(f"controller REST server could not start on {config.host}:{config.port} "
                                  "(port in use?)")
            if asyncio.get_running_loop().time() > deadline:
                raise KVMeshError(f"controller REST server did not start within {STARTUP_TIMEOUT_S:g}s")
            await asyncio.sleep(0.01)
        sockets = [s for server in self._server.servers for s in (server.sockets or [])]
        self.port = sockets[0].getsockname()[1] if sockets else config.port
        log.info("controller %s: REST on %s, NATS %s", self.core.controller_id, self.url, url)

    def _domains(self, url: str) -> DomainMap:
        """Which sharing domain each engine principal is in: the domains file the stores read (--domains-file,
        else domains.json beside the controller's credentials file, the embedded NATS's included)."""
        given = self.config.domains_file
        if given is None and self.embedded is not None and self.embedded.credentials is not None:
            given = self.embedded.credentials.domains_file
        domains = domains_map(given, url, CONTROLLER.path)
        log.info("controller %s: sharing domains from %s", self.core.controller_id,
                 domains.file or "no domains map (every engine in the default domain)")
        return domains

    async def _serve(self) -> None:
        assert self._server is not None
        try:
            await self._server.serve()
        except SystemExit:  # uvicorn exits the "process" when it cannot bind; we report it instead
            log.error("controller REST server failed to start on %s:%s", self.config.host, self.config.port)

    @property
    def http_done(self) -> bool:
        """True once the REST server task has ended (for the entry point to notice a crash)."""
        return self._server_task is not None and self._server_task.done()

    def _health_details(self) -> dict[str, Any]:
        table = self.core.table
        return {"pid": os.getpid(), "num_keys": len(table.index), "instances": len(table.instances),
                "producers": len(table.producers), "rest_url": self.url if self.port else None}

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._server_task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._server_task), SHUTDOWN_TIMEOUT_S)
            except asyncio.TimeoutError:
                self._server.force_exit = True  # type: ignore[union-attr]
                self._server_task.cancel()
                await asyncio.gather(self._server_task, return_exceptions=True)
            self._server_task = None
        if self.feed is not None:
            await self.feed.stop()
            self.feed = None
        if self.kv_events is not None:
            await self.kv_events.stop()
            self.kv_events = None
            self.core.kv_events = None
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.nc.close(), 5)
            except Exception as exc:
                log.debug("closing NATS failed: %s", exc)
            self.nc = None
            self.core.router.nc = None
        if self.embedded is not None:
            self.embedded.stop()
            self.embedded = None

    async def __aenter__(self) -> "ControllerService":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
