"""The controller's NATS side: what it subscribes to, what it sends, and its periodic maintenance.

Runs on the controller's one event loop (shared with uvicorn). Subscriptions, each processed in order by
nats-py (one task per subscription, so there is no ordering *between* them):
  - `kvmesh.events.>`           AdmissionBatch / SyncChunk from every producer -> ProducerTable / HolderIndex
  - `Subjects.REGISTER`         RegisterEngine / RegisterStore
  - `Subjects.HEARTBEAT`        Heartbeat (liveness; a seq claim may reveal a lost batch)
  - `Subjects.health(...)`, `Subjects.PING_ALL`   HealthRequest -> HealthReply(service="controller")
Sends: `ControllerHello` on start and after every NATS reconnect (producers register again and full-sync:
that is how a restarted controller rebuilds its whole index), `SyncRequest` to `Subjects.sync(producer_id)`
when the table asks for one. A maintenance task ticks the table (liveness, sync retries) a few times a second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared import bus, protocol
from kvmesh.shared.errors import MeshUnavailable, ProtocolError
from kvmesh.shared.protocol import Subjects
from kvmesh.services.controller.producers import ProducerTable

log = logging.getLogger(__name__)

SYNC_REQUEST_TIMEOUT_S = 2.0
# protocol.encode() writes the "t" tag last: a payload ending in this is a SyncChunk (a hint only; decoding
# falls back to trying the other type, so a producer encoding differently still works).
_SYNC_CHUNK_SUFFIX = b"\xa1t\xaasync_chunk"


def _decode_either(payload: bytes, first: type, second: type) -> Any:
    try:
        return protocol.decode(payload, first)
    except ProtocolError as exc:
        if "message type" not in str(exc):
            raise
    return protocol.decode(payload, second)


class ProducerFeed:
    """Wires a ProducerTable to NATS. `start()` after connecting, `stop()` before closing the connection."""

    def __init__(self, nc: NatsClient, table: ProducerTable, controller_id: str,
                 clock: Callable[[], float] = time.monotonic, tick_interval_s: float = 0.25,
                 health_details: Callable[[], dict[str, Any]] | None = None) -> None:
        self.nc = nc
        self.table = table
        self.controller_id = controller_id
        self.clock = clock
        self.tick_interval_s = tick_interval_s
        self.started_at = time.time()
        self._health_details = health_details or (lambda: {})
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None
        self._reconnects_seen = 0
        self.sync_requests_sent = 0
        self.bad_messages = 0

    async def start(self) -> None:
        limits = dict(pending_msgs_limit=bus.PENDING_MSGS_LIMIT, pending_bytes_limit=bus.PENDING_BYTES_LIMIT)
        self._subs = [
            await self.nc.subscribe(Subjects.EVENTS_WILDCARD, cb=self._on_event, **limits),
            await self.nc.subscribe(Subjects.REGISTER, cb=self._on_register, **limits),
            await self.nc.subscribe(Subjects.HEARTBEAT, cb=self._on_heartbeat, **limits),
            await bus.serve(self.nc, Subjects.health("controller"), protocol.HealthRequest, self._on_health),
            await bus.serve(self.nc, Subjects.PING_ALL, protocol.HealthRequest, self._on_health),
        ]
        if Subjects.token(self.controller_id) != "controller":
            self._subs.append(await bus.serve(self.nc, Subjects.health(self.controller_id),
                                              protocol.HealthRequest, self._on_health))
        # Subscriptions must be in place on the server before producers answer the hello.
        await self.nc.flush(timeout=5)
        self._reconnects_seen = self.nc.stats["reconnects"]
        await self.hello()
        self._ticker = asyncio.create_task(self._tick_loop(), name="controller-maintenance")

    async def stop(self) -> None:
        await cancel_and_wait([self._ticker, *self._tasks])
        self._ticker = None
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # connection already closed
                log.debug("unsubscribe failed: %s", exc)
        self._subs = []

    async def hello(self) -> None:
        """Ask every producer to register again and send a full sync."""
        await bus.publish(self.nc, Subjects.CONTROLLER_HELLO,
                          protocol.ControllerHello(controller_id=self.controller_id, started_at=self.started_at))
        log.info("controller %s: hello sent; producers will register and full-sync", self.controller_id)

    # ---------------------------------------------------------------------------------------------------
    # Incoming

    async def _on_event(self, msg: Msg) -> None:
        payload = msg.data
        try:
            if payload.endswith(_SYNC_CHUNK_SUFFIX):
                event = _decode_either(payload, protocol.SyncChunk, protocol.AdmissionBatch)
            else:
                event = _decode_either(payload, protocol.AdmissionBatch, protocol.SyncChunk)
        except ProtocolError as exc:
            self._bad(msg, exc)
            return
        now = self.clock()
        if isinstance(event, protocol.AdmissionBatch):
            wants_sync = self.table.on_batch(event, now)
        else:
            wants_sync = self.table.on_sync_chunk(event, now)
        if wants_sync:
            self.request_sync(event.producer_id, "sequence gap")

    async def _on_register(self, msg: Msg) -> None:
        try:
            reg = _decode_either(msg.data, protocol.RegisterEngine, protocol.RegisterStore)
        except ProtocolError as exc:
            self._bad(msg, exc)
            return
        if isinstance(reg, protocol.RegisterEngine):
            self.table.on_register_engine(reg, self.clock())
            log.info("registered engine worker %s (instance %s, rank %d/%d)", reg.worker_id, reg.instance_id,
                     reg.rank, reg.world_size)
        else:
            self.table.on_register_store(reg, self.clock())
            log.info("registered store %s (%s)", reg.store_id, reg.location)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            heartbeat = protocol.decode(msg.data, protocol.Heartbeat)
        except ProtocolError as exc:
            self._bad(msg, exc)
            return
        if self.table.on_heartbeat(heartbeat, self.clock()):
            self.request_sync(heartbeat.producer_id, "unknown or behind")

    async def _on_health(self, _request: protocol.HealthRequest) -> protocol.HealthReply:
        return protocol.HealthReply(service="controller", service_id=self.controller_id, status="ok",
                                    details=self._health_details())

    def _bad(self, msg: Msg, exc: Exception) -> None:
        self.bad_messages += 1
        log.warning("dropped a bad message on %s: %s", msg.subject, exc)

    # ---------------------------------------------------------------------------------------------------
    # Outgoing

    def request_sync(self, producer_id: str, reason: str) -> None:
        """Ask one producer for a full sync, in the background (never blocks an event handler)."""
        task = asyncio.get_running_loop().create_task(self._request_sync(producer_id, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _request_sync(self, producer_id: str, reason: str) -> None:
        self.sync_requests_sent += 1
        try:
            await bus.request(self.nc, Subjects.sync(producer_id), protocol.SyncRequest(reason=reason),
                              protocol.Ack, timeout=SYNC_REQUEST_TIMEOUT_S)
            log.info("asked %s for a full sync (%s)", producer_id, reason)
        except (MeshUnavailable, ProtocolError) as exc:
            # Retried by the maintenance pass while the producer is alive.
            log.info("sync request to %s (%s) not acknowledged: %s", producer_id, reason, exc)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval_s)
            try:
                for producer_id in self.table.tick(self.clock()):
                    self.request_sync(producer_id, "needs a full sync")
                reconnects = self.nc.stats["reconnects"]
                if reconnects != self._reconnects_seen and self.nc.is_connected:
                    # We may have missed registrations and batches while away.
                    self._reconnects_seen = reconnects
                    await self.hello()
            except Exception:  # the maintenance loop must survive anything
                log.exception("controller maintenance pass failed")
