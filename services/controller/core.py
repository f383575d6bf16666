"""The controller's operations, independent of HTTP: what each REST endpoint does, as plain methods.

Everything here runs on the controller's event loop; `api/` maps these methods (and their
ControllerError exceptions) to HTTP, `service.py` wires the NATS side (`ProducerFeed`) in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE
from kvmesh.services.controller.commands import CommandRouter
from kvmesh.services.controller.config import ControllerConfig
from kvmesh.services.controller.errors import ControllerError, NotFound, Refused, TooManyCommands
from kvmesh.services.controller.holder_index import HolderIndex
from kvmesh.services.controller.lookup import KeyRequest, LookupEngine
from kvmesh.services.controller.metrics import Metrics
from kvmesh.services.controller.ops import EventLog, EventRecord
from kvmesh.services.controller.principal_quotas import Limits
from kvmesh.services.controller.producer_records import Producer
from kvmesh.services.controller.producers import ProducerTable
from kvmesh.services.controller.usage import FleetUsage


# /health error codes per rank (LMCache's convention: 0 healthy, anything else an error).
HEALTH_OK = 0
HEALTH_SILENT = 1  # no heartbeat within --liveness-timeout
HEALTH_MISSING = 2  # a rank of the instance's world_size that has not registered
ALL_INSTANCES = "all"  # /query_worker_info's instance_id for every instance (LMCache's)


@dataclass(frozen=True)
class CommandResult:
    event_id: str
    num_tokens: int


class CommandError(ControllerError):
    """A ControllerError raised by a command, carrying the command's event_id (its status: failed)."""

    def __init__(self, cause: ControllerError, event_id: str) -> None:
        super().__init__(cause.message)
        self.status_code = cause.status_code
        self.event_id = event_id


