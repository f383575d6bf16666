"""Small state files beside a store's chunks (pins and claims, the disk store's and a persisting remote
store's): msgpack, rewritten crash-safely (temporary file, fsync, rename, directory fsync), and kept in step with
the index by `CoalescedSave`; `StoreState` is the pair of them for one store directory.

When each is on disk: a pin, unpin, clear, remove or wipe is answered only once the files hold its effect
(`StoreState.save_now`: the requests that arrive while one write runs share the next write). Claims that puts
add are saved in the background, at most once per CLAIMS_SAVE_INTERVAL and at close: a crash may lose the
claims of the last second's puts (those chunks are then unclaimed: kept until evicted or wiped).

`CoalescedSave` runs on the store's event loop: it snapshots the state there (the index has no locks) and writes
the file on a thread. Reads happen once, at start, before the store serves.

The pins file (`save_pins` / `load_pins`) is `{key: [count, expires_at, {owner: count}]}`, `expires_at` a
wall-clock time or None (until unpinned): wall-clock, because the index's pins expire on the monotonic clock,
which restarts with the machine. A file from before pins had owners (`[count, expires_at]`) loads its pins as
unowned (the operator's: a wipe drops them; no engine's unpin does).

The claims file (`save_claims` / `load_claims`) is `{"callers": [path, ...], "masks": {key: mask}, "orphans":
[key, ...], "domains": {key: domain}, "unclaimed": [key, ...]}`: bit i of a key's mask is `callers[i]`, so a
chunk costs its key and a small int, however many callers claim it; `domains` names the sharing domain of the
chunks not in the default one; `unclaimed` the held chunks nobody claims. Where several domains use the store, a
chunk file the claims file does not name at all is dropped at start (`StoreState.restore`): its domain is
unknown.

The retention file (`save_retention` / `load_retention`; kept by a store that asks for it, the persisting remote
store: the disk store keeps retention in its index snapshot) is `{key: [owner, priority, lease_end]}`, the
retained chunks' owning principal, priority and wall-clock lease end (None: no lease), saved as the claims are
(at most once per CLAIMS_SAVE_INTERVAL: a crash may lose the last second's). Read back as untrusted input
(shared/store_kit/retention_restore.py: out-of-range entries dropped, lease ends clamped to 30 days, counted) and
re-taken within each owner's share as the store's `--retained-share` sets it at that start; a chunk it does not
name is unretained.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

import msgpack

from kvmesh.shared.store_kit.chunk_claims import ClaimTable
from kvmesh.shared.store_kit.chunk_index import ChunkIndex
from kvmesh.shared.store_kit.chunk_pins import UNOWNED
from kvmesh.shared.store_kit.retention_restore import bounded_retention, restore_retention
from kvmesh.shared.wire.chunk_file import fsync_directory
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)

T = TypeVar("T")

CLAIMS_NAME = "claims.msgpack"
PINS_NAME = "pins.msgpack"
RETENTION_NAME = "retention.msgpack"
MAX_OWNER_CHARS = 1024  # a principal's name in a retention file: far more than any real one
CLAIMS_SAVE_INTERVAL = 1.0  # seconds between two rewrites of a claims file (every put changes the claims)


def write_atomically(path: Path, value: Any) -> None:
    """Replace `path` with `value` as msgpack, crash-safely and durably (`write_bytes_atomically`)."""
    write_bytes_atomically(path, msgpack.packb(value, use_bin_type=True))


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, crash-safely and durably: readers see the old file or the new one, and once
    this returns the new one survives a crash (the rename is fsync'd with the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def read_msgpack(path: Path, what: str) -> Any | None:
    """The msgpack value in `path`; None when there is no file or it is unreadable (logged: a damaged state
    file must not stop the store, which then starts without that state)."""
    try:
        return msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        return None
    except Exception as exc:
        log.warning("%s: unreadable %s file, starting without %s (%s)", path, what, what, exc)
        return None


def save_claims(path: Path, table: ClaimTable) -> None:
    write_atomically(path, {"callers": table.callers, "masks": table.masks, "orphans": table.orphans,
                            "domains": table.domains, "unclaimed": table.unclaimed})


def load_claims(path: Path) -> ClaimTable:
    """The persisted claims; none when the file is missing or damaged (the chunks are then unclaimed: kept until
    evicted or wiped)."""
    raw = read_msgpack(path, "claims")
    try:
        if raw is not None:
            return ClaimTable([str(c) for c in raw["callers"]], {bytes(k): int(m) for k, m in raw["masks"].items()},
                              list(map(bytes, raw.get("orphans", []))),
                              {bytes(k): str(d) for k, d in raw.get("domains", {}).items()},
                              list(map(bytes, raw.get("unclaimed", []))))  # 10^6 at a big store's start
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        log.warning("%s: malformed claims file, starting without claims (%s)", path, exc)
    return ClaimTable([], {})


@dataclass(frozen=True)
class PinRecord:
    """A pin as it is persisted: nesting count and wall-clock expiry (None = until unpinned)."""

    count: int
    expires_at: float | None
    owners: dict[str, int] | None = None  # owner -> its pins; None: all `count` unowned (a file from before owners)

    def owner_counts(self) -> dict[str, int]:
        return self.owners if self.owners else {UNOWNED: max(1, self.count)}


def pin_records(index: ChunkIndex[Any]) -> dict[ChunkKey, PinRecord]:
    """The index's live pins, to persist."""
    now = time.time()
    return {key: PinRecord(count, None if left is None else now + left, index.pin_owners(key))
            for key, (count, left) in index.pins().items()}


