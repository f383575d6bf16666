"""The disk store's own files besides the chunks: the directory lock, the pins file and the claims file.

Chunk files, and the start-up scan of the directory, are shared/chunk_file.py's (the same for the remote
store's persistence). Everything here is blocking file I/O and runs on the store's I/O thread pool (or before
the event loop serves anything, at start).

Directory layout: `<root>/<2 hex>/<32 hex>.kvc` chunk files (chunk_file.chunk_path), `<root>/.lock` (flock
held by the running store), `<root>/pins.msgpack` (the pins, rewritten on change), `<root>/claims.msgpack` (who
put each chunk, rewritten at most once a second and at close: shared/state_file.py). A chunk the claims file
does not name (a crash within that second, or a directory from before claims) has no claim: it is kept until
evicted or wiped.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from kvmesh.shared.errors import StoreError
from kvmesh.shared.keys import ChunkKey
from kvmesh.shared.state_file import read_msgpack, write_atomically
from kvmesh.services.disk_store.index import PinRecord

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


def load_pins(root: Path) -> dict[ChunkKey, PinRecord]:
    path = root / PINS_NAME
    raw = read_msgpack(path, "pins")
    try:
        return {bytes(k): PinRecord(int(c), None if e is None else float(e)) for k, (c, e) in (raw or {}).items()}
    except Exception as exc:  # a damaged pins file must not stop the store
        log.warning("%s: malformed pins file, starting without pins (%s)", path, exc)
        return {}


def save_pins(root: Path, records: dict[ChunkKey, PinRecord]) -> None:
    """Rewrite the pins file crash-safely (temporary file + rename)."""
    write_atomically(root / PINS_NAME, {k: [r.count, r.expires_at] for k, r in records.items()})
