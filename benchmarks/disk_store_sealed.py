"""Disk store throughput with chunks sealed on the engine (`encrypt_stores`, services/engine/tiers/sealed.py)
against in clear, next to the machine's memcpy (and one thread's sealing and opening) measured in the same run;
prints JSON.

The store runs as its own process on a real nats-server, as in benchmarks/disk_store.py (whose chunks, pipelined
puts and gets this reuses): this process is the engine side, its pool a shared segment lent to the store. The
sealed side goes through `SealedTier` as an engine's does: each put seals from the pool slot into a staging slot
of a lent pool of its own, each get reads into a staging slot and opens into the pool slot. Plain and sealed
alternate in rounds of `--round-mib` (ABBA), each on keys of its own; reads follow in the same order. The page
cache is left alone unless `--drop-caches` (a shared machine's other users would pay for it): reads are then
cached on both sides alike.

    python benchmarks/disk_store_sealed.py --total-gib 1 --chunk-mib 16
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvmesh.shared.messaging import bus

from kvmesh.services.engine.tiers.disk import DiskStoreClient
from kvmesh.services.engine.tiers.memory_pool import MemoryPool
from kvmesh.services.engine.tiers.sealed import SEAL_OVERHEAD, ChunkSealer, SealedTier
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, _die_with_parent

from disk_store import (CALLER, GiB, MiB, STORE_ID, Chunks, drop_page_cache, store_read, store_write,  # beside this
                        wait_healthy)


def best_gbps(nbytes: int, call: Callable[[], object], repeat: int = 20) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return round(nbytes / best / 1e9, 3)


def cpu_seconds(pid: int) -> float:
    """CPU time process `pid`'s live threads have used so far, to the nanosecond (Linux schedstat; /proc/PID/stat
    counts in 10 ms ticks, coarser than one round)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def ceilings(chunks: Chunks, sealer: ChunkSealer) -> dict[str, float]:
    """One thread's rates on one chunk, the best of 20: memcpy (the machine's ceiling), sealing (AES-GCM and the
    store's xxh3 of the sealed bytes) and opening."""
    data = chunks.view(0)
    src = np.frombuffer(data, dtype=np.uint8)
    dst = np.empty_like(src)
    sealed, opened = memoryview(bytearray(len(data) + SEAL_OVERHEAD)), memoryview(bytearray(len(data)))
    chunks.stamp(0)
    meta = chunks.meta(0)
    stored = sealer.seal_into(meta, data, sealed)
    return {"memcpy_GBps": best_gbps(len(data), lambda: np.copyto(dst, src)),
            "seal_GBps": best_gbps(len(data), lambda: sealer.seal_into(meta, data, sealed)),
            "open_GBps": best_gbps(len(data), lambda: sealer.open_into(meta.key, stored, sealed, opened))}


