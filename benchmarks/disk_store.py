"""Disk store throughput against the raw disk, measured in the same run; prints JSON.

The store runs as its own process (`python -m kvmesh.services.disk_store`) on a real nats-server; this process
is the engine-side client: its buffer pool is one shared segment (a sealed memfd) of `--slots` chunk slots, lent
to the store over its pool socket, and puts/gets pass (pool token, offset) over NATS while the store copies /
reads the bytes in place.

    python benchmarks/disk_store.py --total-gib 2 --chunk-mib 32

Writes: store (puts pipelined, timed until every file is written and fsynced) and raw (the same bytes as
plain files, one fsync per file, sequential), alternating in rounds of `--round-mib` (ABBA order) because the
disk's speed drifts. Reads: the same rounds, the page cache dropped before each side's part: raw `readinto`,
store gets pipelined (checksum verified by the store). Without root the page cache cannot be dropped: the
JSON then says `"page_cache_dropped": false` and both reads are (equally) cached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.disk import DiskStoreClient
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, _die_with_parent
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KEY_BYTES
from kvmesh.shared.wire.shm import SharedSegment

MiB = 1024 * 1024
GiB = 1024 * MiB
STORE_ID = "bench-disk"
CALLER = protocol.Principal.engine("bench").producer("bench")  # puts and gets as one engine worker would


def drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def chunk_key(i: int) -> bytes:
    return i.to_bytes(KEY_BYTES, "big")


class Chunks:
    """`count` distinct chunks served from `slots` slots of one shared segment (random bytes, the chunk
    index stamped in the first 8 bytes of its slot)."""

    def __init__(self, count: int, nbytes: int, slots: int) -> None:
        self.count, self.nbytes, self.slots = count, nbytes, slots
        self.segment = SharedSegment.create(slots * nbytes)
        rng = np.random.default_rng(0)
        for s in range(slots):
            self.view(s)[:] = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        self.checksums = []
        for i in range(count):
            self.stamp(i)
            self.checksums.append(chunk_file.checksum(self.view(i % slots)))

    def view(self, slot: int) -> memoryview:
        return self.segment.buf[slot * self.nbytes:(slot + 1) * self.nbytes]

    def stamp(self, i: int) -> None:
        """Make slot i % slots hold chunk i."""
        self.view(i % self.slots)[:8] = i.to_bytes(8, "little")

    def meta(self, i: int) -> protocol.ChunkMeta:
        return protocol.ChunkMeta(key=chunk_key(i), num_tokens=256, shape=[self.nbytes], dtype="uint8",
                                  fmt="bench", nbytes=self.nbytes, checksum=self.checksums[i])

    def buffer(self, i: int) -> ChunkBuffer:
        slot = i % self.slots
        return ChunkBuffer(view=self.view(slot), pool=self.segment, pool_offset=slot * self.nbytes)

    def close(self) -> None:
        self.segment.close()


PUT_LATENCIES: list[float] = []  # seconds from put call to reply (when the engine may reuse its buffer)


async def store_write(client: DiskStoreClient, chunks: Chunks, indices: range, inflight: int) -> float:
    """Puts pipelined `inflight` deep; a slot is restamped only after its previous put was answered."""
    start = time.perf_counter()
    slot_free = [asyncio.Event() for _ in range(chunks.slots)]
    for event in slot_free:
        event.set()
    window = asyncio.Semaphore(inflight)

    async def put(i: int) -> None:
        try:
            began = time.perf_counter()
            if not await client.put(chunks.meta(i), chunks.buffer(i)):
                raise RuntimeError(f"put {i} refused")
            PUT_LATENCIES.append(time.perf_counter() - began)
        finally:
            slot_free[i % chunks.slots].set()
            window.release()

    tasks = []
    for i in indices:
        await window.acquire()
        await slot_free[i % chunks.slots].wait()
        slot_free[i % chunks.slots].clear()
        chunks.stamp(i)
        tasks.append(asyncio.create_task(put(i)))
    await asyncio.gather(*tasks)
    if not await client.wait_written(timeout=120):
        raise RuntimeError("store did not finish writing")
    return time.perf_counter() - start


async def store_read(client: DiskStoreClient, chunks: Chunks, indices: range, inflight: int) -> float:
    start = time.perf_counter()
    window = asyncio.Semaphore(min(inflight, chunks.slots))
    errors: list[str] = []

    async def get(i: int) -> None:
        async with window:
            meta = await client.get_into(chunk_key(i), chunks.buffer(i))
            if meta is None or meta.checksum != chunks.checksums[i] or \
                    int.from_bytes(chunks.view(i % chunks.slots)[:8], "little") != i:
                errors.append(f"chunk {i}: {'miss' if meta is None else 'wrong bytes'}")

    # A slot is reused only by chunk i + slots, and the window (<= slots) keeps them apart.
    await asyncio.gather(*(get(i) for i in indices))
    if errors:
        raise RuntimeError(f"{len(errors)} bad gets, first: {errors[0]}")
    return time.perf_counter() - start


def raw_write(directory: Path, chunks: Chunks, indices: range, fsync: bool) -> float:
    start = time.perf_counter()
    for i in indices:
        chunks.stamp(i)
        with open(directory / f"{i}.raw", "wb", buffering=0) as f:
            view, done = chunks.view(i % chunks.slots), 0
            while done < len(view):
                done += f.write(view[done:])
            if fsync:
                os.fsync(f.fileno())
    return time.perf_counter() - start


def raw_read(directory: Path, chunks: Chunks, indices: range) -> float:
    start = time.perf_counter()
    for i in indices:
        with open(directory / f"{i}.raw", "rb", buffering=0) as f:
            view, done = chunks.view(i % chunks.slots), 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise RuntimeError(f"raw file {i} is short")
                done += n
    return time.perf_counter() - start


async def wait_healthy(nc, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"disk store exited with code {process.returncode}")
        try:
            await bus.request(nc, protocol.Subjects.health(protocol.store_path(STORE_ID)), protocol.HealthRequest(),
                              protocol.HealthReply, 0.5)
            return
        except Exception:
            await asyncio.sleep(0.05)
    raise RuntimeError("disk store did not become healthy")


async def run(args: argparse.Namespace) -> dict[str, object]:
    chunk_bytes = int(args.chunk_mib * MiB)
    count = max(1, int(args.total_gib * GiB) // chunk_bytes)
    total = count * chunk_bytes
    base = Path(tempfile.mkdtemp(prefix="kvmesh-bench-", dir=args.dir))
    store_dir, raw_dir = base / "store", base / "raw"
    raw_dir.mkdir()
    chunks = Chunks(count, chunk_bytes, args.slots)
    server = EmbeddedNats().start()
    command = [sys.executable, "-m", "kvmesh.services.disk_store", "--nats-url", server.url, "--dir", str(store_dir),
               "--max-size-gb", f"{total * 1.1 / GiB + 0.1:.3f}", "--store-id", STORE_ID,
               "--writer-threads", str(args.writer_threads), "--staging-mb", str(args.staging_mb),
               "--log-level", "WARNING"] + (["--no-fsync"] if args.no_fsync else []) + \
        (["--durable-puts"] if args.durable_puts else [])
    store = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    nc = await bus.connect(server.url, name="bench-client")
    try:
        await wait_healthy(nc, store)
        client = DiskStoreClient(nc, STORE_ID, CALLER, request_timeout=10.0, data_timeout=60.0)
        # The disk's speed drifts a lot on shared machines: interleave store and raw in rounds, alternating
        # which goes first (ABBA), so both see the same conditions; sum each side's time.
        step = max(1, int(args.round_mib * MiB) // chunk_bytes)
        rounds = [range(start, min(start + step, count)) for start in range(0, count, step)]
        t_store_write = t_raw_write = t_store_read = t_raw_read = 0.0
        for r, indices in enumerate(rounds):
            for side in (("store", "raw") if r % 2 == 0 else ("raw", "store")):
                if side == "store":
                    t_store_write += await store_write(client, chunks, indices, args.inflight)
                else:
                    t_raw_write += raw_write(raw_dir, chunks, indices, fsync=not args.no_fsync)
        dropped = not args.no_drop_caches and drop_page_cache()
        for r, indices in enumerate(rounds):
            for side in (("raw", "store") if r % 2 == 0 else ("store", "raw")):
                if dropped:
                    drop_page_cache()
                if side == "store":
                    t_store_read += await store_read(client, chunks, indices, args.inflight)
                else:
                    t_raw_read += raw_read(raw_dir, chunks, indices)
        stats = (await client.stats())[0]
        await client.close()
    finally:
        await nc.close()
        store.terminate()
        try:
            store.wait(30)
        except subprocess.TimeoutExpired:
            store.kill()
            store.wait()
        server.stop()
        chunks.close()
        shutil.rmtree(base, ignore_errors=True)

    def gbps(seconds: float) -> float:
        return round(total / seconds / 1e9, 3)

    return {
        "benchmark": "disk_store", "total_bytes": total, "chunk_bytes": chunk_bytes, "chunks": count,
        "fsync_per_file": not args.no_fsync, "page_cache_dropped": dropped, "inflight": args.inflight,
        "rounds": len(rounds),
        "writer_threads": args.writer_threads, "staging_mb": args.staging_mb,
        "put_mode": "durable (reply after file and directory fsync)" if args.durable_puts else
                    "staged (reply after copy)" if args.staging_mb > 0 else "write-through (reply after fsync)",
        "store_write_GBps": gbps(t_store_write), "raw_write_GBps": gbps(t_raw_write),
        "write_ratio": round(t_raw_write / t_store_write, 3),
        "store_read_GBps": gbps(t_store_read), "raw_read_GBps": gbps(t_raw_read),
        "read_ratio": round(t_raw_read / t_store_read, 3),
        "put_reply_ms_p50": round(float(np.percentile(PUT_LATENCIES, 50)) * 1e3, 2),
        "put_reply_ms_p90": round(float(np.percentile(PUT_LATENCIES, 90)) * 1e3, 2),
        "store_stats": {k: stats.details.get(k) for k in ("writes_done", "write_errors", "hits", "corrupt_dropped",
                                                          "puts_pool", "puts_inline", "gets_pool", "gets_inline")},
        "filesystem_dir": str(args.dir or tempfile.gettempdir()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-gib", type=float, default=2.0)
    parser.add_argument("--chunk-mib", type=float, default=32.0)
    parser.add_argument("--slots", type=int, default=8, help="chunk slots in the client's shared pool")
    parser.add_argument("--inflight", type=int, default=4, help="puts/gets in flight (<= slots)")
    parser.add_argument("--round-mib", type=float, default=256.0,
                        help="store and raw alternate in rounds of this many MiB (ABBA order)")
    parser.add_argument("--writer-threads", type=int, default=1)
    parser.add_argument("--staging-mb", type=float, default=512.0, help="0 = write-through puts")
    parser.add_argument("--no-fsync", action="store_true")
    parser.add_argument("--durable-puts", action="store_true", help="the store's --durable-puts (no staging)")
    parser.add_argument("--no-drop-caches", action="store_true")
    parser.add_argument("--dir", help="where to put the store's and the raw files (default: $TMPDIR)")
    args = parser.parse_args()
    args.inflight = min(args.inflight, args.slots)
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
