"""The controller's NATS side: what it subscribes to, what it sends, and its periodic maintenance.

Runs on the controller's one event loop (shared with uvicorn). Subscriptions, each processed in order by
nats-py (one task per subscription, so there is no ordering *between* them):
  - `Subjects.EVENTS_ALL`       AdmissionBatch / SyncChunk from every producer -> ProducerTable / HolderIndex
  - `Subjects.REGISTER_ALL`     RegisterEngine / RegisterStore
  - `Subjects.PEER_LOOKUP_ALL`  PeerLookup -> PeerLookupReply (P2P hits: peers.py)
  - `Subjects.HEARTBEAT_ALL`    Heartbeat (liveness; a seq claim may reveal a lost batch)
  - `Subjects.health("controller")`, `Subjects.PING_ALL`   HealthRequest -> HealthReply(service="controller")
Sends: `ControllerHello` on start and after every NATS reconnect (producers register again and full-sync:
that is how a restarted controller rebuilds its whole index), `SyncRequest` to `Subjects.sync(path)` when the
table asks for one. A maintenance task ticks the table (liveness, sync retries) a few times a second.

Who sent a message is the producer path its subject ends in (NATS permissions let only that principal publish
there, docs/security.md); the body must agree with it. A registration binds a producer id to its path (an engine
worker's id is derived from its instance, a store's is its principal's name) unless another live path owns that
id; events and heartbeats count only from the path their producer registered from. Anything else is dropped and
counted in `forged_messages` (their WARNINGs at most one per sender principal every 10 s); a heartbeat of an
unknown producer makes it announce itself again, within its principal's `SyncBudget` (sync_budget.py: past it the
heartbeat is dropped and counted in `sync_requests_limited`, so a flood of them costs O(1) each). A registration
past a limit (`PrincipalQuotas.refusal`: producer count, chunk_size, key parameter sets, host/ip length) is refused
with a WARNING and counted in `registrations_refused`; so is an engine registration whose `domain` is not the
sharing domain that the domains map (`DomainMap`, the file the stores read) gives its principal
(`reason="domain"`): an engine's domain comes from its credentials, never from its message. Engine worker ids end
in a per-process tag (`protocol.worker_id_for`), so replicas sharing an instance id are distinct producers on
distinct paths; when several live ones claim the same instance id and rank, the controller logs a WARNING and sends
an `InstanceConflict` to the newcomer and to the worker that served the rank before it (they log one too; O(1)
notices per registration); the instance id is served by one of them (`InstanceClaims` docs). A principal at its
share of producers or key parameter sets makes room by forgetting its own down producers
(`ProducerTable.room_for`); past that it is refused, never another principal.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Callable

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvmesh.services.controller.peers import peer_holders
from kvmesh.services.controller.principal_quotas import principal_of
from kvmesh.services.controller.producers import ProducerTable
from kvmesh.services.controller.sync_budget import SyncBudget
from kvmesh.shared import protocol
from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.errors import MeshUnavailable, ProtocolError
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.sharing_domains import DomainMap
from kvmesh.shared.protocol import ProducerPath, Subjects, is_worker_id_of
from kvmesh.shared.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

SYNC_REQUEST_TIMEOUT_S = 2.0
MAX_CONFLICT_NAMES = 8  # claimants named in one InstanceConflict notice and its WARNING
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
                 health_details: Callable[[], dict[str, Any]] | None = None, domains: DomainMap | None = None,
                 sync_requests_per_principal: float = 64.0) -> None:
        self.nc = nc
        self.table = table
        self.domains = domains if domains is not None else DomainMap(None)  # engine principal -> sharing domain
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
        self.sync_requests_limited = 0  # heartbeats of unknown producers past their principal's SyncBudget
        self.sync_budget = SyncBudget(sync_requests_per_principal, clock)
        self._forged_log = RateLimitedLog(log)
        self.bad_messages = 0
        self.forged_messages = 0
        self.peer_lookups = collections.Counter[str]()  # answers to P2P lookups: "peer" (one named) or "none"
        self.conflicts_reported = 0
        self.conflict_notices_sent = 0

    async def start(self) -> None:
        limits = dict(pending_msgs_limit=bus.PENDING_MSGS_LIMIT, pending_bytes_limit=bus.PENDING_BYTES_LIMIT)
        self._subs = [
            await self.nc.subscribe(Subjects.EVENTS_ALL, cb=self._on_event, **limits),
            await self.nc.subscribe(Subjects.REGISTER_ALL, cb=self._on_register, **limits),
            await self.nc.subscribe(Subjects.HEARTBEAT_ALL, cb=self._on_heartbeat, **limits),
            await bus.serve_from(self.nc, Subjects.PEER_LOOKUP_ALL, protocol.PeerLookup, self._on_peer_lookup),
            await bus.serve(self.nc, Subjects.health(protocol.CONTROLLER.path), protocol.HealthRequest,
                            self._on_health),
            await bus.serve(self.nc, Subjects.PING_ALL, protocol.HealthRequest, self._on_health),
        ]
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
        if not self._from_registered(msg, Subjects.EVENTS_ALL, event.producer_id):
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
        sender = Subjects.producer_of(msg.subject, Subjects.REGISTER_ALL)
        path = self._registration_path(sender, reg)
        if path is None:
            return
        domain = self.domains.domain_of(path)  # the principal's, never the message's
        named = reg.domain.split("/", 1)[0] if isinstance(reg, protocol.RegisterEngine) else domain
        if named != domain:  # an engine's `domain` is "<name>[/<digest of its secret>]" (mesh/domain.py)
            self.table.stats.registrations_refused["domain"] += 1
            log.warning("controller: refused the registration of %r from %s: it names sharing domain %r, the "
                        "domains map (%s) puts %s in %r", reg.worker_id, path, named,
                        self.domains.file or "none: every engine is in the default domain", principal_of(path), domain)
            return
        refused = self.table.room_for(reg, path, self.clock())
        if refused is not None:
            reason, message = refused
            self.table.stats.registrations_refused[reason] += 1
            log.warning("controller: refused %s", message)
            return
        if isinstance(reg, protocol.RegisterEngine):
            serving_before = self.table.instances.get(reg.instance_id, {}).get(reg.rank)
            claimants = self.table.on_register_engine(reg, self.clock(), path, domain)
            log.info("registered engine worker %s (instance %s, rank %d/%d, host %s)", reg.worker_id,
                     reg.instance_id, reg.rank, reg.world_size, reg.host or "?")
            if claimants:
                await self._report_conflict(reg.instance_id, reg.rank, claimants,
                                            {reg.worker_id, serving_before} & set(claimants))
        else:
            self.table.on_register_store(reg, self.clock(), path)
            log.info("registered store %s (%s)", reg.store_id, reg.location)

    def _registration_path(self, sender: ProducerPath | None,
                           reg: protocol.RegisterEngine | protocol.RegisterStore) -> str | None:
        """The verified producer path of a registration, or None (logged, counted) when it must be refused."""
        if isinstance(reg, protocol.RegisterEngine):
            producer_id, role = reg.worker_id, "engine"
            valid = sender is not None and sender.owns(reg.instance_id, reg.worker_id) and (
                is_worker_id_of(reg.worker_id, reg.instance_id, reg.world_size, reg.rank))
        else:
            producer_id, role = reg.store_id, "store"
            valid = sender is not None and sender.owns(reg.store_id, reg.store_id)
        if sender is None or sender.role != role or not valid:
            self._forged(f"{role} registration of {producer_id!r} from "
                         f"{sender.path if sender else 'a subject without a producer path'}", sender)
            return None
        owner = self.table.owner_of(producer_id, sender.path)
        if owner is not None:
            self._forged(f"{sender.path} registering {producer_id!r}, which {owner} holds while alive", sender)
            return None
        return sender.path

    async def _report_conflict(self, instance_id: str, rank: int, claimants: list[str], involved: set[str]) -> None:
        """Several live workers claim one instance id and rank: a WARNING here, and a notice to the workers
        this registration involves (`involved`: the newcomer and the one that served the rank before it) and
        the one serving now. Each claimant hears of the conflict when it registers into it or loses the rank,
        so N registrations cost O(N) notices, not one per claimant each (N²/2); a notice and the WARNING name
        the latest MAX_CONFLICT_NAMES claimants only."""
        serving = self.table.instances.get(instance_id, {}).get(rank, "")
        named = claimants[-MAX_CONFLICT_NAMES:]
        names = [self._describe(worker_id) for worker_id in named]
        more = f" and {len(claimants) - len(named)} more" if len(claimants) > len(named) else ""
        self.conflicts_reported += 1
        log.warning("controller: instance id %r rank %d is claimed by %d live workers: %s%s; not merged: the "
                    "instance id is served by %s only (see duplicate_workers in GET /instances). Give each vLLM "
                    "replica its own lmcache_instance_id", instance_id, rank, len(claimants), "; ".join(names),
                    more, serving)
        notice = protocol.InstanceConflict(instance_id=instance_id, rank=rank, serving=serving, others=names)
        for worker_id in sorted(involved | {serving} - {""}):
            self.conflict_notices_sent += 1
            await bus.publish(self.nc, Subjects.worker(instance_id, worker_id, protocol.CONFLICT_OP), notice)

    def _describe(self, worker_id: str) -> str:
        producer = self.table.producer(worker_id)
        reg = producer.engine if producer is not None else None
        if reg is None or not (reg.host or reg.ip):
            return worker_id
        return f"{worker_id} on {reg.host or '?'} ({reg.ip or '?'})"

    def _from_registered(self, msg: Msg, wildcard: str, producer_id: str) -> bool:
        """Whether `msg` came from the path `producer_id` registered from; else it is dropped and counted."""
        sender = Subjects.producer_of(msg.subject, wildcard)
        if sender is not None and self.table.sender_is(producer_id, sender.path):
            return True
        if sender is not None and self.table.producer(producer_id) is None \
                and sender.producer == Subjects.token(producer_id):
            return False  # not registered yet (or we missed it): its heartbeat makes it announce itself
        self._forged(f"a message of producer {producer_id!r} from {sender.path if sender else msg.subject}", sender)
        return False

    def _forged(self, what: str, sender: ProducerPath | None = None) -> None:
        self.forged_messages += 1
        self._forged_log.warning(f"{sender.role}.{sender.owner}" if sender else "", "controller: refused %s", what)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            heartbeat = protocol.decode(msg.data, protocol.Heartbeat)
        except ProtocolError as exc:
            self._bad(msg, exc)
            return
        sender = Subjects.producer_of(msg.subject, Subjects.HEARTBEAT_ALL)
        if self.table.producer(heartbeat.producer_id) is None and sender is not None \
                and sender.producer == Subjects.token(heartbeat.producer_id):
            if self.sync_budget.take(principal_of(sender.path)):
                self._ask_sync(sender.path, "unregistered")  # it announces itself: registration and full sync
            else:
                self.sync_requests_limited += 1
            return
        if not self._from_registered(msg, Subjects.HEARTBEAT_ALL, heartbeat.producer_id):
            return
        if self.table.on_heartbeat(heartbeat, self.clock()):
            self.request_sync(heartbeat.producer_id, "unknown or behind")

    async def _on_peer_lookup(self, request: protocol.PeerLookup, subject: str) -> protocol.PeerLookupReply:
        """P2P: the holders of record of the leading keys (peers.py); nothing for an asker that is not the
        registered worker it names."""
        sender = Subjects.producer_of(subject, Subjects.PEER_LOOKUP_ALL)
        asker = self.table.producer(request.worker_id)
        if sender is None or asker is None or not self.table.sender_is(request.worker_id, sender.path):
            self._forged(f"a peer lookup of {request.worker_id!r} on {subject}", sender)
            return protocol.PeerLookupReply()
        reply = peer_holders(self.table, asker, request)
        self.peer_lookups["peer" if reply.num_chunks else "none"] += 1
        return reply

    async def _on_health(self, _request: protocol.HealthRequest) -> protocol.HealthReply:
        return protocol.HealthReply(service="controller", service_id=self.controller_id, status="ok",
                                    details=self._health_details(), path=protocol.CONTROLLER.path)

    def _bad(self, msg: Msg, exc: Exception) -> None:
        self.bad_messages += 1
        log.warning("dropped a bad message on %s: %s", msg.subject, exc)

    # ---------------------------------------------------------------------------------------------------
    # Outgoing

    def request_sync(self, producer_id: str, reason: str) -> None:
        """Ask one registered producer for a full sync, in the background (never blocks an event handler)."""
        producer = self.table.producer(producer_id)
        if producer is not None and producer.path is not None:
            self._ask_sync(producer.path, reason)

    def _ask_sync(self, path: str, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self._request_sync(path, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _request_sync(self, path: str, reason: str) -> None:
        self.sync_requests_sent += 1
        try:
            await bus.request(self.nc, Subjects.sync(path), protocol.SyncRequest(reason=reason),
                              protocol.Ack, timeout=SYNC_REQUEST_TIMEOUT_S)
            log.info("asked %s for a full sync (%s)", path, reason)
        except (MeshUnavailable, ProtocolError) as exc:
            # Retried by the maintenance pass while the producer is alive.
            log.info("sync request to %s (%s) not acknowledged: %s", path, reason, exc)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval_s)
            try:
                for producer_id in self.table.tick(self.clock()):
                    self.request_sync(producer_id, "needs a full sync")
                self.sync_budget.forget_full()
                reconnects = self.nc.stats["reconnects"]
                if reconnects != self._reconnects_seen and self.nc.is_connected:
                    # We may have missed registrations and batches while away.
                    self._reconnects_seen = reconnects
                    await self.hello()
            except Exception:  # the maintenance loop must survive anything
                log.exception("controller maintenance pass failed")
