#!/usr/bin/env python
"""Multi-round QA under a request rate, the shape of LMCache's own multi-round QA benchmark: vLLM alone, LMCache
0.5.6 (multiprocess server), KVMesh and the floor, when the working set fits KVMesh's CPU tier, when the disk
store has to serve most of it, and when the remote store has to (issue 28). Plus a soak mode for KVMesh alone.

    python benchmarks/multi_round_qa.py [--regime a|b|c|all] [--qps 1,2,4,8] [--ttft-bound 1.0] [--quick]
                                        [--users 12] [--rounds 4] [--peers vllm lmcache kvmesh floor] [--out DIR]
    python benchmarks/multi_round_qa.py --soak SECONDS [--soak-qps 0.5] [--sample-secs 60]
    python benchmarks/multi_round_qa.py --workload agentic [--regime a|b|c|all] [--qps 0.125,0.25,0.5,1]
                                        [--sessions 4] [--subagents 3] [--turns 3] [--tool-output 64] [--think-secs 1]

The workload (one "level" per QPS of the sweep): --users users, each with a document of --context tokens behind
one shared system prompt of --system tokens, ask --rounds questions of --question tokens in turn. A user's prompt
for question r is "system + document + (question, answer) x (r-1) + question r", the answers in it fixed
stand-ins of --answer tokens (serving.py's `build_prompts`: every peer gets byte-identical prompts; the model has
random weights, its real answers are noise), and each request generates exactly --answer tokens (greedy, EOS
ignored). Arrivals, as in LMCache's benchmark: requests come at --qps per second on average. New users start at
that rate (user u's first question at the u-th arrival of a Poisson process of rate QPS, or every 1/QPS seconds
with --arrivals uniform); after that each user is a process of rate QPS / users (exponential gaps of mean
users / QPS, or exactly that gap), gated by its answers: its next question is sent at the later of its scheduled
time and the arrival of its last answer's last token. All users are active together, so between two questions of
one user the others' prompts go through vLLM's KV space: that is where reuse has to come from outside vLLM. Each
level has users of its own (other documents, same system prompt), so a level starts cold like the first; levels
run in rising QPS on one vLLM per peer. Arrival times are drawn from --seed, the same for every peer.

--workload agentic (agentic_workload.py): in place of users, --sessions agent sessions per level, each a plan
over the session's own --context behind the shared --system prompt, --subagents sub-agents forked from it that
run --turns turns each (a tool output of --tool-output tokens appended per turn, after a think time of mean
--think-secs), and a merge of their results; sessions start at --qps sessions per second (default
0.125,0.25,0.5,1). Everything else (peers, regimes, the bound, the warm-up, the counters) as below; the working
set is the prefix tree of every session's leaves (each sub-agent's last turn and the merge). Writes
`agentic-<regime>.json` / `.png`. --quick: 3 sessions x 2 sub-agents x 2 turns at 0.25, 0.5 sessions/s.

Regimes (W: the KV bytes of one level's working set, the prefix tree of every user's last prompt and answer,
serving.py's `working_set_tokens` x the model's KV bytes per token). KVMesh's CPU tier C, disk store cap D and
remote store R (the mesh's own remote store from `kvmesh up`, or with --remote-store redis a redis-server that
this script starts on loopback: maxmemory R, volatile-lru):

  a  W fits the CPU tier: C = 2 W (room for the previous level's chunks too), D = 4 GB, no remote store
  b  W ~ 3 C: C = W / 3, D = 4 GB (holds every level): the disk store serves the rest
  c  W ~ 3 C + D: C = D = W / 4, R = 4 GB: what neither holds comes from the remote store

C is never below what the requests in vLLM's KV space need at once (--kv-requests of the longest prompt), so at
small sizes the ratio W / C can be below the target; the JSON records the real one ("w_over_cpu_tier"). LMCache's
L1 (--l1-size-gb) is C. LMCache 0.5.6's MP server offers L2 adapters (--l2-adapter JSON: fs, fs_native, resp
(Redis / Valkey), valkey, mooncake_store, nixl, ...); here regimes b and c give it the `fs` adapter on a directory
of the run (the JSON says which, "lmcache_l2"; 0.5.6's fs adapter has no capacity cap, so it holds everything:
a tier at least as strong as KVMesh's capped disk + remote), regime a none.

Peers, one after the other in one run, same model (the `--bench` demo model of serving.py; built if missing),
same vLLM flags (prefix caching on, --block-size 128, --max-num-batched-tokens = --max-model-len = the longest
prompt + answer), same prompts and arrival times:

  vllm     vLLM alone, its KV space small: --kv-requests requests of the longest prompt (in blocks, with
           --num-gpu-blocks-override, which the CPU build honours; see serving.py)
  lmcache  LMCache 0.5.6 multiprocess server (L1 = C, the L2 above) and vLLM's LMCacheMPConnector, small KV
           space; "not_run" with the reason when lmcache cannot be imported (--lmcache-site)
  kvmesh   KVMeshConnector on a fresh `kvmesh up` mesh (controller, disk store; remote store in regime c) with
           the regime's C / D / R, small KV space
  floor    vLLM alone with a KV space for the whole working set plus the requests in flight (the machine's
           ceiling for reuse: no connector's TTFT can be below it)

vLLM's compute is pinned to core 0 (VLLM_CPU_OMP_THREADS_BIND=0), this client, the mesh, Redis and the LMCache
server to the other cores, as serving.py does. Before the first level every peer is warmed up alike (`warm_up`):
two requests with an unrelated prompt, then --warmup-users users of their own through all their rounds, two at a
time (a fresh vLLM's first forwards run up to 2x slower, which fell on the first level's cold requests). Per peer
and level: TTFT p50/p90/p99 (sent -> first token), inter-token latency (ITL) p50/p90 over every gap between two
streamed tokens of every request, requests/s and generated tokens/s over the level's wall time (first send -> last
token), failures (an HTTP error, a broken stream or fewer tokens than asked), and hit rates from the server's
/metrics counters read before and after the level: vLLM's prefix cache (prefix_cache_hits / queries), the
connector's (external_prefix_cache_hits / queries), and for KVMesh by tier as shares of the level's prompt tokens:
disk = lmcache:num_local_disk_read_bytes, remote = num_remote_read_bytes (each / KV bytes per token: tokens read
from that tier, which counts chunks fetched and then not used and the chunk files' headers, so it can exceed the
tier's hits), CPU = num_retrieved_tokens less those two, at least 0 (a lower bound). LMCache's L1/L2 split is not
on vLLM's /metrics (its server runs with metrics off): None.

The sweep: a peer "holds" a QPS when that level's p90 TTFT is at most --ttft-bound (default 1.0 s: about 2.5x a
cold prefill of the longest default prompt, ~1.5k tokens in bf16 on one core of this machine, so only queueing
pushes past it) and no request failed; `max_qps_held` is the highest QPS held with every lower level held
too. Once a peer misses the bound, its higher levels are skipped (they can only queue more) unless --full-sweep.
Every peer of a regime is started (and warmed up) first; then the levels run in rising QPS, the peers taking
turns within each level, the first of them moving on by one each level (`interleave`). The machine's speed
drifts over minutes on a shared VM (vLLM alone measured 0.23 s and then 0.45 s p50 at QPS 1 in two regimes run
one after the other, its ITL 9 ms and then 17 ms): run peer after peer, that drift fell on whichever peer ran
late, and comparisons within a level are what the goals ask.

Writes `multi_round_qa-<regime>.json` and `multi_round_qa-<regime>.png` (TTFT p50 and p90, and requests/s and
generated tokens/s, against QPS, one line per peer) to --out, and prints a table. Default sizes: one regime with
the four peers and the sweep takes ~15 minutes on a 2-core machine (4 vLLM starts of ~1 minute, up to 4 levels
of 48 requests each). --quick: 6 users x 3 rounds of short prompts at QPS 1,2 (~7 minutes a regime, mostly vLLM starts).

Soak (--soak SECONDS): KVMesh alone on a fresh mesh (controller, disk store) at a steady --soak-qps, users
arriving without end (each user of --rounds questions replaced by a new one, --users at a time), with a CPU tier
of twice the KV of the requests in flight and a disk store of three times that (--soak-cpu-gb, --soak-disk-gb),
so both evict throughout. Every --sample-secs (default 60) and at the start and the end it samples: the RSS and
open file descriptors of every process (vLLM's API server, engine core and workers, `kvmesh up`, the controller,
the disk store, nats-server: the process trees of vLLM and `kvmesh up`, through psutil), the CPU tier's chunks
and bytes (lmcache:pinned_memory_objs_count, lmcache:local_cache_usage) and evictions, the controller's table
sizes from its /metrics (kvmesh_controller_index_keys, _producer_keys, _producers, _instances, _tracked_events,
_commands_in_flight), the disk store directory's bytes, and requests done and failed. Writes `soak.json` and
`soak.png` (one panel per measure over time); exits 1 if any request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agentic_workload import (AgenticShape, Session, Step, build_sessions, run_session,  # noqa: E402
                              session_times)
from serving import (BLOCK, COUNTERS, GB, Shape, blocks, build_prompts, bytes_per_token, hit_rates,  # noqa: E402
                     percentile, working_set_tokens)
from vllm_peers import (CHUNK, KVMESH, LMCACHE_SITE, Mesh, Server, completion_events, cpu_name,  # noqa: E402
                        free_port, lmcache_connector, lmcache_env, pin_to, side_cores, start_lmcache_server,
                        start_mesh)

PEERS = ["vllm", "lmcache", "kvmesh", "floor"]
REGIMES = ["a", "b", "c"]
RATE_UNIT = {"qa": "QPS", "agentic": "sessions/s"}
BIG_GB = 4.0  # a disk store / remote store that holds every level of the run
TTFT_BOUND_S = 1.0
IDLE_BETWEEN_S = 2.0  # between two levels: the last one's vLLM goes idle


# ---- one request -----------------------------------------------------------------------------------------


@dataclass
class Request:
    user: int  # within the level (the session, agentic)
    round: int  # 1-based (agentic: 1 the plan, 1 + t a sub-agent's turn t, turns + 2 the merge)
    prompt_tokens: int
    sent_s: float  # since the level started
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed tokens
    error: str | None = None
    role: str = "question"  # agentic: "plan", "subagent" or "merge"


def timed_complete(server: Server, prompt: list[int], max_tokens: int, request: Request) -> None:
    """One greedy streaming completion of exactly `max_tokens` tokens (EOS ignored), as Server.complete, with the
    time of every streamed token; fills `request` (its `error` on any failure, or fewer tokens than asked)."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    stamps: list[float] = []
    try:
        for event in completion_events(server.url, body, server.name):
            if event.get("usage"):
                request.tokens = event["usage"].get("completion_tokens") or request.tokens
            if event.get("choices"):
                stamps.append(time.perf_counter())
    except Exception as error:  # noqa: BLE001 - every failure is counted, the run goes on
        request.error = f"{type(error).__name__}: {error}"[:300]
    ended = time.perf_counter()
    request.e2e_s = ended - started
    if stamps:
        request.ttft_s = stamps[0] - started
        request.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]
    if request.error is None and request.tokens != max_tokens:
        request.error = f"generated {request.tokens} tokens, asked {max_tokens}"


