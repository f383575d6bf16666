#!/usr/bin/env python
"""What a scheduler lookup of a 16k-token prompt costs vLLM's scheduler thread, and how many NATS requests it
causes, for a disk-store hit and a CPU-tier hit: before / after the asynchronous lookup.

    python benchmarks/scheduler_lookup.py --label after                                   # this tree's kvmesh
    git worktree add /work/wt-before c2baa25
    python benchmarks/scheduler_lookup.py --label before --kvmesh-tree /work/wt-before   # an older tree's kvmesh
    python benchmarks/scheduler_lookup.py --label before --kvmesh-path DIR               # DIR/kvmesh/ importable

One run: the "tiny" demo model rebuilt with 32768 positions (its own cache dir), `kvmesh up` (embedded NATS,
controller, disk store; no remote store) on free loopback ports, and vLLM's OpenAI server (CPU build, its OpenMP
threads pinned to core 0, prefix caching off, --max-model-len 17000, every prompt one prefill step) with
`timed_connector.TimedKVMeshConnector`: KVMeshConnector with its scheduler-side hooks timed per request
(benchmarks/timed_connector.py says how steps are attributed). The YAML: chunk_size 256, the CPU tier (2 GB), the
mesh's disk store (local_disk, 5 GB), `nats_url` the mesh's NATS.

For each of --prompts distinct 16384-token prompts (streaming completions, max_tokens 1):
  cold           a miss: computed, stored into the CPU tier and (write-behind) the disk store; then wait until
                 its chunk files are all in the disk directory
  disk_idle      POST /clear {LocalCPUBackend} while vLLM is idle, then the prompt again: the disk store holds
                 it, the CPU tier does not (in the new design the scheduler's CPU-tier mirror only learns of the
                 clear with the next step's output, so this one is answered from the stale mirror)
  disk           /clear again, one short unrelated request (a step that carries the clear to the mirror), then
                 the prompt: a disk hit as the lookup designs intend it
  cpu            the prompt once more: a CPU-tier hit (the disk hit's prefetch put it there)
For each request: the connector's time on the scheduler thread (wall: perf_counter, cpu: thread_time; summed
over every hook, see timed_connector.py; also each get_num_new_matched_tokens call), how often vLLM asked (None =
"ask again") and after how long it got an answer, the hit the connector logged ("Reqid: ..., hit tokens H"), the
tokens the worker logged as retrieved, TTFT, and the NATS requests it caused, per kind: worker.<op> (the
scheduler's lookup is worker.prefix_lookup in both designs: c2baa25 sends a WorkerCommand with op
"prefix_lookup", now a PrefixLookup, on the same subject) and store.<op> (store.contains, store.get, ...). They
are seen by an observer connection subscribed to every subject (`>`, replies included) in one subscription, so
in the server's order: "during the lookup" counts the requests between a worker.prefix_lookup and its reply
(what the lookup itself cost); "whole request" counts every kvmesh.* request from sending the completion to
--settle seconds after its response (the prefetch, the load, write-behind, events, heartbeats).

Ceilings measured in the same run, on the same NATS and this machine: the median request/reply round trip of a
tiny message to a trivial responder (nats-py, --rtt-samples requests at start and at end; also from a thread
blocking on the loop, as a blocking scheduler would), and the median time to blake2b-128 the prompt's 16384
tokens once (as little-endian int64, the bytes chunk keys hash). Ratios: scheduler time / NATS round trip,
scheduler time / one raw hash of the prompt.

Writes benchmarks/results/scheduler_lookup-<label>.json (every sample, medians, ratios) and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))  # the test suite's wait_until

from demo import Child, wait_http  # noqa: E402
from make_demo_model import ensure_model  # noqa: E402
from ttft import Prompts  # noqa: E402
from vllm_peers import completion_events, cpu_name, free_port, pin_to  # noqa: E402
from support.waiting import wait_until  # noqa: E402

CHUNK = 256
SIZE = 16384
MAX_LEN = 17000
INSTANCE = "schedbench"
TIMED = {"kv_connector": "TimedKVMeshConnector", "kv_connector_module_path": "timed_connector", "kv_role": "kv_both"}
CASES = ["cold", "disk_idle", "disk", "cpu"]
HIT_LINE = re.compile(r"Reqid: (?P<req>\S+), Total tokens (?P<total>\d+), hit tokens (?P<hit>\d+), "
                      r"need to load (?P<load>\d+)")
RETRIEVED_LINE = re.compile(r"Retrieved (?P<tokens>\d+) tokens for request (?P<req>\S+) in ")
LOAD_ERROR_LINE = re.compile(r"request (?P<req>\S+): loaded \d+ of \d+ tokens;|loading KV for request (?P<req2>\S+) "
                             r"failed")
SOURCE_LINE = re.compile(r"TimedKVMeshConnector \((?P<role>\w+)\): KVMeshConnector from (?P<path>\S+);")


# ---- NATS: the observer and the round-trip ceiling ------------------------------------------------------------
class NatsBench:
    """An asyncio loop in a thread with three nats-py connections: an observer of every subject (`>`) that
    records each message in the server's order, and a trivial echo responder and a requester for the round-trip
    ceiling."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="nats-bench", daemon=True)
        self.thread.start()
        self.seen: list[tuple[float, str, str | None, int]] = []  # (perf_counter, subject, reply subject, bytes)
        self._conns: list[Any] = []
        self.call(self._start())

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        import nats

        observer = await nats.connect(self.url, name="scheduler-bench-observer")
        requester = await nats.connect(self.url, name="scheduler-bench-requester")
        responder = await nats.connect(self.url, name="scheduler-bench-responder")
        self._conns = [observer, requester, responder]

        async def seen(msg: Any) -> None:
            self.seen.append((time.perf_counter(), msg.subject, msg.reply or None, len(msg.data)))

        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        # Everything, replies included, in ONE subscription: nats-py runs each subscription's callbacks from its
        # own queue, so only one subscription keeps the server's order (a lookup's reply after the requests it
        # caused). Chunk data travels by shared memory, so the messages are small.
        self._seen_cb = seen
        self._observer = observer
        self._observing = await observer.subscribe(">", cb=seen)
        await responder.subscribe("schedbench.echo", cb=echo)
        await responder.flush()
        await observer.flush()
        await requester.flush()
        self.requester = requester

    async def _rtts(self, n: int) -> list[float]:
        samples = []
        for _ in range(10):  # warm the path
            await self.requester.request("schedbench.echo", b"x", timeout=5)
        for _ in range(n):
            started = time.perf_counter()
            await self.requester.request("schedbench.echo", b"x", timeout=5)
            samples.append(time.perf_counter() - started)
        return samples

    async def _observe(self, on: bool) -> None:
        if on:
            self._observing = await self._observer.subscribe(">", cb=self._seen_cb)
        else:
            await self._observing.unsubscribe()
        await self._observer.flush()

    def rtt(self, n: int) -> dict[str, Any]:
        """Round trips measured on the loop, and from this thread blocking on the loop (each a median); the
        observer is off meanwhile, so the server forwards each message once."""
        self.call(self._observe(False))
        try:
            return self._rtt(n)
        finally:
            self.call(self._observe(True))

    def _rtt(self, n: int) -> dict[str, Any]:
        in_loop = self.call(self._rtts(n))
        from_thread = []
        for _ in range(n):
            started = time.perf_counter()
            self.call(self.requester.request("schedbench.echo", b"x", timeout=5))
            from_thread.append(time.perf_counter() - started)
        return {"in_loop_median_s": statistics.median(in_loop), "in_loop_p90_s": quantile(in_loop, 0.9),
                "from_thread_median_s": statistics.median(from_thread), "samples": n}

    def window(self, start: float, end: float) -> list[tuple[str, str | None]]:
        """(subject, reply) of the messages that reached the observer between two perf_counter times, in the
        server's order (delivery times lag by milliseconds on a busy core; the order does not)."""
        return [(s, r) for t, s, r, _ in list(self.seen) if start <= t <= end]

    def raw(self, start: float, end: float) -> list[tuple[str, str, int]]:
        """(kind, sender: the reply inbox's connection part, bytes) of the requests in the window, in order."""
        return [(subject_kind(s), (r or "").split(".")[1][-6:] if r and r.count(".") >= 2 else "-", n)
                for t, s, r, n in list(self.seen) if start <= t <= end and s.startswith("kvmesh.")
                and subject_kind(s).startswith(("worker.", "store."))]

    def counts(self, start: float, end: float) -> dict[str, int]:
        """Messages per subject kind (replies not counted) between two perf_counter times."""
        return dict(Counter(subject_kind(s) for s, _ in self.window(start, end) if s.startswith("kvmesh.")))

    def subjects(self, start: float, end: float) -> dict[str, int]:
        return dict(Counter(s for s, _ in self.window(start, end) if s.startswith("kvmesh.")))

    def during_lookups(self, start: float, end: float) -> dict[str, Any]:
        """The scheduler's worker lookups in the window and the requests between each one and its reply."""
        messages = self.window(start, end)
        lookups = []
        for index, (subject, reply) in enumerate(messages):
            if subject_kind(subject) != "worker.prefix_lookup":
                continue
            end_index = next((i for i in range(index + 1, len(messages)) if messages[i][0] == reply), None)
            between = messages[index + 1:end_index] if end_index is not None else []
            sequence: list[list[Any]] = []  # run-length encoded kinds, in order
            for kind in (subject_kind(s) for s, _ in between if s.startswith("kvmesh.")):
                if sequence and sequence[-1][0] == kind:
                    sequence[-1][1] += 1
                else:
                    sequence.append([kind, 1])
            lookups.append({"reply_seen": end_index is not None,
                            "requests_before_reply": dict(Counter(k for k, n in sequence for _ in range(n))),
                            "sequence": sequence})
        worker = len(lookups)
        store: Counter[str] = Counter()
        for lookup in lookups:
            store.update({k: v for k, v in lookup["requests_before_reply"].items() if k.startswith("store.")})
        return {"worker_lookups": worker, "store_requests": dict(store), "lookups": lookups,
                "all_replies_seen": all(lookup["reply_seen"] for lookup in lookups)}

    def close(self) -> None:
        async def close_all() -> None:
            for nc in self._conns:
                await nc.close()

        try:
            self.call(close_all(), 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def subject_kind(subject: str) -> str:
    parts = subject.split(".")
    if len(parts) >= 4 and parts[1] in ("worker", "store"):
        return f"{parts[1]}.{parts[-1]}"
    return ".".join(parts[:2])


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def hash_ceiling(tokens: list[int], repeat: int) -> dict[str, Any]:
    """One blake2b-128 over the prompt's tokens as little-endian int64 (the bytes chunk keys hash)."""
    import numpy as np

    raw = np.asarray(tokens, dtype="<i8").tobytes()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        hashlib.blake2b(raw, digest_size=16).digest()
        samples.append(time.perf_counter() - started)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "bytes": len(raw), "samples": repeat}


