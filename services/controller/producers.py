"""Producers and instances as the controller knows them: registrations, sequence/sync state, liveness.

Pure logic on the controller's event loop: every method takes `now` and returns what the NATS side must do
(which producers to ask for a full sync); `producer_feed.py` feeds it decoded messages and sends the requests.

A *producer* is an engine worker (one per vLLM rank; its CPU tier, location LocalCPUBackend) or a store
(LocalDiskBackend / RemoteBackend), named by `producer_id` (worker_id or store_id). Each owns one slot of the
HolderIndex. An *instance* is the set of engine workers sharing an `instance_id`, one per rank.

Several live workers may claim the same instance id and rank (vLLM replicas started with the same, usually the
default, lmcache_instance_id; each engine process has its own worker_id). They are never merged: the instance id
is served (lookups, commands, health) by one claimant per rank, the latest registered of the live ones (so a
restarted engine takes over from its silent predecessor at once), and `conflicts()` reports the others.

Quotas per principal (`engine.<instance>` or `store.<id>`: the producer path's first two tokens, which the NATS
permissions bind to one user): every table a registration grows is bounded globally (`Limits.max_producers`,
`max_key_param_sets`) and per principal (`max_workers_per_principal`, `max_key_param_sets_per_principal`), and
the command line keeps each share at most half its global bound, so one principal filling its share never
refuses another. A principal at its share makes room by forgetting its own down workers first (a restarted
engine's old incarnations), never anyone else's. The other tables keyed by what a principal sends (instance ids,
ranks, claimants) have one entry per worker, so the worker share bounds them too. The holder index and the full
syncs being received grow with the keys a principal's producers report: at most `max_keys_per_principal` keys
each (its producers' held keys together; each sync buffer at most that), admissions past it dropped and counted
(`keys_refused`), so a lookup may miss them, never crediting a key nobody reported.

Consistency, per producer: batches are numbered 1, 2, 3, ...; the controller applies batch `last_seq + 1`.
A gap (a higher seq, a heartbeat still claiming a higher seq after a grace period, a seq that went back to 1
or below ours: a restarted producer) sets `needs_sync`, and a SyncRequest goes out. A full sync is the
SyncChunk parts of one sync_id, snapshot at seq S; batches with seq > S that arrive while the parts stream
are folded into it, and when the final part arrives the producer's bits become exactly that set.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Collection

from kvmesh.shared import protocol
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE
from kvmesh.services.controller.holder_index import HolderIndex
from kvmesh.shared.credentials import DEFAULT_DOMAIN
from kvmesh.shared.keys import ChunkKey, KeyParams

log = logging.getLogger(__name__)

MAX_HOST_LEN = 255  # a DNS name's limit: longer host / ip fields in a registration are refused
MAX_CONCURRENT_SYNCS = 4  # per producer; more means parts are being lost, and older ones are dropped

KeySpec = tuple[KeyParams, int, bool]  # (params, chunk_size, save_unfull_chunk): one ChunkHasher per lookup


def key_spec(reg: protocol.RegisterEngine) -> KeySpec:
    """How a worker's chunk keys are made: lookups hash the tokens once per distinct spec."""
    return (reg.key_params(), reg.chunk_size, reg.save_unfull_chunk)


@dataclass(frozen=True)
class Limits:
    """What registrations may cost the controller (docs/config.md, `ControllerConfig`)."""

    max_producers: int = 4096
    producer_expiry_s: float = 600.0
    min_chunk_size: int = 16
    max_chunk_size: int = 65536
    max_key_param_sets: int = 128
    max_workers_per_principal: int = 256
    max_key_param_sets_per_principal: int = 64
    max_keys_per_principal: int = 4_000_000


def principal_of(path: str) -> str:
    """The principal (`engine.<instance>` / `store.<id>`) of a producer path `role.<owner>.<producer>`."""
    return path.rsplit(".", 1)[0]


@dataclass
class PrincipalUsage:
    """What one principal's registrations hold in the controller's tables (its quotas count these)."""

    producers: set[str] = field(default_factory=set)
    key_specs: Counter[KeySpec] = field(default_factory=Counter)  # spec -> its engine workers with it


