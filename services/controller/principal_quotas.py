"""What one principal's registrations may cost the controller: its share of every table a registration grows.

Quotas per principal (`engine.<instance>` or `store.<id>`: the producer path's first two tokens, which the NATS
permissions bind to one user): every table a registration grows is bounded globally (`Limits.max_producers`,
`max_key_param_sets`) and per principal (`max_workers_per_principal`, `max_key_param_sets_per_principal`), and
the command line keeps each share at most half its global bound, so one principal filling its share never
refuses another. A principal at its share makes room by forgetting its own down workers first (a restarted
engine's old incarnations, `ProducerTable.room_for`), never anyone else's. The other tables keyed by what a
principal sends (instance ids, ranks, claimants) have one entry per worker, so the worker share bounds them too.
The holder index and the full syncs being received grow with the keys a principal's producers report: at most
`max_keys_per_principal` keys each (its producers' held keys together; each sync buffer at most that), admissions
past it dropped and counted (`keys_refused`), so a lookup may miss them, never crediting a key nobody reported.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Collection

from kvmesh.services.controller.holder_index import HolderIndex
from kvmesh.services.controller.producer_records import IngestStats, KeySpec, Producer, key_spec
from kvmesh.shared import protocol
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)

MAX_HOST_LEN = 255  # a DNS name's limit: longer host / ip fields in a registration are refused


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


class PrincipalQuotas:
    """The global and per-principal counts a registration is judged by, over the producer table's `producers`
    and `index`; keys refused past a principal's room are counted in `stats.keys_refused`."""

    def __init__(self, limits: Limits, producers: dict[str, Producer], index: HolderIndex,
                 stats: IngestStats) -> None:
        self.limits = limits
        self._producers = producers
        self._index = index
        self._stats = stats
        self.key_specs: Counter[KeySpec] = Counter()  # spec -> engine workers registered with it
        self.usage: dict[str, PrincipalUsage] = {}  # principal -> what its producers hold
        self._keys_refused_logged_at = -math.inf

    # ---------------------------------------------------------------------------------------------------
    # Registrations

    def refusal(self, reg: protocol.RegisterEngine | protocol.RegisterStore,
                path: str | None = None) -> tuple[str, str] | None:
        """(reason, message) when a registration from producer path `path` must be refused for a limit it would
        pass, else None. The per-principal shares are checked before the global bounds they protect."""
        limits = self.limits
        producer_id = reg.worker_id if isinstance(reg, protocol.RegisterEngine) else reg.store_id
        known = self._producers.get(producer_id)
        usage = self.usage.get(principal_of(path)) if path is not None else None
        mine = usage is not None and producer_id in usage.producers
        if usage is not None and not mine and len(usage.producers) >= limits.max_workers_per_principal:
            return "principal_producers", (
                f"registration of {producer_id!r}: {principal_of(path or '')} has {len(usage.producers)} producers "
                f"registered, its share (--max-workers-per-principal {limits.max_workers_per_principal})")
        if known is None and len(self._producers) >= limits.max_producers:
            return "max_producers", (f"registration of {producer_id!r}: {len(self._producers)} producers are "
                                     f"known, the limit (--max-producers {limits.max_producers})")
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

    def longest_down(self, path: str) -> Producer | None:
        """The down producer of `path`'s principal silent the longest (the first to forget for room), if any."""
        usage = self.usage.get(principal_of(path))
        down = [p for p in map(self._producers.__getitem__, usage.producers) if not p.alive] if usage else []
        return min(down, key=lambda p: p.last_seen) if down else None

    def bind(self, producer: Producer, path: str | None) -> None:
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

    def set_spec(self, producer: Producer, reg: protocol.RegisterEngine | None) -> None:
        """Count `reg`'s key spec (None: none) for `producer` instead of its current registration's."""
        self._count_global(producer.engine, reg)
        self._count_spec(producer, producer.engine, -1)
        self._count_spec(producer, reg, +1)

    def forget(self, producer: Producer) -> None:
        """Count `producer` nowhere any more (it leaves the table)."""
        self._count_global(producer.engine, None)
        self.bind(producer, None)  # (its spec leaves its principal's count here)

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

    def _count_global(self, old_reg: protocol.RegisterEngine | None, reg: protocol.RegisterEngine | None) -> None:
        if old_reg is not None:
            old = key_spec(old_reg)
            self.key_specs[old] -= 1
            if not self.key_specs[old]:
                del self.key_specs[old]
        if reg is not None:
            self.key_specs[key_spec(reg)] += 1

    # ---------------------------------------------------------------------------------------------------
    # Keys

    def admissible(self, producer: Producer, admitted: list[ChunkKey]) -> list[ChunkKey]:
        """The part of a batch's `admitted` keys within `producer`'s principal's room (its held keys count)."""
        room = self._key_room(producer, include_own=True)
        return admitted if len(admitted) <= room else self._refuse_keys(producer, admitted, room)

    def fold(self, producer: Producer, keys: set[ChunkKey], new: Collection[ChunkKey]) -> None:
        """Add `new` to a sync's `keys`, up to the principal's room for a sync of this producer."""
        room = self._key_room(producer, include_own=False) - len(keys)
        if len(new) <= room:
            keys.update(new)
        else:
            keys.update(self._refuse_keys(producer, list(new), room))

    def _key_room(self, producer: Producer, include_own: bool) -> int:
        """How many more keys `producer` may report under its principal's `max_keys_per_principal`: counting its
        own held keys (a batch adds to them) or not (a full sync replaces them). Unbounded without a path."""
        if producer.path is None:
            return self.limits.max_keys_per_principal
        held = sum(self._index.count(other.slot) for pid in self._usage_of(producer).producers
                   if (other := self._producers.get(pid)) is not None and (include_own or other is not producer))
        return max(0, self.limits.max_keys_per_principal - held)

    def _refuse_keys(self, producer: Producer, keys: list[ChunkKey], room: int) -> list[ChunkKey]:
        """The first `room` of `keys`; the rest are dropped, counted and logged (at most once a minute)."""
        room = max(0, room)
        self._stats.keys_refused += len(keys) - room
        now = time.monotonic()
        if now - self._keys_refused_logged_at >= 60.0:
            self._keys_refused_logged_at = now
            log.warning("producer %s: %s reports more than --max-keys-per-principal %d keys; the rest are not "
                        "indexed (lookups miss them)", producer.producer_id, principal_of(producer.path or ""),
                        self.limits.max_keys_per_principal)
        return keys[:room]