# ---- vLLM ---------------------------------------------------------------------------------------------------------
def stream(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """One greedy streaming completion of one token: TTFT, total time, the response id, the send time."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    first = None
    response_id = None
    text = []
    for event in completion_events(url, body):
        response_id = response_id or event.get("id")
        if not event.get("choices"):
            continue
        if first is None:
            first = time.perf_counter()
        text.append(event["choices"][0].get("text") or "")
    done = time.perf_counter()
    return {"sent": sent, "first": first or done, "done": done, "ttft_s": (first or done) - sent,
            "total_s": done - sent, "id": response_id, "text": "".join(text)}


def timed_line(path: Path, response_id: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        if not path.exists():
            return None
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["req_id"].startswith(response_id):
                return record
        return None

    return wait_until(find, 15, what=f"the timed connector's line for {response_id}", interval=0.1)


def chunk_files(disk: Path) -> int:
    return sum(1 for _ in disk.glob("*/*.kvc"))


def median_or_none(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---- the run ------------------------------------------------------------------------------------------------------
def kvmesh_source(env: dict[str, str]) -> str:
    """Where the children's `import kvmesh.shared` comes from (their PYTHONPATH vs the editable install): a package
    every tree has (a module that moved would come from the editable install under an older tree)."""
    out = subprocess.run([sys.executable, "-c", "import os, kvmesh.shared as k; print(os.path.realpath("
                          "k.__file__))"], env=env, capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else f"error: {out.stderr[-300:]}"


def make_kvmesh_path(tree: Path, into: Path) -> Path:
    """A directory whose `kvmesh/` package is `tree`'s: kvmesh_pkg's files, and `shared`, `services` as symlinks
    (pyproject's package-dir: kvmesh -> kvmesh_pkg, kvmesh.shared -> shared, kvmesh.services -> services)."""
    package = into / "kvmesh"
    package.mkdir(parents=True)
    for path in (tree / "kvmesh_pkg").glob("*.py"):
        (package / path.name).write_bytes(path.read_bytes())
    (package / "shared").symlink_to(tree.resolve() / "shared")
    (package / "services").symlink_to(tree.resolve() / "services")
    return into


def git_describe(tree: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()

    return {"tree": str(tree), "commit": git("rev-parse", "HEAD"), "subject": git("log", "-1", "--format=%s")[:120],
            "dirty_files": [line for line in git("status", "--porcelain").splitlines() if line][:20]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    work = Path(tempfile.mkdtemp(prefix="kvmesh-schedlookup-"))
    logs = work / "logs"
    disk = work / "disk"
    kvmesh_path = args.kvmesh_path
    tree = REPO
    if args.kvmesh_tree:
        tree = args.kvmesh_tree.resolve()
        kvmesh_path = make_kvmesh_path(tree, work / "kvmesh-path")
    elif kvmesh_path:
        tree = (kvmesh_path / "kvmesh" / "shared").resolve().parent
    expected_root = (kvmesh_path / "kvmesh" / "shared").resolve() if kvmesh_path else (REPO / "shared").resolve()

    model = ensure_model(args.model_dir, "tiny", max_positions=32768)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVMESH_"))}
    pythonpath = [str(kvmesh_path)] if kvmesh_path else []
    pythonpath += [str(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(pythonpath), TOKENIZERS_PARALLELISM="false")
    source = kvmesh_source(env)
    if not source.startswith(str(expected_root)):
        raise SystemExit(f"the children import kvmesh from {source}, not from {expected_root}: PYTHONPATH does not "
                         f"beat the venv's editable install here")
    print(f"kvmesh for the children: {source}", flush=True)

    all_cores = os.sched_getaffinity(0)
    side = all_cores - {0} or {0}
    pin_to(side)  # this client, kvmesh up and vLLM's scheduler process; vLLM's OpenMP threads go to core 0
    side_list = ",".join(map(str, sorted(side)))
    nats_port, controller_port, vllm_port = free_port(), free_port(), free_port()
    controller = f"http://127.0.0.1:{controller_port}"
    # The observer below reads every subject (`>`), which KVMesh's own NATS permits no one: this run's NATS is
    # one without authentication, and `kvmesh up` joins it.
    from kvmesh.shared.messaging.embedded_nats import EmbeddedNats

    nats = EmbeddedNats(port=nats_port).start()
    nats_url = nats.url
    mesh = Child("kvmesh-up", ["taskset", "-c", side_list, sys.executable, "-m", "kvmesh.cli", "up", "--nats-url",
                               nats_url, "--port", str(controller_port), "--host", "127.0.0.1", "--disk-dir",
                               str(disk), "--disk-size", "5", "--no-remote", "--log-dir", str(logs)],
                 logs / "kvmesh-up.log", env=env)
    config = work / "kvmesh.yaml"
    config.write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 2\n"
                      f'local_disk: "file://{disk}"\nmax_local_disk_size: 5\n'
                      f'nats_url: "{nats_url}"\nenable_controller: true\nlmcache_instance_id: "{INSTANCE}"\n')
    timed_path = work / "timed.jsonl"
    vllm_env = {**env, "LMCACHE_CONFIG_FILE": str(config), "KVMESH_TIMED_CONNECTOR_OUT": str(timed_path),
                "VLLM_CPU_OMP_THREADS_BIND": "0",
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    vllm_log = logs / "vllm.log"
    vllm = None
    bench = None
    started = time.time()
    try:
        wait_http(mesh, f"{controller}/healthz", 120, "kvmesh up")
        vllm = Child("vllm", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                              "--dtype", "float32", "--port", str(vllm_port), "--host", "127.0.0.1",
                              "--max-model-len", str(MAX_LEN), "--max-num-batched-tokens", str(MAX_LEN),
                              "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(TIMED)],
                     vllm_log, env=vllm_env)
        url = f"http://127.0.0.1:{vllm_port}"
        wait_http(vllm, f"{url}/v1/models", 900, "vLLM")
        bench = NatsBench(nats_url)
        prompts = Prompts(model)
        hash_prompt = prompts.fresh(SIZE, "hash")
        ceilings: dict[str, Any] = {"nats_rtt_start": bench.rtt(args.rtt_samples),
                                    "blake2b_16k_start": hash_ceiling(hash_prompt, args.hash_samples)}
        print(f"ceilings at start: {json.dumps(ceilings)}", flush=True)

        def vlog() -> str:
            return vllm_log.read_text(errors="replace")

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            response = httpx.post(f"{controller}{path}", json=body, timeout=30)
            response.raise_for_status()
            return response.json()

        def lookup(prompt: list[int]) -> Any:
            return post("/lookup", {"tokens": prompt}).get("layout_info", {}).get(INSTANCE)

        def clear_cpu(prompt: list[int]) -> None:
            post("/clear", {"instance_id": INSTANCE, "location": "LocalCPUBackend"})
            wait_until(lambda: (entry := lookup(prompt)) and entry[0] == "LocalDiskBackend"
                       and entry[1] >= SIZE - CHUNK,
                       30, what="the controller reporting the prompt on LocalDiskBackend after /clear", interval=0.1)

        def measure(case: str, prompt: list[int]) -> dict[str, Any]:
            result = stream(url, str(model), prompt)
            time.sleep(args.settle)
            rid = result["id"]
            timed = timed_line(timed_path, rid)
            text = vlog()
            hits = [(int(m["hit"]), int(m["load"])) for m in HIT_LINE.finditer(text) if m["req"].startswith(rid)]
            retrieved = [int(m["tokens"]) for m in RETRIEVED_LINE.finditer(text) if m["req"].startswith(rid)]
            errors = [m.group(0) for m in LOAD_ERROR_LINE.finditer(text) if (m["req"] or m["req2"]).startswith(rid)]
            lookup_end = result["first"]
            during = bench.during_lookups(result["sent"], result["done"] + args.settle)
            sample = {
                "case": case, "req_id": timed["req_id"], "ttft_s": result["ttft_s"], "total_s": result["total_s"],
                "sched_wall_s": timed["total_wall_s"], "sched_cpu_s": timed["total_cpu_s"],
                "lookup_wall_s": timed["hooks"]["get_num_new_matched_tokens"]["wall_s"],
                "lookup_cpu_s": timed["hooks"]["get_num_new_matched_tokens"]["cpu_s"],
                "lookup_calls": timed["lookup_calls"], "lookup_none_answers": timed["lookup_none_answers"],
                "lookup_call_wall_cpu_s": timed["lookup_call_wall_cpu_s"],
                "lookup_answered_after_s": timed["lookup_answered_after_s"], "steps": timed["steps"],
                "hit_tokens": hits[-1][0] if hits else None, "load_tokens": hits[-1][1] if hits else None,
                "hit_lines": len(hits), "retrieved_tokens": retrieved, "load_errors": errors,
                "nats_during_lookup": {"worker.prefix_lookup": during["worker_lookups"], **during["store_requests"]}
                if during["worker_lookups"] else {},
                "lookup_nats_detail": during,
                "nats_requests_raw": bench.raw(result["sent"], result["done"] + args.settle)[:20],
                "nats_to_first_token": bench.counts(result["sent"], lookup_end),
                "nats_to_settled": bench.counts(result["sent"], result["done"] + args.settle),
                "nats_subjects_to_first_token": bench.subjects(result["sent"], lookup_end),
                "hooks": timed["hooks"], "output": result["text"],
            }
            worker_lookups = sum(v for k, v in sample["nats_during_lookup"].items() if k.startswith("worker."))
            print(f"  {case:9s} ttft {sample['ttft_s'] * 1e3:8.1f} ms"
                  f"  sched wall {sample['sched_wall_s'] * 1e3:7.2f} ms"
                  f" cpu {sample['sched_cpu_s'] * 1e3:7.2f} ms  asked {sample['lookup_calls']}x"
                  f" (None {sample['lookup_none_answers']})  hit {sample['hit_tokens']}  retrieved {retrieved}"
                  f"  answered after {(sample['lookup_answered_after_s'] or 0) * 1e3:.1f} ms"
                  f"  worker lookups {worker_lookups}  nats in lookup {sample['nats_during_lookup']}, whole request "
                  f"{sample['nats_to_settled']}", flush=True)
            return sample

        # one-time costs (allocator growth at 16k, first lookups and stores) are not samples
        print("warm-up", flush=True)
        for size in (600, 2500):
            stream(url, str(model), prompts.fresh(size, "warmup"))
        warm = prompts.fresh(SIZE, "warmup")
        before = chunk_files(disk)
        stream(url, str(model), warm)
        wait_until(lambda: chunk_files(disk) >= before + SIZE // CHUNK, 120, what="the warm-up prompt's chunks on disk",
                   interval=0.1)
        clear_cpu(warm)
        stream(url, str(model), prompts.fresh(300, "nudge"))
        stream(url, str(model), warm)
        stream(url, str(model), warm)

        samples: list[dict[str, Any]] = []
        for index in range(args.prompts):
            print(f"prompt {index + 1}/{args.prompts}", flush=True)
            prompt = prompts.fresh(SIZE, f"p{index}")
            before = chunk_files(disk)
            samples.append(measure("cold", prompt))
            wait_until(lambda: chunk_files(disk) >= before + SIZE // CHUNK, 120, what="the prompt's chunks on disk",
                       interval=0.1)
            time.sleep(0.5)  # the last writes' renames
            clear_cpu(prompt)
            samples.append(measure("disk_idle", prompt))
            clear_cpu(prompt)
            stream(url, str(model), prompts.fresh(300, "nudge"))  # a step carries the clear to the scheduler
            time.sleep(args.settle)
            samples.append(measure("disk", prompt))
            samples.append(measure("cpu", prompt))
        ceilings["nats_rtt_end"] = bench.rtt(args.rtt_samples)
        ceilings["blake2b_16k_end"] = hash_ceiling(hash_prompt, args.hash_samples)
        rtt = statistics.median([ceilings["nats_rtt_start"]["in_loop_median_s"],
                                 ceilings["nats_rtt_end"]["in_loop_median_s"]])
        one_hash = statistics.median([ceilings["blake2b_16k_start"]["median_s"],
                                      ceilings["blake2b_16k_end"]["median_s"]])
        ceilings["nats_rtt_median_s"] = rtt
        ceilings["blake2b_16k_median_s"] = one_hash
        sources = {m["role"]: m["path"] for m in SOURCE_LINE.finditer(vlog())}
    finally:
        if bench is not None:
            bench.close()
        if vllm is not None:
            vllm.stop(60)
        mesh.stop(30)
        nats.stop()
        shutil.rmtree(disk, ignore_errors=True)  # chunk files (hundreds of MB); the logs stay

    cases: dict[str, Any] = {}
    for case in CASES:
        rows = [s for s in samples if s["case"] == case]
        kinds = sorted({k for s in rows for k in s["nats_to_settled"]})
        lookup_kinds = sorted({k for s in rows for k in s["nats_during_lookup"]})
        sched = statistics.median(s["sched_wall_s"] for s in rows)
        sched_cpu = statistics.median(s["sched_cpu_s"] for s in rows)
        cases[case] = {
            "n": len(rows),
            "sched_wall_median_s": sched, "sched_cpu_median_s": sched_cpu,
            "lookup_wall_median_s": statistics.median(s["lookup_wall_s"] for s in rows),
            "lookup_calls_median": statistics.median(s["lookup_calls"] for s in rows),
            "lookup_answered_after_median_s": median_or_none([s["lookup_answered_after_s"] for s in rows]),
            "ttft_median_s": statistics.median(s["ttft_s"] for s in rows),
            "hit_tokens": [s["hit_tokens"] for s in rows],
            "retrieved_tokens": [s["retrieved_tokens"] for s in rows],
            "load_errors": sum(len(s["load_errors"]) for s in rows),
            "nats_during_lookup_median": {k: statistics.median(s["nats_during_lookup"].get(k, 0) for s in rows)
                                          for k in lookup_kinds},
            "nats_whole_request_median": {k: statistics.median(s["nats_to_settled"].get(k, 0) for s in rows)
                                          for k in kinds},
            "worker_lookups_during_lookup_median": statistics.median(
                sum(v for k, v in s["nats_during_lookup"].items() if k.startswith("worker.")) for s in rows),
            "store_requests_during_lookup_median": statistics.median(
                sum(v for k, v in s["nats_during_lookup"].items() if k.startswith("store.")) for s in rows),
            "store_requests_whole_request_median": statistics.median(
                sum(v for k, v in s["nats_to_settled"].items() if k.startswith("store.")) for s in rows),
            "ratios": {"sched_wall_over_nats_rtt": sched / rtt, "sched_cpu_over_nats_rtt": sched_cpu / rtt,
                       "sched_wall_over_one_hash": sched / one_hash, "sched_cpu_over_one_hash": sched_cpu / one_hash},
        }
    import torch
    import vllm as vllm_module

    return {
        "benchmark": "scheduler_lookup", "label": args.label, "prompt_tokens": SIZE, "prompts": args.prompts,
        "kvmesh": {"children_import": source, "connector_sources": sources, **git_describe(tree),
                   "kvmesh_path": str(kvmesh_path) if kvmesh_path else None},
        "ceilings": ceilings, "cases": cases, "samples": samples,
        "setup": {"vllm": vllm_module.__version__, "torch": torch.__version__, "model": str(model),
                  "model_preset": "tiny (2 layers, hidden 256, 2 KV heads x 64, fp32), max_positions 32768",
                  "max_model_len": MAX_LEN, "max_num_batched_tokens": MAX_LEN, "chunk_size": CHUNK,
                  "VLLM_CPU_OMP_THREADS_BIND": "0", "side_cores": side_list, "settle_s": args.settle,
                  "yaml": config.read_text(), "statistic": "median over prompts",
                  "attribution": "timed_connector.py: build_connector_meta split among the step's scheduled "
                                 "requests (else those in flight); update_connector_output among those in flight"},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "command": " ".join([sys.executable, *sys.argv]), "wall_s": round(time.time() - started, 1),
        "logs": str(logs),
    }


def summary_line(result: dict[str, Any]) -> str:
    c, ceil = result["cases"], result["ceilings"]
    parts = []
    for case in ("disk", "disk_idle", "cpu"):
        r = c[case]
        parts.append(f"{case}: sched {r['sched_wall_median_s'] * 1e3:.2f} ms wall / "
                     f"{r['sched_cpu_median_s'] * 1e3:.2f} ms cpu "
                     f"({r['ratios']['sched_wall_over_nats_rtt']:.2f}x NATS RTT, "
                     f"{r['ratios']['sched_wall_over_one_hash']:.1f}x one hash); during the lookup "
                     f"{r['worker_lookups_during_lookup_median']:g} worker lookup(s) + "
                     f"{r['store_requests_during_lookup_median']:g} store request(s) (whole request "
                     f"{r['store_requests_whole_request_median']:g}), answer after "
                     f"{(r['lookup_answered_after_median_s'] or 0) * 1e3:.1f} ms; "
                     f"TTFT {r['ttft_median_s'] * 1e3:.0f} ms")
    return (f"[{result['label']}] 16k-token prompt; NATS RTT {ceil['nats_rtt_median_s'] * 1e6:.0f} us, one blake2b of "
            f"the prompt {ceil['blake2b_16k_median_s'] * 1e6:.0f} us. " + "; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="after", help="names the result file (before, after, ...)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--kvmesh-path", type=Path, help="a directory holding a `kvmesh/` package, prepended to the "
                                                        "children's PYTHONPATH (default: the installed kvmesh)")
    group.add_argument("--kvmesh-tree", type=Path, help="a KVMesh source tree (e.g. a git worktree of an older "
                                                        "commit): a --kvmesh-path is built from it")
    parser.add_argument("--prompts", type=int, default=3, help="distinct 16k-token prompts")
    parser.add_argument("--rtt-samples", type=int, default=200)
    parser.add_argument("--hash-samples", type=int, default=200)
    parser.add_argument("--settle", type=float, default=0.5, help="seconds after a response still counted")
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "kvmesh-tests" / "models" /
                        "tiny-32k")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    result = run(args)
    result["summary"] = summary_line(result)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"scheduler_lookup-{args.label}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"label": result["label"], "ceilings": {k: v for k, v in result["ceilings"].items()
                                                             if k.endswith("_median_s")},
                      "cases": {k: {kk: vv for kk, vv in v.items() if kk not in ("retrieved_tokens",)}
                                for k, v in result["cases"].items()}}, indent=2))
    print(result["summary"])
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
