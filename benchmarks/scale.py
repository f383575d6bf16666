"""Cost curves (issue 28): how each service's cost grows with its input, each next to a ceiling measured in the
same run; one log-log PNG per service with the fitted growth exponents, and one JSON document.

    python benchmarks/scale.py                         # every service at the default sizes (see --help)
    python benchmarks/scale.py --quick --out /tmp/scale   # tiny sizes: a smoke run of a minute or two
    python benchmarks/scale.py --services controller,scheduler --max-chunks 1000000

Measured (each point of the controller, disk store and CPU tier in a fresh spawned process, so its memory
figures start from a clean interpreter):

  controller    the index (`ProducerFeed` -> `ProducerTable` -> `HolderIndex`) fed in process through the
                feed's own NATS callbacks (`_on_register`, `_on_event`: registration, an empty full sync, then
                `AdmissionBatch`es of `MAX_KEYS_PER_BATCH` keys, msgpack-encoded as a producer sends them) from
                10^3 to --max-chunks chunks held by --controller-instances instances, and from 1 to
                --max-instances instances holding --instance-sweep-chunks chunks. Per point: memory per
                indexed chunk (what the ingest left allocated, tracemalloc; RSS growth beside it) next to the
                bytes of a plain dict of the same 16-byte keys to small ints (sys.getsizeof of the same
                objects), ingest time per chunk (tracemalloc on), and the /lookup handler's latency
                p50/p99 (`api.lookup_handler`: JSON body -> msgspec -> `ControllerCore.lookup` -> JSON answer; no
                HTTP, whose cost does not depend on the index: benchmarks/controller.py measures it) for 8192-
                token prompts (32 chunks) the instances hold. Ceilings: a plain dict lookup of the same 32 keys,
                and one blake2b-128 over the prompt's token bytes (the hashing a lookup cannot avoid).
  disk_store    a restart of the store (`DiskStore.open()`: directory lock, the index rebuilt, pins and claims
                restored; then one get, inline, of a held chunk: the restart to its first served hit) from 10^3 to
                --disk-max-files valid chunk files (`chunk_file.encode_header`, --disk-chunk-bytes of data each,
                keys spread over the 256 fan-out directories), twice: with no index snapshot (every file's header
                read: `chunk_file.scan_directory`) and from the snapshot the previous stop wrote
                (services/disk_store/snapshot.py: names listed, no stat; each file's stat is checked while
                the store serves). Wall time of both, open and to the first hit, the time until that check is
                done (`restart_checked_s`), and memory per file (what a third, traced start leaves allocated, tracemalloc; RSS growth
                of the timed snapshot start beside it). Ceiling: `os.scandir` over the same files, and each
                restart's ratio to it. The page cache stays warm (the files were just written) unless
                --drop-caches (root) drops it before each side.
  engine_cpu    `LocalCPUBackend` on a `MemoryPool` of N slots of --cpu-slot-bytes, N from 10^3 to what
                --cpu-pool-gb holds: per chunk, `put` (admission), `allocate` and the copy of the chunk's bytes
                into its slot, `prefix` (lookup, in prompts of 32 keys), each the best of several passes, and
                admissions into the full pool (LRU eviction; up to 1000, or as many as 3 s allow, at least 10).
                Pages are faulted in by an untimed first fill. Ceilings: dict insert and dict lookup of the
                same keys, and one bulk memcpy (torch copy_) of the same bytes into the pool's memory.
  nats          messages and payload bytes on NATS for one engine request (`CacheEngine` API, no vLLM) as the
                prompt grows, per tier: `store` (a miss: CPU tier plus write-behind to the disk and remote
                stores), `cpu` (a CPU-tier hit), `disk` (CPU tier cleared: from a real disk store process) and
                `remote` (CPU tier and disk store cleared: from a real remote store process). Counted by an
                observer subscribed to `>` (benchmarks/scheduler_lookup.py's NatsBench), heartbeats left out,
                and from the server's /varz (out_msgs/out_bytes less the observer's own deliveries: what the
                mesh's clients received). Floor: one request naming every key plus its reply (2 messages; bytes
                of `ChunkKeys` of the request's keys, encoded by the protocol).
  scheduler     the connector's scheduler thread per request as prompts grow from 1k to --scheduler-max-tokens:
                `SchedulerSide.get_num_new_matched_tokens` for a new request (chain keys hashed once, CPU-tier
                mirror lookup, a full CPU hit) over a real `SchedulerLookup` and a cache engine in this process
                (vLLM's single-process case, as tests/support/connector_driver.py drives it); also its parts,
                `ChunkHasher.chain` and `SchedulerLookup.cpu_tokens`. Ceiling: one blake2b-128 over the same
                token bytes in one call (scheduler_lookup.hash_ceiling).

Growth exponents: the least-squares slope of log(cost) against log(input) of every curve. A per-unit cost
(per chunk, per file) grows linearly in total when its exponent is 0; a per-request or total cost when it is 1.
A curve is "superlinear" when its total cost grows faster than linear (total exponent > 1.1). Other work on the
machine shows in every figure: the 1-minute load average is recorded at start and end.

Writes --out/scale.json and --out/scale-<service>.png (matplotlib, the `bench` extra: `pip install -e .[bench]`; without it the
plots are skipped), prints the JSON and one summary line per curve.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))  # support.engine: the engine tests' paged KV and configs

from controller import CHUNK_SIZE as LOOKUP_CHUNK, KV_FORMAT, MODEL, prompt_tokens, rss_bytes  # noqa: E402
from disk_store import drop_page_cache  # noqa: E402
from scheduler_lookup import NatsBench, hash_ceiling  # noqa: E402

SERVICES = ["controller", "disk_store", "engine_cpu", "nats", "scheduler"]
LOOKUP_PROMPTS = 16  # distinct 8192-token prompts the controller's lookups cycle over
PROMPT_KEYS = 32  # chunks per lookup (and per CPU-tier `prefix` call)
EVICTING_ADMISSIONS, EVICTING_BUDGET_S = 1000, 3.0  # admissions timed into a full CPU tier (at least 10)
SLACK = 0.1  # a total exponent above 1 + SLACK is "superlinear"


# ---- shared helpers ---------------------------------------------------------------------------------------------
def isolated(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a fresh spawned process (its RSS starts from a clean interpreter); its return value."""
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def decades(low: int, high: int) -> list[int]:
    """low, 10 * low, ... below high, then high."""
    sizes, n = [], low
    while n < high:
        sizes.append(n)
        n *= 10
    return sizes + [high]


def doublings(low: int, high: int) -> list[int]:
    sizes, n = [], low
    while n < high:
        sizes.append(n)
        n *= 2
    return sizes + [high]