# ---- arrivals --------------------------------------------------------------------------------------------


def schedule(users: int, rounds: int, qps: float, arrivals: str, rng: random.Random) -> tuple[list[float],
                                                                                                list[list[float]]]:
    """(start time of each user, gap before each of its questions 2..rounds): users start at rate `qps`, then each
    user asks at rate qps / users (exponential gaps, or fixed ones with "uniform")."""
    if qps <= 0:
        raise ValueError(f"QPS must be > 0, got {qps}")
    starts, now = [], 0.0
    for _ in range(users):
        starts.append(now)
        now += rng.expovariate(qps) if arrivals == "poisson" else 1 / qps
    per_user = qps / users
    gaps = [[rng.expovariate(per_user) if arrivals == "poisson" else 1 / per_user for _ in range(rounds - 1)]
            for _ in range(users)]
    return starts, gaps


def run_user(server: Server, prompts: list[list[int]], answer: int, start: float, gaps: list[float],
             t0: float, out: list[Request], user: int, stop: Callable[[], bool] = lambda: False) -> None:
    """One user's questions in turn: each at the later of its scheduled time and its last answer's end."""
    due = t0 + start
    for r, prompt in enumerate(prompts, 1):
        if stop():
            return
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sent = time.perf_counter()
        request = Request(user, r, len(prompt), sent - t0)
        timed_complete(server, prompt, answer, request)
        out.append(request)
        if r <= len(gaps):
            due = sent + gaps[r - 1]


def run_level(server: Server, prompts: list[list[list[int]]], answer: int, qps: float, arrivals: str,
              seed: int) -> tuple[list[Request], float]:
    """Every user of `prompts` (prompts[round][user]) through its rounds at `qps`; (requests, wall seconds from
    the first send to the last token)."""
    users, rounds = len(prompts[0]), len(prompts)
    starts, gaps = schedule(users, rounds, qps, arrivals, random.Random(f"{seed}-{qps}"))
    out: list[Request] = []
    t0 = time.perf_counter()
    return run_together([threading.Thread(target=run_user, daemon=True,
                                          args=(server, [prompts[r][u] for r in range(rounds)], answer, starts[u],
                                                gaps[u], t0, out, u)) for u in range(users)], out, t0)


