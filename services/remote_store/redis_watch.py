"""The remote-store service for a Redis / Valkey remote tier: it reports what Redis holds to the controller.

Engines read and write Redis themselves (services/engine/tiers/redis.py) and run the controller's pin, unpin
and clear there; this service is the tier's producer on the mesh (store id `redis-<prefix>`, location
RemoteBackend), so `/lookup` sees the chunks of every engine and stays exact when Redis evicts:
  * at start, and again after any break in the notifications, it SCANs `<prefix>:chunk:*` and publishes the
    difference (then a full sync, so the controller's view is rebuilt from what Redis holds);
  * in between, Redis keyspace notifications on the chunk values: `rename_to` (an engine's put moving into
    place) and `set` admit; `del`, `expired`, `evicted` and `rename_from` evict.
Notifications need `notify-keyspace-events` to contain `Kg$xe`; the service adds those flags with CONFIG SET
at start (where the server allows it: else a WARNING saying what to set). Standalone and sentinel servers only:
a cluster notifies per node. Redis down: one WARNING, a retry every second, and a rescan once it is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvmesh.shared import protocol
from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.messaging.admissions import AdmissionReporter
from kvmesh.shared.store_kit.store_endpoint import StoreEndpoint
from kvmesh.shared.wire.keys import ChunkKey
from kvmesh.shared.wire.redis_keys import RedisKeys
from kvmesh.shared.wire.redis_url import CLUSTER, RedisTarget

log = logging.getLogger(__name__)

NOTIFY_FLAGS = "Kg$xe"  # keyspace channel; generic (del, rename, expire), string (set), expired, evicted
ADMITTING = frozenset({"rename_to", "set"})
EVICTING = frozenset({"del", "expired", "evicted", "rename_from"})
SCAN_COUNT = 1000


class RedisWatch:
    """Keeps `held` equal to the chunk values under `key_prefix` and tells the controller every change."""

    def __init__(self, target: RedisTarget, store_id: str, key_prefix: str, nats_url: str, *,
                 timeout: float = 2.0, retry_interval: float = 1.0, heartbeat_interval: float = 2.0,
                 auth: Any = None) -> None:
        if target.mode == CLUSTER:
            raise ValueError("the Redis remote-store mode watches one server (standalone or sentinel), "
                             "not a cluster")
        self.target = target
        self.store_id = store_id
        self.keys = RedisKeys(key_prefix)
        self.nats_url = nats_url
        self.auth = auth
        self.timeout = timeout
        self.retry_interval = retry_interval
        self.held: set[ChunkKey] = set()
        self.reporter = AdmissionReporter(store_id, protocol.store_path(store_id), protocol.REMOTE,
                                          held_keys=lambda: list(self.held), register=self._registration,
                                          heartbeat_interval=heartbeat_interval)
        self.endpoint = StoreEndpoint("remote_store", store_id)
        self.capacity_bytes = 0
        self.resyncs = 0  # full rescans done (tests wait on it)
        self._started_at = time.time()
        self._task: asyncio.Task[None] | None = None
        self._reachable = True

    async def start(self, nc: Any = None) -> None:
        await self.endpoint.connect(nc, self.nats_url, self.auth)
        await self.endpoint.serve([], self.reporter, self._health_details)
        self._task = asyncio.create_task(self._run(), name=f"redis-watch-{self.store_id}")
        log.info("remote store %s: reporting the chunks of %s under %s", self.store_id, self.target.describe(),
                 self.keys.chunk_pattern)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        await self.endpoint.close()

    # ---- the watch ------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        """Subscribe, rescan, follow the notifications; on any failure start over after `retry_interval`."""
        while True:
            client = self.target.client(self.timeout, retries=0)  # no silent reconnect: a break means a rescan
            try:
                await self._watch(client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._reachable:
                    self._reachable = False
                    log.warning("remote store %s: %s unreachable (%s: %s); /lookup keeps the last known chunks "
                                "until it is back", self.store_id, self.target.describe(), type(exc).__name__, exc)
            finally:
                await client.aclose()
            await asyncio.sleep(self.retry_interval)

    async def _watch(self, client: Redis) -> None:
        await self._enable_notifications(client)
        pubsub = client.pubsub()
        try:
            # subscribed before the scan: a change during the scan is heard, not lost between the two
            await pubsub.psubscribe(f"__keyspace@{self.target.db}__:{self.keys.chunk_pattern}")
            await self._rescan(client)
            if not self._reachable:
                self._reachable = True
                log.info("remote store %s: %s reachable again", self.store_id, self.target.describe())
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.timeout)
                if message is None:
                    await pubsub.ping()  # a silent connection must still be alive (its pong is skipped below)
                elif message["type"] == "pmessage":
                    self._on_notification(message["channel"], message["data"])
        finally:
            await pubsub.aclose()

    def _on_notification(self, channel: bytes, event: bytes) -> None:
        key = self.keys.key_of(channel.split(b":", 1)[1] if b":" in channel else b"")
        if key is None:
            return
        kind = event.decode(errors="replace")
        if kind in ADMITTING and key not in self.held:
            self.held.add(key)
            self.reporter.admit(key)
        elif kind in EVICTING and key in self.held:
            self.held.discard(key)
            self.reporter.evict(key)

    async def _rescan(self, client: Redis) -> None:
        """Make `held` what Redis holds now: admit the new, evict the gone, then a full sync."""
        found: set[ChunkKey] = set()
        async for name in client.scan_iter(match=self.keys.chunk_pattern, count=SCAN_COUNT):
            key = self.keys.key_of(name)
            if key is not None:
                found.add(key)
        for key in found - self.held:
            self.reporter.admit(key)
        for key in self.held - found:
            self.reporter.evict(key)
        self.held = found
        memory = await client.config_get("maxmemory")
        self.capacity_bytes = int(memory.get("maxmemory", 0) or 0) if memory else 0
        self.resyncs += 1
        await self.reporter.publish_full_sync()
        log.info("remote store %s: %d chunks in %s", self.store_id, len(found), self.target.describe())

    async def _enable_notifications(self, client: Redis) -> None:
        try:
            current = (await client.config_get("notify-keyspace-events")).get("notify-keyspace-events", "")
            current = current.decode() if isinstance(current, bytes) else current
            missing = [flag for flag in NOTIFY_FLAGS if flag not in current and not (flag in "g$xe" and "A" in current)]
            if missing:
                await client.config_set("notify-keyspace-events", current + "".join(missing))
        except (RedisConnectionError, RedisTimeoutError):
            raise
        except Exception as exc:  # managed services may refuse CONFIG: the operator sets it
            log.warning("remote store %s: cannot enable keyspace notifications on %s (%s); set "
                        "notify-keyspace-events to include %s, or /lookup misses admissions and evictions",
                        self.store_id, self.target.describe(), exc, NOTIFY_FLAGS)

    # ---- what the controller sees ---------------------------------------------------------------------------
    def _registration(self) -> protocol.RegisterStore:
        return protocol.RegisterStore(store_id=self.store_id, location=protocol.REMOTE,
                                      capacity_bytes=self.capacity_bytes, started_at=self._started_at)

    def _health_details(self) -> dict[str, Any]:
        return {"redis": self.target.describe(), "num_chunks": len(self.held), "reachable": self._reachable}


async def run_redis_watch(target: RedisTarget, store_id: str, key_prefix: str, nats_url: str, auth: Any,
                          timeout: float, heartbeat_interval: float, stop: asyncio.Event) -> None:
    """Serve until `stop` is set (the remote-store service's body with `--redis-url`)."""
    watch = RedisWatch(target, store_id, key_prefix, nats_url, timeout=timeout, auth=auth,
                       heartbeat_interval=heartbeat_interval)
    try:
        await watch.start()
        await stop.wait()
    finally:
        await watch.stop()
