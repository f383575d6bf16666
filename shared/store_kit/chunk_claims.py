"""Claims on a store's chunks: who put each chunk, as caller masks, what a clear took back, the held chunks' claims
and sharing domains (`HeldClaims`), and the table that persists them. `ChunkIndex` (shared/store_kit/chunk_index.py)
keeps them with its chunks.

Claims: a put records who sent it (the caller's path, `engine.<instance>.<worker>`), also when the chunk is
already held or in flight (the first writer's bytes stay: a key names its content). `clear(caller)` takes back
only that caller's claims, `release(key, principal)` only that principal's (every worker of it), so one tenant's
clear or remove never removes what another still uses. A chunk nobody claims any more is forgotten, unless
pinned: then it lives until its last pin goes (`forget_orphans`). A chunk that never had a claim (found on disk
from before claims existed, or put without a caller) is kept until evicted or wiped. Claims do not protect from
eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Container, Generic, Iterable, Protocol, TypeVar

from kvmesh.shared.wire.keys import ChunkKey


class _Entry(Protocol):
    @property
    def num_tokens(self) -> int:
        ...


E = TypeVar("E", bound=_Entry)

DEFAULT_DOMAIN = "default"  # the same name as shared/messaging/sharing_domains.py's (which the index may not import)


@dataclass
class Cleared(Generic[E]):
    """What one caller's `clear` did.

    `released`: the entries of every chunk (held, pinned or in flight) whose claim by the caller it dropped,
    i.e. what left the caller's view; `forgotten`: the held chunks nobody claims or pins any more (the store
    frees their bytes); `discarded`: the puts in flight nobody claims any more (dropped when they land).
    """

    released: list[E] = field(default_factory=list)
    forgotten: list[tuple[ChunkKey, E]] = field(default_factory=list)
    discarded: list[E] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.released)


@dataclass
class ClaimTable:
    """The claims of the held chunks, to persist: `masks[key]` has bit i set when `callers[i]` claims the key;
    `orphans` are pinned chunks that lost their last claim (forgotten when unpinned)."""

    callers: list[str]
    masks: dict[ChunkKey, int]
    orphans: list[ChunkKey] = field(default_factory=list)
    domains: dict[ChunkKey, str] = field(default_factory=dict)  # the held chunks not in the default domain
    unclaimed: list[ChunkKey] = field(default_factory=list)  # held with no claim (put without a caller, or old)

    def recorded(self) -> set[ChunkKey]:
        """Every key the table names (claimed, orphaned, in a domain, or unclaimed)."""
        return self.masks.keys() | set(self.orphans) | self.domains.keys() | set(self.unclaimed)


class Callers:
    """Caller paths interned as small ids, one bit each in a chunk's claim mask.

    An id is recycled once no chunk (held or in flight) carries its bit, so masks stay as wide as the number of
    callers with chunks in the store, usually a handful: then a mask is one of Python's cached small ints and a
    claim costs only its dict slot.
    """

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._paths: list[str] = []  # id -> path ("" once recycled)
        self._counts: list[int] = []  # id -> chunks whose mask has its bit
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._ids)

    def bit(self, path: str) -> int:
        """The bit of `path`, 0 if no chunk is claimed by it."""
        index = self._ids.get(path)
        return 0 if index is None else 1 << index

    def add(self, mask: int, path: str) -> int:
        """`mask` with `path`'s claim added (counted once per chunk)."""
        index = self._ids.get(path)
        if index is None:
            index = self._free.pop() if self._free else len(self._paths)
            if index == len(self._paths):
                self._paths.append(path)
                self._counts.append(0)
            self._ids[path] = index
            self._paths[index] = path
        if not mask >> index & 1:
            self._counts[index] += 1
        return mask | 1 << index

    def drop(self, mask: int) -> None:
        """A chunk claimed by `mask` lost these claims (it is gone, or these callers gave it up)."""
        while mask:
            low = mask & -mask
            index = low.bit_length() - 1
            self._counts[index] -= 1
            if not self._counts[index]:
                del self._ids[self._paths[index]]
                self._paths[index] = ""
                self._free.append(index)
            mask ^= low

    def paths(self, mask: int) -> list[str]:
        return [path for index, path in enumerate(self._paths) if mask >> index & 1]

    def mask_of(self, principal: str) -> int:
        """The bits of every caller path of `principal` (itself, or its workers `<principal>.<worker>`)."""
        mask = 0
        for path, index in self._ids.items():
            if path == principal or path.startswith(principal + "."):
                mask |= 1 << index
        return mask

    def table(self) -> list[str]:
        return list(self._paths)

    def counts(self) -> dict[str, int]:
        return {path: self._counts[index] for path, index in self._ids.items()}


class HeldClaims:
    """The claims and sharing domains of a store's held chunks: `masks` (key -> caller mask, absent when none),
    `orphans` (held, pinned keys whose last claim a clear took back), `domains` (key -> domain, only the non-default
    ones); `callers` interns the paths of these and of the puts in flight (which carry their own masks).
    `version` is bumped on every change, so a store persisting them (`table`) saves on change."""

    def __init__(self) -> None:
        self.callers = Callers()
        self.masks: dict[ChunkKey, int] = {}
        self.orphans: set[ChunkKey] = set()
        self.domains: dict[ChunkKey, str] = {}
        self.version = 0

    def forget(self, key: ChunkKey) -> None:
        """A held key is gone: drop its claims, orphan mark and domain."""
        mask = self.masks.pop(key, 0)
        if mask:
            self.callers.drop(mask)
            self.version += 1
        self.orphans.discard(key)
        if self.domains.pop(key, None) is not None:
            self.version += 1

    def table(self, held: Iterable[ChunkKey]) -> ClaimTable:
        """The claims of the `held` keys, to persist (a copy: the store writes it on another thread)."""
        unclaimed = [key for key in held if key not in self.masks and key not in self.orphans]
        return ClaimTable(self.callers.table(), dict(self.masks), list(self.orphans), dict(self.domains), unclaimed)

    def restore(self, table: ClaimTable, held: Container[ChunkKey]) -> int:
        """Re-take persisted claims on the `held` keys (keys no longer held are skipped); how many keys got some."""
        restored = 0
        for key, saved in table.masks.items():
            if key not in held:
                continue
            mask = self.masks.get(key, 0)
            for index, path in enumerate(table.callers):
                if saved >> index & 1 and path:
                    mask = self.callers.add(mask, path)
            if mask:
                self.masks[key] = mask
                self.orphans.discard(key)
                restored += 1
        self.orphans.update(key for key in table.orphans if key in held and key not in self.masks)
        self.domains.update((key, domain) for key, domain in table.domains.items()
                            if key in held and domain != DEFAULT_DOMAIN)
        self.version += 1
        return restored
