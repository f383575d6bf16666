"""A save's copy into slots of the CPU pool never used before, with the pool's pages faulted ahead by its own thread
(services/engine/tiers/fault_ahead.py) and without, next to the same copy into slots used before (pages already
mapped: the machine's memcpy for these bytes), in the same run, as ratios.

A fresh server's pool is all such slots until it fills, so this is what each save pays on vLLM's thread then.
Default object: 0.5 MiB, one 256-token step's chunk and state of the Qwen3-Next demo model. One torch thread (as
vLLM's CPU worker copies with one per OpenMP core, and a save is one copy). Prints JSON.

    python benchmarks/pool_fault_ahead.py [--object-kib 512] [--objects 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvmesh.services.engine.tiers.fault_ahead import AHEAD_BYTES
from kvmesh.services.engine.tiers.memory_pool import MemoryPool


def copies_ms(pool: MemoryPool, source: torch.Tensor, objects: int) -> list[float]:
    """Milliseconds of each copy of `source` into a newly allocated slot."""
    times = []
    for _ in range(objects):
        slot = pool.allocate()
        assert slot is not None, "the pool is too small for --objects"
        started = time.perf_counter()
        slot.tensor[:source.numel()].copy_(source)
        times.append((time.perf_counter() - started) * 1e3)
    return times


def summary(times: list[float]) -> dict[str, float]:
    """A case's median and p90 copy time."""
    return {"median_ms": statistics.median(times), "p90_ms": sorted(times)[int(len(times) * 0.9)]}


def never_used(object_bytes: int, objects: int, ahead: int) -> dict[str, float]:
    """The copies into slots never used before, the pool faulting `ahead` bytes ahead of them (0: none)."""
    source = torch.randint(0, 256, (object_bytes,), dtype=torch.uint8)
    capacity = objects * object_bytes + AHEAD_BYTES
    pool = MemoryPool(capacity, object_bytes, pin=False, fault_ahead_bytes=ahead)
    try:
        if pool.fault_ahead is not None and not pool.fault_ahead.wait_faulted(min(ahead, capacity), 60):
            raise SystemExit("the pool's pages could not be faulted ahead here (no MADV_POPULATE_WRITE?)")
        fresh = copies_ms(pool, source, objects)
    finally:
        pool.close()
    return summary(fresh)


def used_before(object_bytes: int, objects: int) -> dict[str, float]:
    """The same copies into slots written once before (freed, then allocated again)."""
    source = torch.randint(0, 256, (object_bytes,), dtype=torch.uint8)
    pool = MemoryPool(objects * object_bytes, object_bytes, pin=False, fault_ahead_bytes=0)
    try:
        slots = [pool.allocate() for _ in range(objects)]
        for slot in slots:
            assert slot is not None
            slot.tensor.fill_(1)
            slot.release()
        times = copies_ms(pool, source, objects)
    finally:
        pool.close()
    return summary(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--object-kib", type=int, default=512, help="bytes per save (KiB)")
    parser.add_argument("--objects", type=int, default=400, help="saves per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the three cases")
    args = parser.parse_args()
    torch.set_num_threads(1)
    object_bytes = args.object_kib * 1024
    runs: dict[str, list[dict[str, float]]] = {"used_before": [], "fresh_faulted_ahead": [], "fresh_no_fault_ahead": []}
    for _ in range(args.rounds):
        runs["used_before"].append(used_before(object_bytes, args.objects))
        runs["fresh_faulted_ahead"].append(never_used(object_bytes, args.objects, AHEAD_BYTES))
        runs["fresh_no_fault_ahead"].append(never_used(object_bytes, args.objects, 0))
    medians = {case: statistics.median(run["median_ms"] for run in results) for case, results in runs.items()}
    ceiling = medians["used_before"]
    print(json.dumps({
        "object_bytes": object_bytes, "objects": args.objects, "rounds": args.rounds,
        "median_copy_ms": medians,
        "p90_copy_ms": {case: statistics.median(run["p90_ms"] for run in results) for case, results in runs.items()},
        "memcpy_GBps_used_before": object_bytes / ceiling / 1e6,
        "ratio_to_used_before": {case: value / ceiling for case, value in medians.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