async def run(args: argparse.Namespace) -> dict[str, object]:
    chunk_bytes = int(args.chunk_mib * MiB)
    count = max(2, int(args.total_gib * GiB) // chunk_bytes) // 2 * 2  # half plain, half sealed
    half = count // 2
    base = Path(tempfile.mkdtemp(prefix="kvmesh-bench-sealed-", dir=args.dir))
    chunks = Chunks(count, chunk_bytes, args.slots)
    staging = MemoryPool(args.inflight * (chunk_bytes + SEAL_OVERHEAD + 4096), chunk_bytes + SEAL_OVERHEAD,
                         use_shm=True, pin=False)
    server = EmbeddedNats().start()
    command = [sys.executable, "-m", "kvmesh.services.disk_store", "--nats-url", server.url, "--dir",
               str(base / "store"), "--max-size-gb", f"{count * (chunk_bytes + 8192) * 1.1 / GiB + 0.1:.3f}",
               "--store-id", STORE_ID, "--staging-mb", str(args.staging_mb), "--log-level", "WARNING"] + \
        (["--no-fsync"] if args.no_fsync else [])
    store = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    nc = await bus.connect(server.url, name="bench-client")
    sealer = ChunkSealer("bench", os.urandom(32))
    machine = ceilings(chunks, sealer)
    try:
        await wait_healthy(nc, store)
        plain = DiskStoreClient(nc, STORE_ID, CALLER, request_timeout=10.0, data_timeout=60.0)
        misses: collections.Counter[str] = collections.Counter()
        sealed = SealedTier(plain, sealer, staging, misses)
        step = max(1, int(args.round_mib * MiB) // chunk_bytes)
        rounds = [(range(start, min(start + step, half)), range(half + start, half + min(start + step, half)))
                  for start in range(0, half, step)]
        seconds = collections.Counter[str]()
        cpu = collections.Counter[str]()  # CPU seconds of this process (the engine side) and of the store
        for phase, timed in (("write", store_write), ("read", store_read)):
            if phase == "read" and args.drop_caches:
                drop_page_cache()
            for r, (plain_keys, sealed_keys) in enumerate(rounds):
                sides = [("plain", plain, plain_keys), ("sealed", sealed, sealed_keys)]
                for name, client, indices in (sides if r % 2 == 0 else sides[::-1]):
                    engine_cpu, store_cpu = cpu_seconds(os.getpid()), cpu_seconds(store.pid)
                    took = await timed(client, chunks, indices, args.inflight)  # type: ignore[arg-type]
                    seconds[f"{name}_{phase}"] += took
                    cpu[f"{name}_{phase}_engine"] += cpu_seconds(os.getpid()) - engine_cpu
                    cpu[f"{name}_{phase}_store"] += cpu_seconds(store.pid) - store_cpu
        stats = (await plain.stats())[0]
        await plain.close()
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
        staging.close()
        shutil.rmtree(base, ignore_errors=True)

    side_bytes = half * chunk_bytes

    def gbps(key: str) -> float:
        return round(side_bytes / seconds[key] / 1e9, 3)

    return {
        "benchmark": "disk_store_sealed", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python", *sys.argv]), "round_mib": args.round_mib, "chunk_bytes": chunk_bytes,
        "chunks_per_side": half, "rounds": len(rounds), "inflight": args.inflight, "fsync_per_file": not args.no_fsync,
        "page_cache_dropped": bool(args.drop_caches), "staging_mb": args.staging_mb,
        **machine,
        "plain_write_GBps": gbps("plain_write"), "sealed_write_GBps": gbps("sealed_write"),
        "write_sealed_vs_plain": round(seconds["plain_write"] / seconds["sealed_write"], 3),
        "plain_read_GBps": gbps("plain_read"), "sealed_read_GBps": gbps("sealed_read"),
        "read_sealed_vs_plain": round(seconds["plain_read"] / seconds["sealed_read"], 3),
        # CPU seconds per GB each side's reads and writes took, in this process and in the store's: on a machine
        # whose cores the plain side already keeps busy, the sealed side's extra pass bounds its ratio
        "cpu_s_per_GB": {key: round(value / (side_bytes / 1e9), 3) for key, value in sorted(cpu.items())},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "sealed_misses": dict(misses),
        "store_stats": {k: stats.details.get(k) for k in ("writes_done", "write_errors", "hits", "puts_pool",
                                                          "puts_inline", "gets_pool", "gets_inline")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-gib", type=float, default=1.0, help="both sides together")
    parser.add_argument("--chunk-mib", type=float, default=16.0)
    parser.add_argument("--slots", type=int, default=8, help="chunk slots in the client's shared pool")
    parser.add_argument("--inflight", type=int, default=4, help="puts/gets in flight (<= slots)")
    parser.add_argument("--round-mib", type=float, default=32.0, help="bytes per side per round")
    parser.add_argument("--staging-mb", type=float, default=512.0, help="the store's staging; 0 = write-through")
    parser.add_argument("--no-fsync", action="store_true")
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache before the reads (root)")
    parser.add_argument("--dir", help="where the store's files go (default: $TMPDIR)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
