"""A chunk store's index: held chunks, puts in flight, eviction order, pins and token counts.

Bookkeeping only, no I/O and no locks: a store calls it from its own event loop thread and does the work the
index asks for (free these victims' bytes, this put may now be seen). Both chunk stores use it (the remote
store's memory, the disk store's files; shared/store_kit/store_ops.py answers their control ops from it), so that
contains / pin / unpin / remove / clear mean the same thing everywhere:

  * contains(keys)  -> how many leading keys are held (a put still in flight is not held);
  * pin(keys)       -> the contiguous held prefix gets one more pin of the owner (pins nest, optional TTL);
  * unpin(keys)     -> the contiguous prefix the owner pinned loses one of the owner's pins;
  * release(key, p) -> takes back principal p's claims on a key (the store's `remove`; see Claims);
  * remove(key)     -> forgets a held key (pinned or not) and discards a put of it in flight (in-process only);
  * clear(caller)   -> drops the caller's claims; forgets what nobody claims or pins any more (see Claims);
  * wipe()          -> forgets every unpinned key (and those only unowned pins hold) and discards every put in
                       flight, whoever claims them.

Sharing domains: every chunk belongs to the domain of the put that brought it (`reserve(..., domain=)`; stored
sparsely: only non-default ones). Reads, pins and unpins take the asker's domain and treat another domain's chunk
as absent; a put of a key held or in flight in another domain raises ForeignChunk and changes nothing, so one
domain never replaces, nor lands in, another's chunk. The store maps callers to domains (its DomainMap).

Pins have owners (shared/store_kit/chunk_pins.py): an unpin drops only the owner's own. Claims
(shared/store_kit/chunk_claims.py): a put records who sent it; a clear or remove takes back only the caller's, and a
chunk goes with its last.

Every change of what is held is reported through `on_admit` / `on_evict` (an AdmissionReporter's methods).
An entry's `charge` is what it counts against the capacity: the remote store's buffer size class, the disk
store's file size (header page + data), which both differ from the chunk's own `nbytes`. Which chunks are evicted
first is the store's `cache_policy` (LRU, LFU, FIFO, MRU: shared/eviction/).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Protocol, TypeVar

from kvmesh.shared.errors import StoreError
from kvmesh.shared.eviction import Clock, make_policy
from kvmesh.shared.eviction.base import MAX_LEASE_SECS, MAX_PRIORITY
from kvmesh.shared.protocol.principals import principal_of
from kvmesh.shared.store_kit.chunk_claims import DEFAULT_DOMAIN, ClaimTable, Cleared, HeldClaims
from kvmesh.shared.store_kit.chunk_pins import UNOWNED, PinOwners
from kvmesh.shared.wire.keys import ChunkKey


class IndexEntry(Protocol):
    """What the index needs to know of a store's per-chunk record."""

    @property
    def charge(self) -> int:  # bytes counted against the capacity
        ...

    @property
    def num_tokens(self) -> int:
        ...


E = TypeVar("E", bound=IndexEntry)


class SpaceRefused(StoreError):
    """No room for a chunk even after evicting every unpinned one; nothing was changed."""


class ForeignChunk(StoreError):
    """A put of a key that another sharing domain holds or is putting; nothing was changed."""


@dataclass
class _InFlight(Generic[E]):
    entry: E
    reserved: int = 0  # bytes counted in `reserved_bytes` for it: its charge, or less while its bytes arrive
    discard: bool = False  # removed or cleared while in flight: do not hold it when it lands
    claims: int = 0  # who put it (a `Callers` mask)
    domain: str = DEFAULT_DOMAIN  # the sharing domain of who put it
    # a put's retention to take when it lands: (owner, priority, lease end on the index's clock or None, bound)
    retention: tuple[str, int, float | None, int] | None = None


def _ignore(_: ChunkKey) -> None:
    pass


