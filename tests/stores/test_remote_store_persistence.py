"""The remote store's write-behind to its persist directory (services/remote_store/persistence.py).

`pending` is what the store reports as `pending_writes`: callers wait for 0 before relying on the files (a
restart reads them back), so the write in progress must count, not only the queued ones.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmesh.services.remote_store import persistence
from kvmesh.shared import protocol

from support.waiting import WAIT_S, wait_until_async


@dataclass
class Chunk:
    meta: protocol.ChunkMeta
    payload: bytes
    dropped: bool = False

    def data(self) -> memoryview:
        return memoryview(self.payload)


async def test_pending_counts_the_write_in_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()
    written: list[bytes] = []

    def slow_write(root: Path, meta: protocol.ChunkMeta, data: memoryview, fsync: bool) -> None:
        started.set()
        release.wait(WAIT_S)  # a disk slower than the test
        written.append(meta.key)

    monkeypatch.setattr(persistence.chunk_file, "write_chunk_file", slow_write)
    done: list[Chunk] = []
    persister = persistence.Persister(tmp_path, done.append)
    persister.start()
    try:
        meta = protocol.ChunkMeta(key=bytes(16), num_tokens=1, shape=[4], dtype="uint8", fmt="L2TD", nbytes=4, checksum=1)
        persister.write(Chunk(meta, b"abcd"))
        assert persister.pending == 1
        await wait_until_async(started.is_set, what="the write to start")
        assert persister.pending == 1, "taken off the queue, not written yet"
        release.set()
        await wait_until_async(lambda: persister.pending == 0, what="the write to finish")
        assert written == [meta.key] and len(done) == 1
    finally:
        release.set()
        await persister.stop()
