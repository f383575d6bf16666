"""Small state files beside a store's chunks (the disk store's pins, both stores' claims): msgpack, rewritten
crash-safely (temporary file, fsync, rename), and kept in step with the index by `CoalescedSave`.

`CoalescedSave` runs on the store's event loop: it snapshots the state there (the index has no locks) and writes
the file on a thread. Reads happen once, at start, before the store serves.

The claims file (`save_claims` / `load_claims`) is `{"callers": [path, ...], "masks": {key: mask}, "orphans":
[key, ...]}`: bit i of a key's mask is `callers[i]`, so a chunk costs its key and a small int, however many
callers claim it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

import msgpack

from kvmesh.shared.chunk_index import ClaimTable

log = logging.getLogger(__name__)

T = TypeVar("T")

CLAIMS_NAME = "claims.msgpack"
CLAIMS_SAVE_INTERVAL = 1.0  # seconds between two rewrites of a claims file (every put changes the claims)


def write_atomically(path: Path, value: Any) -> None:
    """Replace `path` with `value` as msgpack, crash-safely: readers see the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(value, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    write_atomically(path, {"callers": table.callers, "masks": table.masks, "orphans": table.orphans})


def load_claims(path: Path) -> ClaimTable:
    """The persisted claims; none when the file is missing or damaged (the chunks are then unclaimed: kept until
    evicted or wiped)."""
    raw = read_msgpack(path, "claims")
    try:
        if raw is not None:
            return ClaimTable([str(c) for c in raw["callers"]], {bytes(k): int(m) for k, m in raw["masks"].items()},
                              [bytes(k) for k in raw.get("orphans", [])])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        log.warning("%s: malformed claims file, starting without claims (%s)", path, exc)
    return ClaimTable([], {})


class CoalescedSave(Generic[T]):
    """Keeps a file in step with some state: `soon()` after a change starts a background save unless one runs;
    the running one saves again while the state moved meanwhile (`version()`), so a burst of changes costs a few
    writes, never one per change. `min_interval` spaces the writes out (claims change with every put: one
    rewrite and fsync per interval at most, not one per put). `close()` writes what is left.

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
        self._hurry: asyncio.Event | None = None

    def mark_saved(self) -> None:
        """The file already holds the current state (just loaded from it)."""
        self._saved = self._version()

    def soon(self) -> None:
        if self._version() != self._saved and (self._task is None or self._task.done()):
            self._hurry = asyncio.Event()
            self._task = asyncio.ensure_future(self._save_while_changed(self._hurry))

    async def _save_while_changed(self, hurry: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while (version := self._version()) != self._saved:
            wait = self._last_write + self._min_interval - time.monotonic()
            if wait > 0 and not hurry.is_set():
                try:
                    await asyncio.wait_for(hurry.wait(), wait)
                except TimeoutError:
                    pass
                continue  # the state may have moved while we waited: snapshot the latest
            try:
                await loop.run_in_executor(self.executor, self._write, self._snapshot())
            except OSError as exc:
                log.warning("could not save %s: %s", self.what, exc)
                return
            self._saved = version
            self._last_write = time.monotonic()

    async def close(self) -> None:
        """Finish the save under way without waiting out the interval, then write what is still unsaved."""
        if self._hurry is not None:
            self._hurry.set()
        if self._task is not None:
            await asyncio.wait([self._task])
        if self._version() != self._saved:
            try:
                await asyncio.get_running_loop().run_in_executor(self.executor, self._write, self._snapshot())
                self._saved = self._version()
            except OSError as exc:
                log.warning("could not save %s: %s", self.what, exc)