class ChunkIndex(Generic[E]):
    """Held chunks under a byte budget, with eviction by the named policy (default LRU) and pins.

    Invariant: a key is held (in `_held` and in the eviction policy: visible to contains/get, its charge in
    `used_bytes`), in flight (in `_in_flight`, its charge in `reserved_bytes`, invisible and never a victim), or
    unknown; never two of these. `used_bytes + reserved_bytes <= capacity_bytes` holds after every `reserve`.
    Claims (shared/store_kit/chunk_claims.py): a held key's are in `_claims` (a HeldClaims, with its orphans and
    domain), a key in flight carries its mask in `_InFlight.claims` (0 once discarded).
    """

    def __init__(self, capacity_bytes: int, on_admit: Callable[[ChunkKey], None] = _ignore,
                 on_evict: Callable[[ChunkKey], None] = _ignore, *, policy: str = "LRU",
                 clock: Clock = time.monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        # ValueError naming `cache_policy` if unknown; pin TTLs expire on `clock`
        self._policy = make_policy(policy, capacity_bytes, clock)
        self._clock = clock
        self._held: dict[ChunkKey, E] = {}
        self._in_flight: dict[ChunkKey, _InFlight[E]] = {}
        self.reserved_bytes = 0
        self.on_admit = on_admit
        self.on_evict = on_evict
        self._pins_version = 0
        self._claims = HeldClaims()  # the held keys' claims and (non-default) domains
        self._pin_owners = PinOwners(self._policy)
        self.evictions = 0  # chunks evicted to make room or to fit the capacity (not removals, clears or wipes)
        self.retains_refused = 0  # retentions not taken (past their owner's bound; out of range, as the store says)
        self._retention_version = 0  # bumped when a held key's retention is taken or goes with its key

    # ---- queries -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._held

    @property
    def used_bytes(self) -> int:
        return self._policy.used_bytes

    @property
    def policy_name(self) -> str:
        """The eviction policy's `cache_policy` name (LRU, LFU, FIFO, MRU)."""
        return self._policy.name

    @property
    def pinned_count(self) -> int:
        return self._policy.pinned_count

    @property
    def in_flight_count(self) -> int:
        return len(self._in_flight)

    @property
    def pins_version(self) -> int:
        """Bumped whenever pins are taken, dropped or lose their key: a store persisting pins saves on change."""
        return self._pins_version

    @property
    def retention_version(self) -> int:
        """Bumped whenever a held key is retained or a retained key is forgotten (a lease's end is not a change:
        its persisted end says it ended): a store persisting retention saves on change."""
        return self._retention_version

    @property
    def claims_version(self) -> int:
        """Bumped whenever the claims of held chunks change: a store persisting them saves on change."""
        return self._claims.version

    def claimed_by(self, key: ChunkKey) -> list[str]:
        """The callers claiming a held or in-flight key."""
        flight = self._in_flight.get(key)
        mask = self._claims.masks.get(key, 0) if key in self._held else flight.claims if flight is not None else 0
        return self._claims.callers.paths(mask)

    def claim_counts(self) -> dict[str, int]:
        """caller path -> how many chunks (held or in flight) it claims."""
        return self._claims.callers.counts()

    def held(self, key: ChunkKey) -> E | None:
        """The entry of a held key, without changing its recency."""
        return self._held.get(key)

    def domain_of(self, key: ChunkKey) -> str | None:
        """The sharing domain of a held key, or of a put of it in flight (even a discarded one); None if neither."""
        if key in self._held:
            return self._claims.domains.get(key, DEFAULT_DOMAIN)
        flight = self._in_flight.get(key)
        return flight.domain if flight is not None else None

    def visible(self, key: ChunkKey, domain: str = DEFAULT_DOMAIN) -> E | None:
        """The entry of a held key of `domain` (another domain's chunk is absent to it), recency unchanged."""
        entry = self._held.get(key)
        return entry if entry is not None and self._claims.domains.get(key, DEFAULT_DOMAIN) == domain else None

    def is_known(self, key: ChunkKey) -> bool:
        """Held, or in flight and still wanted."""
        return key in self._held or self.in_flight(key) is not None

    def in_flight(self, key: ChunkKey) -> E | None:
        """The entry of a put of `key` in flight and still wanted (it becomes held when it lands)."""
        flight = self._in_flight.get(key)
        return flight.entry if flight is not None and not flight.discard else None

    def in_flight_items(self) -> list[tuple[ChunkKey, E]]:
        """Every put in flight and still wanted."""
        return [(key, flight.entry) for key, flight in self._in_flight.items() if not flight.discard]

    def is_pinned(self, key: ChunkKey) -> bool:
        return self._policy.is_pinned(key)

    def keys(self) -> list[ChunkKey]:
        return list(self._held)

    def held_items(self) -> list[tuple[ChunkKey, E]]:
        """The held keys with their entries (a copy)."""
        return list(self._held.items())

    def contains_prefix(self, keys: Iterable[ChunkKey], domain: str = DEFAULT_DOMAIN) -> int:
        """How many leading keys are held in `domain`."""
        count = 0
        for key in keys:
            if self.visible(key, domain) is None:
                break
            count += 1
        return count

    # ---- reads -------------------------------------------------------------------------------------------
    def touch(self, key: ChunkKey, domain: str = DEFAULT_DOMAIN) -> E | None:
        """The entry of a key held in `domain`, counted as a hit by the policy (LRU: now the most recent); None if
        not held there."""
        entry = self.visible(key, domain)
        if entry is not None:
            self._policy.touch(key)
        return entry

    # ---- puts --------------------------------------------------------------------------------------------
    def reserve(self, key: ChunkKey, entry: E, caller: str | None = None,
                nbytes: int | None = None, domain: str = DEFAULT_DOMAIN) -> list[tuple[ChunkKey, E]]:
        """Accept a put from `caller` (its claim; None: an unclaimed chunk) of sharing domain `domain`: evict the
        policy's victims to make room and count `nbytes` of the entry's charge (all of it when None) as
        reserved; `grow` reserves the rest as the bytes arrive (all of it by `commit`).

        Returns the evicted (key, entry) pairs, whose bytes the store frees. Raises SpaceRefused, changing
        nothing, when pinned chunks and puts in flight leave no room. The key must not be known.
        """
        if self.is_known(key):
            raise ValueError(f"chunk {key.hex()} is already held or in flight")
        nbytes = entry.charge if nbytes is None else nbytes
        evicted = self._make_room(key, nbytes)
        stale = self._in_flight.pop(key, None)  # a discarded put of the same key still landing: superseded
        if stale is not None:
            self.reserved_bytes -= stale.reserved
        claims = self._claims.callers.add(0, caller) if caller is not None else 0
        self._in_flight[key] = _InFlight(entry, nbytes, claims=claims, domain=domain)
        self.reserved_bytes += nbytes
        return evicted

    def grow(self, key: ChunkKey, entry: E, total: int) -> list[tuple[ChunkKey, E]]:
        """Reserve up to `total` bytes in all (at most its charge) for the put of `entry` in flight, evicting as
        `reserve` does; the evicted pairs. A put no longer in flight (superseded) reserves nothing: it will not
        be held."""
        flight = self._in_flight.get(key)
        if flight is None or flight.entry is not entry:
            return []
        nbytes = min(total, entry.charge) - flight.reserved
        if nbytes <= 0:
            return []
        evicted = self._make_room(key, nbytes)
        flight.reserved += nbytes
        self.reserved_bytes += nbytes
        return evicted

    def _make_room(self, key: ChunkKey, nbytes: int) -> list[tuple[ChunkKey, E]]:
        victims = self._policy.victims_for(nbytes + self.reserved_bytes)
        if victims is None:
            pinned = sum(self._held[k].charge for k in self._held if self._policy.is_pinned(k))
            raise SpaceRefused(f"no room for {nbytes} more bytes of chunk {key.hex()}: capacity "
                               f"{self.capacity_bytes}, pinned {pinned}, in flight {self.reserved_bytes}")
        self.evictions += len(victims)
        return [(victim, self._forget(victim)) for victim in victims]

    def claim(self, key: ChunkKey, caller: str, domain: str = DEFAULT_DOMAIN) -> bool:
        """A put from `caller` (of `domain`) of a key already held or in flight (and wanted): add its claim; False
        if the key is neither (the caller then reserves it). ForeignChunk, changing nothing, when another domain
        holds it or is putting it (even a put a removal discarded: its bytes may still land)."""
        self.check_domain(key, domain)
        if key in self._held:
            self._claims.masks[key] = self._claims.callers.add(self._claims.masks.get(key, 0), caller)
            self._claims.orphans.discard(key)
            self._claims.version += 1
            return True
        flight = self._in_flight.get(key)
        if flight is None or flight.discard:
            return False
        flight.claims = self._claims.callers.add(flight.claims, caller)
        return True

    def check_domain(self, key: ChunkKey, domain: str) -> None:
        """ForeignChunk when `key` is held, or a put of it is in flight, in a domain other than `domain`."""
        owner = self.domain_of(key)
        if owner is not None and owner != domain:
            raise ForeignChunk(f"chunk {key.hex()} is held by another sharing domain; the put is refused and "
                               "that chunk is unchanged")

    def revive(self, key: ChunkKey, domain: str = DEFAULT_DOMAIN) -> bool:
        """A new put (of `domain`) of a key whose put is in flight (even one discarded by a removal): keep that
        one. ForeignChunk, changing nothing, when that put is another domain's.

        True if there is one, which will now be held when it lands; the new put then has nothing to do. For a
        store whose put in flight already has the bytes (the disk store's staged write); the remote store lets
        the new put supersede instead (`reserve`), since its bytes are still arriving.
        """
        flight = self._in_flight.get(key)
        if flight is None:
            return False
        self.check_domain(key, domain)
        flight.discard = False
        return True

    def commit(self, key: ChunkKey, entry: E | None = None) -> bool:
        """The put of `entry` landed: True if it is now held, False if it was discarded (or superseded).

        `entry` tells a superseded put from the one that replaced it; None means the put in flight, whichever.
        """
        flight = self._in_flight.get(key)
        if flight is None or (entry is not None and flight.entry is not entry):
            return False
        del self._in_flight[key]
        self.reserved_bytes -= flight.reserved
        if flight.discard:
            return False
        assert flight.reserved == flight.entry.charge, f"chunk {key.hex()}: committed before all of it was reserved"
        self._held[key] = flight.entry
        if flight.claims:
            self._claims.masks[key] = flight.claims
            self._claims.version += 1
        if flight.domain != DEFAULT_DOMAIN:
            self._claims.domains[key] = flight.domain
            self._claims.version += 1
        self._policy.add(key, flight.entry.charge)
        if flight.retention is not None:
            owner, priority, lease_end, bound = flight.retention
            lease_secs = lease_end - self._clock() if lease_end is not None else None
            self.retain_held(key, owner, bound, priority, lease_secs if lease_secs and lease_secs > 0 else None)
        self.on_admit(key)
        return True

    def retain(self, key: ChunkKey, owner: str, max_owner_bytes: int, priority: int = 0,
               lease_secs: float | None = None) -> None:
        """Keep a held key over the unretained ones (shared/eviction/base.py `retain`: a priority, a lease), within
        `owner`'s bound; a key in flight takes it when it lands. Not taken (past the bound, or not known):
        counted in `retains_refused`."""
        flight = self._in_flight.get(key)
        if flight is not None:
            lease_end = self._clock() + lease_secs if lease_secs else None
            flight.retention = (owner, priority, lease_end, max_owner_bytes)
            return
        self.retain_held(key, owner, max_owner_bytes, priority, lease_secs)

    def retain_held(self, key: ChunkKey, owner: str, max_owner_bytes: int, priority: int,
                    lease_secs: float | None) -> bool:
        """`retain` of a key as held now (a put in flight is not looked at); True if taken, else counted in
        `retains_refused`. Also what re-takes a persisted retention at start (retention_restore.py)."""
        if self._policy.retain(key, owner, max_owner_bytes, priority, lease_secs):
            self._retention_version += 1
            return True
        self.retains_refused += 1
        return False

    def retain_put(self, key: ChunkKey, caller: str, priority: int, lease_secs: float, share: float) -> None:
        """A put's retention (`PutRequest.priority` / `lease_secs`: the storing request's kv_priority and lease),
        owned by the caller's principal within `share` of the capacity (`--retained-share`). Client input: a
        priority or lease out of range (MAX_PRIORITY, MAX_LEASE_SECS; NaN, inf) is not taken, counted in
        `retains_refused`. The disk store persists it in its index snapshot (`retentions`; read back at start:
        shared/store_kit/retention_restore.py)."""
        if priority == 0 and lease_secs == 0:
            return
        if not (0 <= priority <= MAX_PRIORITY and 0 <= lease_secs <= MAX_LEASE_SECS):
            self.retains_refused += 1
            return
        self.retain(key, principal_of(caller), int(share * self.capacity_bytes), priority, lease_secs or None)

    def retained_bytes(self, owner: str) -> int:
        return self._policy.retained_bytes(owner)

    def retentions(self) -> list[tuple[ChunkKey, str, int, float | None]]:
        """(key, owner, priority, wall-clock lease end or None) of every retained held key, to persist: wall-clock,
        as pins are, because the index's clock is monotonic and restarts with the machine."""
        now = time.time()
        return [(key, owner, priority, None if left is None else now + left)
                for key, owner, priority, left in self._policy.retentions()]

    def is_retained(self, key: ChunkKey) -> bool:
        return self._policy.is_retained(key)

    def abort(self, key: ChunkKey, entry: E | None = None) -> None:
        """The put of `entry` (None: the put in flight, whichever) failed: release its reservation."""
        flight = self._in_flight.get(key)
        if flight is not None and (entry is None or flight.entry is entry):
            del self._in_flight[key]
            self.reserved_bytes -= flight.reserved
            self._discard(flight)

    def load(self, key: ChunkKey, entry: E) -> None:
        """Hold a chunk found at start (persisted); call oldest (least recently used) first: it arrives as a new
        key, so LRU, MRU and FIFO rebuild their order from the call order, and LFU starts every count over."""
        self._held[key] = entry
        self._policy.add(key, entry.charge)
        self.on_admit(key)

    def load_many(self, held: dict[ChunkKey, E]) -> None:
        """`load` of each key with its entry, oldest first, in bulk (a start of 10^6): the index must hold nothing
        yet, and adopts `held` as its own dict (the caller keeps no reference to it)."""
        assert not self._held and not self._in_flight, "load_many is for a start"
        self._held = held
        entries = list(held.values())
        shared = entries[0] if entries and entries.count(entries[0]) == len(entries) else None  # one size (a C pass)
        self._policy.add_new(held, [shared.charge] * len(entries) if shared is not None else
                             [entry.charge for entry in entries])
        if self.on_admit is not _ignore:
            for key in held:
                self.on_admit(key)

    def trim_to_capacity(self) -> list[tuple[ChunkKey, E]]:
        """Evict unpinned chunks, in the policy's victim order, until the held ones fit the capacity (after
        loading chunks persisted under a larger capacity); the evicted (key, entry) pairs."""
        victims = self._policy.victims_for(0) or []
        self.evictions += len(victims)
        return [(victim, self._forget(victim)) for victim in victims]

    # ---- removals ----------------------------------------------------------------------------------------
    def remove(self, key: ChunkKey) -> E | None:
        """Forget a held key, pinned or not, whoever claims it, and discard a put of it in flight; the held entry
        or None."""
        flight = self._in_flight.get(key)
        if flight is not None:
            self._discard(flight)
        return self._forget(key) if key in self._held else None

    def release(self, key: ChunkKey, principal: str) -> Cleared[E]:
        """Take back every claim of `principal` (all its caller paths) on `key`, held or in flight: the store's
        `remove`. The key goes when its last claim goes (a pinned one when its last pin goes: `forget_orphans`);
        another principal's claims, and unclaimed chunks, stay. `released` is empty when it held no claim."""
        cleared: Cleared[E] = Cleared()
        bits = self._claims.callers.mask_of(principal)
        if bits:
            mask = self._claims.masks.get(key, 0)
            if mask & bits:
                self._take_back_held(key, mask, bits, cleared)
                self._claims.version += 1
            flight = self._in_flight.get(key)
            if flight is not None and flight.claims & bits:
                self._take_back_in_flight(flight, bits, cleared)
        return cleared

    def drop(self, key: ChunkKey, entry: E) -> bool:
        """Forget `key` only if it still holds `entry` (its bytes turned out bad or gone; a newer put of the key
        may have replaced it meanwhile). True if it was forgotten."""
        if self._held.get(key) is not entry:
            return False
        self._forget(key)
        return True

    def clear(self, caller: str) -> Cleared[E]:
        """Take back every claim of `caller`: forget the held chunks nobody else claims (pinned ones stay until
        unpinned: `forget_orphans`), discard its puts in flight nobody else claims."""
        cleared: Cleared[E] = Cleared()
        bit = self._claims.callers.bit(caller)
        if not bit:
            return cleared
        for key, mask in [(key, mask) for key, mask in self._claims.masks.items() if mask & bit]:
            self._take_back_held(key, mask, bit, cleared)
        self._claims.version += bool(cleared.released)
        for flight in self._in_flight.values():
            if flight.claims & bit:
                self._take_back_in_flight(flight, bit, cleared)
        return cleared

    def _take_back_held(self, key: ChunkKey, mask: int, bits: int, cleared: Cleared[E]) -> None:
        """Drop the claims `bits` (some of them in `mask`, the held key's) on a held key: it is forgotten once
        nobody claims it, or orphaned while pinned."""
        cleared.released.append(self._held[key])
        self._claims.callers.drop(mask & bits)
        if mask & ~bits:
            self._claims.masks[key] = mask & ~bits
            return
        del self._claims.masks[key]
        if self._policy.is_pinned(key):
            self._claims.orphans.add(key)
        else:
            cleared.forgotten.append((key, self._forget(key)))

    def _take_back_in_flight(self, flight: _InFlight[E], bits: int, cleared: Cleared[E]) -> None:
        """Drop the claims `bits` (some of them the put's) on a put in flight: discarded once nobody claims it."""
        cleared.released.append(flight.entry)
        self._claims.callers.drop(flight.claims & bits)
        flight.claims &= ~bits
        if not flight.claims:
            flight.discard = True
            cleared.discarded.append(flight.entry)

    def forget_orphans(self) -> list[tuple[ChunkKey, E]]:
        """Forget the chunks a clear left unclaimed but pinned whose pins are gone (unpinned, or expired); the
        forgotten (key, entry) pairs, whose bytes the store frees."""
        return [(key, self._forget(key)) for key in list(self._claims.orphans) if not self._policy.is_pinned(key)]

    def wipe(self) -> list[tuple[ChunkKey, E]]:
        """Forget every held key no owner pins (unpinned, or held only by unowned pins: the operator's to drop)
        and discard every put in flight, whoever claims them; the removed (key, entry) pairs. Chunks pinned by
        an owner keep their claims."""
        for flight in self._in_flight.values():
            self._discard(flight)
        return [(key, self._forget(key)) for key in list(self._held) if not self._pin_owners.owned(key)]

    def _discard(self, flight: _InFlight[E]) -> None:
        flight.discard = True
        self._claims.callers.drop(flight.claims)
        flight.claims = 0

    def _forget(self, key: ChunkKey) -> E:
        if self._policy.is_pinned(key):
            self._pins_version += 1
        if self._policy.is_retained(key):
            self._retention_version += 1
        self._policy.remove(key)
        entry = self._held.pop(key)
        self._claims.forget(key)
        self._pin_owners.forget(key)
        self.on_evict(key)
        return entry

    # ---- pins --------------------------------------------------------------------------------------------
    def pin(self, keys: Iterable[ChunkKey], ttl_secs: float | None = None, owner: str = UNOWNED,
            domain: str = DEFAULT_DOMAIN) -> list[ChunkKey]:
        """Pin, as `owner`, the contiguous prefix of `keys` held in `domain` (pins nest); the keys pinned."""
        pinned: list[ChunkKey] = []
        for key in keys:
            if self.visible(key, domain) is None or not self._pin_owners.pin(key, ttl_secs, owner):
                break
            pinned.append(key)
        self._pins_version += bool(pinned)
        return pinned

    def unpin(self, keys: Iterable[ChunkKey], owner: str = UNOWNED,
              domain: str = DEFAULT_DOMAIN) -> list[ChunkKey]:
        """Drop one of `owner`'s pins from each key of the contiguous prefix of `keys` that `owner` pins (in
        `domain`); the keys unpinned. Another owner's pins are never touched."""
        unpinned: list[ChunkKey] = []
        for key in keys:
            if self.visible(key, domain) is None or not self._pin_owners.unpin(key, owner):
                break
            unpinned.append(key)
        self._pins_version += bool(unpinned)
        return unpinned

    def pins(self) -> dict[ChunkKey, tuple[int, float | None]]:
        """Live pins, to persist: key -> (nesting count, seconds left, None = until unpinned)."""
        return {key: (count, left) for key, count, left in self._policy.pins()}

    def pin_owners(self, key: ChunkKey) -> dict[str, int]:
        """owner -> how many of the live pins of `key` it holds ("" for unowned ones); a copy."""
        return dict(self._pin_owners.live(key))

    # ---- claims, persisted ---------------------------------------------------------------------------------
    def claim_table(self) -> ClaimTable:
        """The held chunks' claims, to persist (a copy: the store writes it on another thread)."""
        return self._claims.table(self._held)

    def restore_claims(self, table: ClaimTable) -> int:
        """Re-take persisted claims on the held keys (keys no longer held are skipped); how many keys got some."""
        return self._claims.restore(table, self._held)

    def forget_unrecorded(self, table: ClaimTable) -> list[tuple[ChunkKey, E]]:
        """Forget the held keys a persisted claims table does not name (not claimed, orphaned, unclaimed, in a domain):
        the file is rewritten at most once a CLAIMS_SAVE_INTERVAL, so such a chunk was put just before a crash and
        its sharing domain is unknown; kept, it would come back in the default domain, readable there. The
        forgotten (key, entry) pairs, whose bytes the store frees."""
        known = table.recorded()
        return [(key, self._forget(key)) for key in list(self._held) if key not in known]

    def tokens_of(self, keys: Iterable[ChunkKey]) -> int:
        return sum(entry.num_tokens for key in keys if (entry := self._held.get(key)) is not None)