def random_keys(count: int) -> list[bytes]:
    """`count` random 16-byte chunk keys (distinct objects, as keys decoded from messages are)."""
    raw = os.urandom(16 * count)
    return [raw[i:i + 16] for i in range(0, len(raw), 16)]


def quiet_logs() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kvmesh").setLevel(logging.WARNING)


def timed_loop(fn: Callable[[], object], min_seconds: float, min_repeats: int = 5) -> list[float]:
    """Wall seconds of repeated calls of fn: at least `min_repeats`, until `min_seconds` have passed."""
    samples: list[float] = []
    deadline = time.perf_counter() + min_seconds
    while len(samples) < min_repeats or time.perf_counter() < deadline:
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def fit_exponent(xs: list[float], ys: list[float | None]) -> float | None:
    """Least-squares slope of log(y) against log(x) over the points with y > 0 (None with fewer than two)."""
    points = [(x, y) for x, y in zip(xs, ys) if x > 0 and y is not None and y > 0]
    if len({x for x, _ in points}) < 2:
        return None
    slope = np.polyfit(np.log([x for x, _ in points]), np.log([y for _, y in points]), 1)[0]
    return round(float(slope), 3)


def curve(name: str, xs: list[float], ys: list[float | None], unit: str, per_unit: bool,
          ceiling: bool = False) -> dict[str, Any]:
    """One measured series. `per_unit`: the cost is per unit of the input (per chunk, per file), so its total is
    y * x; `ceiling`: a reference series (never flagged)."""
    exponent = fit_exponent(xs, ys)
    total = None if exponent is None else round(exponent + (1.0 if per_unit else 0.0), 3)
    return {"name": name, "x": xs, "y": ys, "unit": unit, "per_unit": per_unit, "ceiling": ceiling,
            "exponent": exponent, "total_exponent": total,
            "superlinear": bool(not ceiling and total is not None and total > 1 + SLACK)}


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    curves: list[dict[str, Any]]


def plot(service: str, panels: list[Panel], path: Path, note: str) -> bool:
    """One log-log PNG, a panel per figure, every curve labelled with its fitted exponent k."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for c in panel.curves:
            points = [(x, y) for x, y in zip(c["x"], c["y"]) if y is not None and y > 0]
            if not points:
                continue
            k = "n/a" if c["exponent"] is None else f"{c['exponent']:.2f}"
            flag = " SUPERLINEAR" if c["superlinear"] else ""
            ax.plot([x for x, _ in points], [y for _, y in points], "--" if c["ceiling"] else "-",
                    marker="o" if not c["ceiling"] else "x", label=f"{c['name']} (k={k}){flag}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{service}: cost vs input, k = fitted log-log slope; {note}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- 1. controller ----------------------------------------------------------------------------------------------
@dataclass
class _Msg:
    """What ProducerFeed's subscription callbacks read of a nats-py message."""

    subject: str
    data: bytes


