"""The scheduler's mirror of each worker's CPU tier, and the evictions a worker holds until the mirror saw them.

Every worker reports its CPU tier's admissions and evictions with each step's output (`StepEventLog`, sent as
`CpuTierEvents`, vLLM's worker -> scheduler connector metadata, carried by vLLM's own IPC); the scheduler
applies them to one key set per rank (`CpuTierMirror`) and answers CPU-tier hits from it without a round trip.
The mirror lags the tier: a chunk evicted after the last step's output is still "held" for the scheduler.

For a model with KV cache groups that lag used to rule out in-step loads from workers in other processes:
vLLM 0.32 cannot take a failed in-step load with groups (cpu_leases.py). So a worker of such a model *holds*
each chunk its CPU tier evicts (a reference to its slot, `StepEventLog.hold`) until the scheduler says it saw
that eviction, and its loads still find held chunks (`LocalCPUBackend.acquire`). The protocol:

  * every event of a rank has a sequence number (1, 2, ...); each step's `CpuTierEvents` carry the first
    number of the rank's events, so the mirror knows it applied every event in order (`CpuTierMirror.seen`);
    a gap (a step's output vLLM never delivered) marks the rank's mirror unordered, and no in-step load is
    planned from it any more (loads from it stay asynchronous, as before);
  * each step's metadata carries, per rank, the last event the scheduler had applied when it planned that
    step's loads (`KVMeshConnectorMetadata.evictions_seen`: the least over the step's mirror-planned loads'
    lookups and the mirror now); the worker runs that step's loads, then releases the chunks held for
    evictions up to that number (`StepEventLog.seen`).

Why a load planned from the mirror finds every chunk it was promised: the scheduler plans it only when the
mirror holds every chunk after applying events up to n (per rank); the worker's step metadata is handled in
order, and it releases nothing held for an event past n before that load has taken its references. A chunk
the mirror holds at n is either still in the tier, or its eviction came after n and its slot is still held
(a re-admission after n puts it back in the tier). What a held chunk's slot holds never changes (a slot is
reused only after its last reference is released: memory_pool.py), and every chunk was checked against its
key's span when the tier admitted it (saves write their own layout; chunks from stores and peers pass
`CacheEngine.meta_mismatch` before admission: StorageManager.read_into), so its meta is right for the load.

The cost: held slots return to the pool a step later. The tier never holds more than `evicted_hold_share`
of its pool this way for making room (`LocalCPUBackend.allocate` stops evicting there: the save or fetch
that wanted a slot is dropped, as with a full pool); a clear holds every chunk it removes until the next step.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from kvmesh.shared.wire.keys import ChunkKey

if TYPE_CHECKING:
    from kvmesh.services.engine.config.engine_config import EngineConfig
    from kvmesh.services.engine.tiers.cpu import ChunkRef

try:  # the base class exists wherever vLLM does; the module stays importable (and testable) without it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except Exception:  # pragma: no cover - only without vLLM
    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass

log = logging.getLogger(__name__)


# ---- worker side ------------------------------------------------------------------------------------------------
def evicted_hold_slots(config: "EngineConfig", pool_slots: int) -> int:
    """How many evictions to make room a worker holds at most: `evicted_hold_share` of its CPU pool, at least one
    slot (0 when the share is 0: nothing is held, and no load is planned from the mirror)."""
    if config.evicted_hold_share <= 0 or not config.local_cpu:
        return 0
    return max(1, int(config.evicted_hold_share * pool_slots))


class StepEventLog:
    """Worker side: the CPU tier's admissions and evictions since the last step's output (a TierListener), each
    numbered; with `hold_slots` > 0 also the tier's evicted chunks, held until the scheduler saw their eviction
    (an `EvictionHolder` of the tier: `LocalCPUBackend.hold_evictions`)."""

    def __init__(self, hold_slots: int = 0) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[bool, ChunkKey]] = []
        self._next = 1  # the number of the next event
        self.hold_slots = hold_slots  # evictions to make room held at most (`LocalCPUBackend.allocate`)
        self._held: deque[tuple[int, ChunkKey, "ChunkRef"]] = deque()  # by event number
        self._by_key: dict[ChunkKey, "ChunkRef"] = {}  # the latest held chunk of each key

    def admit(self, key: ChunkKey) -> None:
        with self._lock:
            self._events.append((True, key))
            self._next += 1

    def evict(self, key: ChunkKey) -> None:
        with self._lock:
            self._events.append((False, key))
            self._next += 1

    def take(self) -> list[tuple[bool, ChunkKey]]:
        """The events since the last take (their numbers: `take_numbered`)."""
        return self.take_numbered()[1]

    def take_numbered(self) -> tuple[int, list[tuple[bool, ChunkKey]]]:
        """(the first event's number, the events since the last take)."""
        with self._lock:
            events, self._events = self._events, []
            return self._next - len(events), events

    # ---- EvictionHolder (called by the tier under its lock, right after `evict` told of the key) -----------
    def hold(self, key: ChunkKey, ref: "ChunkRef") -> bool:
        """Keep the evicted chunk's slot reference until `seen` passes its eviction; False: not holding."""
        if self.hold_slots <= 0:
            return False
        with self._lock:
            self._held.append((self._next - 1, key, ref))
            self._by_key[key] = ref
        return True

    def find(self, key: ChunkKey) -> "ChunkRef | None":
        """A new reference to the held chunk of `key` (the latest evicted), or None."""
        from kvmesh.services.engine.tiers.cpu import ChunkRef

        with self._lock:
            ref = self._by_key.get(key)
            if ref is None:
                return None
            return ChunkRef(ref.meta, ref.slot.ref())

    def full(self) -> bool:
        """Whether holding one more eviction to make room would pass `hold_slots`."""
        with self._lock:
            return len(self._held) >= self.hold_slots

    def held_count(self) -> int:
        with self._lock:
            return len(self._held)

    def seen(self, upto: int | None) -> int:
        """The scheduler saw every eviction up to number `upto` (None: it plans nothing from the mirror, so
        nothing need be held): release those chunks; how many were released."""
        released: list["ChunkRef"] = []
        with self._lock:
            while self._held and (upto is None or self._held[0][0] <= upto):
                _, key, ref = self._held.popleft()
                if self._by_key.get(key) is ref:
                    del self._by_key[key]
                released.append(ref)
        for ref in released:  # outside the lock: the pool's lock is taken after, never inside, ours
            ref.release()
        return len(released)


@dataclass
class CpuTierEvents(KVConnectorWorkerMetadata):
    """One step's CPU-tier changes, per rank, in order: (admitted?, key). vLLM aggregates the ranks' copies.
    `first`: per rank, the number of its first event here (absent: not numbered, e.g. a test's hand-made events)."""

    events: dict[int, list[tuple[bool, ChunkKey]]] = field(default_factory=dict)
    first: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "CpuTierEvents":
        if isinstance(other, CpuTierEvents):
            for rank, events in other.events.items():
                mine = self.events.setdefault(rank, [])
                first = other.first.get(rank)
                if not mine and first is not None:
                    self.first[rank] = first
                elif mine and (first is None or self.first.get(rank, 0) + len(mine) != first):
                    self.first.pop(rank, None)  # not consecutive: unordered (CpuTierMirror.apply)
                mine.extend(events)
        return self


# ---- scheduler side ----------------------------------------------------------------------------------------------
class CpuTierMirror:
    """Scheduler side: the keys each rank's CPU tier holds, as of the last step's output, and the number of the
    last event applied in order per rank (`seen`; None once a rank's events came out of order or unnumbered)."""

    def __init__(self) -> None:
        self._held: dict[int, set[ChunkKey]] = {}
        self._seen: dict[int, int | None] = {}
        self._warned: set[int] = set()

    def apply(self, update: CpuTierEvents) -> None:
        for rank, events in update.events.items():
            held = self._held.setdefault(rank, set())
            for admitted, key in events:
                if admitted:
                    held.add(key)
                else:
                    held.discard(key)
            self._count(rank, update.first.get(rank), len(events))

    def _count(self, rank: int, first: int | None, count: int) -> None:
        seen = self._seen.get(rank, 0)
        if seen is not None and first is not None and first == seen + 1:
            self._seen[rank] = seen + count
            return
        self._seen[rank] = None
        if rank not in self._warned:
            self._warned.add(rank)
            log.warning("rank %d's CPU-tier events reached the scheduler out of order or unnumbered (event %s "
                        "after %s): its loads with KV cache groups stay asynchronous", rank, first, seen)

    def seen(self, rank: int) -> int | None:
        """The number of rank's last event applied, every earlier one applied in order (0: none yet); None when
        the mirror of that rank cannot be trusted to the event."""
        return self._seen.get(rank, 0)

    def prefix(self, rank: int, keys: Sequence[ChunkKey]) -> int:
        held = self._held.get(rank, ())
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count