def restore_pins(index: ChunkIndex[Any], records: dict[ChunkKey, PinRecord]) -> int:
    """Re-take persisted pins on the held keys (expired ones are dropped); how many keys were pinned."""
    now = time.time()
    restored = 0
    for key, record in records.items():
        if key not in index or (record.expires_at is not None and record.expires_at <= now):
            continue
        ttl = None if record.expires_at is None else record.expires_at - now
        domain = index.domain_of(key)  # held: restored with the claims, before the pins (StoreState.restore)
        assert domain is not None
        for owner, count in record.owner_counts().items():
            for _ in range(count):
                index.pin([key], ttl, owner=owner, domain=domain)
        restored += 1
    return restored


def save_pins(path: Path, records: dict[ChunkKey, PinRecord]) -> None:
    write_atomically(path, {k: [r.count, r.expires_at, r.owner_counts()] for k, r in records.items()})


def load_pins(path: Path) -> dict[ChunkKey, PinRecord]:
    """The persisted pins; none when the file is missing or damaged (logged: the chunks are then unpinned)."""
    raw = read_msgpack(path, "pins")
    try:
        return {bytes(k): PinRecord(int(c), None if e is None else float(e),
                                    {str(o): int(n) for o, n in rest[0].items() if int(n) > 0} if rest else None)
                for k, (c, e, *rest) in (raw or {}).items()}
    except Exception as exc:  # a damaged pins file must not stop the store
        log.warning("%s: malformed pins file, starting without pins (%s)", path, exc)
        return {}


RetentionRecord = tuple[ChunkKey, str, int, float | None]  # key, owner, priority, wall-clock lease end or None


def save_retention(path: Path, records: list[RetentionRecord]) -> None:
    write_atomically(path, {key: [owner, priority, lease_end] for key, owner, priority, lease_end in records})


def load_retention(path: Path) -> tuple[list[RetentionRecord], int]:
    """The persisted retentions, bounds checked, and how many were dropped or clamped; none when the file is
    missing or damaged (logged: the chunks are then unretained)."""
    raw = read_msgpack(path, "retention")
    if not isinstance(raw, dict):
        if raw is not None:
            log.warning("%s: malformed retention file, starting without retention", path)
        return [], 0
    records: list[RetentionRecord] = []
    dropped, now = 0, time.time()
    for key, value in raw.items():
        fields = value if isinstance(value, list) and len(value) == 3 else [None, None, None]
        owner = fields[0]
        bounded = bounded_retention(fields[1], fields[2], now) if isinstance(owner, str) and \
            len(owner) <= MAX_OWNER_CHARS and isinstance(key, bytes) else None
        if bounded is not None:
            records.append((key, owner, bounded[0], bounded[1]))
        dropped += bounded is None or bounded[2]
    return records, dropped


