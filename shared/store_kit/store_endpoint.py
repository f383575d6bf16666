"""A store's presence on NATS, whatever holds its bytes (disk store, remote store): `StoreEndpoint`.

Runs on the store's one asyncio event loop, like the store itself: its connections (its own: a main one and a lane
per engine principal; or one lent by a test), one subscription per op and caller principal (the subject's last
tokens are the caller's path, which NATS permissions let only that caller publish on), its AdmissionReporter,
health answers (on `Subjects.health(<store's path>)` and the ping-all subject); `stop_serving()` then `close()`
undo it. The ops it serves are the store's `Handler`s (shared/store_kit/store_ops.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from typing import Any, Awaitable, Callable

from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.admissions import AdmissionReporter
from kvmesh.shared.messaging.credentials import credentials_for
from kvmesh.shared.messaging.sharing_domains import DomainMap
from kvmesh.shared.ops.service import serve_health
from kvmesh.shared.store_kit.store_bounds import StoreBounds
from kvmesh.shared.store_kit.store_ops import Handler

log = logging.getLogger(__name__)


class _Lane:
    """One of a store's own NATS connections that serves engines: one principal's lane, or the shared one (every
    engine by wildcard where the domains map lists none, else the listed principals past --max-lanes, each by
    its own subjects). `subscriptions` maps each principal path served here (ENGINES: the wildcard) to its
    subscriptions, one per op."""

    def __init__(self, name: str, nc: NatsClient) -> None:
        self.name = name
        self.nc = nc
        self.subscriptions: dict[str, list[Subscription]] = {}

    @property
    def lost(self) -> int:
        """How often nats-server cut this connection off (or it otherwise dropped): its reconnects, and 1 if it
        is down now."""
        return self.nc.stats["reconnects"] + (0 if self.nc.is_connected else 1)

    @property
    def dropped(self) -> int:
        """Requests nats-py dropped on this connection because their op's queue was full."""
        counts = getattr(self.nc, "dropped", None)
        return 0 if counts is None else sum(counts.values())


ENGINES = "engine.>"  # the caller paths of every engine: the shared connection's wildcard where no map lists one
SHARED_LANE = "shared"  # the shared connection's name suffix and its key in `lane_disconnects`
LANE_CHECK_INTERVAL = 0.25  # seconds between two looks at the domains map (a stat) for lanes to open or close


