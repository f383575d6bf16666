"""The disk store's own files besides the chunks: the directory lock (the pins and claims files are
shared/store_kit/state_file.py's `StoreState`, the same as a persisting remote store's).

Chunk files, and the start-up scan of the directory, are shared/wire/chunk_file.py's (the same for the remote
store's persistence). Everything here is blocking file I/O and runs on the store's I/O thread pool (or before
the event loop serves anything, at start).

Directory layout: `<root>/<2 hex>/<32 hex>.kvc` chunk files (chunk_file.chunk_path), `<root>/.lock` (flock
held by the running store), `<root>/pins.msgpack` (the pins, on disk before a pin, unpin, clear, remove or wipe
is answered), `<root>/claims.msgpack` (who put each chunk: on disk before a clear, remove or wipe is answered;
the claims puts add are saved at most once a second and at close). A chunk the claims file does not name (a
crash within that second, or a directory from before claims) has no claim: it is kept until evicted or wiped.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvmesh.shared.errors import StoreError

LOCK_NAME = ".lock"


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