class CoalescedSave(Generic[T]):
    """Keeps a file in step with some state: `soon()` after a change starts a background save unless one runs;
    the running one saves again while the state moved meanwhile (`version()`), so a burst of changes costs a few
    writes, never one per change. `min_interval` spaces the writes out (claims change with every put: one
    rewrite and fsync per interval at most, not one per put). `save_now()` waits until the file holds the state
    as it is at the call (skipping the interval); its callers share writes. `close()` writes what is left.

    `snapshot()` runs on the loop, `write(snapshot)` on `executor` (None: the loop's default).
    """

    def __init__(self, what: str, version: Callable[[], int], snapshot: Callable[[], T],
                 write: Callable[[T], None], min_interval: float = 0.0, executor: Executor | None = None) -> None:
        self.what = what
        self.executor = executor
        self._version = version
        self._snapshot = snapshot
        self._write = write
        self._min_interval = min_interval
        self._saved = version()
        self._last_write = -float("inf")  # monotonic
        self._task: asyncio.Task[None] | None = None
        self._wanted = self._saved  # the newest version someone waits for (save_now, close): no interval for it
        self._nudge = asyncio.Event()  # set when _wanted moves, to cut an interval wait short
        self._error: OSError | None = None  # of the last write, None once one succeeds

    def mark_saved(self) -> None:
        """The file already holds the current state (just loaded from it)."""
        self._saved = self._version()

    def soon(self) -> None:
        if self._version() != self._saved and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self._save_while_changed())

    async def save_now(self) -> None:
        """Return once the file holds the state as it is now (or newer); raise OSError if writing it failed.

        Joins the save under way: every caller that arrives while one write runs is covered by the next one, so
        a burst of callers costs two writes at most, not one each. Versions only grow, so "saved >= wanted"
        means covered; a save task ends only once it saved the latest version, or failed.
        """
        wanted = self._version()
        if self._saved >= wanted:
            return
        self._wanted = max(self._wanted, wanted)  # no waiting out min_interval for this version
        self._nudge.set()
        self.soon()  # or join the save under way: it goes on until the file holds the latest version
        assert self._task is not None
        await asyncio.wait([self._task])  # not cancelled with us: other callers share it
        if self._saved < wanted:
            raise self._error or OSError(f"could not save {self.what}")

    async def _save_while_changed(self) -> None:
        loop = asyncio.get_running_loop()
        while (version := self._version()) != self._saved:
            wait = self._last_write + self._min_interval - time.monotonic()
            if wait > 0 and self._saved >= self._wanted:  # nobody waits: space the writes out
                self._nudge.clear()
                try:
                    await asyncio.wait_for(self._nudge.wait(), wait)
                except TimeoutError:
                    pass
                continue  # the state may have moved while we waited: snapshot the latest
            try:
                await loop.run_in_executor(self.executor, self._write, self._snapshot())
            except OSError as exc:
                log.warning("could not save %s: %s", self.what, exc)
                self._error = exc
                return
            self._saved, self._error = version, None
            self._last_write = time.monotonic()

    async def close(self) -> None:
        """Finish the save under way without waiting out the interval, then write what is still unsaved."""
        self._wanted = max(self._wanted, self._version())
        self._nudge.set()
        if self._task is not None:
            await asyncio.wait([self._task])
        if self._version() != self._saved:
            try:
                await asyncio.get_running_loop().run_in_executor(self.executor, self._write, self._snapshot())
                self._saved = self._version()
            except OSError as exc:
                log.warning("could not save %s: %s", self.what, exc)


@dataclass(frozen=True)
class Restored:
    """What `StoreState.restore` did: keys that got pins, keys that got claims, and the chunks it forgot (the
    store frees their bytes)."""

    pinned: int
    claimed: int
    strays: list[tuple[ChunkKey, Any]]
    retained: int = 0  # keys whose persisted retention was re-taken
    retention_dropped: int = 0  # persisted retentions out of bounds: dropped, or their lease end clamped


