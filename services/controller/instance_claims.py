"""Instance ids: which engine workers claim each instance id and rank, and which one serves it.

An *instance* is the set of engine workers sharing an `instance_id`, one per rank. Several live workers may claim
the same instance id and rank (vLLM replicas started with the same, usually the default, lmcache_instance_id;
each engine process has its own worker_id). They are never merged: the instance id is served (lookups, commands,
health) by one claimant per rank, the latest registered of the live ones (so a restarted engine takes over from
its silent predecessor at once), and `conflicts()` reports the others.
"""

from __future__ import annotations

from kvmesh.services.controller.producer_records import Producer


class InstanceClaims:
    """Claimants and the serving worker of every instance id and rank, over the producer table's `producers`.

    `changes` counts the times a serving worker changed (the table's `version` includes it: lookup plans depend
    on who serves).
    """

    def __init__(self, producers: dict[str, Producer]) -> None:
        self._producers = producers
        self.instances: dict[str, dict[int, str]] = {}  # instance_id -> rank -> the worker_id serving it
        self.claims: dict[str, dict[int, list[str]]] = {}  # instance_id -> rank -> claimants, latest last
        self.changes = 0

    def claim(self, instance_id: str, rank: int, worker_id: str, fresh: bool) -> None:
        """`worker_id` claims `instance_id`'s `rank`; a new or restarted claimant goes last (the latest)."""
        claimants = self.claims.setdefault(instance_id, {}).setdefault(rank, [])
        if worker_id in claimants and fresh:
            claimants.remove(worker_id)
        if worker_id not in claimants:
            claimants.append(worker_id)
        self.elect(instance_id, rank)

    def unclaim(self, instance_id: str, rank: int, worker_id: str) -> None:
        ranks = self.claims.get(instance_id, {})
        claimants = ranks.get(rank, [])
        if worker_id in claimants:
            claimants.remove(worker_id)
            if not claimants:
                del ranks[rank]
                if not ranks:
                    del self.claims[instance_id]
        self.elect(instance_id, rank)

    def elect(self, instance_id: str, rank: int) -> None:
        """Serve `instance_id`'s `rank` from its latest live claimant (else its latest claimant)."""
        claimants = self.claims.get(instance_id, {}).get(rank, [])
        live = [w for w in claimants if self._producers[w].alive]
        serving = (live or claimants or [None])[-1]
        ranks = self.instances.get(instance_id, {})
        if ranks.get(rank) == serving:
            return
        if serving is None:
            del ranks[rank]
            if not ranks:
                del self.instances[instance_id]
        else:
            self.instances.setdefault(instance_id, {})[rank] = serving
        self.changes += 1

    def elect_for(self, producer: Producer) -> None:
        """Elect again for the rank `producer` claims (it went up or down), if it is an engine worker."""
        if producer.engine is not None:
            self.elect(producer.engine.instance_id, producer.engine.rank)

    def conflicts(self, instance_id: str) -> dict[int, list[str]]:
        """rank -> its live claimants, for every rank of `instance_id` that more than one live worker claims."""
        found: dict[int, list[str]] = {}
        for rank, claimants in self.claims.get(instance_id, {}).items():
            live = [w for w in claimants if self._producers[w].alive]
            if len(live) > 1:
                found[rank] = live
        return found

    def duplicates_of(self, instance_id: str) -> list[Producer]:
        """The live workers claiming `instance_id` that do not serve it (a conflict), by rank."""
        serving = set(self.instances.get(instance_id, {}).values())
        return [self._producers[w] for rank, live in sorted(self.conflicts(instance_id).items())
                for w in live if w not in serving]
