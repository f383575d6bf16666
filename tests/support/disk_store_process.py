"""The disk store as its own process, for tests (tests/stores/, and the engine tests of pool lending):
`StoreProcess` (`python -m kvmesh.services.disk_store`, restartable, never outliving the test), deterministic
chunks (`key_of`, `data_of`, `meta_of`) and the slots of a pool lent to it (`slot`, `put_pool`)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.disk import DiskStoreClient
from kvmesh.shared.errors import MeshUnavailable
from kvmesh.shared.messaging.embedded_nats import _die_with_parent
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.shm import SharedSegment

from support.waiting import WAIT_S, wait_until_async

CHUNK = 256 * 1024
SLOTS = 8
ENGINE = protocol.Principal.engine("test").producer("w0")  # the caller path the tests' clients send as


def key_of(i: int) -> bytes:
    return hashlib.blake2b(f"chunk-{i}".encode(), digest_size=16).digest()


def data_of(i: int, nbytes: int = CHUNK) -> bytes:
    return hashlib.shake_256(f"data-{i}".encode()).digest(nbytes)


def meta_of(i: int, nbytes: int = CHUNK) -> protocol.ChunkMeta:
    return protocol.ChunkMeta(key=key_of(i), num_tokens=256, shape=[nbytes], dtype="uint8", fmt="test",
                              nbytes=nbytes, checksum=chunk_file.checksum(data_of(i, nbytes)))


class StoreProcess:
    """One disk store process on `root`; restartable; never outlives the test (parent-death signal + stop)."""

    def __init__(self, nats_url: str, root: Path, log_dir: Path, max_size_gb: float = 1.0) -> None:
        self.nats_url, self.root, self.log_dir, self.max_size_gb = nats_url, root, log_dir, max_size_gb
        self.store_id = f"disk-{uuid.uuid4().hex[:8]}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, *extra: str) -> None:
        self.starts += 1
        log = open(self.log_dir / f"store-{self.starts}.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.services.disk_store", "--nats-url", self.nats_url, "--dir", str(self.root),
             "--max-size-gb", str(self.max_size_gb), "--store-id", self.store_id, *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_parent,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        log.close()

    async def wait_healthy(self, nc) -> None:
        async def healthy() -> bool:
            assert self.process is not None and self.process.poll() is None, self.log()
            try:
                await bus.request(nc, protocol.Subjects.health(protocol.store_path(self.store_id)),
                                  protocol.HealthRequest(), protocol.HealthReply, 1)
            except MeshUnavailable:
                return False
            return True

        try:
            await wait_until_async(healthy, what="the store healthy", interval=0.05)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}:\n{self.log()}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = WAIT_S) -> int | None:
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(sig)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise AssertionError(f"store did not stop on signal {sig}:\n{self.log()}")

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.log_dir.glob("store-*.log")))


def slot(segment: SharedSegment, i: int) -> ChunkBuffer:
    offset = (i % SLOTS) * CHUNK
    return ChunkBuffer(view=segment.buf[offset:offset + CHUNK], pool=segment, pool_offset=offset)


async def put_pool(client: DiskStoreClient, segment: SharedSegment, i: int) -> bool:
    buffer = slot(segment, i)
    buffer.view[:] = data_of(i)
    return await client.put(meta_of(i), buffer)