def controller_point(chunks: int, instances: int, lookups: int) -> dict[str, Any]:
    """Index `chunks` keys held by `instances` instances through the feed's callbacks; memory, ingest, lookups."""
    quiet_logs()
    from kvmesh.services.controller.api.lookup_body import lookup_handler
    from kvmesh.services.controller.config import ControllerConfig
    from kvmesh.services.controller.core import ControllerCore
    from kvmesh.services.controller.producer_feed import ProducerFeed
    from kvmesh.shared import protocol
    from kvmesh.shared.messaging.admissions import MAX_KEYS_PER_BATCH
    from kvmesh.shared.protocol import LOCAL_CPU, Subjects
    from kvmesh.shared.wire.keys import ChunkHasher, KeyParams

    core = ControllerCore(ControllerConfig())
    feed = ProducerFeed(None, core.table, core.controller_id)  # type: ignore[arg-type]  # never started: no NATS
    handle = lookup_handler(core)
    hasher = ChunkHasher(KeyParams(MODEL, KV_FORMAT), LOOKUP_CHUNK)
    prompts = [prompt_tokens(n % instances, n) for n in range(LOOKUP_PROMPTS)]
    prompt_keys = [hasher.keys(tokens) for tokens in prompts]
    bodies = [json.dumps({"tokens": tokens.tolist()}).encode() for tokens in prompts]
    handle(bodies[0])  # imports and first-call caches, before the memory baseline
    per_instance = max(1, chunks // instances)

    async def ingest() -> None:
        for i in range(instances):
            instance = f"bench-{i}"
            worker_id = protocol.worker_id_for(instance, 1, 0, "scale")
            path = protocol.Principal.engine(instance).producer(worker_id)
            registration = protocol.RegisterEngine(
                worker_id=worker_id, instance_id=instance, model=MODEL, kv_format=KV_FORMAT, world_size=1, rank=0,
                chunk_size=LOOKUP_CHUNK, save_unfull_chunk=True, started_at=time.time())
            await feed._on_register(_Msg(Subjects.register(path), protocol.encode(registration)))
            empty_sync = protocol.SyncChunk(producer_id=worker_id, location=LOCAL_CPU, sync_id=f"s{i}", seq=0,
                                            part=0, final=True, keys=[])
            await feed._on_event(_Msg(Subjects.events(path), protocol.encode(empty_sync)))
            own = [k for n, keys in enumerate(prompt_keys) if n % instances == i for k in keys]
            left, seq = max(0, per_instance - len(own)), 0
            while own or left:
                fill = min(left, MAX_KEYS_PER_BATCH - len(own))
                batch_keys, own, left = own + random_keys(fill), [], left - fill
                seq += 1
                batch = protocol.AdmissionBatch(producer_id=worker_id, location=LOCAL_CPU, seq=seq,
                                                admitted=batch_keys)
                await feed._on_event(_Msg(Subjects.events(path), protocol.encode(batch)))

    gc.collect()
    rss_before = rss_bytes(os.getpid())
    tracemalloc.start()  # what the ingest leaves allocated: exact at every size, where RSS only moves in arenas
    started = time.perf_counter()
    asyncio.run(ingest())
    ingest_s = time.perf_counter() - started
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rss_after = rss_bytes(os.getpid())
    table = core.table.index.table
    indexed = len(table)
    if feed.forged_messages or feed.bad_messages or core.table.stats.keys_refused:
        raise RuntimeError(f"the feed refused messages: forged {feed.forged_messages}, bad {feed.bad_messages}, "
                           f"keys refused {core.table.stats.keys_refused}")
    floor_bytes = sys.getsizeof(table) + indexed * sys.getsizeof(bytes(16))  # a plain dict: key -> small int
    mask_bytes = sum(sys.getsizeof(mask) for mask in table.values() if mask > 256)  # masks past the small ints

    for n, body in enumerate(bodies):  # every prompt is credited in full to the instance holding it
        status, answer = handle(body)
        layout = json.loads(answer)["layout_info"]
        if status != 200 or layout.get(f"bench-{n % instances}") != ["LocalCPUBackend", 8192]:
            raise RuntimeError(f"lookup {n}: {status} {layout}")
    latencies = []
    for j in range(lookups):
        body = bodies[j % len(bodies)]
        t0 = time.perf_counter()
        handle(body)
        latencies.append(time.perf_counter() - t0)
    get = table.get

    def probe_all() -> None:
        for keys in prompt_keys:
            for key in keys:
                get(key, 0)

    dict_s = min(timed_loop(probe_all, 0.2)) / len(prompt_keys)
    blake = hash_ceiling(prompts[0].tolist(), 50)["median_s"]
    return {
        "chunks": indexed, "instances": instances, "ingest_s": round(ingest_s, 3),
        "ingest_us_per_chunk": round(ingest_s / indexed * 1e6, 3),  # tracemalloc on: slower than without
        "bytes_per_chunk": round(traced / indexed, 1),
        "rss_mb": [round(rss_before / 2**20, 1), round(rss_after / 2**20, 1)],
        "rss_bytes_per_chunk": round((rss_after - rss_before) / indexed, 1),
        "plain_dict_bytes_per_chunk": round(floor_bytes / indexed, 1),
        "mask_int_bytes_per_chunk": round(mask_bytes / indexed, 1),
        "lookups": lookups, "lookup_p50_us": round(float(np.percentile(latencies, 50)) * 1e6, 1),
        "lookup_p99_us": round(float(np.percentile(latencies, 99)) * 1e6, 1),
        "ceiling_dict_lookup_us": round(dict_s * 1e6, 3), "ceiling_blake2b_prompt_us": round(blake * 1e6, 1),
    }


def measure_controller(args: argparse.Namespace) -> dict[str, Any]:
    done: dict[tuple[int, int], dict[str, Any]] = {}

    def point(chunks: int, instances: int) -> dict[str, Any]:  # the two sweeps may share a point
        if (chunks, instances) not in done:
            done[chunks, instances] = isolated(controller_point, chunks, instances, args.lookups)
        return done[chunks, instances]

    by_chunks = [point(n, args.controller_instances) for n in decades(1000, args.max_chunks)]
    by_instances = [point(args.instance_sweep_chunks, i) for i in decades(1, args.max_instances)]
    xs = [p["chunks"] for p in by_chunks]
    xi = [p["instances"] for p in by_instances]
    curves = {
        "memory_per_chunk": curve("index memory per chunk", xs, [p["bytes_per_chunk"] for p in by_chunks], "B", True),
        "memory_ceiling": curve("plain dict (getsizeof)", xs, [p["plain_dict_bytes_per_chunk"] for p in by_chunks],
                                "B", True, ceiling=True),
        "ingest_per_chunk": curve("ingest per chunk (tracemalloc on)", xs,
                                  [p["ingest_us_per_chunk"] for p in by_chunks], "us", True),
        "lookup_p50": curve("/lookup p50", xs, [p["lookup_p50_us"] for p in by_chunks], "us", False),
        "lookup_p99": curve("/lookup p99", xs, [p["lookup_p99_us"] for p in by_chunks], "us", False),
        "lookup_ceiling_dict": curve("dict lookup of the 32 keys", xs,
                                     [p["ceiling_dict_lookup_us"] for p in by_chunks], "us", False, ceiling=True),
        "lookup_ceiling_hash": curve("blake2b of the prompt", xs, [p["ceiling_blake2b_prompt_us"] for p in by_chunks],
                                     "us", False, ceiling=True),
        "memory_per_chunk_vs_instances": curve("index memory per chunk", xi,
                                               [p["bytes_per_chunk"] for p in by_instances], "B", False),
        "memory_ceiling_vs_instances": curve("plain dict (getsizeof)", xi,
                                             [p["plain_dict_bytes_per_chunk"] for p in by_instances], "B", False,
                                             ceiling=True),
        "ingest_vs_instances": curve("ingest, all chunks (tracemalloc on)", xi, [p["ingest_s"] for p in by_instances],
                                     "s", False),
        "lookup_p50_vs_instances": curve("/lookup p50", xi, [p["lookup_p50_us"] for p in by_instances], "us", False),
        "lookup_p99_vs_instances": curve("/lookup p99", xi, [p["lookup_p99_us"] for p in by_instances], "us", False),
        "lookup_ceiling_dict_vs_instances": curve("dict lookup of the 32 keys", xi,
                                                  [p["ceiling_dict_lookup_us"] for p in by_instances], "us", False,
                                                  ceiling=True),
    }
    c = curves
    panels = [
        Panel(f"memory per chunk ({args.controller_instances} instances)", "chunks indexed", "bytes / chunk",
              [c["memory_per_chunk"], c["memory_ceiling"]]),
        Panel(f"/lookup of 8192 tokens ({args.controller_instances} instances)", "chunks indexed", "us",
              [c["lookup_p50"], c["lookup_p99"], c["ingest_per_chunk"], c["lookup_ceiling_dict"],
               c["lookup_ceiling_hash"]]),
        Panel(f"{args.instance_sweep_chunks} chunks over N instances", "instances",
              "us (lookup) / bytes per chunk (memory)",
              [c["lookup_p50_vs_instances"], c["lookup_p99_vs_instances"], c["memory_per_chunk_vs_instances"],
               c["lookup_ceiling_dict_vs_instances"], c["memory_ceiling_vs_instances"]]),
        Panel(f"ingest of {args.instance_sweep_chunks} chunks from N instances", "instances", "seconds",
              [c["ingest_vs_instances"]]),
    ]
    return {"points_by_chunks": by_chunks, "points_by_instances": by_instances, "curves": curves, "_panels": panels,
            "note": "index fed in process through ProducerFeed's callbacks; /lookup = api.lookup_handler"}


# ---- 2. disk store ----------------------------------------------------------------------------------------------
def chunk_key(i: int) -> bytes:
    """The key of chunk file i (spread over the fan-out directories)."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def make_chunk_files(root: Path, start: int, stop: int, nbytes: int) -> None:
    """Valid chunk files start..stop-1 (as the store writes them: chunk_file's header, then the data)."""
    from kvmesh.shared import protocol
    from kvmesh.shared.wire import chunk_file

    data = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
    digest = chunk_file.checksum(data)
    for fan in range(256):
        (root / f"{fan:02x}").mkdir(parents=True, exist_ok=True)
    for i in range(start, stop):
        key = chunk_key(i)
        meta = protocol.ChunkMeta(key=key, num_tokens=256, shape=[nbytes], dtype="uint8", fmt="scale",
                                  nbytes=nbytes, checksum=digest)
        with open(chunk_file.chunk_path(root, key), "wb") as f:
            f.write(chunk_file.encode_header(meta) + data)


def scandir_count(root: str) -> int:
    """The ceiling: list every chunk file with os.scandir."""
    count = 0
    with os.scandir(root) as fans:
        for fan in fans:
            if fan.is_dir():
                with os.scandir(fan.path) as entries:
                    for entry in entries:
                        count += entry.name.endswith(".kvc")
    return count


async def first_hit_then_close(store: Any, hit_key: bytes, opened_at: float) -> tuple[float, float, float]:
    """A disk store (DiskStore) just opened (at `opened_at`, perf_counter) serves: (seconds from the open to its first served
    hit of `hit_key`, to the end of the stat check of the files it took from its snapshot, and its stop's seconds).
    The store is closed whatever happens (its stop writes the snapshot the next start reads)."""
    from kvmesh.shared import protocol

    checks = store.start_checks()  # as the service does once it serves
    try:
        reply = await store.reader.get(protocol.GetRequest(key=hit_key), "scale")
        hit_s = time.perf_counter() - opened_at
        if not reply.found:
            raise RuntimeError(f"the first get after the restart missed: {reply.error}")
        if checks is not None:
            await checks
        checked_s = time.perf_counter() - opened_at
        if store.counters["snapshot_files_dropped"]:
            raise RuntimeError(f"the check dropped {store.counters['snapshot_files_dropped']} files")
    finally:
        t1 = time.perf_counter()
        await store.close()
    return hit_s, checked_s, time.perf_counter() - t1


def disk_point(root: str, files: int, drop_caches: bool) -> dict[str, Any]:
    """The store's restart over `files` chunk files, to its first served hit: without an index snapshot (every
    file's header read) and with the one the previous stop wrote; time and memory, next to os.scandir's time."""
    quiet_logs()
    from kvmesh.services.disk_store import snapshot
    from kvmesh.services.disk_store.options import DiskStoreOptions
    from kvmesh.services.disk_store.store import DiskStore
    from kvmesh.shared import protocol

    scandir_count(root)  # both sides see the same (warm) directory entries
    dropped = drop_caches and drop_page_cache()
    t0 = time.perf_counter()
    listed = scandir_count(root)
    scandir_s = time.perf_counter() - t0
    if listed != files:
        raise RuntimeError(f"{listed} chunk files listed, expected {files}")
    options = DiskStoreOptions(root=Path(root), capacity_bytes=1 << 50, store_id="scale-disk")
    hit_key = chunk_key(files - 1)

    def start(traced: bool) -> tuple[float, float, float, float, int, int, Any]:
        """One restart: (seconds to open, seconds to its first served hit, seconds until the files taken from the
        snapshot are checked (served meanwhile), seconds to stop (which writes the snapshot the next start reads),
        RSS growth, traced bytes it left allocated (0 untraced), the scan report)."""
        store = DiskStore(options)
        if dropped:
            drop_page_cache()
        gc.collect()
        rss_before = rss_bytes(os.getpid())
        if traced:
            tracemalloc.start()
        t0 = time.perf_counter()
        report = store.open()
        open_s = time.perf_counter() - t0

        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] if traced else 0
        tracemalloc.stop()
        rss = rss_bytes(os.getpid()) - rss_before
        hit_s, checked_s, stop_s = asyncio.run(first_hit_then_close(store, hit_key, t0))  # (after memory)
        if len(store.index) != files or report.removed_corrupt or report.removed_tmp:
            raise RuntimeError(f"the store indexed {len(store.index)} of {files} files "
                               f"({report.removed_corrupt} deleted as bad)")
        return open_s, hit_s, checked_s, stop_s, rss, kept, report

    (Path(root) / snapshot.SNAPSHOT_NAME).unlink(missing_ok=True)
    scan_open_s, scan_hit_s, _, _, _, _, report = start(traced=False)  # every header read; its stop writes a snapshot
    if report.snapshot != "none":
        raise RuntimeError(f"the scan start found a snapshot: {report.snapshot}")
    open_s, hit_s, checked_s, stop_s, rss, _, report = start(traced=False)  # from the snapshot: timed without tracemalloc
    if report.snapshot != "used" or report.trusted != files:
        raise RuntimeError(f"the snapshot start took {report.trusted} of {files} files from it ({report.snapshot})")
    _, _, _, _, _, kept, _ = start(traced=True)  # its memory in a third start, traced
    return {"files": files, "open_s": round(open_s, 4), "open_us_per_file": round(open_s / files * 1e6, 2),
            "restart_hit_s": round(hit_s, 4), "restart_checked_s": round(checked_s, 4),
            "stop_with_snapshot_s": round(stop_s, 4),
            "scan_open_s": round(scan_open_s, 4),
            "scan_restart_hit_s": round(scan_hit_s, 4),
            "scan_open_us_per_file": round(scan_open_s / files * 1e6, 2),
            "scandir_s": round(scandir_s, 4), "scandir_us_per_file": round(scandir_s / files * 1e6, 3),
            "restart_vs_scandir": round(hit_s / scandir_s, 2), "scan_restart_vs_scandir": round(scan_hit_s / scandir_s, 2),
            "bytes_per_file": round(kept / files, 1), "rss_bytes_per_file": round(rss / files, 1),
            "page_cache_dropped": dropped}


def measure_disk_store(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="kvmesh-scale-disk-", dir=args.dir))
    root = base / "store"
    points, made, create_s = [], 0, 0.0
    try:
        for files in decades(1000, args.disk_max_files):
            t0 = time.perf_counter()
            make_chunk_files(root, made, files, args.disk_chunk_bytes)
            create_s += time.perf_counter() - t0
            made = files
            points.append(isolated(disk_point, str(root), files, args.drop_caches))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    xs = [p["files"] for p in points]
    curves = {
        "restart_to_hit": curve("restart to the first hit, index snapshot", xs, [p["restart_hit_s"] for p in points],
                                "s", False),
        "restart_to_hit_scan": curve("restart to the first hit, every header read", xs,
                                     [p["scan_restart_hit_s"] for p in points], "s", False),
        "restart_checked": curve("restart until its files' stat is checked (served meanwhile), index snapshot", xs,
                                 [p["restart_checked_s"] for p in points], "s", False),
        "startup_time": curve("store open, index snapshot", xs, [p["open_s"] for p in points], "s", False),
        "startup_time_scan": curve("store open, every header read", xs, [p["scan_open_s"] for p in points], "s",
                                   False),
        "startup_ceiling": curve("os.scandir of the files", xs, [p["scandir_s"] for p in points], "s", False,
                                 ceiling=True),
        "startup_memory_per_file": curve("store memory per file", xs, [p["bytes_per_file"] for p in points], "B", True),
    }
    panels = [Panel("restart to the first hit", "chunk files", "seconds",
                    [curves["restart_to_hit"], curves["restart_checked"], curves["restart_to_hit_scan"],
                     curves["startup_ceiling"]]),
              Panel("start-up memory", "chunk files", "bytes / file", [curves["startup_memory_per_file"]])]
    for p in points:  # the figure next to the machine's own ceiling, measured in the same run
        print(f"disk_store: {p['files']} files: restart to the first hit {p['restart_hit_s']} s with the index "
              f"snapshot ({p['restart_vs_scandir']}x os.scandir's {p['scandir_s']} s; its files' stat checked at "
              f"{p['restart_checked_s']} s), {p['scan_restart_hit_s']} s "
              f"reading every header ({p['scan_restart_vs_scandir']}x)", file=sys.stderr, flush=True)
    return {"points": points, "curves": curves, "_panels": panels, "files_created_s": round(create_s, 1),
            "chunk_data_bytes": args.disk_chunk_bytes, "directory": str(args.dir or tempfile.gettempdir()),
            "note": f"{args.disk_chunk_bytes}-byte chunks (one 4 KiB header page each)"}