def run_together(threads: list[threading.Thread], out: list[Request], t0: float) -> tuple[list[Request], float]:
    """Start `threads` (a level's users or sessions, filling `out`) and wait for them all; (the requests, wall
    seconds from `t0` to the last token)."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ends = [r.sent_s + (r.e2e_s or 0.0) for r in out]
    return out, (max(ends) if ends else time.perf_counter() - t0)


def run_agentic_level(server: Server, sessions: list[Session], shape: AgenticShape, rate: float, think_secs: float,
                      arrivals: str, seed: int) -> tuple[list[Request], float]:
    """Every session of the level (agentic_workload.py) at `rate` sessions per second; (requests, wall seconds
    from the first send to the last token)."""
    times = session_times(shape, len(sessions), rate, think_secs, arrivals, random.Random(f"{seed}-agentic-{rate}"))
    out: list[Request] = []
    t0 = time.perf_counter()

    def send(step: Step) -> bool:
        turn = {"plan": 1, "subagent": 1 + step.turn, "merge": shape.turns + 2}[step.role]
        request = Request(step.session, turn, len(step.prompt), time.perf_counter() - t0, role=step.role)
        timed_complete(server, step.prompt, shape.answer, request)
        out.append(request)
        return request.error is None

    return run_together([threading.Thread(target=run_session, args=(session, i, times[i], t0, send), daemon=True)
                         for i, session in enumerate(sessions)], out, t0)


# ---- figures ---------------------------------------------------------------------------------------------


def summarize(requests: list[Request], wall: float, answer: int) -> dict[str, Any]:
    ok = [r for r in requests if r.error is None and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    warm = [r.ttft_s for r in ok if r.round > 1 and r.ttft_s is not None]

    def pct(values: list[float], q: float) -> float | None:
        return percentile(values, q) if values else None

    return {
        "requests": len(requests), "failures": len(requests) - len(ok),
        "errors": sorted({r.error for r in requests if r.error})[:5],
        "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
        "warm_ttft_p50_s": pct(warm, 50), "warm_ttft_p90_s": pct(warm, 90),
        "itl_p50_s": pct(itl, 50), "itl_p90_s": pct(itl, 90),
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "generated_tokens_per_s": sum(r.tokens for r in ok) / wall if wall > 0 else None,
        "wall_s": wall,
    }


def tier_rates(counted: dict[str, float], token_bytes: int) -> dict[str, float | None]:
    """vLLM's and the connector's hit rates (serving.py's `hit_rates`) and, where KVMesh counted them, the shares
    of the prompt tokens its CPU tier, disk store and remote tier served."""
    rates: dict[str, float | None] = dict(hit_rates(counted))
    prompt = counted.get("vllm:prompt_tokens_total")
    retrieved = counted.get("lmcache:num_retrieved_tokens_total")
    if not prompt or retrieved is None:
        rates.update(kvmesh_cpu_hit_rate=None, kvmesh_disk_hit_rate=None, kvmesh_remote_hit_rate=None)
        return rates
    disk = counted.get("lmcache:num_local_disk_read_bytes_total", 0.0) / token_bytes
    remote = counted.get("lmcache:num_remote_read_bytes_total", 0.0) / token_bytes
    rates.update(kvmesh_cpu_hit_rate=max(retrieved - disk - remote, 0.0) / prompt,
                 kvmesh_disk_hit_rate=disk / prompt, kvmesh_remote_hit_rate=remote / prompt)
    return rates


def held(level: dict[str, Any], bound: float) -> bool:
    p90 = level.get("ttft_p90_s")
    return level.get("failures", 1) == 0 and p90 is not None and p90 <= bound


def max_qps_held(levels: list[dict[str, Any]], bound: float) -> float | None:
    best = None
    for level in sorted(levels, key=lambda lv: lv["qps"]):
        if not held(level, bound):
            break
        best = level["qps"]
    return best


# ---- the peers -------------------------------------------------------------------------------------------


@dataclass
class Setup:
    model: Path
    work: Path
    env: dict[str, str]
    max_len: int
    levels: list[tuple[float, Any]]  # (rate, what `run_level` runs at it: prompts[round][user], or sessions)
    warmup: list[int]
    warmup_users: list[list[list[int]]]  # prompts[round][user] of users no level has (warm_up)
    answer: int
    dtype: str
    chunk: int
    arrivals: str
    seed: int
    bound: float
    full_sweep: bool
    token_bytes: int
    run: Callable[[Server, float, Any], tuple[list[Request], float]]  # one level: (requests, wall seconds)


def warm_up(server: Server, setup: Setup) -> None:
    """Before any timed request, every peer alike: one prompt twice, then the warm-up users through all their
    rounds, two at a time, at once. A fresh vLLM's first forwards of each batch shape run up to 2x slower (a
    1,057-token prefill: 0.22-0.26 s in the first seconds, 0.11-0.12 s after), which otherwise lands on the
    first level's cold requests of whichever peer it happens to."""
    for _ in range(2):
        server.complete(setup.warmup, 2)
    prompts = setup.warmup_users  # prompts[round][user]
    for first in range(0, len(prompts[0]) if prompts else 0, 2):
        done: list[Request] = []
        pair = [threading.Thread(target=run_user, args=(server, [r[u] for r in prompts], setup.answer, 0.0,
                                                         [0.0] * (len(prompts) - 1), time.perf_counter(), done, u))
                for u in range(first, min(first + 2, len(prompts[0])))]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join()
        failed = [r.error for r in done if r.error]
        if failed:
            raise RuntimeError(f"{server.name}: a warm-up request failed: {failed[0]}")


def start_server(setup: Setup, name: str, kv_blocks: int, extra: list[str], env: dict[str, str] | None = None
                 ) -> Server:
    args = ["--dtype", setup.dtype, "--enable-prefix-caching", "--block-size", str(BLOCK),
            "--num-gpu-blocks-override", str(kv_blocks), *extra]
    return Server(name, setup.model, free_port(), setup.work / "logs", setup.max_len, args, env or setup.env)


def measure_level(setup: Setup, name: str, server: Server, qps: float, workload: Any) -> dict[str, Any]:
    """One level on one peer's running server, with its counters read around it."""
    before = server.counters(COUNTERS)
    requests, wall = setup.run(server, qps, workload)
    after = server.counters(COUNTERS)
    counted = {k: after[k] - before.get(k, 0.0) for k in sorted(after)}
    level = {"qps": qps, **summarize(requests, wall, setup.answer), **tier_rates(counted, setup.token_bytes),
             "counters": counted, "requests_detail": [asdict(r) for r in requests]}
    print(f"  {name} QPS {qps:g}: TTFT p50 {fmt(level['ttft_p50_s'])} p90 {fmt(level['ttft_p90_s'])}, "
          f"ITL p50 {fmt(level['itl_p50_s'], 1000, 1)} ms, {fmt(level['requests_per_s'], 1, 2)} req/s, "
          f"{level['failures']} failed, wall {wall:.1f}s", flush=True)
    return level


@dataclass
class Peer:
    """One peer's running vLLM (and whatever serves its tiers) and its levels so far."""

    name: str
    server: Server
    kv_blocks: int
    info: dict[str, Any]  # what the report says of its tiers
    levels: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[float] = field(default_factory=list)
    error: str | None = None  # a level that could not be measured: none after it is run

    def result(self, bound: float) -> dict[str, Any]:
        return {"kv_blocks": self.kv_blocks, "levels": self.levels, "skipped_qps": self.skipped,
                "max_qps_held": max_qps_held(self.levels, bound), "error": self.error, **self.info}