class ControllerCore:
    """Index, registrations, event ids and command routing of one controller."""

    def __init__(self, config: ControllerConfig, clock: Any = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.controller_id = config.resolved_controller_id()
        self.table = ProducerTable(HolderIndex(), liveness_timeout_s=config.liveness_timeout_s,
                                   sync_retry_s=config.sync_retry_s, heartbeat_grace_s=config.heartbeat_grace_s,
                                   limits=Limits(max_producers=config.max_producers,
                                                 producer_expiry_s=config.producer_expiry_s,
                                                 min_chunk_size=config.min_chunk_size,
                                                 max_chunk_size=config.max_chunk_size,
                                                 max_key_param_sets=config.max_key_param_sets,
                                                 max_workers_per_principal=config.max_workers_per_principal,
                                                 max_key_param_sets_per_principal=(
                                                     config.max_key_param_sets_per_principal),
                                                 max_keys_per_principal=config.max_keys_per_principal))
        self.lookups = LookupEngine(self.table)
        # Two windows, so that a flood of lookups never pushes a pin or clear id out of /check_finish.
        self.events = EventLog(config.event_window_size, config.event_window_s, clock)
        self.lookup_events = EventLog(config.lookup_window_size, config.event_window_s, clock)
        self.commands_in_flight = 0
        self.router = CommandRouter(self.table, config.command_timeout_s)
        self.metrics = Metrics()
        self.usage = FleetUsage(self.table, self.router, config)  # /usage
        self.feed: Any = None  # the ProducerFeed, once connected (service.py sets it)
        self.kv_events: Any = None  # the KVEventStream, when --kv-events-port is given (service.py sets it)
        self.started_at = time.time()

    # -- glue to the NATS side ---------------------------------------------------------------------------

    def nats_connected(self) -> bool:
        nc = self.router.nc
        return bool(nc is not None and nc.is_connected)

    def sync_requests_sent(self) -> int:
        return self.feed.sync_requests_sent if self.feed is not None else 0

    def sync_requests_limited(self) -> int:
        return self.feed.sync_requests_limited if self.feed is not None else 0

    def bad_messages(self) -> int:
        return self.feed.bad_messages if self.feed is not None else 0

    def forged_messages(self) -> int:
        return self.feed.forged_messages if self.feed is not None else 0

    def instance_conflicts(self) -> int:
        return self.feed.conflicts_reported if self.feed is not None else 0

    def peer_lookups(self, answer: str) -> int:
        """P2P lookups answered with a peer (`answer` "peer") or with none ("none")."""
        return self.feed.peer_lookups[answer] if self.feed is not None else 0

    # -- operations --------------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | np.ndarray,
               key_request: KeyRequest = KeyRequest()) -> tuple[str, dict[str, tuple[str, int]]]:
        started = time.perf_counter()
        layout = self.lookups.lookup(tokens, key_request)
        event_id = self.lookup_events.new("lookup", status="finished")
        self.metrics.lookups += 1
        self.metrics.lookup_hits += bool(layout)
        self.metrics.lookup_seconds.observe(time.perf_counter() - started)
        return event_id, layout

    async def command(self, op: str, instance_id: str, location: str, tokens: list[int],
                      key_request: KeyRequest = KeyRequest(), move_to: str = "",
                      keep_source: bool = True, move_from: str = "") -> CommandResult:
        """pin / unpin / clear / move / prefetch, synchronously: the result carries num_tokens; the event id records the
        outcome. A move copies the instance's chunks of `tokens` from `location` to `move_to` (and, unless
        `keep_source`, they leave `location`: the CPU tier only, a store is shared); with `move_from`, another
        instance, the chunks come from that instance's CPU tier instead, rank for rank (P2P).

        Raises CommandError (with the event id) for unknown instances/locations, timeouts and worker errors,
        TooManyCommands (no event id) past `max_commands` in flight: each one holds its token list until its
        workers answer or time out, so a silent worker must not make that unbounded.
        """
        if self.commands_in_flight >= self.config.max_commands:
            self.metrics.commands[(op, "TooManyCommands")] += 1
            raise TooManyCommands(f"{self.commands_in_flight} pin/unpin/clear/move/prefetch requests are in flight, "
                                  f"the limit (--max-commands {self.config.max_commands}); retry once some are answered")
        event_id = self.events.new(op)
        started = time.perf_counter()
        self.commands_in_flight += 1
        try:
            target = self.router.resolve(instance_id, location)
            peers = None
            if op == "move":
                self.router.resolve(instance_id, move_to)  # it has the target location too
                if move_from:
                    peers = self.router.pair_ranks(self.router.resolve(move_from, LOCAL_CPU), target)
            num_tokens = await self.router.run(op, target, tokens, key_request, move_to, keep_source, peers)
        except ControllerError as exc:
            self.events.fail(event_id, exc.message)
            self.metrics.commands[(op, type(exc).__name__)] += 1
            raise CommandError(exc, event_id) from None
        except Exception as exc:  # a bug: still recorded, still an answer
            self.events.fail(event_id, f"{type(exc).__name__}: {exc}")
            self.metrics.commands[(op, "error")] += 1
            raise
        finally:
            self.commands_in_flight -= 1
        self.events.finish(event_id, num_tokens)
        self.metrics.commands[(op, "ok")] += 1
        self.metrics.command_seconds.observe(time.perf_counter() - started)
        if op == "clear":
            # The lookup right after this reply must not show what was just cleared.
            for producer_id in self.table.mark_cleared(instance_id, target.holders, self.clock()):
                if self.feed is not None:
                    self.feed.request_sync(producer_id, "confirm after clear")
        return CommandResult(event_id, num_tokens)

    async def move(self, source: tuple[str, str], target: tuple[str, str], tokens: list[int], keep_source: bool,
                   key_request: KeyRequest = KeyRequest()) -> CommandResult:
        """LMCache's /move: (instance_id, location) -> (instance_id, location), a copy unless not `keep_source`.

        Between two instances (both with enable_p2p, one sharing domain, the same ranks) the target's workers
        stream the chunks from the source's CPU tier into their `target_location`, rank for rank; unless
        `keep_source` the chunks that arrived then leave the source's CPU tier."""
        (instance_id, location), (target_instance, target_location) = source, target
        if target_instance != instance_id:
            self.router.resolve(instance_id, location)  # an unknown instance or location is named first
            if location != LOCAL_CPU:
                raise Refused(f"a move between instances reads the source's CPU tier ({LOCAL_CPU}), not {location}: "
                              "instances that share a store read each other's chunks from it already")
            moved = await self.command("move", target_instance, LOCAL_CPU, tokens, key_request, target_location,
                                       True, move_from=instance_id)
            if not keep_source and moved.num_tokens:
                await self.command("evict", instance_id, LOCAL_CPU, tokens[:moved.num_tokens], key_request)
            return moved
        if location == target_location:
            raise Refused(f"/move from {location} to itself (instance {instance_id})")
        if not keep_source and location != LOCAL_CPU:
            raise Refused(f"{location} is shared with other instances: moving out of it would remove their "
                          "chunks too; copy instead (should_copy: true)")
        return await self.command("move", instance_id, location, tokens, key_request, target_location, keep_source)

    def check_finish(self, event_id: str) -> EventRecord:
        record = self.events.get(event_id) or self.lookup_events.get(event_id)
        if record is None:
            raise NotFound(f"unknown event_id {event_id!r} (never issued, or older than the window of "
                           f"{self.events.max_events} command / {self.lookup_events.max_events} lookup events, "
                           f"{self.events.max_age_s:g}s)")
        return record

    # -- introspection -----------------------------------------------------------------------------------

    def _workers(self, instance_id: str) -> list[Producer]:
        workers = self.table.workers_of(instance_id)
        if not workers:
            raise NotFound(f"unknown instance {instance_id!r}: no engine worker of it has registered")
        return workers

    def _age(self, producer: Producer) -> float:
        return round(max(0.0, self.clock() - producer.last_seen), 3)

    def _wall(self, moment: float | None) -> float | None:
        """A time of `self.clock` as a Unix time (LMCache reports those)."""
        return None if moment is None else round(time.time() - (self.clock() - moment), 3)

    def worker_info(self, producer: Producer) -> dict[str, Any]:
        reg = producer.engine
        assert reg is not None
        return {
            # LMCache's WorkerInfo fields (no worker port here: the controller reaches workers over NATS)...
            "instance_id": reg.instance_id, "worker_id": reg.rank, "ip": reg.ip or None, "port": None,
            "peer_init_url": reg.peer_endpoint or None, "registration_time": self._wall(producer.registered_at),
            "last_heartbeat_time": self._wall(producer.last_seen),
            # ...and ours.
            "worker_name": producer.producer_id, "host": reg.host or None, "model": reg.model,
            "kv_format": reg.kv_format, "world_size": reg.world_size, "rank": reg.rank,
            "chunk_size": reg.chunk_size, "save_unfull_chunk": reg.save_unfull_chunk,
            "disk_store": reg.disk_store, "remote_stores": list(reg.remote_stores),
            "started_at": reg.started_at, "last_heartbeat_age_s": self._age(producer),
            "alive": producer.alive, "num_keys": self.table.index.count(producer.slot),
            "last_seq": producer.last_seq, "in_sync": not producer.needs_sync,
        }

    def query_worker_info(self, instance_id: str, worker_ids: list[int] | None) -> list[dict[str, Any]]:
        """The workers (ranks) `worker_ids` of an instance (None or []: all of them); instance_id "all" (as in
        LMCache): those ranks of every instance, each instance's workers by rank."""
        if instance_id == ALL_INSTANCES:
            return [self.worker_info(w) for iid in sorted(self.table.instances) for w in self.table.workers_of(iid)
                    if w.engine is not None and (not worker_ids or w.engine.rank in worker_ids)]
        workers = {w.engine.rank: w for w in self._workers(instance_id) if w.engine is not None}
        ranks = sorted(workers) if not worker_ids else worker_ids
        missing = [rank for rank in ranks if rank not in workers]
        if missing:
            raise NotFound(f"instance {instance_id} has no worker(s) {missing}; registered ranks: {sorted(workers)}")
        return [self.worker_info(workers[rank]) for rank in ranks]

    def query_instance(self, ip: str) -> str:
        """The instance whose workers report `ip` (LMCache's /query_instance); with several, the first by id."""
        found = sorted(iid for iid in self.table.instances
                       if any(w.engine is not None and w.engine.ip == ip for w in self.table.workers_of(iid)))
        if not found:
            known = sorted({w.engine.ip for iid in self.table.instances for w in self.table.workers_of(iid)
                            if w.engine is not None and w.engine.ip})
            raise NotFound(f"no registered engine worker reports ip {ip!r}; known: {known[:20]}")
        return found[0]

    def health(self, instance_id: str) -> dict[str, Any]:
        workers = self._workers(instance_id)
        world_size = workers[0].engine.world_size if workers[0].engine else len(workers)
        infos = {w.producer_id: {"rank": w.engine.rank if w.engine else None, "alive": w.alive,
                                 "last_heartbeat_age_s": self._age(w)} for w in workers}
        stores: dict[str, dict[str, Any]] = {}
        for worker in workers:
            for location in (LOCAL_DISK, REMOTE):
                for store_id in self.table.stores_of(worker, location):
                    store = self.table.producer(store_id)
                    stores[store_id] = {"location": location, "registered": store is not None and store.store is not None,
                                        "alive": bool(store is not None and store.alive)}
        # (world_size comes from registrations: bounded like the producers themselves)
        codes = {rank: HEALTH_MISSING for rank in range(min(world_size, self.config.max_producers))}
        codes.update({w.engine.rank if w.engine else i: HEALTH_OK if w.alive else HEALTH_SILENT
                      for i, w in enumerate(workers)})
        return {"instance_id": instance_id, "healthy": not any(codes.values()), "world_size": world_size,
                "error_codes": codes, "workers": infos, "stores": stores}

    def instances(self) -> dict[str, Any]:
        table = self.table
        instances = []
        for instance_id in sorted(table.instances):
            workers = table.workers_of(instance_id)
            locations = [LOCAL_CPU] + [loc for loc in (LOCAL_DISK, REMOTE)
                                       if all(table.stores_of(w, loc) for w in workers)]
            instances.append({"instance_id": instance_id,
                              "alive": all(w.alive for w in workers),
                              "locations": locations,
                              "workers": [self.worker_info(w) for w in workers],
                              # live workers claiming the same instance id and rank, not serving it
                              "duplicate_workers": [self.worker_info(w) for w in table.instance_claims.duplicates_of(instance_id)]})
        stores = [{"store_id": p.producer_id, "location": p.location, "alive": p.alive,
                   "registered": p.store is not None, "num_keys": table.index.count(p.slot),
                   "last_heartbeat_age_s": self._age(p), "in_sync": not p.needs_sync}
                  for p in table.producers.values() if p.engine is None]
        return {"controller_id": self.controller_id, "num_keys": len(table.index),
                "instances": instances, "stores": stores}
