"""What the controller keeps of one producer: its record, a full sync being received, and the ingest counters.

A *producer* is an engine worker (one per vLLM rank; its CPU tier, location LocalCPUBackend) or a store
(LocalDiskBackend / RemoteBackend), named by `producer_id` (worker_id or store_id). Each owns one slot of the
HolderIndex. `ProducerTable` (producers.py) holds them all.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvmesh.shared import protocol
from kvmesh.shared.messaging.sharing_domains import DEFAULT_DOMAIN
from kvmesh.shared.wire.keys import ChunkKey, KeyParams

KeySpec = tuple[KeyParams, int, bool]  # (params, chunk_size, save_unfull_chunk): one ChunkHasher per lookup


def key_spec(reg: protocol.RegisterEngine) -> KeySpec:
    """How a worker's chunk keys are made: lookups hash the tokens once per distinct spec."""
    return (reg.key_params(), reg.chunk_size, reg.save_unfull_chunk)


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