class StoreState:
    """A store's pins file and claims file in `root` (and its retention file: `keeps_retention`), in step with its
    `index`.

    `restore()` reads them at start (blocking, before the store serves); `save_soon()` after any change (puts'
    claims: coalesced, at most once per CLAIMS_SAVE_INTERVAL); `save_now()` before answering an op whose effect
    must survive a crash once answered (pin, unpin, clear, remove, wipe); `close()` last.
    """

    def __init__(self, root: Path, index: ChunkIndex[Any], executor: Executor | None = None,
                 keeps_retention: bool = False) -> None:
        self.root = root
        self.index = index
        self._pins = CoalescedSave("pins", lambda: index.pins_version, lambda: pin_records(index),
                                   lambda records: save_pins(root / PINS_NAME, records), executor=executor)
        self._claims = CoalescedSave("claims", lambda: index.claims_version, index.claim_table,
                                     lambda table: save_claims(root / CLAIMS_NAME, table),
                                     min_interval=CLAIMS_SAVE_INTERVAL, executor=executor)
        self._retention = CoalescedSave("retention", lambda: index.retention_version, index.retentions,
                                        lambda records: save_retention(root / RETENTION_NAME, records),
                                        min_interval=CLAIMS_SAVE_INTERVAL, executor=executor) \
            if keeps_retention else None

    def _saves(self) -> list[CoalescedSave[Any]]:
        return [self._pins, self._claims, *([self._retention] if self._retention is not None else [])]

    @property
    def executor(self) -> Executor | None:
        return self._pins.executor

    @executor.setter
    def executor(self, executor: Executor | None) -> None:
        for save in self._saves():
            save.executor = executor

    def restore(self, several_domains: bool = False, retained_share: float = 0.0) -> Restored:
        """Re-take the persisted pins and claims on the held keys.

        A held chunk the claims file does not name was put in the last moments before a crash (the file is
        rewritten at most once a CLAIMS_SAVE_INTERVAL), so its sharing domain is unknown. Where only the default
        domain can have put it, it is kept (in the default domain, unclaimed: a crash of a single-tenant store,
        or of an engine's embedded one, loses nothing). Where another domain could have (`several_domains`: the
        store's map names one, or the claims file holds chunks of one), it is forgotten
        (`ChunkIndex.forget_unrecorded`), never kept readable by the default domain; the store frees what
        `Restored.strays` lists. A directory without a claims file (a store from before claims, or a first
        start) keeps every chunk and gets a claims file now. With `keeps_retention`, the retention file's
        retentions are re-taken within `retained_share` of the capacity per owner (`restore_retention`)."""
        claims_file = self.root / CLAIMS_NAME
        recorded = claims_file.exists()
        table = load_claims(claims_file)
        # claims first: they carry each chunk's sharing domain, which a pin is taken in
        claimed = self.index.restore_claims(table)
        strays = self.index.forget_unrecorded(table) if recorded and (several_domains or table.domains) else []
        pinned = restore_pins(self.index, load_pins(self.root / PINS_NAME))
        retained = dropped = 0
        if self._retention is not None:
            records, dropped = load_retention(self.root / RETENTION_NAME)
            retained = sum(restore_retention(self.index, key, owner, priority, lease_end, retained_share)
                           for key, owner, priority, lease_end in records)
            if dropped or retained != len(records):  # so that no stale entry retains a chunk put again later
                save_retention(self.root / RETENTION_NAME, self.index.retentions())
        if not recorded or strays:
            self.root.mkdir(parents=True, exist_ok=True)  # a first start: the store makes it after restoring
            save_claims(claims_file, self.index.claim_table())
        for save in self._saves():  # the files already say so
            save.mark_saved()
        return Restored(pinned, claimed, strays, retained, dropped)

    def save_soon(self) -> None:
        for save in self._saves():
            save.soon()

    async def save_now(self) -> None:
        """The files hold the index as it is now; OSError if one could not be written."""
        results = await asyncio.gather(*(save.save_now() for save in self._saves()), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def close(self) -> None:
        for save in self._saves():
            await save.close()
