"""GET /usage: chunks, bytes, pins, hits, evictions and refused retentions per instance (and worker), tier, store
and sharing domain.

Two sources, kept apart in the answer:
  - the holder index: `num_chunks`, the chunks each producer holds as the controller applied its admissions.
    Always there, no network; it lags a producer by its flush interval, and misses what a full sync has not
    brought back yet.
  - each producer's own figures (`TierUsage`, shared/protocol/usage.py), asked on its health subject when /usage
    is asked (only the principal at that path answers there, services/controller NATS permissions): bytes,
    capacity, pins, reads that hit, evictions, and its own chunk count (`reported_chunks`). Admissions carry
    keys, never sizes or pins, so these are the only honest source of them.

A module (a tier of an instance, of a sharing domain, or one store) sums its producers' figures only when every
one of them answered (`reporting` == `producers`); otherwise those figures are null: a partial sum would read as
a smaller fleet. `num_chunks` is always the index's. A store-backed module of an instance or a domain is the
stores' totals (`shared`: true), chunks of every instance using them, never split.

Bounds: the answer lists at most every producer the controller knows (`--max-producers`), like /instances; one
/usage asks each live producer it reports on once, for `--usage-timeout` at most, and `--max-usage-requests` of
them run at once (more are 429).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

from kvmesh.services.controller.commands import CommandRouter
from kvmesh.services.controller.config import ControllerConfig
from kvmesh.services.controller.errors import NotFound, TooManyCommands
from kvmesh.services.controller.producer_records import Producer
from kvmesh.services.controller.producers import ProducerTable
from kvmesh.shared import protocol
from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.messaging import bus
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE, TierUsage

# LMCache's tier words: L1 is an instance's own memory, L2 what lies below it (here: the disk and remote stores).
TIER_OF = {LOCAL_CPU: "l1", LOCAL_DISK: "l2", REMOTE: "l2"}
STORE_LOCATIONS = (LOCAL_DISK, REMOTE)
SUMMED = ("used_bytes", "capacity_bytes", "pinned_chunks", "hits", "evictions", "retains_refused")


def _total(usages: list[TierUsage]) -> TierUsage:
    return TierUsage(**{name: sum(getattr(u, name) for u in usages) for name in TierUsage.__dataclass_fields__})


class FleetUsage:
    """Answers /usage from the producer table and the producers' own figures."""

    def __init__(self, table: ProducerTable, router: CommandRouter, config: ControllerConfig) -> None:
        self.table = table
        self.router = router
        self.timeout_s = config.usage_timeout_s
        self.max_in_flight = config.max_usage_requests
        self.in_flight = 0

    async def answer(self, instance_id: str | None = None, location: str | None = None) -> dict[str, Any]:
        """The /usage body, for one instance or all, one location or all (the caller checked `location`)."""
        if self.in_flight >= self.max_in_flight:
            raise TooManyCommands(f"{self.in_flight} /usage requests are in flight, the limit "
                                  f"(--max-usage-requests {self.max_in_flight}); retry once some are answered")
        self.in_flight += 1
        try:
            return await self._answer(instance_id, location)
        finally:
            self.in_flight -= 1

    async def _answer(self, instance_id: str | None, location: str | None) -> dict[str, Any]:
        table = self.table
        if instance_id is not None and not table.workers_of(instance_id):
            raise NotFound(f"unknown instance {instance_id!r}: no engine worker of it has registered")
        instance_ids = [instance_id] if instance_id is not None else sorted(table.instances)
        workers = {iid: table.workers_of(iid) for iid in instance_ids}
        if instance_id is not None:  # the stores this instance uses
            stores = [table.producers[s] for s in self._store_ids(workers[instance_id], STORE_LOCATIONS)
                      if s in table.producers]
        else:  # every store, registered or only heard of (as /instances lists them)
            stores = [p for p in table.producers.values() if p.engine is None]
        stores = [s for s in stores if location is None or s.location == location]
        asked = [*(w for ws in workers.values() for w in ws if location in (None, LOCAL_CPU)), *stores]
        usages = await self._ask(asked)
        domains: dict[str, list[str]] = {}
        for iid in instance_ids:
            domains.setdefault(workers[iid][0].domain, []).append(iid)
        return {
            "instances": [{"instance_id": iid, "registered": True, "alive": all(w.alive for w in workers[iid]),
                           "domain": workers[iid][0].domain,
                           "modules": self._modules(workers[iid], usages, location),
                           "workers": [self._worker(w, usages) for w in workers[iid]]
                           if location in (None, LOCAL_CPU) else []}
                          for iid in instance_ids],
            "shared_modules": [{"tier": TIER_OF.get(s.location or "", "l2"), "backend": s.location, "shared": True,
                                "store_id": s.producer_id, "alive": s.alive, "registered": s.store is not None,
                                **self._figures([s], usages)} for s in stores],
            "domains": [{"domain": domain, "instance_ids": ids,
                         "modules": self._modules([w for iid in ids for w in workers[iid]], usages, location)}
                        for domain, ids in sorted(domains.items())],
        }

    # -- the producers' own figures ------------------------------------------------------------------------

    async def _ask(self, producers: list[Producer]) -> dict[str, TierUsage]:
        """producer_id -> its figures, for the live producers that answered within the timeout."""
        nc = self.router.nc
        live = [p for p in producers if p.alive and p.path is not None]
        if nc is None or not nc.is_connected or not live:
            return {}
        answers = await asyncio.gather(*(self._ask_one(nc, p) for p in live))
        return {p.producer_id: usage for p, usage in zip(live, answers) if usage is not None}

    async def _ask_one(self, nc: Any, producer: Producer) -> TierUsage | None:
        assert producer.path is not None
        try:
            reply = await bus.request(nc, protocol.Subjects.health(producer.path), protocol.HealthRequest(),
                                      protocol.HealthReply, self.timeout_s)
        except KVMeshError:  # down, slow, or not speaking the protocol: reported without its figures
            return None
        if reply.service_id != producer.producer_id:
            return None
        return TierUsage.from_details(reply.details)

    # -- building the answer -------------------------------------------------------------------------------

    def _store_ids(self, workers: Iterable[Producer], locations: Iterable[str]) -> list[str]:
        ids: dict[str, None] = {}
        for location in locations:
            for worker in workers:
                ids.update(dict.fromkeys(self.table.stores_of(worker, location)))
        return list(ids)

    def _modules(self, workers: list[Producer], usages: dict[str, TierUsage],
                 location: str | None) -> list[dict[str, Any]]:
        """The CPU tier of `workers` (summed), then each store location they use (the stores' totals)."""
        modules = []
        if location in (None, LOCAL_CPU):
            modules.append({"tier": TIER_OF[LOCAL_CPU], "backend": LOCAL_CPU, "shared": False, "store_ids": [],
                            **self._figures(workers, usages)})
        for store_location in STORE_LOCATIONS:
            if location not in (None, store_location):
                continue
            ids = self._store_ids(workers, [store_location])
            if ids:
                known = [self.table.producers[s] for s in ids if s in self.table.producers]
                modules.append({"tier": TIER_OF[store_location], "backend": store_location, "shared": True,
                                "store_ids": ids, **self._figures(known, usages, unknown=len(ids) - len(known))})
        return modules

    def _worker(self, worker: Producer, usages: dict[str, TierUsage]) -> dict[str, Any]:
        assert worker.engine is not None
        return {"worker_id": worker.producer_id, "rank": worker.engine.rank, "alive": worker.alive,
                **self._figures([worker], usages)}

    def _figures(self, producers: list[Producer], usages: dict[str, TierUsage], unknown: int = 0) -> dict[str, Any]:
        """The index's chunk count of `producers`, and their own figures summed when all of them (and no
        `unknown` one: a store a registration names that never registered) answered, else nulls."""
        reported = [usages[p.producer_id] for p in producers if p.producer_id in usages]
        complete = bool(producers) and not unknown and len(reported) == len(producers)
        total = _total(reported) if complete else None
        figures: dict[str, Any] = {"producers": len(producers) + unknown, "reporting": len(reported),
                                   "num_chunks": sum(self.table.index.count(p.slot) for p in producers),
                                   "reported_chunks": total.num_chunks if total else None}
        figures.update({name: getattr(total, name) if total else None for name in SUMMED})
        figures["usage_ratio"] = (round(total.used_bytes / total.capacity_bytes, 6)
                                  if total and total.capacity_bytes else None)
        return figures