# ---- 3. engine CPU tier -----------------------------------------------------------------------------------------
def cpu_tier_point(chunks: int, slot_bytes: int) -> dict[str, Any]:
    """Admission and lookup per chunk in a CPU tier of `chunks` slots, and the dict / memcpy ceilings."""
    quiet_logs()
    import torch

    from kvmesh.services.engine.tiers.cpu import LocalCPUBackend
    from kvmesh.services.engine.tiers.memory_pool import MemoryPool
    from kvmesh.shared.protocol import ChunkMeta

    torch.set_num_threads(1)
    pool = MemoryPool(chunks * slot_bytes, slot_bytes, use_shm=True, pin=False)
    tier = LocalCPUBackend(pool)
    nbytes = pool.slot_nbytes

    def metas_for(keys: list[bytes]) -> list[ChunkMeta]:
        return [ChunkMeta(key=k, num_tokens=256, shape=[nbytes], dtype="uint8", fmt="scale", nbytes=nbytes,
                          checksum=1) for k in keys]

    keys = random_keys(chunks)
    metas = metas_for(keys)
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)

    def fill(batch: list[ChunkMeta]) -> tuple[float, float, float]:
        """allocate, copy into, put: seconds of each loop."""
        t0 = time.perf_counter()
        slots = [tier.allocate() for _ in batch]
        t1 = time.perf_counter()
        for slot in slots:
            assert slot is not None, "the pool ran out of slots"
            slot.tensor.copy_(source)
        t2 = time.perf_counter()
        for meta, slot in zip(batch, slots):
            tier.put(meta, slot)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    # Best of several passes: a small pool's pass takes milliseconds, which other work on the machine distorts.
    repeats = max(3, min(30, 300_000 // chunks))
    groups = [keys[i:i + PROMPT_KEYS] for i in range(0, chunks, PROMPT_KEYS)]
    fill(metas)  # faults every page of the pool in (untimed)
    alloc_s = copy_s = put_s = lookup_s = float("inf")
    for _ in range(repeats):
        tier.clear_all()
        gc.collect()
        times = fill(metas)
        alloc_s, copy_s, put_s = min(alloc_s, times[0]), min(copy_s, times[1]), min(put_s, times[2])
        assert len(tier) == chunks
        t0 = time.perf_counter()
        found = sum(tier.prefix(group) for group in groups)
        lookup_s = min(lookup_s, time.perf_counter() - t0)
        assert found == chunks, f"prefix found {found} of {chunks}"
    # The pool is full: every allocate evicts the LRU chunk. Few of them, within a time budget: each may cost
    # O(pool) (allocate walks a snapshot of every evictable key), and the largest pools would take minutes.
    n_evict, e_alloc, e_copy, e_put = 0, 0.0, 0.0, 0.0
    deadline = time.perf_counter() + EVICTING_BUDGET_S
    for meta in metas_for(random_keys(min(chunks, EVICTING_ADMISSIONS))):
        t0 = time.perf_counter()
        slot = tier.allocate()
        t1 = time.perf_counter()
        assert slot is not None, "nothing could be evicted"
        slot.tensor.copy_(source)
        t2 = time.perf_counter()
        tier.put(meta, slot)
        t3 = time.perf_counter()
        e_alloc, e_copy, e_put, n_evict = e_alloc + t1 - t0, e_copy + t2 - t1, e_put + t3 - t2, n_evict + 1
        if n_evict >= 10 and t3 > deadline:
            break

    def plain_insert() -> dict[bytes, ChunkMeta]:
        plain: dict[bytes, ChunkMeta] = {}
        for key, meta in zip(keys, metas):
            plain[key] = meta
        return plain

    plain = plain_insert()

    def plain_prefix(group: list[bytes]) -> int:
        count = 0
        for key in group:
            if key not in plain:
                break
            count += 1
        return count

    def plain_lookup() -> None:
        assert sum(plain_prefix(group) for group in groups) == chunks

    dict_insert_s = min(timed_loop(plain_insert, 0.0, repeats))
    dict_lookup_s = min(timed_loop(plain_lookup, 0.0, repeats))
    memcpy_s = memcpy_seconds(pool, min(repeats, 5))
    tier.close()
    pool.close()

    def us(seconds: float, n: int = chunks) -> float:
        return round(seconds / n * 1e6, 4)

    return {"chunks": chunks, "slot_bytes": nbytes, "pool_gb": round(chunks * nbytes / 1e9, 3), "passes": repeats,
            "put_us": us(put_s), "allocate_us": us(alloc_s), "copy_us": us(copy_s),
            "admission_us": us(alloc_s + copy_s + put_s), "lookup_us": us(lookup_s),
            "evicting_admission_us": us(e_alloc + e_copy + e_put, n_evict), "evicting_put_us": us(e_put, n_evict),
            "evicting_allocate_us": us(e_alloc, n_evict), "evicting_admissions": n_evict,
            "ceiling_dict_insert_us": us(dict_insert_s), "ceiling_dict_lookup_us": us(dict_lookup_s),
            "ceiling_memcpy_us": us(memcpy_s)}


def memcpy_seconds(pool: Any, repeats: int) -> float:
    """The memcpy ceiling: the best of `repeats` bulk copies (64 MiB pieces) over all of the pool's memory."""
    import torch

    assert pool.segment is not None
    memory = torch.frombuffer(pool.segment.buf, dtype=torch.uint8)  # released on return, before the pool closes
    piece = min(memory.numel(), 64 * 2**20)
    bulk = torch.randint(0, 256, (piece,), dtype=torch.uint8)

    def memcpy() -> None:
        for offset in range(0, memory.numel(), piece):
            end = min(offset + piece, memory.numel())
            memory[offset:end].copy_(bulk[:end - offset])

    return min(timed_loop(memcpy, 0.0, repeats))


def measure_engine_cpu(args: argparse.Namespace) -> dict[str, Any]:
    most = max(1000, int(args.cpu_pool_gb * 1e9) // args.cpu_slot_bytes)
    points = [isolated(cpu_tier_point, n, args.cpu_slot_bytes) for n in decades(1000, most)]
    xs = [p["chunks"] for p in points]

    def c(key: str, name: str, ceiling: bool = False) -> dict[str, Any]:
        return curve(name, xs, [p[key] for p in points], "us", True, ceiling)

    curves = {
        "put": c("put_us", "put (admission)"), "allocate": c("allocate_us", "allocate"),
        "copy": c("copy_us", "copy into the slot"), "admission": c("admission_us", "allocate + copy + put"),
        "evicting_admission": c("evicting_admission_us", "admission into a full pool (LRU eviction)"),
        "lookup": c("lookup_us", "prefix (lookup)"),
        "ceiling_dict_insert": c("ceiling_dict_insert_us", "dict insert", True),
        "ceiling_memcpy": c("ceiling_memcpy_us", "bulk memcpy of the bytes", True),
        "ceiling_dict_lookup": c("ceiling_dict_lookup_us", "dict lookup", True),
    }
    panels = [Panel("admission per chunk", "chunks in the pool", "us / chunk",
                    [curves[k] for k in ("put", "allocate", "copy", "admission", "evicting_admission",
                                         "ceiling_dict_insert", "ceiling_memcpy")]),
              Panel("lookup per chunk", "chunks in the pool", "us / chunk",
                    [curves["lookup"], curves["ceiling_dict_lookup"]])]
    return {"points": points, "curves": curves, "_panels": panels,
            "note": f"slots of {points[0]['slot_bytes']} B, pool up to {points[-1]['pool_gb']} GB"}


# ---- 4. NATS messages and bytes per request -------------------------------------------------------------------
BACKGROUND = ("kvmesh.ctrl.heartbeat.", "kvmesh.health.", "kvmesh.ping")


def message_kind(subject: str) -> str:
    """store.<op>, worker.<op>, events, ctrl.<what>, or reply."""
    parts = subject.split(".")
    if parts[0] == "_INBOX":
        return "reply"
    if len(parts) >= 4 and parts[1] == "store":
        return f"store.{parts[3]}"
    if len(parts) >= 5 and parts[1] == "worker":
        return f"worker.{parts[-1]}"
    return ".".join(parts[1:3]) if parts[1] == "ctrl" else parts[1]


def varz(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as response:
        data = json.loads(response.read())
    return {k: int(data[k]) for k in ("in_msgs", "in_bytes", "out_msgs", "out_bytes")}


def count_messages(bench: NatsBench, monitor: int, settle: float, action: Callable[[], None]) -> dict[str, Any]:
    """NATS traffic of `action`, until `settle` seconds after it: the observer's count by kind (heartbeats left
    out) and the server's /varz deltas."""
    time.sleep(settle)  # what came before (a clear's evictions, flushes) is delivered before the window opens
    before, start = varz(monitor), time.perf_counter()
    action()
    time.sleep(settle)
    end, after = time.perf_counter(), varz(monitor)
    seen = [(subject, size) for t, subject, _, size in list(bench.seen) if start <= t <= end]
    ours = [(s, n) for s, n in seen if not s.startswith(BACKGROUND)]
    return {"msgs": len(ours), "bytes": sum(n for _, n in ours),
            "by_kind": dict(sorted(Counter(message_kind(s) for s, _ in ours).items())),
            "background_msgs": len(seen) - len(ours),
            "varz_in_msgs": after["in_msgs"] - before["in_msgs"],
            "varz_in_bytes": after["in_bytes"] - before["in_bytes"],
            "varz_delivered_msgs": after["out_msgs"] - before["out_msgs"] - len(seen),
            "varz_delivered_bytes": after["out_bytes"] - before["out_bytes"] - sum(n for _, n in seen)}


def nats_run(chunk_counts: list[int], settle: float) -> dict[str, Any]:
    """One engine (CacheEngine API) on a NATS with a real disk store and remote store; per prompt length, the
    messages of a store and of a retrieve served from each tier."""
    quiet_logs()
    from kvmesh.services.engine.assembly import build_engine
    from kvmesh.services.engine.core import token_api
    from kvmesh.shared import protocol
    from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, free_port
    from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec
    from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE, disk_store_id, remote_store_id
    from support.engine import BLOCK, CHUNK, PagedKV, engine_config, random_tokens
    from support.engine_mesh import PARAMS

    work = Path(tempfile.mkdtemp(prefix="kvmesh-scale-nats-"))
    monitor = free_port()
    # No authentication: the observer reads every subject (`>`), which KVMesh's own NATS permits no one.
    nats = EmbeddedNats(extra_config=f"http: 127.0.0.1:{monitor}").start()
    mesh = bench = engine = None
    try:
        disk_id, remote_id = disk_store_id(), remote_store_id(0)
        mesh = LocalMesh([
            ServiceSpec("kvmesh.services.disk_store", ["--dir", str(work / "disk"), "--max-size-gb", "0.5",
                                                       "--store-id", disk_id], disk_id),
            ServiceSpec("kvmesh.services.remote_store", ["--max-size-gb", "0.5", "--partition", "0", "--partitions",
                                                         "1", "--store-id", remote_id], remote_id)],
            nats_url=nats.url, log_dir=work / "logs")
        mesh.start_services(60)
        bench = NatsBench(nats.url)
        largest = max(chunk_counts) * CHUNK
        kv = PagedKV(num_blocks=2 * (largest // BLOCK) + 8)
        engine = build_engine(engine_config(nats_url=nats.url, local_disk=str(work / "disk"),
                                           remote_url="lm://localhost:65432", remote_partitions=1,
                                           cpu_chunks=4 * sum(chunk_counts) + 8,
                                           heartbeat_interval_secs=3600, touch_interval_secs=settle / 3,
                                           lmcache_instance_id="scale"), PARAMS, kv.layout)
        if not engine.wait_connected(30):
            raise RuntimeError("the engine did not reach NATS")
        deadline = time.monotonic() + 30
        while engine.storage is None or None in (engine.storage.lower(REMOTE), engine.storage.lower(LOCAL_DISK)):
            if time.monotonic() > deadline:
                raise RuntimeError("the engine did not find its disk and remote stores")
            time.sleep(0.05)
        storage = engine.storage
        disk_client = storage.lower(LOCAL_DISK)
        assert engine.nats_loop is not None and disk_client is not None

        def warm_up() -> None:  # pool lending, stream connections: one-time costs, not per request
            tokens = random_tokens(CHUNK, seed=999_999)
            token_api.store(engine, tokens, **kv.kv(kv.slots(CHUNK)))
            engine.wait_write_behind(30)
            for location in (LOCAL_CPU, LOCAL_DISK):
                token_api.clear(engine, location)
                token_api.retrieve(engine, tokens, **kv.kv(kv.slots(CHUNK)))

        warm_up()
        points = []
        for chunks in chunk_counts:
            n = chunks * CHUNK
            tokens = random_tokens(n, seed=chunks)
            src = kv.slots(n)
            dst = kv.slots(n, exclude=src)

            def store() -> None:
                token_api.store(engine, tokens, **kv.kv(src))
                if not engine.wait_write_behind(30):
                    raise RuntimeError("write-behind did not finish")

            def retrieve(location: str | None) -> Callable[[], None]:
                def run() -> None:
                    before = storage.stats[f"fetched_{location}"] if location else 0
                    got = token_api.retrieve(engine, tokens, **kv.kv(dst))
                    if not bool(got.all()):
                        raise RuntimeError(f"{chunks} chunks: retrieve loaded {int(got.sum())} of {n} tokens")
                    if location and storage.stats[f"fetched_{location}"] - before != chunks:
                        raise RuntimeError(f"{chunks} chunks: not all were served by {location}")
                return run

            point: dict[str, Any] = {"chunks": chunks, "tokens": n,
                                     "chunk_bytes": kv.layout.chunk_nbytes(CHUNK)}
            point["store"] = count_messages(bench, monitor, settle, store)
            # the files, before the disk store serves them (its stats requests: outside the counted window)
            if not engine.nats_loop.call(disk_client.wait_written(30), 31, default=False):
                raise RuntimeError("the disk store did not write the chunks")
            point["cpu"] = count_messages(bench, monitor, settle, retrieve(None))
            token_api.clear(engine, LOCAL_CPU)
            point["disk"] = count_messages(bench, monitor, settle, retrieve(LOCAL_DISK))
            token_api.clear(engine, LOCAL_CPU)
            if token_api.clear(engine, LOCAL_DISK) < n:
                raise RuntimeError("the disk store's clear missed chunks")
            point["remote"] = count_messages(bench, monitor, settle, retrieve(REMOTE))
            keys = engine.hasher.keys(tokens) if engine.hasher is not None else []
            point["floor_msgs"] = 2
            point["floor_bytes"] = len(protocol.encode(protocol.ChunkKeys(list(keys), [CHUNK] * len(keys)))) + \
                len(protocol.encode(protocol.ContainsReply(prefix=len(keys))))
            points.append(point)
        return {"points": points, "chunk_tokens": CHUNK}
    finally:
        if engine is not None:
            engine.close()
        if bench is not None:
            bench.close()
        if mesh is not None:
            mesh.stop()
        nats.stop()
        shutil.rmtree(work, ignore_errors=True)


def measure_nats(args: argparse.Namespace) -> dict[str, Any]:
    run = isolated(nats_run, args.nats_chunks, args.settle)
    points = run["points"]
    xs = [p["chunks"] for p in points]
    curves: dict[str, Any] = {}
    for case in ("store", "cpu", "disk", "remote"):
        curves[f"{case}_msgs"] = curve(f"{case}: messages", xs, [p[case]["msgs"] for p in points], "msgs", False)
        curves[f"{case}_bytes"] = curve(f"{case}: bytes", xs, [p[case]["bytes"] for p in points], "B", False)
    curves["floor_msgs"] = curve("one batched request + reply", xs, [p["floor_msgs"] for p in points], "msgs", False,
                                 ceiling=True)
    curves["floor_bytes"] = curve("ChunkKeys of the keys + reply", xs, [p["floor_bytes"] for p in points], "B",
                                  False, ceiling=True)
    panels = [Panel("NATS messages per request", "chunks in the prompt", "messages",
                    [curves[f"{c}_msgs"] for c in ("store", "cpu", "disk", "remote")] + [curves["floor_msgs"]]),
              Panel("NATS payload bytes per request", "chunks in the prompt", "bytes",
                    [curves[f"{c}_bytes"] for c in ("store", "cpu", "disk", "remote")] + [curves["floor_bytes"]])]
    return {"points": points, "curves": curves, "_panels": panels,
            "note": f"{run['chunk_tokens']}-token chunks; a CPU hit's messages are the lower tiers' recency "
                    "refresh (store.touch)"}


# ---- 5. the scheduler thread ------------------------------------------------------------------------------------
def scheduler_run(token_counts: list[int], min_seconds: float) -> dict[str, Any]:
    """get_num_new_matched_tokens of new requests (full CPU-tier hits) per prompt length, and its parts."""
    quiet_logs()
    from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents
    from kvmesh.services.engine.adapter.scheduler_lookup import SchedulerLookup, engines
    from kvmesh.services.engine.adapter.scheduler_side import SchedulerSide
    from kvmesh.services.engine.assembly import build_engine
    from support.engine import PagedKV, engine_config
    from support.engine_mesh import PARAMS

    chunk = 256
    kv = PagedKV(num_blocks=32)
    config = engine_config(chunk_size=chunk, max_local_cpu_size=0.01, lmcache_instance_id="scale-scheduler")
    worker = build_engine(config, PARAMS, kv.layout, use_mesh=False)
    engines.add(0, worker)  # vLLM's single-process case: the scheduler finds the worker's engine here
    lookup = SchedulerLookup(world_size=1, timeout=5.0, nats_name="scale-scheduler")
    try:
        side = SchedulerSide(config, 16, lookup)
        hasher = lookup.hasher()
        params = lookup.key_params(0)
        assert hasher is not None and params is not None
        points = []
        for n in token_counts:
            tokens = [int(t) for t in np.random.default_rng(n).integers(0, 128_000, n)]
            chain = hasher.chain(tokens)
            lookup.update(CpuTierEvents({0: [(True, params.shard_key(span.key)) for span in chain]}))
            counter = iter(range(10**9))

            def one_request() -> None:
                request = SimpleNamespace(request_id=f"r{n}-{next(counter)}", num_tokens=n, num_prompt_tokens=n,
                                          all_token_ids=tokens, lora_request=None, mm_features=[],
                                          prompt_embeds=None, cache_salt=None)
                to_load, _ = side.get_num_new_matched_tokens(request, 0)
                assert to_load == n - 1, f"{n} tokens: {to_load} to load"
                side.request_finished(request, [])

            cpu0 = time.thread_time()
            walls = timed_loop(one_request, min_seconds)
            cpu_s = (time.thread_time() - cpu0) / len(walls)
            hashing = timed_loop(lambda: hasher.chain(tokens), min_seconds / 2)
            mirror = timed_loop(lambda: lookup.cpu_tokens(chain), min_seconds / 4)
            points.append({"tokens": n, "chunks": len(chain), "requests": len(walls),
                           "request_us": round(statistics.median(walls) * 1e6, 2),
                           "request_cpu_us": round(cpu_s * 1e6, 2),
                           "chain_hash_us": round(statistics.median(hashing) * 1e6, 2),
                           "mirror_lookup_us": round(statistics.median(mirror) * 1e6, 2),
                           "ceiling_blake2b_us": round(hash_ceiling(tokens, 50)["median_s"] * 1e6, 2)})
        return {"points": points, "chunk_size": chunk}
    finally:
        lookup.close()
        engines.remove(worker)
        worker.close()


def measure_scheduler(args: argparse.Namespace) -> dict[str, Any]:
    run = isolated(scheduler_run, doublings(1024, args.scheduler_max_tokens), args.min_seconds)
    points = run["points"]
    xs = [p["tokens"] for p in points]

    def c(key: str, name: str, ceiling: bool = False) -> dict[str, Any]:
        return curve(name, xs, [p[key] for p in points], "us", False, ceiling)

    curves = {"request": c("request_us", "get_num_new_matched_tokens (wall)"),
              "request_cpu": c("request_cpu_us", "get_num_new_matched_tokens (thread CPU)"),
              "chain_hash": c("chain_hash_us", "ChunkHasher.chain"),
              "mirror_lookup": c("mirror_lookup_us", "CPU-tier mirror lookup"),
              "ceiling_blake2b": c("ceiling_blake2b_us", "one blake2b of the token bytes", True)}
    panels = [Panel("scheduler thread per request (a full CPU-tier hit)", "prompt tokens", "us",
                    list(curves.values()))]
    return {"points": points, "curves": curves, "_panels": panels, "note": f"chunk_size {run['chunk_size']}"}


# ---- main -------------------------------------------------------------------------------------------------------
MEASURES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "controller": measure_controller, "disk_store": measure_disk_store, "engine_cpu": measure_engine_cpu,
    "nats": measure_nats, "scheduler": measure_scheduler}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--services", default=",".join(SERVICES), help=f"comma-separated subset of {SERVICES}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (up to 10^4 chunks): a smoke run")
    parser.add_argument("--max-chunks", type=int, help="controller: largest index (default 10^7; quick 10^4)")
    parser.add_argument("--controller-instances", type=int, default=10, help="controller: instances of the chunk "
                        "sweep (default 10)")
    parser.add_argument("--instance-sweep-chunks", type=int, help="controller: chunks of the instance sweep "
                        "(default 10^6; quick 10^4)")
    parser.add_argument("--max-instances", type=int, help="controller: most instances (default 1000; quick 100)")
    parser.add_argument("--lookups", type=int, help="controller: /lookup calls per point (default 2000; quick 200)")
    parser.add_argument("--disk-max-files", type=int, help="disk store: most chunk files (default 10^6; quick 10^4)")
    parser.add_argument("--disk-chunk-bytes", type=int, default=64, help="disk store: data bytes per chunk file "
                        "(default 64; each file also has a 4 KiB header page)")
    parser.add_argument("--dir", help="disk store: where to create the chunk files (default: $TMPDIR)")
    parser.add_argument("--drop-caches", action="store_true", help="disk store: drop the page cache before each "
                        "timed side (needs root; slows everything else on the machine)")
    parser.add_argument("--cpu-pool-gb", type=float, help="engine CPU tier: largest pool (default 2; quick 0.04)")
    parser.add_argument("--cpu-slot-bytes", type=int, default=4096, help="engine CPU tier: slot size (default 4096)")
    parser.add_argument("--nats-chunks", type=lambda s: [int(x) for x in s.split(",")],
                        help="nats: prompt lengths in chunks of 32 tokens (default 1,2,4,...,64; quick 1,4,16)")
    parser.add_argument("--settle", type=float, default=0.6, help="nats: seconds a request's traffic is counted "
                        "after it returns (default 0.6)")
    parser.add_argument("--scheduler-max-tokens", type=int, help="scheduler: longest prompt (default 131072; "
                        "quick 16384)")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="scheduler: seconds of samples per size")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="directory for scale.json and the PNGs")
    args = parser.parse_args(argv)
    defaults = {"max_chunks": (10**4, 10**7), "instance_sweep_chunks": (10**4, 10**6),
                "max_instances": (100, 1000), "lookups": (200, 2000), "disk_max_files": (10**4, 10**6),
                "cpu_pool_gb": (0.04, 2.0), "nats_chunks": ([1, 4, 16], [1, 2, 4, 8, 16, 32, 64]),
                "scheduler_max_tokens": (16384, 131072)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.services = [s.strip() for s in args.services.split(",") if s.strip()]
    unknown = set(args.services) - set(SERVICES)
    if unknown:
        parser.error(f"unknown services {sorted(unknown)}; known: {SERVICES}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()[0]
    services: dict[str, Any] = {}
    for service in args.services:
        t0 = time.time()
        result = MEASURES[service](args)
        panels = result.pop("_panels")
        path = args.out / f"scale-{service}.png"
        result["plot"] = str(path) if plot(service, panels, path, result.get("note", "")) else None
        result["wall_s"] = round(time.time() - t0, 1)
        services[service] = result
        print(f"{service}: done in {result['wall_s']} s", file=sys.stderr, flush=True)
    superlinear = [f"{service}.{name}" for service, r in services.items() for name, c in r["curves"].items()
                   if c["superlinear"]]
    report = {
        "benchmark": "scale", "quick": args.quick, "services": services, "superlinear": superlinear,
        "exponents": {f"{service}.{name}": c["exponent"] for service, r in services.items()
                      for name, c in r["curves"].items()},
        "cpus": os.cpu_count(), "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.time() - started, 1), "command": " ".join([sys.executable, *sys.argv]),
    }
    (args.out / "scale.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    for service, r in services.items():
        for name, c in r["curves"].items():
            total = "" if c["per_unit"] is False else f", total {c['total_exponent']}"
            flag = "  <-- SUPERLINEAR" if c["superlinear"] else ""
            print(f"{service}.{name}: k = {c['exponent']}{total} ({c['name']}){flag}")
    print(f"written: {args.out / 'scale.json'} and {len(services)} plot(s) in {args.out}")
    return report


if __name__ == "__main__":
    main()