def start_peer(stack: ExitStack, setup: Setup, name: str, kv_blocks: int, extra: list[str],
               env: dict[str, str] | None = None, info: dict[str, Any] | None = None) -> Peer:
    """A peer's vLLM started, ready and warmed up; stopped when `stack` closes."""
    server = start_server(setup, name, kv_blocks, extra, env)
    stack.callback(server.stop)
    server.ready()
    warm_up(server, setup)
    return Peer(name, server, kv_blocks, info or {})


def interleave(setup: Setup, peers: list[Peer]) -> None:
    """Every level on every peer, the peers taking turns level by level (the first one moving on by one each
    level), so that what the shared machine does over the run's minutes falls on all of them alike. A peer that
    missed the bound (or failed a request) skips its higher levels unless --full-sweep; one whose level could not
    be measured at all (its server died) stops there, with the error in its result."""
    for index, (qps, prompts) in enumerate(setup.levels):
        for peer in peers[index % len(peers):] + peers[:index % len(peers)] if peers else []:
            if peer.error is not None or (peer.levels and not setup.full_sweep
                                          and not held(peer.levels[-1], setup.bound)):
                peer.skipped.append(qps)
                continue
            time.sleep(IDLE_BETWEEN_S)  # the last peer's vLLM stops busy-waiting (it spins 1 s after a step)
            try:
                peer.levels.append(measure_level(setup, peer.name, peer.server, qps, prompts))
            except Exception as error:  # noqa: BLE001 - the other peers' levels go on
                peer.error = f"QPS {qps:g}: {type(error).__name__}: {error}"[:2000]
                print(f"  {peer.name} failed: {peer.error}", flush=True)


@dataclass
class Sizes:
    """One regime's tiers, GB (None: no such tier)."""

    cpu_gb: float
    disk_gb: float
    remote_gb: float | None
    target_w_over_cpu: float
    w_over_cpu_tier: float


def regime_sizes(regime: str, working_bytes: float, in_flight_bytes: float) -> Sizes:
    """C, D, R of a regime for a working set of `working_bytes` (module docstring), C at least `in_flight_bytes`."""
    cpu_share, disk, remote, target = {"a": (2.0, BIG_GB, None, 0.5), "b": (1 / 3, BIG_GB, None, 3.0),
                                       "c": (1 / 4, None, BIG_GB, 3.0)}[regime]
    cpu = max(working_bytes * cpu_share, in_flight_bytes)
    disk_gb = disk if disk is not None else max(working_bytes / 4, in_flight_bytes) / GB
    return Sizes(round(cpu / GB, 6), round(disk_gb, 6), remote, target, working_bytes / cpu)