@dataclass
class SyncProgress:
    """One full sync being received: keys so far (plus folded later batches), and where it stands."""

    sync_id: str
    seq: int  # the producer's batch seq the snapshot reflects
    started_at: float
    keys: set[ChunkKey] = field(default_factory=set)
    next_part: int = 0
    folded_seq: int = 0  # highest batch seq folded in (starts at `seq`)
    broken: bool = False  # a part or a later batch went missing: the result cannot be trusted
    last_part_at: float = 0.0


@dataclass
class Producer:
    """What the controller knows of one producer. `engine`/`store` hold its latest registration."""

    producer_id: str
    slot: int
    location: str | None = None
    path: str | None = None  # the producer path its registration came from: its other messages must too
    domain: str = DEFAULT_DOMAIN  # an engine worker's sharing domain: its principal's, in the domains map
    engine: protocol.RegisterEngine | None = None
    store: protocol.RegisterStore | None = None
    registered_at: float | None = None
    last_seen: float = 0.0
    alive: bool = True
    last_seq: int | None = None  # None: nothing trustworthy yet, a sync is needed
    needs_sync: bool = True
    sync_requested_at: float | None = None
    syncs: dict[str, SyncProgress] = field(default_factory=dict)
    claimed_seq: int = 0  # highest last_seq a heartbeat claimed that we had not seen yet
    claimed_at: float = 0.0
    syncs_completed: int = 0

    @property
    def kind(self) -> str:
        if self.engine is not None:
            return "engine"
        if self.store is not None:
            return "store"
        return "unregistered"


@dataclass
class IngestStats:
    batches: int = 0
    sync_parts: int = 0
    heartbeats: int = 0
    registrations: int = 0
    seq_gaps: int = 0
    syncs_completed: int = 0
    syncs_broken: int = 0
    stale_keys_dropped: int = 0
    producers_forgotten: int = 0
    keys_refused: int = 0  # admitted keys dropped past --max-keys-per-principal
    registrations_refused: Counter[str] = field(default_factory=Counter)  # reason -> count


