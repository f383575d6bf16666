"""A disk store's restart from its index snapshot at one size (default 10^6 chunk files), on a shared machine.

`benchmarks/scale.py --services disk_store` draws the whole curve, but at 10^6 files its set-up (making the files,
a first start that reads every header and writes the snapshot) takes minutes of disk and CPU. Here the set-up runs
at the lowest CPU and I/O priority (nice 19, idle I/O class), so it can share a machine that is running tests, and
only the restarts are timed, back at the priority it was started with: `DiskStore.open()` (directory lock, the snapshot read, names
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
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from scale import chunk_key, first_hit_then_close, make_chunk_files, scandir_count  # benchmarks/scale.py, beside this file

from kvmesh.services.disk_store import snapshot
from kvmesh.services.disk_store.options import DiskStoreOptions
from kvmesh.services.disk_store.store import DiskStore


STARTED_NICENESS = os.getpriority(os.PRIO_PROCESS, 0)  # `nice -n -10 python ...` times restarts at -10


def lowest_priority() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    subprocess.run(["ionice", "-c3", "-p", str(os.getpid())], check=False)


def normal_priority() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, STARTED_NICENESS)  # root may lower its niceness again
    subprocess.run(["ionice", "-c2", "-n4", "-p", str(os.getpid())], check=False)


def restart(options: DiskStoreOptions, files: int) -> dict[str, Any]:
    scandir_count(str(options.root))  # warm, as the store's own listing finds them
    t0 = time.perf_counter()
    listed = scandir_count(str(options.root))
    scandir_s = time.perf_counter() - t0
    if listed != files:
        raise RuntimeError(f"{listed} chunk files listed, expected {files}")
    store = DiskStore(options)
    gc.collect()
    listed_first = not snapshot.read_snapshot(options.root)[0].complete  # left by a stop that had not listed yet
    t0 = time.perf_counter()
    report = store.open()
    open_s = time.perf_counter() - t0

    hit_s, checked_s, stop_s = asyncio.run(first_hit_then_close(store, chunk_key(files - 1), t0))
    if report.trusted != files:
        raise RuntimeError(f"took {report.trusted} of {files} files from the snapshot")
    return {"snapshot": "periodic (listed first)" if listed_first else "complete", "open_s": round(open_s, 3),
            "restart_hit_s": round(hit_s, 3), "checked_s": round(checked_s, 3), "stop_s": round(stop_s, 3), "scandir_s": round(scandir_s, 3),
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
    # a restart from a complete snapshot (a clean stop's) is the figure; one after a stop that had not yet listed
    # the directory (an earlier, interrupted run) lists it first, as a crash's periodic snapshot does
    timed = [run for run in runs if run["snapshot"] == "complete"] or runs
    hits = sorted(run["restart_hit_s"] for run in timed)
    median = statistics.median(hits)
    print(json.dumps({"files": args.files, "runs": runs, "restart_hit_s_median": median,
                      "loadavg_1m": [load_start, os.getloadavg()[0]]}))
    print(f"{args.files} chunk files: restart to the first hit from a {timed[0]['snapshot']} index snapshot: median "
          f"{median:.3f} s of {len(hits)} (best {hits[0]:.3f}, worst {hits[-1]:.3f}), "
          f"{median / statistics.median(run['scandir_s'] for run in timed):.2f}x os.scandir over the same files; "
          f"load average {load_start:.1f}")

if __name__ == "__main__":
    main()
