"""Claims on a store's chunks: who put each chunk, as caller masks, what a clear took back, and the table that
persists them. `ChunkIndex` (shared/chunk_index.py) keeps them with its chunks.

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
from typing import Generic, Protocol, TypeVar

from kvmesh.shared.keys import ChunkKey


class _Entry(Protocol):
    @property
    def num_tokens(self) -> int:
        ...


E = TypeVar("E", bound=_Entry)


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