class ProducerTable:
    """All producers, the instances they form, and the HolderIndex they feed.

    `version` increases whenever something a lookup plan depends on changes (a registration, a producer
    going up or down), so the lookup side can cache its plan and rebuild it only then.
    """

    def __init__(self, index: HolderIndex | None = None, liveness_timeout_s: float = 6.0,
                 sync_retry_s: float = 3.0, heartbeat_grace_s: float = 1.0, limits: Limits = Limits()) -> None:
        self.index = index or HolderIndex()
        self.limits = limits
        self.liveness_timeout_s = liveness_timeout_s
        self.sync_retry_s = sync_retry_s
        self.heartbeat_grace_s = heartbeat_grace_s
        self.producers: dict[str, Producer] = {}
        self.instances: dict[str, dict[int, str]] = {}  # instance_id -> rank -> the worker_id serving it
        self.claims: dict[str, dict[int, list[str]]] = {}  # instance_id -> rank -> claimants, latest last
        self.version = 0
        self.stats = IngestStats()
        self._alive_mask = 0
        self.key_specs: Counter[KeySpec] = Counter()  # spec -> engine workers registered with it
        self.usage: dict[str, PrincipalUsage] = {}  # principal -> what its producers hold
        self._keys_refused_logged_at = -math.inf

    # ---------------------------------------------------------------------------------------------------
    # Queries

    @property
    def alive_mask(self) -> int:
        return self._alive_mask

    def producer(self, producer_id: str) -> Producer | None:
        return self.producers.get(producer_id)

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
            self._alive_mask |= 1 << producer.slot
            self.version += 1
        elif producer.location is None and location is not None:
            producer.location = location
        return producer

    def _touch(self, producer: Producer, now: float) -> None:
        producer.last_seen = now
        if not producer.alive:
            producer.alive = True
            self._alive_mask |= 1 << producer.slot
            self.version += 1
            self._elect_for(producer)
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
        self.version += 1

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

    def refusal(self, reg: protocol.RegisterEngine | protocol.RegisterStore,
                path: str | None = None) -> tuple[str, str] | None:
        """(reason, message) when a registration from producer path `path` must be refused for a limit it would
        pass, else None. The per-principal shares are checked before the global bounds they protect."""
        limits = self.limits
        producer_id = reg.worker_id if isinstance(reg, protocol.RegisterEngine) else reg.store_id
        known = self.producers.get(producer_id)
        usage = self.usage.get(principal_of(path)) if path is not None else None
        mine = usage is not None and producer_id in usage.producers
        if usage is not None and not mine and len(usage.producers) >= limits.max_workers_per_principal:
            return "principal_producers", (
                f"registration of {producer_id!r}: {principal_of(path or '')} has {len(usage.producers)} producers "
                f"registered, its share (--max-workers-per-principal {limits.max_workers_per_principal})")
        if known is None and len(self.producers) >= limits.max_producers:
            return "max_producers", (f"registration of {producer_id!r}: {len(self.producers)} producers are known, "
                                     f"the limit (--max-producers {limits.max_producers})")
        if not isinstance(reg, protocol.RegisterEngine):
            return None
        if len(reg.host) > MAX_HOST_LEN or len(reg.ip) > MAX_HOST_LEN:
            return "host", (f"registration of {producer_id!r}: host or ip longer than {MAX_HOST_LEN} characters")
        if not limits.min_chunk_size <= reg.chunk_size <= limits.max_chunk_size:
            return "chunk_size", (f"registration of {producer_id!r}: chunk_size {reg.chunk_size} is outside "
                                  f"[{limits.min_chunk_size}, {limits.max_chunk_size}] (--min/--max-chunk-size)")
        spec = key_spec(reg)
        old_spec = key_spec(known.engine) if known is not None and known.engine is not None else None
        if usage is not None and spec not in usage.key_specs:
            held = len(usage.key_specs) - (mine and old_spec is not None and usage.key_specs[old_spec] == 1)
            if held >= limits.max_key_param_sets_per_principal:
                return "principal_key_param_sets", (
                    f"registration of {producer_id!r}: {principal_of(path or '')} has {len(usage.key_specs)} "
                    f"distinct key parameter sets registered, its share "
                    f"(--max-key-param-sets-per-principal {limits.max_key_param_sets_per_principal})")
        specs = len(self.key_specs)
        if old_spec is not None and self.key_specs[old_spec] == 1:
            specs -= 1  # its own old spec goes away with this registration
        if spec not in self.key_specs and specs >= limits.max_key_param_sets:
            return "key_param_sets", (f"registration of {producer_id!r}: {len(self.key_specs)} distinct key "
                                      f"parameter sets are registered, the limit "
                                      f"(--max-key-param-sets {limits.max_key_param_sets})")
        return None

    def room_for(self, reg: protocol.RegisterEngine | protocol.RegisterStore, path: str,
                 now: float) -> tuple[str, str] | None:
        """`refusal(reg, path)`, after forgetting the principal's own down producers, longest silent first, while
        only its share is in the way (a restarted engine's old incarnations give way to the new one)."""
        refused = self.refusal(reg, path)
        while refused is not None and refused[0].startswith("principal_"):
            usage = self.usage[principal_of(path)]
            down = [p for p in map(self.producers.__getitem__, usage.producers) if not p.alive]
            if not down:
                break
            oldest = min(down, key=lambda p: p.last_seen)
            log.info("producer %s (down for %.0fs) forgotten to make room in %s's share", oldest.producer_id,
                     now - oldest.last_seen, principal_of(path))
            self.forget(oldest)
            refused = self.refusal(reg, path)
        return refused

    def _bind(self, producer: Producer, path: str | None) -> None:
        """Count `producer` in the share of `path`'s principal (and out of its previous one's)."""
        if producer.path == path:
            return
        if producer.path is not None:
            self._usage_of(producer).producers.discard(producer.producer_id)
            self._count_spec(producer, producer.engine, -1)
            self._drop_unused(producer.path)
        producer.path = path
        if path is not None:
            self.usage.setdefault(principal_of(path), PrincipalUsage()).producers.add(producer.producer_id)
            self._count_spec(producer, producer.engine, +1)

    def _usage_of(self, producer: Producer) -> PrincipalUsage:
        assert producer.path is not None
        return self.usage.setdefault(principal_of(producer.path), PrincipalUsage())

    def _drop_unused(self, path: str) -> None:
        principal = principal_of(path)
        usage = self.usage.get(principal)
        if usage is not None and not usage.producers:
            del self.usage[principal]

    def _count_spec(self, producer: Producer, reg: protocol.RegisterEngine | None, delta: int) -> None:
        """Add `delta` to the principal's count of `reg`'s key spec (a producer without a path counts nowhere)."""
        if reg is None or producer.path is None:
            return
        specs = self._usage_of(producer).key_specs
        spec = key_spec(reg)
        specs[spec] += delta
        if specs[spec] <= 0:
            del specs[spec]

    def _set_spec(self, producer: Producer, reg: protocol.RegisterEngine | None) -> None:
        self._set_spec_of(producer.engine, reg)
        self._count_spec(producer, producer.engine, -1)
        self._count_spec(producer, reg, +1)

    def _set_spec_of(self, old_reg: protocol.RegisterEngine | None, reg: protocol.RegisterEngine | None) -> None:
        if old_reg is not None:
            old = key_spec(old_reg)
            self.key_specs[old] -= 1
            if not self.key_specs[old]:
                del self.key_specs[old]
        if reg is not None:
            self.key_specs[key_spec(reg)] += 1

    def on_register_engine(self, reg: protocol.RegisterEngine, now: float, path: str | None = None,
                           domain: str = DEFAULT_DOMAIN) -> list[str]:
        """Take an engine worker's registration from `path`, whose principal is in sharing domain `domain` (the
        domains map's word, never the message's); returns the live workers claiming its instance id and rank
        when there is more than one (a conflict to report), else []."""
        producer = self._get_or_create(reg.worker_id, now, LOCAL_CPU)
        self._bind(producer, path)
        self.index.set_ordered(producer.slot, True)  # who serves a P2P hit: the first to admit a key
        producer.domain = domain
        self._set_spec(producer, reg)
        old = producer.engine
        previous = old.started_at if old is not None else None
        if old is not None and (old.instance_id, old.rank) != (reg.instance_id, reg.rank):
            self._unclaim(old.instance_id, old.rank, reg.worker_id)
        producer.engine, producer.store, producer.location = reg, None, LOCAL_CPU
        self._registered(producer, reg.started_at, previous, now)
        self._claim(reg.instance_id, reg.rank, reg.worker_id, fresh=previous != reg.started_at)
        return self.conflicts(reg.instance_id).get(reg.rank, [])

    def on_register_store(self, reg: protocol.RegisterStore, now: float, path: str | None = None) -> None:
        producer = self._get_or_create(reg.store_id, now, reg.location)
        self._bind(producer, path)
        self.index.set_ordered(producer.slot, False)
        if producer.engine is not None:  # the id was an engine worker's: it is one no more
            old = producer.engine
            self._set_spec(producer, None)
            producer.engine = None
            self._unclaim(old.instance_id, old.rank, producer.producer_id)
        previous = producer.store.started_at if producer.store is not None else None
        producer.store, producer.location = reg, reg.location
        self._registered(producer, reg.started_at, previous, now)

    # ---------------------------------------------------------------------------------------------------
    # Instance ids: who claims them, who serves them

    def _claim(self, instance_id: str, rank: int, worker_id: str, fresh: bool) -> None:
        """`worker_id` claims `instance_id`'s `rank`; a new or restarted claimant goes last (the latest)."""
        claimants = self.claims.setdefault(instance_id, {}).setdefault(rank, [])
        if worker_id in claimants and fresh:
            claimants.remove(worker_id)
        if worker_id not in claimants:
            claimants.append(worker_id)
        self._elect(instance_id, rank)

    def _unclaim(self, instance_id: str, rank: int, worker_id: str) -> None:
        ranks = self.claims.get(instance_id, {})
        claimants = ranks.get(rank, [])
        if worker_id in claimants:
            claimants.remove(worker_id)
            if not claimants:
                del ranks[rank]
                if not ranks:
                    del self.claims[instance_id]
        self._elect(instance_id, rank)

    def _elect(self, instance_id: str, rank: int) -> None:
        """Serve `instance_id`'s `rank` from its latest live claimant (else its latest claimant)."""
        claimants = self.claims.get(instance_id, {}).get(rank, [])
        live = [w for w in claimants if self.producers[w].alive]
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
        self.version += 1

    def _elect_for(self, producer: Producer) -> None:
        if producer.engine is not None:
            self._elect(producer.engine.instance_id, producer.engine.rank)

    def conflicts(self, instance_id: str) -> dict[int, list[str]]:
        """rank -> its live claimants, for every rank of `instance_id` that more than one live worker claims."""
        found: dict[int, list[str]] = {}
        for rank, claimants in self.claims.get(instance_id, {}).items():
            live = [w for w in claimants if self.producers[w].alive]
            if len(live) > 1:
                found[rank] = live
        return found

    def duplicates_of(self, instance_id: str) -> list[Producer]:
        """The live workers claiming `instance_id` that do not serve it (a conflict), by rank."""
        serving = set(self.instances.get(instance_id, {}).values())
        return [self.producers[w] for rank, live in sorted(self.conflicts(instance_id).items())
                for w in live if w not in serving]

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
                self._fold(producer, sync.keys, batch.admitted)
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
            room = self._key_room(producer, include_own=True)
            admitted = batch.admitted if len(batch.admitted) <= room else self._refuse_keys(
                producer, batch.admitted, room)
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
        self._fold(producer, sync.keys, chunk.keys)
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

    def _key_room(self, producer: Producer, include_own: bool) -> int:
        """How many more keys `producer` may report under its principal's `max_keys_per_principal`: counting its
        own held keys (a batch adds to them) or not (a full sync replaces them). Unbounded without a path."""
        if producer.path is None:
            return self.limits.max_keys_per_principal
        held = sum(self.index.count(other.slot) for pid in self._usage_of(producer).producers
                   if (other := self.producers.get(pid)) is not None and (include_own or other is not producer))
        return max(0, self.limits.max_keys_per_principal - held)

    def _fold(self, producer: Producer, keys: set[ChunkKey], new: Collection[ChunkKey]) -> None:
        """Add `new` to a sync's `keys`, up to the principal's room for a sync of this producer."""
        room = self._key_room(producer, include_own=False) - len(keys)
        if len(new) <= room:
            keys.update(new)
        else:
            keys.update(self._refuse_keys(producer, list(new), room))

    def _refuse_keys(self, producer: Producer, keys: list[ChunkKey], room: int) -> list[ChunkKey]:
        """The first `room` of `keys`; the rest are dropped, counted and logged (at most once a minute)."""
        room = max(0, room)
        self.stats.keys_refused += len(keys) - room
        now = time.monotonic()
        if now - self._keys_refused_logged_at >= 60.0:
            self._keys_refused_logged_at = now
            log.warning("producer %s: %s reports more than --max-keys-per-principal %d keys; the rest are not "
                        "indexed (lookups miss them)", producer.producer_id, principal_of(producer.path or ""),
                        self.limits.max_keys_per_principal)
        return keys[:room]

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
            self._unclaim(producer.engine.instance_id, producer.engine.rank, producer.producer_id)
            self._set_spec_of(producer.engine, None)
        self._bind(producer, None)  # (its spec leaves its principal's count here)
        self._alive_mask &= ~(1 << producer.slot)
        self.index.release_slot(producer.slot)
        self.stats.producers_forgotten += 1
        self.version += 1

    def tick(self, now: float) -> list[str]:
        """Periodic pass: liveness, expiry, heartbeat claims, sync retries. Returns producer_ids to ask for a sync."""
        to_sync: list[str] = []
        # Down for long enough: forgotten, so dead producers never hold slots (and widen every mask) for good.
        for producer in [p for p in self.producers.values()
                         if not p.alive and now - p.last_seen > self.limits.producer_expiry_s]:
            log.warning("producer %s down for %.0fs: forgotten (%d keys dropped); it registers again if it returns",
                        producer.producer_id, now - producer.last_seen, self.index.count(producer.slot))
            self.forget(producer)
        for producer in self.producers.values():
            if producer.alive and now - producer.last_seen > self.liveness_timeout_s:
                producer.alive = False
                self._alive_mask &= ~(1 << producer.slot)
                self.version += 1
                self._elect_for(producer)
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
