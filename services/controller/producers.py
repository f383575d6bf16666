"""The producer table: every producer the controller knows, its sequence/sync state and liveness.

Pure logic on the controller's event loop: every method takes `now` and returns what the NATS side must do
(which producers to ask for a full sync); `producer_feed.py` feeds it decoded messages and sends the requests.
What a producer is: producer_records.py; who serves an instance id: instance_claims.py; what a principal's
registrations and keys may cost: principal_quotas.py.

Consistency, per producer: batches are numbered 1, 2, 3, ...; the controller applies batch `last_seq + 1`.
A gap (a higher seq, a heartbeat still claiming a higher seq after a grace period, a seq that went back to 1
or below ours: a restarted producer) sets `needs_sync`, and a SyncRequest goes out. A full sync is the
SyncChunk parts of one sync_id, snapshot at seq S; batches with seq > S that arrive while the parts stream
are folded into it, and when the final part arrives the producer's bits become exactly that set.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvmesh.services.controller.holder_index import HolderIndex
from kvmesh.services.controller.instance_claims import InstanceClaims
from kvmesh.services.controller.principal_quotas import Limits, PrincipalQuotas, principal_of
from kvmesh.services.controller.producer_records import IngestStats, Producer, SyncProgress
from kvmesh.shared import protocol
from kvmesh.shared.messaging.sharing_domains import DEFAULT_DOMAIN
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)

MAX_CONCURRENT_SYNCS = 4  # per producer; more means parts are being lost, and older ones are dropped


class ProducerTable:
    """All producers, the instances they form, and the HolderIndex they feed.

    `version` increases whenever something a lookup plan depends on changes (a registration, a producer
    going up or down), so the lookup side can cache its plan and rebuild it only then.
    """

    def __init__(self, index: HolderIndex | None = None, liveness_timeout_s: float = 6.0,
                 sync_retry_s: float = 3.0, heartbeat_grace_s: float = 1.0, limits: Limits = Limits()) -> None:
        self.index = index or HolderIndex()
        self.liveness_timeout_s = liveness_timeout_s
        self.sync_retry_s = sync_retry_s
        self.heartbeat_grace_s = heartbeat_grace_s
        self.producers: dict[str, Producer] = {}
        self._by_slot: dict[int, Producer] = {}  # slot -> its producer (the KV event stream names holders by it)
        self.instance_claims = InstanceClaims(self.producers)
        self._changes = 0
        self.stats = IngestStats()
        self.quotas = PrincipalQuotas(limits, self.producers, self.index, self.stats)
        self._alive_mask = 0
        # told of an admission batch's descriptions (parent, token ids) before its keys are indexed: the KV event
        # stream, when on (kv_event_stream.py); None: they are ignored
        self.on_described: Callable[[Producer, list[list[Any]], list[ChunkKey]], None] | None = None

    # ---------------------------------------------------------------------------------------------------
    # Queries

    @property
    def version(self) -> int:
        return self._changes + self.instance_claims.changes

    @property
    def instances(self) -> dict[str, dict[int, str]]:
        """instance_id -> rank -> the worker_id serving it (`InstanceClaims`)."""
        return self.instance_claims.instances

    @property
    def alive_mask(self) -> int:
        return self._alive_mask

    def producer(self, producer_id: str) -> Producer | None:
        return self.producers.get(producer_id)

    def holder_of(self, slot: int) -> Producer | None:
        """The producer in `slot` (while it is being forgotten too: its keys are released before it leaves)."""
        return self._by_slot.get(slot)

    def workers_of(self, instance_id: str) -> list[Producer]:
        """The registered engine workers of an instance, by rank."""
        ranks = self.instances.get(instance_id, {})
        return [self.producers[ranks[rank]] for rank in sorted(ranks)]

    def stores_of(self, worker: Producer, location: str) -> list[str]:
        """store_ids behind `location` for one engine worker (empty when the location is not configured)."""
        reg = worker.engine
        if reg is None:
            return []
        if location == LOCAL_DISK:
            return [reg.disk_store] if reg.disk_store else []
        if location == REMOTE:
            return list(reg.remote_stores)
        return []

    def _used_by_another_instance(self, store_id: str, instance_id: str) -> bool:
        return any(store_id in self.stores_of(worker, location)
                   for other in self.instances if other != instance_id
                   for worker in self.workers_of(other) for location in (LOCAL_DISK, REMOTE))

    def location_mask(self, worker: Producer, location: str) -> int:
        """Bits of the producers that hold keys 'at `location`' for this worker, alive or not."""
        if location == LOCAL_CPU:
            return 1 << worker.slot
        mask = 0
        for store_id in self.stores_of(worker, location):
            store = self.producers.get(store_id)
            if store is not None:
                mask |= 1 << store.slot
        return mask

    # ---------------------------------------------------------------------------------------------------
    # Registrations

    def _get_or_create(self, producer_id: str, now: float, location: str | None = None) -> Producer:
        producer = self.producers.get(producer_id)
        if producer is None:
            producer = Producer(producer_id=producer_id, slot=self.index.new_slot(), location=location,
                                last_seen=now)
            self.producers[producer_id] = producer
            self._by_slot[producer.slot] = producer
            self._alive_mask |= 1 << producer.slot
            self._changes += 1
        elif producer.location is None and location is not None:
            producer.location = location
        return producer

    def _touch(self, producer: Producer, now: float) -> None:
        producer.last_seen = now
        if not producer.alive:
            producer.alive = True
            self._alive_mask |= 1 << producer.slot
            self._changes += 1
            self.instance_claims.elect_for(producer)
            log.info("producer %s is back", producer.producer_id)

    def _registered(self, producer: Producer, started_at: float, previous_started_at: float | None,
                    now: float) -> None:
        self.stats.registrations += 1
        if previous_started_at is not None and started_at != previous_started_at:
            # A restarted producer numbers its batches from 1 again and may have lost its keys.
            log.info("producer %s restarted; its keys will be rebuilt from its full sync", producer.producer_id)
            producer.last_seq = None
            producer.needs_sync = True
        producer.registered_at = now
        # A registration is always followed by a full sync (AdmissionReporter announces both): count it as
        # a request in flight so the maintenance pass does not ask a second time.
        producer.sync_requested_at = now
        self._touch(producer, now)
        self._changes += 1

    def owner_of(self, producer_id: str, path: str) -> str | None:
        """The path that owns `producer_id` while it is alive when that is not `path` (a registration from
        `path` must then be refused), else None."""
        producer = self.producers.get(producer_id)
        if producer is None or producer.path in (None, path) or not producer.alive:
            return None
        return producer.path

    def sender_is(self, producer_id: str, path: str) -> bool:
        """Whether `path` is the path `producer_id` registered from (its events and heartbeats must be)."""
        producer = self.producers.get(producer_id)
        return producer is not None and producer.path == path

    def room_for(self, reg: protocol.RegisterEngine | protocol.RegisterStore, path: str,
                 now: float) -> tuple[str, str] | None:
        """`PrincipalQuotas.refusal(reg, path)`, after forgetting the principal's own down producers, longest
        silent first, while only its share is in the way (a restarted engine's old incarnations give way to the
        new one)."""
        refused = self.quotas.refusal(reg, path)
        while refused is not None and refused[0].startswith("principal_"):
            oldest = self.quotas.longest_down(path)
            if oldest is None:
                break
            log.info("producer %s (down for %.0fs) forgotten to make room in %s's share", oldest.producer_id,
                     now - oldest.last_seen, principal_of(path))
            self.forget(oldest)
            refused = self.quotas.refusal(reg, path)
        return refused

    def on_register_engine(self, reg: protocol.RegisterEngine, now: float, path: str | None = None,
                           domain: str = DEFAULT_DOMAIN) -> list[str]:
        """Take an engine worker's registration from `path`, whose principal is in sharing domain `domain` (the
        domains map's word, never the message's); returns the live workers claiming its instance id and rank
        when there is more than one (a conflict to report), else []."""
        producer = self._get_or_create(reg.worker_id, now, LOCAL_CPU)
        self.quotas.bind(producer, path)
        self.index.set_ordered(producer.slot, True)  # who serves a P2P hit: the first to admit a key
        producer.domain = domain
        self.quotas.set_spec(producer, reg)
        old = producer.engine
        previous = old.started_at if old is not None else None
        if old is not None and (old.instance_id, old.rank) != (reg.instance_id, reg.rank):
            self.instance_claims.unclaim(old.instance_id, old.rank, reg.worker_id)
        producer.engine, producer.store, producer.location = reg, None, LOCAL_CPU
        self._registered(producer, reg.started_at, previous, now)
        self.instance_claims.claim(reg.instance_id, reg.rank, reg.worker_id, fresh=previous != reg.started_at)
        return self.instance_claims.conflicts(reg.instance_id).get(reg.rank, [])

    def on_register_store(self, reg: protocol.RegisterStore, now: float, path: str | None = None) -> None:
        producer = self._get_or_create(reg.store_id, now, reg.location)
        self.quotas.bind(producer, path)
        self.index.set_ordered(producer.slot, False)
        if producer.engine is not None:  # the id was an engine worker's: it is one no more
            old = producer.engine
            self.quotas.set_spec(producer, None)
            producer.engine = None
            self.instance_claims.unclaim(old.instance_id, old.rank, producer.producer_id)
        previous = producer.store.started_at if producer.store is not None else None
        producer.store, producer.location = reg, reg.location
        self._registered(producer, reg.started_at, previous, now)

    # ---------------------------------------------------------------------------------------------------
    # Events

    def on_batch(self, batch: protocol.AdmissionBatch, now: float) -> bool:
        """Apply one AdmissionBatch; True when the producer should be asked for a full sync now."""
        self.stats.batches += 1
        producer = self._get_or_create(batch.producer_id, now, batch.location)
        self._touch(producer, now)
        seq = batch.seq
        for sync in producer.syncs.values():
            if seq > sync.seq:
                if seq != sync.folded_seq + 1:
                    sync.broken = True
                sync.folded_seq = max(sync.folded_seq, seq)
                sync.keys.difference_update(batch.evicted)
                self.quotas.fold(producer, sync.keys, batch.admitted)
        last = producer.last_seq
        gap = False
        if last is not None and seq <= last:
            if seq > 1:
                return False  # a duplicate or an old batch: already reflected
            gap = True  # seq 1 again: the producer restarted without us seeing its registration
        elif last is not None and seq != last + 1:
            gap = True
        self._apply(producer, batch)
        producer.last_seq = seq
        if gap:
            self.stats.seq_gaps += 1
            log.info("producer %s: batch seq %d after %s; asking for a full sync", producer.producer_id, seq, last)
            producer.needs_sync = True
            producer.sync_requested_at = None
        return self._should_request(producer, now)

    def _apply(self, producer: Producer, batch: protocol.AdmissionBatch) -> None:
        if batch.admitted:
            admitted = self.quotas.admissible(producer, batch.admitted)
            if batch.described and self.on_described is not None:
                self.on_described(producer, batch.described, admitted)
            self.index.admit(producer.slot, admitted)
        if batch.evicted:
            self.index.evict(producer.slot, batch.evicted)

    def on_sync_chunk(self, chunk: protocol.SyncChunk, now: float) -> bool:
        """Take one part of a full sync; True when the producer should be asked for a (new) full sync now."""
        self.stats.sync_parts += 1
        producer = self._get_or_create(chunk.producer_id, now, chunk.location)
        self._touch(producer, now)
        sync = producer.syncs.get(chunk.sync_id)
        if sync is None:
            if chunk.part != 0:
                log.info("producer %s: sync %s joined at part %d; asking again", producer.producer_id,
                         chunk.sync_id, chunk.part)
                return self._sync_failed(producer, now)
            sync = SyncProgress(sync_id=chunk.sync_id, seq=chunk.seq, started_at=now, folded_seq=chunk.seq)
            producer.syncs[chunk.sync_id] = sync
            while len(producer.syncs) > MAX_CONCURRENT_SYNCS:
                del producer.syncs[next(iter(producer.syncs))]
        elif chunk.part != sync.next_part:
            del producer.syncs[chunk.sync_id]
            log.info("producer %s: sync %s part %d after %d; asking again", producer.producer_id,
                     chunk.sync_id, chunk.part, sync.next_part - 1)
            return self._sync_failed(producer, now)
        self.quotas.fold(producer, sync.keys, chunk.keys)
        sync.next_part += 1
        sync.last_part_at = now
        if not chunk.final:
            return False
        del producer.syncs[chunk.sync_id]
        if sync.broken:
            return self._sync_failed(producer, now)
        dropped = self.index.replace(producer.slot, sync.keys)
        self.stats.stale_keys_dropped += dropped
        self.stats.syncs_completed += 1
        producer.syncs_completed += 1
        producer.last_seq = sync.folded_seq
        producer.needs_sync = False
        producer.sync_requested_at = None
        log.info("producer %s: full sync at seq %d: %d keys (%d stale dropped)", producer.producer_id,
                 sync.seq, len(sync.keys), dropped)
        return False

    def _sync_failed(self, producer: Producer, now: float) -> bool:
        self.stats.syncs_broken += 1
        producer.needs_sync = True
        producer.sync_requested_at = None
        return self._should_request(producer, now)

    def on_heartbeat(self, heartbeat: protocol.Heartbeat, now: float) -> bool:
        """Note a heartbeat; True when the producer should be asked for a full sync now."""
        self.stats.heartbeats += 1
        producer = self._get_or_create(heartbeat.producer_id, now)
        self._touch(producer, now)
        last = producer.last_seq
        if last is not None and not producer.needs_sync:
            if heartbeat.last_seq < last:
                log.info("producer %s: heartbeat seq %d below %d (restarted); asking for a full sync",
                         producer.producer_id, heartbeat.last_seq, last)
                producer.needs_sync = True
                producer.sync_requested_at = None
            elif heartbeat.last_seq > last and heartbeat.last_seq > producer.claimed_seq:
                # Heartbeats and batches arrive on different subscriptions (no order between them), and a
                # heartbeat may name a batch still in flight: judge the claim after a grace period.
                producer.claimed_seq, producer.claimed_at = heartbeat.last_seq, now
        return self._should_request(producer, now)

    # ---------------------------------------------------------------------------------------------------
    # Time

    def _should_request(self, producer: Producer, now: float) -> bool:
        """Whether to send a SyncRequest now (and if so, note it as sent)."""
        if not producer.needs_sync or not producer.alive:
            return False
        if producer.sync_requested_at is not None and now - producer.sync_requested_at < self.sync_retry_s:
            return False
        if any(now - s.last_part_at < self.sync_retry_s for s in producer.syncs.values()):
            return False  # one is streaming in
        producer.sync_requested_at = now
        return True

    def forget(self, producer: Producer) -> None:
        """Drop a producer: its keys, its registration and its slot (reused by the next new producer)."""
        del self.producers[producer.producer_id]
        if producer.engine is not None:
            self.instance_claims.unclaim(producer.engine.instance_id, producer.engine.rank, producer.producer_id)
        self.quotas.forget(producer)
        self._alive_mask &= ~(1 << producer.slot)
        self.index.release_slot(producer.slot)
        del self._by_slot[producer.slot]
        self.stats.producers_forgotten += 1
        self._changes += 1

    def tick(self, now: float) -> list[str]:
        """Periodic pass: liveness, expiry, heartbeat claims, sync retries. Returns producer_ids to ask for a sync."""
        to_sync: list[str] = []
        # Down for long enough: forgotten, so dead producers never hold slots (and widen every mask) for good.
        for producer in [p for p in self.producers.values()
                         if not p.alive and now - p.last_seen > self.quotas.limits.producer_expiry_s]:
            log.warning("producer %s down for %.0fs: forgotten (%d keys dropped); it registers again if it returns",
                        producer.producer_id, now - producer.last_seen, self.index.count(producer.slot))
            self.forget(producer)
        for producer in self.producers.values():
            if producer.alive and now - producer.last_seen > self.liveness_timeout_s:
                producer.alive = False
                self._alive_mask &= ~(1 << producer.slot)
                self._changes += 1
                self.instance_claims.elect_for(producer)
                log.warning("producer %s silent for %.1fs: marked down; its keys leave lookups until it returns",
                            producer.producer_id, now - producer.last_seen)
            if producer.claimed_seq:
                if producer.last_seq is not None and producer.last_seq >= producer.claimed_seq:
                    producer.claimed_seq = 0
                elif now - producer.claimed_at >= self.heartbeat_grace_s:
                    log.info("producer %s: heartbeat claimed seq %d, we have %s; asking for a full sync",
                             producer.producer_id, producer.claimed_seq, producer.last_seq)
                    self.stats.seq_gaps += 1
                    producer.claimed_seq = 0
                    producer.needs_sync = True
                    producer.sync_requested_at = None
            for sync_id in [s.sync_id for s in producer.syncs.values()
                            if now - max(s.last_part_at, s.started_at) > self.sync_retry_s]:
                del producer.syncs[sync_id]  # its remaining parts were lost
                producer.needs_sync = True
            if self._should_request(producer, now):
                to_sync.append(producer.producer_id)
        return to_sync

    def mark_cleared(self, instance_id: str, producer_ids: list[str], now: float) -> list[str]:
        """After a successful clear by `instance_id`: drop these producers' keys now, so a lookup right after
        the reply is already empty, and return those to ask for a confirming full sync (a store may keep some
        keys, e.g. pinned ones; the sync restores exactly what it still holds).

        A store another instance also uses is left alone: its clear took back this instance's claims only, and
        what it forgot arrives as its evictions (within its flush interval), while the rest stays listed.
        """
        to_sync: list[str] = []
        for producer_id in producer_ids:
            producer = self.producers.get(producer_id)
            if producer is None or self._used_by_another_instance(producer_id, instance_id):
                continue
            self.index.clear_slot(producer.slot)
            producer.needs_sync = True
            producer.sync_requested_at = None
            if self._should_request(producer, now):
                to_sync.append(producer_id)
        return to_sync