class StoreEndpoint:
    """A store's connections, subscriptions, admission reporter and health answers (see the module docstring).

    `service` names the kind of store ("disk_store", "remote_store"): in health replies and connection names.
    Each op's subscription queues at most `queue_bytes` of requests (--request-queue-mb); what arrives past it is
    dropped by nats-py and counted in `dropped`, so a flood costs the store no more memory than that per
    subscription.

    Lanes (issue 24, finding 5): nats-server keeps a pending budget per connection (max_pending) and cuts off a
    connection whose reader falls behind it, and a reader in Python can always be outrun by enough publishers of
    large messages (a 40 MiB put, or 40 MiB of garbage on any op: NATS's max_payload is what bounds a message).
    So what one principal sends must reach a connection that serves that principal alone:
      * `nc` (named `<service>:<store_id>`) carries the admissions, health, ping and the operator's ops
        (`<op>.operator`): no engine publishes anything it reads;
      * each engine principal `engine.<instance token>` that the domains map lists (`DomainMap.engines`) gets a
        lane, a connection of its own named `<service>:<store_id>:<instance token>`, subscribed to its subjects
        only (`Subjects.store_op_from`), every op on it: a principal that floods gets its own lane cut off (it
        reconnects by itself; logged with the principal and counted in `lane_disconnects`), no other's;
      * principals past `max_lanes` share one connection (`<service>:<store_id>:shared`), each subscribed by its
        own subjects; where the map lists no engine (no map, or a NATS whose users were made by hand) that
        connection serves every engine by wildcard, as one connection did before lanes: there one principal's
        flood can cut off the others' requests (list the principals to isolate them).
    The map is looked at every `check_interval` seconds (it is re-read when it changes): lanes open for new
    principals and close for removed ones. An engine that a listing map leaves out is served nowhere. A principal
    that moves (to its new lane, or back to the shared connection) is subscribed where it goes before its old
    subscriptions drain, all of this endpoint's engine subscriptions in one queue group (`queue`): a request sent
    meanwhile is answered exactly once, never twice (a pin taken twice) and never dropped (nats-py discards
    what an unsubscribed subscription still holds; the engine would wait out its timeout and take a miss).
    A lent connection (`connect(nc=...)`) serves every op of every caller by itself, and `close` leaves it open.
    """

    def __init__(self, service: str, store_id: str, queue_bytes: int = bus.PENDING_BYTES_LIMIT,
                 max_lanes: int = StoreBounds().max_lanes, check_interval: float = LANE_CHECK_INTERVAL) -> None:
        self.service = service
        self.store_id = store_id
        self.queue_bytes = queue_bytes
        self.max_lanes = max_lanes
        self.check_interval = check_interval
        self.nc: NatsClient | None = None
        self.reporter: AdmissionReporter | None = None
        self.lanes: dict[str, _Lane] = {}  # engine principal path -> its lane
        self.shared: _Lane | None = None
        self._own_nc = False
        self._url = ""
        self._auth: bus.NatsAuth | None = None
        self._handlers: list[Handler] = []
        self._domains = DomainMap(None)
        self._subscriptions: list[Subscription] = []  # on `nc`
        self._arranging = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._closed_lost: collections.Counter[str] = collections.Counter()  # cut-offs of lanes closed since
        self._closed_dropped = 0  # requests dropped on lanes closed since
        self._bad_entries: set[str] = set()  # domains map entries that name no engine principal (logged once)
        # this endpoint's own group: another process with the same store id still gets every request, as before
        self.queue = f"{service}.{store_id}.{secrets.token_hex(4)}"

    async def connect(self, nc: NatsClient | None, url: str, auth: bus.NatsAuth | None = None) -> NatsClient:
        """`nc` if given (lent: `close` leaves it open, and it serves everything), else the store's main
        connection of its own (lanes open in `serve`), returned.

        Our own waits up to `bus.SERVICE_CONNECT_WAIT` for a NATS still starting and raises MeshUnavailable,
        naming the URL, when none answers or it rejects `auth`. Without `auth`, a store started by hand next to a
        NATS that KVMesh started on this host adds its own user to it, as engines do.
        """
        if nc is None:
            auth = credentials_for(url, protocol.Principal.store(self.store_id), auth)
            nc = await bus.connect(url, f"{self.service}:{self.store_id}", auth,
                                   first_connect_wait=bus.SERVICE_CONNECT_WAIT)
            self._own_nc, self._url, self._auth = True, url, auth
        self.nc = nc
        return nc

    def connections(self) -> list[NatsClient]:
        """The store's connections: the main one first, then the lanes and the shared one."""
        lanes = [*self.lanes.values(), *([self.shared] if self.shared is not None else [])]
        return [nc for nc in (self.nc, *(lane.nc for lane in lanes)) if nc is not None]

    async def serve(self, handlers: list[Handler], reporter: AdmissionReporter,
                    health_details: Callable[[], dict[str, Any]], domains: DomainMap | None = None) -> None:
        """Subscribe the handlers (on the lanes `domains` calls for, see the class docstring), start the reporter
        (registration, full sync), then answer health: a store that answers health is registered and serving."""
        assert self.nc is not None, "connect() first"
        self._handlers = handlers
        self._domains = domains if domains is not None else DomainMap(None)
        if self._own_nc:
            self._subscriptions = await self._subscribe(self.nc, protocol.OPERATOR.path,
                                                        lambda op: protocol.Subjects.store(self.store_id, op,
                                                                                           protocol.OPERATOR.path))
            await self.arrange()
            self._watch = asyncio.create_task(self._watch_domains())
        else:  # a lent connection: every caller's ops on it
            self._subscriptions = await self._subscribe(self.nc, "every caller",
                                                        lambda op: protocol.Subjects.store_op(self.store_id, op))
        self.reporter = reporter
        await reporter.start(self.nc)
        await serve_health(self.nc, self.service, self.store_id, protocol.store_path(self.store_id),
                           details=health_details)
        for nc in self.connections():  # the server has every subscription: a request sent from now on finds its op
            await nc.flush()

    async def _subscribe(self, nc: NatsClient, who: str, subject: Callable[[str], str]) -> list[Subscription]:
        """One subscription per handler on `nc`, on `subject(op)`, in the endpoint's queue group; `who` (for the
        log) is whose ops they are."""
        subscriptions = []
        try:
            for handler in self._handlers:
                subscriptions.append(await bus.serve_from(
                    nc, subject(handler.op), handler.request_type, _from_caller(handler), queue=self.queue,
                    max_concurrent=handler.max_concurrent, pending_bytes_limit=self.queue_bytes))
        except BaseException:
            await _unsubscribe(subscriptions, f"{self.service} {self.store_id}")
            raise
        log.debug("%s %s: serving %s", self.service, self.store_id, who)
        return subscriptions

    def _principal_subjects(self, principal: str) -> Callable[[str], str]:
        if principal == ENGINES:
            return lambda op: protocol.Subjects.store(self.store_id, op, ENGINES)
        return lambda op: protocol.Subjects.store_op_from(self.store_id, op, principal)

    async def arrange(self) -> None:
        """Open and close lanes as the domains map now says (see the class docstring). A principal whose lane
        cannot open is served on the shared connection meanwhile; the next look tries again."""
        async with self._arranging:
            listed = [path for path in self._domains.engines() if self._is_engine_principal(path)]
            kept = [path for path in self.lanes if path in listed]
            room = max(0, self.max_lanes - len(kept))
            new = [path for path in listed if path not in self.lanes][:room]
            opened = dict(zip(new, await asyncio.gather(*(self._open_lane(path) for path in new))))
            laned = set(kept) | {path for path, lane in opened.items() if lane is not None}
            shared = [path for path in listed if path not in laned] if listed else [ENGINES]
            # what moves is subscribed where it goes first, then drained where it was (see the class docstring)
            subscribed: list[NatsClient] = []  # the connections that took new subscriptions
            for path, lane in opened.items():
                if lane is not None:
                    lane.subscriptions[path] = await self._subscribe(lane.nc, path, self._principal_subjects(path))
                    subscribed.append(lane.nc)
                    self.lanes[path] = lane
                    log.info("%s %s: %s served on a lane of its own (%s)", self.service, self.store_id, path,
                             lane.name)
            missing = [path for path in shared if self.shared is None or path not in self.shared.subscriptions]
            if missing and self.shared is None:
                self.shared = await self._connect_lane(SHARED_LANE)
            if self.shared is not None:
                for path in missing:
                    self.shared.subscriptions[path] = await self._subscribe(self.shared.nc, path,
                                                                            self._principal_subjects(path))
                    subscribed.append(self.shared.nc)
                if missing and listed:
                    log.warning("%s %s: %d engine principals past --max-lanes %d share one connection (%s): "
                                "one's flood can cut off the others' requests", self.service, self.store_id,
                                len(shared), self.max_lanes, self.shared.name)
            # The server has the new subscriptions before the old ones go. Only those connections: a look that
            # changed nothing costs no round trip, and a lane being flooded (its flush may time out) holds up no one.
            for nc in dict.fromkeys(subscribed):
                await nc.flush()
            for path in [path for path in self.lanes if path not in laned]:
                await self._close_lane(path)
            if self.shared is not None:
                for path in [path for path in self.shared.subscriptions if path not in shared]:
                    await _unsubscribe(self.shared.subscriptions.pop(path), self.shared.name, drain=True)
                if not self.shared.subscriptions:  # every principal has its lane now
                    await self._retire(self.shared, SHARED_LANE)
                    self.shared = None

    def _is_engine_principal(self, path: str) -> bool:
        """Whether a domains map entry names an engine principal, `engine.<instance token>` (a token: no
        wildcard, no dot), so that its subjects match its callers alone; another entry is logged (once) and
        served nowhere."""
        role, _, name = path.partition(".")
        ok = role == "engine" and protocol.Subjects.is_token(name)
        if not ok and path not in self._bad_entries:
            self._bad_entries.add(path)
            log.warning("%s %s: domains map entry %r is not an engine principal (engine.<instance token>): "
                        "served nowhere", self.service, self.store_id, path)
        return ok

    async def _open_lane(self, principal: str) -> _Lane | None:
        """A connection for `principal`'s lane, or None (logged) if it could not be made."""
        try:
            return await self._connect_lane(principal.split(".", 1)[1])
        except Exception as exc:
            log.warning("%s %s: could not open the lane of %s (%s); it shares the store's shared connection "
                        "meanwhile", self.service, self.store_id, principal, exc)
            return None

    async def _connect_lane(self, suffix: str) -> _Lane:
        name = f"{self.service}:{self.store_id}:{suffix}"
        nc = await bus.connect(self._url, name, self._auth, first_connect_wait=bus.SERVICE_CONNECT_WAIT)
        lane = _Lane(name, nc)
        if isinstance(nc, bus.MeshClient):
            async def cut_off() -> None:  # bus logs the disconnect; this says who it was, and how often
                log.warning("%s %s: the connection %s was cut off and reconnected (%d times so far): its "
                            "principal sends faster than the store reads (a flood?); no other lane is affected",
                            self.service, self.store_id, name, lane.lost)

            nc.reconnect_hooks.append(cut_off)
        return lane

    async def _close_lane(self, principal: str) -> None:
        lane = self.lanes.pop(principal)
        log.info("%s %s: %s no longer in the domains map: its lane %s closes", self.service, self.store_id,
                 principal, lane.name)
        await self._retire(lane, principal)

    async def _retire(self, lane: _Lane, key: str) -> None:
        """Close `lane` (its handlers still running finish first, their replies sent); its counts stay in the
        stats."""
        self._closed_lost[key] += lane.lost
        self._closed_dropped += lane.dropped
        for subscriptions in lane.subscriptions.values():
            await _unsubscribe(subscriptions, lane.name, drain=True)
        lane.subscriptions.clear()
        try:
            await lane.nc.drain()
        except Exception as exc:
            log.debug("%s %s: NATS drain of %s failed: %s", self.service, self.store_id, lane.name, exc)

    async def _watch_domains(self) -> None:
        """Arrange the lanes every `check_interval` until `stop_serving`. It is asked to stop, never cancelled: a
        cancel that lands in nats-py's drain (a lane closing) is swallowed there, and the task would go on
        forever while `stop_serving` waited for it."""
        while True:
            try:
                await asyncio.wait_for(self._stopping.wait(), self.check_interval)
                return
            except TimeoutError:
                pass
            try:
                await self.arrange()
            except Exception:  # a failed look must not end the watch: the next one tries again
                log.exception("%s %s: arranging the lanes failed", self.service, self.store_id)

    @property
    def dropped(self) -> int:
        """Requests dropped so far because their op's queue was full (0 on a connection not made by bus.connect)."""
        counts = getattr(self.nc, "dropped", None)
        main = 0 if counts is None else sum(counts[subscription] for subscription in self._subscriptions)
        lanes = [*self.lanes.values(), *([self.shared] if self.shared is not None else [])]
        return main + self._closed_dropped + sum(lane.dropped for lane in lanes)

    def lane_disconnects(self) -> dict[str, int]:
        """How often each lane was cut off (by principal path; the shared connection as `shared`), nonzero only."""
        lost = collections.Counter(self._closed_lost)
        for path, lane in self.lanes.items():
            lost[path] += lane.lost
        if self.shared is not None:
            lost[SHARED_LANE] += self.shared.lost
        return {key: count for key, count in sorted(lost.items()) if count}

    def counters(self) -> dict[str, Any]:
        """For the store's stats details: requests dropped, full syncs published and the asks they served, the
        lanes open, the principals on the shared connection, and each connection's cut-offs."""
        reporter = self.reporter
        shared = self.shared.subscriptions if self.shared is not None else {}
        return {"requests_dropped": self.dropped, "full_syncs": reporter.syncs_published if reporter else 0,
                "sync_asks": reporter.sync_asks if reporter else 0, "lanes": len(self.lanes),
                "lane_shared_principals": -1 if ENGINES in shared else len(shared),
                "lane_disconnects": self.lane_disconnects()}

    async def stop_serving(self) -> None:
        """Take no more requests (the store may then finish its work and close)."""
        if self._watch is not None:
            self._stopping.set()
            await self._watch  # ends after the look under way, if any
            self._watch = None
        async with self._arranging:
            await _unsubscribe(self._subscriptions, f"{self.service} {self.store_id}")
            self._subscriptions = []
            for lane in [*self.lanes.values(), *([self.shared] if self.shared is not None else [])]:
                for subscriptions in lane.subscriptions.values():
                    await _unsubscribe(subscriptions, lane.name)
                lane.subscriptions = {}

    async def close(self) -> None:
        """After the store closed: publish the last admissions, then close our own connections."""
        await self.stop_serving()
        if self.reporter is not None:
            await self.reporter.stop()
            self.reporter = None
        if self._own_nc:  # every lane at once: a store serving many principals still stops within moments
            retiring = [self._retire(self.lanes.pop(path), path) for path in list(self.lanes)]
            if self.shared is not None:
                retiring.append(self._retire(self.shared, SHARED_LANE))
                self.shared = None
            await asyncio.gather(*retiring)
            try:
                await self.nc.drain()
            except Exception as exc:
                log.debug("%s %s: NATS drain failed: %s", self.service, self.store_id, exc)


async def _unsubscribe(subscriptions: list[Subscription], name: str, drain: bool = False) -> None:
    """Unsubscribe (`drain`: after answering what the subscriptions already hold; else that is discarded)."""
    for subscription in subscriptions:
        try:
            await (bus.drain(subscription) if drain else subscription.unsubscribe())
        except Exception as exc:
            log.debug("%s: unsubscribe failed: %s", name, exc)



def _from_caller(handler: Handler) -> Callable[[Any, str], Awaitable[Any]]:
    """`handler.handle` as a bus handler: the caller is the path the message's subject ends in."""

    def handle(request: Any, subject: str) -> Awaitable[Any]:
        return handler.handle(request, protocol.Subjects.caller_of_store_op(subject))

    return handle
