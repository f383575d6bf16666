"""A disk store's restart from its index snapshot at one size (default 10^6 chunk files), on a shared machine.

`benchmarks/scale.py --services disk_store` draws the whole curve, but at 10^6 files its set-up (making the files,
a first start that reads every header and writes the snapshot) takes minutes of disk and CPU. Here the set-up runs
at the lowest CPU and I/O priority (nice 19, idle I/O class), so it can share a machine that is running tests, and
only the restarts are timed, back at normal priority: `DiskStore.open()` (directory lock, the snapshot read, names
listed, the index loaded), then one get of a held chunk (the restart to its first served hit), then until the
stat check of the files taken from the snapshot is done (served meanwhile), then the stop (which writes the next
snapshot). Ceiling, measured before each restart: `os.scandir` over the same files (scale.py's `scandir_count`).
The files stay in --dir, so a second run times restarts only. Prints one JSON line per restart, then the summary.

    python benchmarks/disk_store_restart.py --dir /var/tmp/kvmesh-restart [--files 1000000] [--restarts 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import subprocess
import time
from pathlib import Path

from scale import chunk_key, make_chunk_files, scandir_count  # benchmarks/scale.py, beside this file

from kvmesh.services.disk_store import snapshot
from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.store import DiskStore
from kvmesh.shared import protocol


def lowest_priority() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    subprocess.run(["ionice", "-c3", "-p", str(os.getpid())], check=False)


def normal_priority() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, 0)  # root may lower its niceness again
    subprocess.run(["ionice", "-c2", "-n4", "-p", str(os.getpid())], check=False)


def restart(options: DiskStoreOptions, files: int) -> dict[str, float]:
    scandir_count(str(options.root))  # warm, as the store's own listing finds them
    t0 = time.perf_counter()
    listed = scandir_count(str(options.root))
    scandir_s = time.perf_counter() - t0
    if listed != files:
        raise RuntimeError(f"{listed} chunk files listed, expected {files}")
    store = DiskStore(options)
    gc.collect()
    t0 = time.perf_counter()
    report = store.open()
    open_s = time.perf_counter() - t0

    async def serve_then_stop() -> tuple[float, float, float]:
        checks = store.start_checks()
        reply = await store.reader.get(protocol.GetRequest(key=chunk_key(files - 1)), "bench")
        hit_s = time.perf_counter() - t0
        if not reply.found:
            raise RuntimeError(f"the first get after the restart missed: {reply.error}")
        if checks is not None:
            await checks
        checked_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        await store.close()
        return hit_s, checked_s, time.perf_counter() - t1

    hit_s, checked_s, stop_s = asyncio.run(serve_then_stop())
    if report.trusted != files or store.counters["snapshot_files_dropped"]:
        raise RuntimeError(f"took {report.trusted} of {files} files from the snapshot, dropped "
                           f"{store.counters['snapshot_files_dropped']}")
    return {"open_s": round(open_s, 3), "restart_hit_s": round(hit_s, 3), "checked_s": round(checked_s, 3),
            "stop_s": round(stop_s, 3), "scandir_s": round(scandir_s, 3),
            "restart_vs_scandir": round(hit_s / scandir_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the chunk files are made (and kept)")
    parser.add_argument("--files", type=int, default=1_000_000, help="chunk files (default 10^6)")
    parser.add_argument("--restarts", type=int, default=3, help="timed restarts (default 3)")
    parser.add_argument("--chunk-bytes", type=int, default=64, help="data bytes per file (default 64)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    options = DiskStoreOptions(root=args.dir, capacity_bytes=1 << 50, store_id="restart-bench")
    if not (args.dir / snapshot.SNAPSHOT_NAME).exists():
        lowest_priority()
        t0 = time.perf_counter()
        make_chunk_files(args.dir, 0, args.files, args.chunk_bytes)
        store = DiskStore(options)
        store.open()  # every header read: no snapshot yet
        asyncio.run(store.close())  # writes it
        print(f"set-up (files made, first start, snapshot written) in {time.perf_counter() - t0:.0f} s at the lowest "
              "priority", flush=True)
    normal_priority()
    load_start = os.getloadavg()[0]
    runs = []
    for _ in range(args.restarts):
        runs.append(restart(options, args.files))
        print(json.dumps(runs[-1]), flush=True)
    best = min(runs, key=lambda r: r["restart_hit_s"])
    print(json.dumps({"files": args.files, "runs": runs, "loadavg_1m": [load_start, os.getloadavg()[0]]}))
    print(f"{args.files} chunk files: restart to the first hit {best['restart_hit_s']} s from the index snapshot "
          f"({best['restart_vs_scandir']}x os.scandir's {best['scandir_s']} s); files' stat checked at "
          f"{best['checked_s']} s (best of {len(runs)}; load average {load_start:.1f})")


if __name__ == "__main__":
    main()
