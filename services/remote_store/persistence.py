"""Optional persistence of the remote store: a directory of chunk files mirroring what the memory holds.

Runs in the store process. `Persister` keeps one FIFO of writes and deletes, consumed by one asyncio task on
the store's loop that runs each file operation in a worker thread: a delete queued after a write of the same
key therefore lands after it, so a removed chunk never comes back at the next start. Files use the shared
self-describing format (shared/wire/chunk_file.py: crash-safe rename, checksum), the same as the disk store's.
Writes are behind the put's reply: a crash loses at most the chunks still queued, never a file's integrity.
At start the store lists the files with `chunk_file.scan_directory` (the disk store's scan too), which also
removes the leftovers of a crash.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable, Protocol

from kvmesh.shared import protocol
from kvmesh.shared.aio import cancel_and_wait
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import ChunkKey

log = logging.getLogger(__name__)


class PersistableChunk(Protocol):
    meta: protocol.ChunkMeta
    dropped: bool

    def data(self) -> memoryview: ...


class Persister:
    """Write-behind mirror of the memory store in `root`. `done(chunk)` is called after each write attempt."""

    def __init__(self, root: Path, done: Callable[[PersistableChunk], None], fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        self._done = done
        self._queue: asyncio.Queue[tuple[str, ChunkKey, PersistableChunk | None]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._unfinished = 0  # queued plus the one being written: the queue's size misses that one
        self.failures = 0

    @property
    def pending(self) -> int:
        """File operations not finished yet, the one in progress included."""
        return self._unfinished

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.get_running_loop().create_task(self._run())

    def write(self, chunk: PersistableChunk) -> None:
        """Queue a chunk's file; the caller keeps the chunk's bytes alive until `done(chunk)`."""
        self._unfinished += 1
        self._queue.put_nowait(("write", chunk.meta.key, chunk))

    def delete(self, key: ChunkKey) -> None:
        self._unfinished += 1
        self._queue.put_nowait(("delete", key, None))

    async def stop(self, timeout: float = 30.0) -> None:
        """Finish the queued work (up to `timeout` seconds), then stop."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
        except asyncio.TimeoutError:
            log.warning("persistence of %s: %d file operations left undone at stop", self.root, self.pending)
        await cancel_and_wait([self._task])
        self._task = None

    async def _run(self) -> None:
        while True:
            op, key, chunk = await self._queue.get()
            try:
                if op == "write":
                    assert chunk is not None
                    try:
                        if not chunk.dropped:  # removed meanwhile: a delete follows in the queue anyway
                            await asyncio.to_thread(chunk_file.write_chunk_file, self.root, chunk.meta,
                                                    chunk.data(), self.fsync)
                    finally:
                        self._done(chunk)
                else:
                    await asyncio.to_thread(chunk_file.unlink_chunk, self.root, key)
            except Exception as exc:  # a full or failing disk costs persistence, never the memory store
                self.failures += 1
                log.warning("persistence of %s: %s of chunk %s failed: %s", self.root, op, key.hex(), exc)
            finally:
                self._unfinished -= 1
                self._queue.task_done()
