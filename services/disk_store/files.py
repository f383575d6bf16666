"""The disk store's directory housekeeping: the lock, the start-up scan, deletions, and the pins file.

Chunk files themselves are read and written with shared/chunk_file.py. Everything here is blocking file I/O
and runs on the store's I/O thread pool (or before the event loop serves anything, at start).

Directory layout: `<root>/<2 hex>/<32 hex>.kvc` chunk files (chunk_file.chunk_path), `<root>/.lock` (flock
held by the running store), `<root>/pins.msgpack` (the pins, rewritten on change).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack

from kvmesh.shared import chunk_file
from kvmesh.shared.errors import StoreError
from kvmesh.shared.keys import ChunkKey
from kvmesh.services.disk_store.index import Entry, PinRecord

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
PINS_NAME = "pins.msgpack"


def lock_directory(root: Path) -> int:
    """Create `root` if needed and take its lock, so two stores never share a directory; returns the fd."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StoreError(f"{root}: another disk store (pid {holder}) is using this directory") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


@dataclass(frozen=True)
class FoundChunk:
    key: ChunkKey
    entry: Entry
    last_used: float  # mtime: written at put, set again by every get, so it orders the LRU across restarts


@dataclass
class ScanReport:
    chunks: list[FoundChunk]  # least recently used first
    removed_tmp: int = 0
    removed_corrupt: int = 0
    seconds: float = 0.0


def scan(root: Path, threads: int = 8) -> ScanReport:
    """Index the chunk files under `root` from their headers; delete leftovers and bad files.

    `*.tmp` files (writes cut short by a crash) are deleted; a `.kvc` file whose header is unreadable, whose
    length disagrees with its header, or whose header names another key is deleted. Data checksums are
    verified on every read, not here, so the scan stays fast (one small read per file).
    """
    start = time.perf_counter()
    report = ScanReport(chunks=[])
    candidates: list[Path] = []
    for fan in sorted(root.iterdir()) if root.is_dir() else []:
        if not (fan.is_dir() and len(fan.name) == 2):
            continue
        for path in fan.iterdir():
            if path.name.endswith(chunk_file.TMP_SUFFIX):
                path.unlink(missing_ok=True)
                report.removed_tmp += 1
            elif path.name.endswith(chunk_file.SUFFIX):
                candidates.append(path)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="disk-scan") as pool:
        results = list(pool.map(lambda p: _inspect(root, p), candidates))
    for path, found in zip(candidates, results):
        if found is None:
            path.unlink(missing_ok=True)
            report.removed_corrupt += 1
        else:
            report.chunks.append(found)
    report.chunks.sort(key=lambda c: c.last_used)
    report.seconds = time.perf_counter() - start
    return report


def _inspect(root: Path, path: Path) -> FoundChunk | None:
    key = chunk_file.key_of_path(path)
    if key is None or chunk_file.chunk_path(root, key) != path:
        log.warning("%s: not a chunk file name of this store; deleting it", path)
        return None
    try:
        meta, offset = chunk_file.read_chunk_meta(path)
        stat = path.stat()
    except (chunk_file.CorruptChunkFile, OSError) as exc:
        log.warning("deleting bad chunk file: %s", exc)
        return None
    if meta.key != key:
        log.warning("%s: header names key %s; deleting it", path, meta.key.hex())
        return None
    entry = Entry(nbytes=meta.nbytes, file_bytes=offset + meta.nbytes, num_tokens=meta.num_tokens)
    return FoundChunk(key, entry, stat.st_mtime)


def unlink_chunk(root: Path, key: ChunkKey, only_inode: int | None = None) -> bool:
    """Delete a chunk's file; with `only_inode`, only if the name still points at that file (a newer write of
    the same key may have replaced it meanwhile). True if a file was deleted."""
    path = chunk_file.chunk_path(root, key)
    try:
        if only_inode is not None and path.stat().st_ino != only_inode:
            return False
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def load_pins(root: Path) -> dict[ChunkKey, PinRecord]:
    path = root / PINS_NAME
    try:
        raw = msgpack.unpackb(path.read_bytes(), raw=False)
        return {bytes(k): PinRecord(int(c), None if e is None else float(e)) for k, (c, e) in raw.items()}
    except FileNotFoundError:
        return {}
    except Exception as exc:  # a damaged pins file must not stop the store
        log.warning("%s: unreadable pins file, starting without pins (%s)", path, exc)
        return {}


def save_pins(root: Path, records: dict[ChunkKey, PinRecord]) -> None:
    """Rewrite the pins file crash-safely (temporary file + rename)."""
    path = root / PINS_NAME
    tmp = root / (PINS_NAME + ".tmp")
    payload = msgpack.packb({k: [r.count, r.expires_at] for k, r in records.items()}, use_bin_type=True)
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