def start_redis(work: Path, max_gb: float) -> tuple[subprocess.Popen[bytes], int]:
    """A throw-away redis-server on loopback (no persistence, maxmemory `max_gb`, volatile-lru) on the side
    cores; (process, port)."""
    port = free_port()
    log = (work / "logs" / "redis.log").open("ab")
    process = subprocess.Popen(["taskset", "-c", side_cores(), "redis-server", "--port", str(port), "--bind",
                                "127.0.0.1", "--save", "", "--appendonly", "no", "--maxmemory",
                                str(int(max_gb * GB)), "--maxmemory-policy", "volatile-lru"],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    import socket

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}: see {work / 'logs' / 'redis.log'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return process, port
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("redis-server did not answer PING within 30 s")


def start_kvmesh(stack: ExitStack, setup: Setup, regime: str, kv_blocks: int, sizes: Sizes, remote_store: str
                 ) -> Peer:
    remote_url = None
    mesh_remote = None
    if sizes.remote_gb is not None:
        if remote_store == "redis":
            redis, port = start_redis(setup.work, sizes.remote_gb)
            stack.callback(lambda: (redis.terminate(), redis.wait(30)))
            remote_url = f"redis://127.0.0.1:{port}"
        else:
            mesh_remote, remote_url = sizes.remote_gb, "lm://localhost:65432"  # the mesh's remote-0, over its NATS
    # a mesh (and disk store directory) of the regime's own: with --regime all, the next regime's disk store
    # must not start out holding this one's chunks (the same prompts)
    mesh = start_mesh(setup.work, sizes.disk_gb, name=f"kvmesh-mesh-{regime}", remote_gb=mesh_remote)
    stack.callback(mesh.stop)
    config = mesh.engine_yaml(setup.work / f"kvmesh-{regime}.yaml", "kvmesh", sizes.cpu_gb, sizes.disk_gb, True,
                              setup.chunk, remote_url)
    return start_peer(stack, setup, "kvmesh", kv_blocks, ["--kv-transfer-config", json.dumps(KVMESH)],
                      {**setup.env, "LMCACHE_CONFIG_FILE": str(config)},
                      {"cpu_tier_gb": sizes.cpu_gb, "disk_gb": sizes.disk_gb, "remote_gb": sizes.remote_gb,
                       "remote_url": remote_url})


def start_lmcache(stack: ExitStack, setup: Setup, kv_blocks: int, env: dict[str, str], l1_gb: float,
                  l2: dict[str, Any] | None) -> Peer:
    extra = ["--l2-adapter", json.dumps(l2)] if l2 else []
    server, port = start_lmcache_server(setup.work, env, l1_gb, setup.chunk, extra)
    stack.callback(server.stop)
    return start_peer(stack, setup, "lmcache", kv_blocks,
                      ["--kv-transfer-config", json.dumps(lmcache_connector(port))], env, {"l1_gb": l1_gb, "l2": l2})


# ---- report ----------------------------------------------------------------------------------------------


def fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def share(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"


def table(peers: dict[str, dict[str, Any]], bound: float, unit: str = "QPS") -> str:
    head = (f"{'peer':<8} {'QPS':>5} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} {'p90':>6} {'req/s':>6} "
            f"{'tok/s':>6} {'fail':>4} {'vLLM':>5} {'conn':>5} {'cpu':>5} {'disk':>5} {'rem':>5}  held")
    lines = [head, "-" * len(head)]
    for name, peer in peers.items():
        for lv in peer["levels"]:
            lines.append(
                f"{name:<8} {lv['qps']:5g} {fmt(lv['ttft_p50_s']):>9} {fmt(lv['ttft_p90_s']):>7} "
                f"{fmt(lv['ttft_p99_s']):>7} {fmt(lv['itl_p50_s'], 1000, 1):>6}ms {fmt(lv['itl_p90_s'], 1000, 1):>4}ms"
                f" {fmt(lv['requests_per_s'], 1, 2):>6} {fmt(lv['generated_tokens_per_s'], 1, 1):>6} "
                f"{lv['failures']:>4} {share(lv.get('vllm_prefix_cache_hit_rate')):>5} "
                f"{share(lv.get('connector_hit_rate')):>5} {share(lv.get('kvmesh_cpu_hit_rate')):>5} "
                f"{share(lv.get('kvmesh_disk_hit_rate')):>5} {share(lv.get('kvmesh_remote_hit_rate')):>5}  "
                f"{'yes' if held(lv, bound) else 'no'}")
        if peer["skipped_qps"]:
            lines.append(f"{name:<8} skipped QPS {', '.join(f'{q:g}' for q in peer['skipped_qps'])} (missed the "
                         "bound below)")
    lines.append(f"max {unit} with p90 TTFT <= {bound:g}s: " + ", ".join(
        f"{n} {fmt(p['max_qps_held'], 1, 2) if p['max_qps_held'] is not None else 'none'}"
        for n, p in peers.items()))
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (name, peer) in enumerate(summary["peers"].items()):
        color = f"C{index}"
        levels = [lv for lv in peer["levels"] if lv["ttft_p50_s"] is not None]
        qps = [lv["qps"] for lv in levels]
        left.plot(qps, [lv["ttft_p50_s"] for lv in levels], marker="o", color=color, label=f"{name} p50")
        left.plot(qps, [lv["ttft_p90_s"] for lv in levels], marker="x", ls="--", color=color, label=f"{name} p90")
        right.plot(qps, [lv["requests_per_s"] for lv in levels], marker="o", color=color, label=f"{name} req/s")
        right.plot(qps, [lv["generated_tokens_per_s"] / 10 for lv in levels], marker="x", ls="--", color=color,
                   label=f"{name} tok/s / 10")
    left.axhline(summary["ttft_bound_s"], color="grey", ls=":", label="p90 bound")
    offered = sorted({lv["qps"] for peer in summary["peers"].values() for lv in peer["levels"]})
    for axis in (left, right):
        axis.set_xlabel(f"offered {summary['workload']['rate_unit']}")
        axis.set_xscale("log", base=2)
        if offered:
            axis.set_xticks(offered, [f"{q:g}" for q in offered])
        axis.legend(fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("TTFT (s)")
    right.set_ylabel("requests/s; generated tokens/s / 10")
    work = summary["workload"]
    shape = (f"agentic, regime {summary['regime']}: {work['sessions']} sessions x {work['subagents']} sub-agents x "
             f"{work['turns']} turns, {work['context']}-token contexts, think {work['think_secs']:g} s"
             if work["kind"] == "agentic" else
             f"multi-round QA, regime {summary['regime']}: {work['users']} users x {work['rounds']} rounds, "
             f"{work['context']}-token documents")
    fig.suptitle(f"{shape}, W/C {summary['sizes']['w_over_cpu_tier']:.1f}; "
                 f"{summary['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- soak ------------------------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """Every Prometheus sample at `url`, summed over labels; {} if it cannot be read."""
    import httpx

    totals: dict[str, float] = {}
    try:
        text = httpx.get(url, timeout=30).text
    except httpx.HTTPError:
        return totals
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return totals


def label(process: Any) -> str:
    """A short name for a process of vLLM's or the mesh's tree."""
    try:
        name, cmd = process.name(), " ".join(process.cmdline())
    except Exception:  # noqa: BLE001 - gone meanwhile
        return "gone"
    for module in ("controller", "disk_store", "remote_store"):
        if f"kvmesh.services.{module}" in cmd:
            return module
    if "nats-server" in name or "nats-server" in cmd:
        return "nats-server"
    if "kvmesh.cli" in cmd:
        return "kvmesh-up"
    if "api_server" in cmd:
        return "vllm-api-server"
    return f"vllm:{name}" if name else "unknown"


def process_stats(roots: list[int]) -> dict[str, dict[str, float]]:
    """RSS (MB) and open file descriptors of every process in the trees of `roots` (psutil), by label + pid."""
    import psutil

    out: dict[str, dict[str, float]] = {}
    for root in roots:
        try:
            tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
        except psutil.Error:
            continue
        for process in tree:
            try:
                if process.name() in ("taskset", "sh"):
                    continue
                out[f"{label(process)}[{process.pid}]"] = {"rss_mb": process.memory_info().rss / 1e6,
                                                           "fds": float(process.num_fds())}
            except psutil.Error:
                continue
    return out


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


CONTROLLER_GAUGES = ("kvmesh_controller_index_keys", "kvmesh_controller_producer_keys", "kvmesh_controller_producers",
                     "kvmesh_controller_instances", "kvmesh_controller_tracked_events",
                     "kvmesh_controller_commands_in_flight")
ENGINE_GAUGES = ("lmcache:pinned_memory_objs_count", "lmcache:local_cache_usage", "lmcache:local_cpu_evict_count_total",
                 "lmcache:num_local_disk_read_bytes_total", "lmcache:num_local_disk_write_bytes_total",
                 "lmcache:num_failed_retrieve_blocks_total", "lmcache:put_failed_count_total")


def soak(args: argparse.Namespace, setup: Setup, shape: Shape, prompts: list[list[list[int]]], kv_blocks: int,
         in_flight_bytes: float, summary: dict[str, Any]) -> int:
    """KVMesh alone at a steady QPS for args.soak seconds, sampling the processes and tables (module docstring)."""
    cpu_gb = args.soak_cpu_gb or round(2 * in_flight_bytes / GB, 6)
    disk_gb = args.soak_disk_gb or round(3 * cpu_gb, 6)
    users_total = len(prompts[0])
    rng = random.Random(f"{args.seed}-soak")
    per_user_gap = shape.users / args.soak_qps
    requests: list[Request] = []
    samples: list[dict[str, Any]] = []
    deadline_box: list[float] = []
    mesh: Mesh = start_mesh(setup.work, disk_gb, name="soak-mesh")
    config = mesh.engine_yaml(setup.work / "soak.yaml", "soak", cpu_gb, disk_gb, True, setup.chunk)
    server = start_server(setup, "kvmesh-soak", kv_blocks, ["--kv-transfer-config", json.dumps(KVMESH)],
                          {**setup.env, "LMCACHE_CONFIG_FILE": str(config)})
    summary["soak"] = {"seconds": args.soak, "qps": args.soak_qps, "sample_secs": args.sample_secs,
                       "cpu_tier_gb": cpu_gb, "disk_gb": disk_gb, "kv_blocks": kv_blocks, "samples": samples}
    next_user = [0]
    lock = threading.Lock()

    def take_user() -> int | None:
        with lock:
            if next_user[0] >= users_total:
                return None
            next_user[0] += 1
            return next_user[0] - 1

    def slot(index: int, t0: float) -> None:
        """One of --users concurrent users at a time: each asks its rounds, then a new user takes its place."""
        first = True
        while time.perf_counter() < deadline_box[0]:
            user = take_user()
            if user is None:
                return
            start = (time.perf_counter() - t0) + (index / args.soak_qps if first else rng.expovariate(
                1 / per_user_gap) if args.arrivals == "poisson" else per_user_gap)
            first = False
            gaps = [rng.expovariate(1 / per_user_gap) if args.arrivals == "poisson" else per_user_gap
                    for _ in range(shape.rounds - 1)]
            run_user(server, [prompts[r][user] for r in range(shape.rounds)], shape.answer, start, gaps, t0, requests,
                     user, stop=lambda: time.perf_counter() >= deadline_box[0])

    def sample(t0: float) -> None:
        engine = scrape(f"{server.url}/metrics")
        controller = scrape(f"{mesh.controller}/metrics")
        done = list(requests)
        samples.append({
            "t_s": time.perf_counter() - t0,
            "processes": process_stats([server.child.process.pid, mesh.child.process.pid]),
            "engine": {k: engine.get(k) for k in ENGINE_GAUGES},
            "controller": {k: controller.get(k) for k in CONTROLLER_GAUGES},
            "disk_store_bytes": dir_bytes(mesh.disk_dir),
            "requests": len(done), "failures": sum(r.error is not None for r in done),
        })
        s = samples[-1]
        rss = sum(p["rss_mb"] for p in s["processes"].values())
        print(f"  soak t={s['t_s']:.0f}s: {s['requests']} requests, {s['failures']} failed, RSS {rss:.0f} MB over "
              f"{len(s['processes'])} processes, CPU tier chunks {s['engine']['lmcache:pinned_memory_objs_count']}, "
              f"controller keys {s['controller']['kvmesh_controller_index_keys']}, disk "
              f"{s['disk_store_bytes'] / 1e6:.0f} MB", flush=True)

    try:
        server.ready()
        warm_up(server, setup)
        t0 = time.perf_counter()
        deadline_box.append(t0 + args.soak)
        threads = [threading.Thread(target=slot, args=(i, t0), daemon=True) for i in range(shape.users)]
        for thread in threads:
            thread.start()
        sample(t0)
        next_sample = t0 + args.sample_secs
        while any(t.is_alive() for t in threads):
            time.sleep(min(1.0, max(0.0, next_sample - time.perf_counter())))
            if time.perf_counter() >= next_sample:
                sample(t0)
                next_sample += args.sample_secs
        sample(t0)
        if next_user[0] >= users_total:
            summary["soak"]["note"] = f"ran out of the {users_total} prepared users before the end"
    finally:
        server.stop()
        mesh.stop()
    failures = [r for r in requests if r.error is not None]
    ttft = [r.ttft_s for r in requests if r.error is None and r.ttft_s is not None]
    summary["soak"].update({
        "requests": len(requests), "failures": len(failures), "all_succeeded": not failures,
        "errors": sorted({r.error for r in failures if r.error})[:10],
        "ttft_p50_s": percentile(ttft, 50) if ttft else None, "ttft_p90_s": percentile(ttft, 90) if ttft else None,
        "users_started": next_user[0],
    })
    summary["machine"]["load_average_end"] = os.getloadavg()
    (args.out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    if plot_soak(summary, args.out / "soak.png"):
        print(f"plot: {args.out / 'soak.png'}")
    print(f"soak: {len(requests)} requests in {args.soak}s at {args.soak_qps:g} QPS, {len(failures)} failed; "
          f"TTFT p50 {fmt(summary['soak']['ttft_p50_s'])} p90 {fmt(summary['soak']['ttft_p90_s'])}; "
          f"{args.out / 'soak.json'}")
    first, last = samples[0], samples[-1]
    for key in sorted({k.split("[")[0] for s in samples for k in s["processes"]}):
        def rss_of(s: dict[str, Any], key: str = key) -> float:
            return sum(v["rss_mb"] for k, v in s["processes"].items() if k.split("[")[0] == key)

        def fds_of(s: dict[str, Any], key: str = key) -> float:
            return sum(v["fds"] for k, v in s["processes"].items() if k.split("[")[0] == key)
        print(f"  {key:<24} RSS {rss_of(first):7.0f} -> {rss_of(last):7.0f} MB   fds {fds_of(first):4.0f} -> "
              f"{fds_of(last):4.0f}")
    return 1 if failures else 0


def plot_soak(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = summary["soak"]["samples"]
    t = [s["t_s"] / 60 for s in samples]
    keys = sorted({k.split("[")[0] for s in samples for k in s["processes"]})

    def per_process(measure: str) -> dict[str, list[float]]:
        return {key: [sum(v[measure] for k, v in s["processes"].items() if k.split("[")[0] == key) for s in samples]
                for key in keys}

    panels: list[tuple[str, dict[str, list[float | None]]]] = [
        ("RSS (MB)", per_process("rss_mb")),  # type: ignore[dict-item]
        ("open file descriptors", per_process("fds")),  # type: ignore[dict-item]
        ("CPU tier chunks", {"chunks": [s["engine"]["lmcache:pinned_memory_objs_count"] for s in samples]}),
        ("CPU tier evictions (cumulative)", {"evicted": [s["engine"]["lmcache:local_cpu_evict_count_total"]
                                                         for s in samples]}),
        ("controller tables", {k.replace("kvmesh_controller_", ""): [s["controller"][k] for s in samples]
                               for k in CONTROLLER_GAUGES}),
        ("disk store (MB)", {"bytes": [s["disk_store_bytes"] / 1e6 for s in samples]}),
        ("requests (cumulative)", {"done": [s["requests"] for s in samples],
                                   "failed": [s["failures"] for s in samples]}),
    ]
    fig, axes = plt.subplots(2, 4, figsize=(18, 7.5))
    for axis, (title, lines) in zip(axes.flat, panels):
        for name, values in lines.items():
            axis.plot(t, [float("nan") if v is None else v for v in values], marker=".", label=name)
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("minutes")
        axis.legend(fontsize=6)
    axes.flat[-1].axis("off")
    soak_info = summary["soak"]
    fig.suptitle(f"KVMesh soak: {soak_info['seconds']}s at {soak_info['qps']:g} QPS, CPU tier "
                 f"{soak_info['cpu_tier_gb']} GB, disk {soak_info['disk_gb']} GB; {soak_info['failures']} of "
                 f"{soak_info['requests']} requests failed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- main ------------------------------------------------------------------------------------------------


def model_description(model: Path) -> str:
    """What a --model directory holds, from its config (architecture, layers, sizes, sliding window)."""
    config = json.loads((model / "config.json").read_text())
    fields = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "sliding_window", "torch_dtype")
    sizes = ", ".join(f"{name} {config[name]}" for name in fields if config.get(name) is not None)
    return f"{model.name}: {'/'.join(config.get('architectures') or ['?'])} ({sizes})"


def parse_qps(text: str) -> list[float]:
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--qps takes numbers separated by commas, got {text!r}") from None
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"--qps needs at least one value, all > 0, got {text!r}")
    return values


QUICK = {"users": 6, "rounds": 3, "system": 128, "context": 512, "question": 32, "answer": 8, "qps": [1.0, 2.0],
         "warmup_users": 2}
AGENTIC_RATES = [0.125, 0.25, 0.5, 1.0]  # sessions per second
AGENTIC_QUICK = {"sessions": 3, "subagents": 2, "turns": 2, "tool_output": 32, "qps": [0.25, 0.5]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", choices=[*REGIMES, "all"], default="a")
    parser.add_argument("--workload", choices=list(RATE_UNIT), default="qa",
                        help="qa: users asking rounds of questions; agentic: sessions forking sub-agents "
                             "(agentic_workload.py), --qps then being sessions per second")
    parser.add_argument("--sessions", type=int, default=4, help="agentic: sessions per level")
    parser.add_argument("--subagents", type=int, default=3, help="agentic: sub-agents per session")
    parser.add_argument("--turns", type=int, default=3, help="agentic: requests per sub-agent")
    parser.add_argument("--tool-output", type=int, default=64,
                        help="agentic: tokens of each tool output and each sub-agent result")
    parser.add_argument("--think-secs", type=float, default=1.0,
                        help="agentic: mean think time (the tool running) before a sub-agent's next turn, s")
    parser.add_argument("--peers", nargs="+", default=PEERS, choices=PEERS)
    parser.add_argument("--users", type=int, default=12, help="users per level, all active together")
    parser.add_argument("--rounds", type=int, default=4, help="questions per user")
    parser.add_argument("--system", type=int, default=256, help="shared system prompt, tokens")
    parser.add_argument("--context", type=int, default=1024, help="each user's document, tokens")
    parser.add_argument("--question", type=int, default=32, help="each question, tokens")
    parser.add_argument("--answer", type=int, default=16, help="generated tokens per request (and stand-in answers)")
    parser.add_argument("--qps", type=parse_qps, default=[1.0, 2.0, 4.0, 8.0],
                        help="the request rates of the sweep, comma-separated (default 1,2,4,8; agentic: sessions "
                             "per second, default 0.125,0.25,0.5,1)")
    parser.add_argument("--arrivals", choices=["poisson", "uniform"], default="poisson")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    parser.add_argument("--warmup-users", type=int, default=4,
                        help="users of their own run through all their rounds, two at a time, before any timed "
                             "request, by every peer (default 4; 0: only one prompt twice)")
    parser.add_argument("--ttft-bound", type=float, default=TTFT_BOUND_S,
                        help=f"p90 TTFT a peer must stay under to hold a QPS, s (default {TTFT_BOUND_S})")
    parser.add_argument("--full-sweep", action="store_true",
                        help="run every QPS even after a peer missed the bound at a lower one")
    parser.add_argument("--kv-requests", type=int, default=2,
                        help="vLLM's small KV space, in requests of the longest prompt + answer (default 2)")
    parser.add_argument("--remote-store", choices=["kvmesh", "redis"], default="kvmesh",
                        help="regime c's remote tier: the mesh's own remote store, or a redis-server started here")
    parser.add_argument("--model", type=Path, help="model dir (default: build the --bench demo model)")
    parser.add_argument("--chunk-size", type=int, default=CHUNK, help="KVMesh's and LMCache's chunk size, tokens")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="vLLM's --dtype for every peer")
    parser.add_argument("--lmcache-site", type=Path, default=LMCACHE_SITE,
                        help="a pip --target directory holding lmcache, put on PYTHONPATH for LMCache only")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 6 users x 3 rounds, 128 + 512-token prompts, 8-token answers, QPS 1,2 "
                             "(sizes given explicitly still win)")
    parser.add_argument("--soak", type=float, metavar="SECONDS", help="soak mode: KVMesh alone for SECONDS")
    parser.add_argument("--soak-qps", type=float, default=0.5, help="the soak's steady request rate (default 0.5)")
    parser.add_argument("--sample-secs", type=float, default=60.0, help="the soak's sampling period, s (default 60)")
    parser.add_argument("--soak-cpu-gb", type=float,
                        help="the soak's CPU tier, GB (default: twice the KV of the requests in flight)")
    parser.add_argument("--soak-disk-gb", type=float, help="the soak's disk store, GB (default: 3x its CPU tier)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    given = {a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    args = parser.parse_args(argv)
    if args.workload == "agentic" and "--qps" not in given:
        args.qps = AGENTIC_RATES
    if args.quick:
        for key, value in {**QUICK, **(AGENTIC_QUICK if args.workload == "agentic" else {})}.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    if args.workload == "agentic" and args.soak is not None:
        parser.error("--soak runs the qa workload only")
    if args.think_secs < 0:
        parser.error("--think-secs must be >= 0")
    for key in ("users", "rounds", "context", "question", "answer", "kv_requests", "sessions", "subagents", "turns",
                "tool_output"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup_users < 0:
        parser.error("--warmup-users must be >= 0")
    if args.soak is not None and (args.soak <= 0 or args.soak_qps <= 0 or args.sample_secs <= 0):
        parser.error("--soak, --soak-qps and --sample-secs must be > 0")
    if args.ttft_bound <= 0:
        parser.error("--ttft-bound must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from make_demo_model import ensure_model, long_text
    from transformers import AutoTokenizer

    started = time.time()
    model = args.model or ensure_model(Path.home() / ".cache" / "kvmesh-tests" / "models" / "bench", "bench")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    encode: Callable[[str], list[int]] = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    corpus = encode(long_text())
    shape = Shape(args.users, args.rounds, args.system, args.context, args.question, args.answer)

    def make_prompts(users: int) -> list[list[list[int]]]:
        return build_prompts(Shape(users, args.rounds, args.system, args.context, args.question, args.answer),
                             corpus, encode, tokenizer.bos_token_id)

    # every level has users of its own: one build, level i gets users [i * U, (i + 1) * U)
    soak_mode = args.soak is not None
    qps_levels = [] if soak_mode else args.qps
    if soak_mode:  # users arriving without end: as many as the soak can start, plus the ones active at its end
        everyone = make_prompts(int(args.soak * args.soak_qps / args.rounds) + 2 * args.users + 2 + args.warmup_users)
    else:
        everyone = make_prompts(args.users * len(qps_levels) + args.warmup_users)
    kept = len(everyone[0]) - args.warmup_users  # the last users warm every peer up, the others are timed
    warmup_users = [r[kept:] for r in everyone] if args.warmup_users else []
    everyone = [r[:kept] for r in everyone]
    levels: list[tuple[float, Any]]
    if args.workload == "agentic":  # sessions of their own per level, as the QA levels have users of their own
        agentic = AgenticShape(args.sessions, args.subagents, args.turns, args.system, args.context, args.question,
                               args.tool_output, args.answer)
        sessions = build_sessions(agentic, corpus, encode, tokenizer.bos_token_id, args.sessions * len(qps_levels))
        levels = [(q, sessions[i * args.sessions:(i + 1) * args.sessions]) for i, q in enumerate(qps_levels)]
        longest = max(len(p) for session in sessions for p in session.prompts())
        working = working_set_tokens([[end for session in levels[0][1] for end in session.ends()]], args.answer)

        def run(server: Server, rate: float, level: Any) -> tuple[list[Request], float]:
            return run_agentic_level(server, level, agentic, rate, args.think_secs, args.arrivals, args.seed)
    else:
        levels = [(q, [r[i * args.users:(i + 1) * args.users] for r in everyone]) for i, q in enumerate(qps_levels)]
        first = levels[0][1] if levels else [r[:args.users] for r in everyone]
        longest = max(len(p) for r in everyone for p in r)
        working = working_set_tokens(first, args.answer)

        def run(server: Server, qps: float, level: Any) -> tuple[list[Request], float]:
            return run_level(server, level, args.answer, qps, args.arrivals, args.seed)
    longest = max([longest, *(len(p) for r in warmup_users for p in r)])
    max_len = longest + args.answer
    per_request = blocks(max_len)
    token_bytes = bytes_per_token(model, args.dtype)
    working_bytes = working * token_bytes
    in_flight_bytes = args.kv_requests * per_request * BLOCK * token_bytes
    small = args.kv_requests * per_request
    floor_blocks = blocks(working) + small
    if small >= blocks(working):
        print(f"warning: the small KV space ({small} blocks) holds a level's working set ({blocks(working)} "
              "blocks): vLLM's prefix cache will not miss", flush=True)
    warmup = [tokenizer.bos_token_id, *encode("[warm-up] "), *corpus[-args.context:]]

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvmesh-mrqa-"))
    pin_to((os.sched_getaffinity(0) - {0}) or {0})
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="1")  # the block override sizes the KV space
    setup = Setup(model, work, env, max_len, levels, warmup, warmup_users, args.answer, args.dtype, args.chunk_size,
                  args.arrivals, args.seed, args.ttft_bound, args.full_sweep, token_bytes, run)

    import torch
    import vllm

    base: dict[str, Any] = {
        "workload": {"kind": args.workload,
                     **(asdict(agentic) if args.workload == "agentic" else asdict(shape)), "qps": qps_levels,
                     "rate_unit": RATE_UNIT[args.workload], "arrivals": args.arrivals, "seed": args.seed,
                     "think_secs": args.think_secs if args.workload == "agentic" else None,
                     "warmup_users": args.warmup_users, "longest_prompt": longest,
                     "requests_per_level": (args.sessions * (args.subagents * args.turns + 2)
                                            if args.workload == "agentic" else args.users * args.rounds),
                     "working_set_tokens": working, "working_set_mb": working_bytes / 1e6},
        "model": {"name": "kvmesh demo --bench (Llama, 6 layers, hidden 512, 8 heads, 2 KV heads x 64, bf16)"
                  if args.model is None else model_description(model),
                  "path": str(model), "kv_bytes_per_token": token_bytes},
        "setup": {"vllm": vllm.__version__, "torch": torch.__version__, "lmcache": None, "dtype": args.dtype,
                  "max_model_len": max_len, "max_num_batched_tokens": max_len, "block_size": BLOCK,
                  "small_kv_blocks": small, "floor_kv_blocks": floor_blocks, "kv_requests": args.kv_requests,
                  "prefix_caching": True, "VLLM_CPU_OMP_THREADS_BIND": "0", "chunk_size": args.chunk_size,
                  "kvmesh_async_loading": True, "disk_page_cache": "not dropped"},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "load_average_start": os.getloadavg()},
        "command": " ".join([sys.executable, *sys.argv]), "logs": str(work / "logs"),
    }
    per_level = (f"{args.sessions} sessions of a plan, {args.subagents} sub-agents x {args.turns} turns and a merge"
                 if args.workload == "agentic" else f"{args.users} users x {args.rounds} rounds")
    print(f"workload: {per_level} per level, prompts up to {longest} tokens, a level's "
          f"working set {working} tokens ({working_bytes / 1e6:.1f} MB of KV); vLLM KV space {small} blocks (floor "
          f"{floor_blocks}); logs {work / 'logs'}", flush=True)

    if soak_mode:
        summary = {"benchmark": "multi_round_qa soak", **base}
        return soak(args, setup, shape, everyone, small, in_flight_bytes, summary)

    status = 0
    for regime in (REGIMES if args.regime == "all" else [args.regime]):
        status |= run_regime(args, setup, regime, base, small, floor_blocks, working_bytes, in_flight_bytes, env)
    print(f"wall {time.time() - started:.0f}s")
    return status


def run_regime(args: argparse.Namespace, setup: Setup, regime: str, base: dict[str, Any], small: int,
               floor_blocks: int, working_bytes: float, in_flight_bytes: float, env: dict[str, str]) -> int:
    started = time.time()
    sizes = regime_sizes(regime, working_bytes, in_flight_bytes)
    l2 = None if regime == "a" else {"type": "fs", "base_path": str(setup.work / f"lmcache-l2-{regime}")}
    peers: dict[str, dict[str, Any]] = {}
    not_run: dict[str, str] = {}
    summary: dict[str, Any] = {
        "benchmark": "multi_round_qa" if args.workload == "qa" else "multi_round_qa agentic", "regime": regime, **json.loads(json.dumps(base)),
        "sizes": {**asdict(sizes), "remote_store": args.remote_store if sizes.remote_gb is not None else None,
                  "lmcache_l1_gb": sizes.cpu_gb, "lmcache_l2": l2 or "none (regime a: the L1 holds the working set)"},
        "ttft_bound_s": args.ttft_bound, "peers": peers, "not_run": not_run,
    }
    if sizes.w_over_cpu_tier < sizes.target_w_over_cpu * 0.8 and regime != "a":
        summary["sizes"]["note"] = (f"W / C is {sizes.w_over_cpu_tier:.2f}, below the target "
                                    f"{sizes.target_w_over_cpu:g}: the CPU tier cannot be smaller than the requests "
                                    "in flight; use more --users for the target ratio")
    print(f"== regime {regime}: CPU tier {sizes.cpu_gb} GB (W/C {sizes.w_over_cpu_tier:.2f}), disk {sizes.disk_gb} "
          f"GB, remote {sizes.remote_gb} GB; LMCache L1 {sizes.cpu_gb} GB, L2 {l2 and l2['type']}", flush=True)
    stem = f"multi_round_qa-{regime}" if args.workload == "qa" else f"agentic-{regime}"
    path = args.out / f"{stem}.json"

    def save() -> None:
        summary["machine"]["load_average_end"] = os.getloadavg()
        summary["wall_s"] = round(time.time() - started, 1)
        path.write_text(json.dumps(summary, indent=2) + "\n")

    with ExitStack() as stack:
        running: list[Peer] = []
        for name in PEERS:
            if name not in args.peers:
                continue
            print(f"== {regime}: starting {name}", flush=True)
            try:
                if name == "vllm":
                    running.append(start_peer(stack, setup, name, small, []))
                elif name == "lmcache":
                    lm_env, found = lmcache_env(env, args.lmcache_site)
                    if lm_env is None:
                        not_run[name] = found
                        print(f"  not run: {found}", flush=True)
                        continue
                    summary["setup"]["lmcache"] = found
                    running.append(start_lmcache(stack, setup, small, lm_env, sizes.cpu_gb, l2))
                elif name == "kvmesh":
                    running.append(start_kvmesh(stack, setup, regime, small, sizes, args.remote_store))
                else:
                    running.append(start_peer(stack, setup, name, floor_blocks, []))
            except (Exception, SystemExit) as error:  # one peer failing must not lose the others' figures
                not_run[name] = f"failed: {error}"[:2000]
                print(f"  {name} failed: {error}", flush=True)
        try:
            interleave(setup, running)
        finally:
            peers.update({peer.name: peer.result(args.ttft_bound) for peer in running})
            save()
    save()
    if plot(summary, args.out / f"{stem}.png"):
        print(f"plot: {args.out / f'{stem}.png'}")
    print(table(peers, args.ttft_bound, RATE_UNIT[args.workload]))
    if not_run:
        print(json.dumps({"not_run": not_run}, indent=2))
    failures = sum(lv["failures"] for p in peers.values() for lv in p["levels"])
    return 1 if not_run or failures or any(p.get("error") for p in peers.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
