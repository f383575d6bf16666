#!/usr/bin/env python
"""Multi-user, multi-round serving: KVMesh next to vLLM's prefix cache and LMCache when vLLM's own KV space is
smaller than the working set, so reuse has to come from outside vLLM (issue 16, "The benchmark").

    python benchmarks/serving.py [--users 6] [--rounds 3] [--concurrency 2] [--context 2048] [--peers ...]
                                 [--dtype auto|float32|...] [--out benchmarks/results]

The workload: U users, each with a document of --context tokens behind one shared system prompt, ask R
questions in turn. Round r sends every user's prompt "system + document + (question, answer) x (r-1) + question
r", at most --concurrency requests in flight, users in order; the next round starts when the last request of
this one has finished. The answers in the history are fixed stand-ins of --answer tokens, so that every peer gets
byte-identical prompts (the benchmark model has random weights: its real answers are noise anyway); each request
generates exactly --answer tokens (greedy, EOS ignored). Rounds 2.. are where caches pay: by the time a user asks
again, the other users' prompts have gone through vLLM's KV space.

Peers, one after the other in one run, same model (the `--bench` demo model: 6 layers, hidden 512, bf16; built
if missing), same vLLM flags (prefix caching on, --block-size 128, --max-num-batched-tokens = --max-model-len =
the longest prompt + answer), same prompts:

  vllm-prefix-cache  vLLM alone, its KV space small (below)
  LMCache            LMCache 0.5.6 in multiprocess mode: `lmcache.v1.multiprocess.server` (L1 CPU cache of
                     --lmcache-l1-gb) and vLLM's LMCacheMPConnector, small KV space. LMCache may live outside
                     the venv (--lmcache-site, put on PYTHONPATH for its server and its vLLM only); the peer goes
                     to "not_run" with the reason when it cannot be imported
  kvmesh-cpu         KVMeshConnector on a fresh `kvmesh up` mesh, small KV space, a CPU tier large enough for
                     the working set (--kvmesh-cpu-gb)
  kvmesh-disk        the same with a CPU tier too small for it (--kvmesh-disk-cpu-gb, default: a fraction of the
                     working set, at least the in-flight requests), so the disk store serves (OS page cache not
                     dropped)
  floor              vLLM alone with a KV space large enough for the whole working set: its prefix cache holds
                     everything (the machine's ceiling for reuse)

vLLM's KV space is set in blocks with `--num-gpu-blocks-override`, which the CPU build honours
(`may_override_num_blocks` in vllm/v1/core/kv_cache_utils.py caps the block count whatever the memory budget, and
the KV tensors are allocated for that count; the server logs "Overriding num_gpu_blocks=... with
num_gpu_blocks_override=..."). VLLM_CPU_KVCACHE_SPACE cannot do it: it is a whole number of GiB, so at least 1,
and 1 GiB already holds ~350k tokens of this model, ten times the working set. The small space is
(--concurrency + 1) requests of the longest prompt (--small-kv-blocks to change it); the floor's is the whole
working set plus that.

Compute is pinned as in ttft.py: vLLM's OpenMP threads on core 0 (VLLM_CPU_OMP_THREADS_BIND=0); this client,
the mesh and the LMCache server on the other cores. Before the rounds, two warm-up requests with an unrelated
prompt pay one-time costs. Per peer: TTFT p50/p90/p99 (sent -> first token), end-to-end latency p50/p90 (sent ->
last token), requests/s and generated tokens/s over the rounds' wall time, and each round's wall time. Ratios:
KVMesh p50 TTFT / LMCache p50 TTFT, and each peer's round wall time and warm p50 TTFT (rounds 2..R) / the
floor's: the floor loads nothing, so no connector's TTFT can be below it, and these say how close each comes. Writes `serving.json` and
`serving.png` (if matplotlib is installed) to --out and prints a table. The machine's load average is recorded
at the start and the end: figures taken next to other work are noisy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vllm_peers import (CHUNK, KVMESH, LMCACHE_SITE, Completion, Server, cpu_name, free_port,  # noqa: E402
                        lmcache_connector, lmcache_env, pin_to, start_lmcache_server, start_mesh)

PEERS = ["vllm-prefix-cache", "LMCache", "kvmesh-cpu", "kvmesh-disk", "floor"]
BLOCK = 128  # vLLM CPU's default block size, passed explicitly so the KV space in blocks means the same tokens
GB = 1_000_000_000  # KVMesh's sizes are in GB (services/engine/config/engine_config.py)
# counters read from each vLLM's /metrics around the rounds: where its prompt tokens came from, preemptions, and
# KVMesh's own (LMCache's names: disk reads, failed loads)
COUNTERS = ("vllm:prefix_cache_", "vllm:external_prefix_cache_", "vllm:num_preemptions", "vllm:prompt_tokens",
            "lmcache:")


# ---- the workload -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    users: int
    rounds: int
    system: int  # shared system prompt, tokens
    context: int  # each user's document, tokens
    question: int  # each question, tokens
    answer: int  # generated tokens per request (and the stand-in answer in the history)


class Pieces:
    """Prompt pieces cut from a fresh place in `corpus` each (wrapping around), each behind a tag naming it, so
    pieces of different tags differ within their first tokens; the same calls give the same tokens."""

    def __init__(self, corpus: list[int], encode: Callable[[str], list[int]]) -> None:
        if not corpus:
            raise ValueError("empty corpus")
        self.corpus, self.encode, self.cursor = corpus, encode, 0

    def __call__(self, tag: str, size: int) -> list[int]:
        head = self.encode(tag)[:size]
        body = [self.corpus[(self.cursor + i) % len(self.corpus)] for i in range(size - len(head))]
        self.cursor += len(body)
        return head + body


def build_prompts(shape: Shape, corpus: list[int], encode: Callable[[str], list[int]], bos: int | None
                  ) -> list[list[list[int]]]:
    """prompts[round][user]: token ids. Round r's prompt extends round r-1's by its stand-in answer and a question.

    Every piece is cut from a fresh place in `corpus` (wrapping around) behind a tag naming it, so documents and
    questions of different users differ within their first tokens while the system prompt is the same for all.
    """
    if min(shape.users, shape.rounds, shape.context, shape.question, shape.answer) < 1 or shape.system < 0:
        raise ValueError(f"every size must be >= 1 (system >= 0): {shape}")
    piece = Pieces(corpus, encode)
    system = ([] if bos is None else [bos]) + piece("[system] ", shape.system)
    answer = piece("[answer] ", shape.answer)
    histories = [system + piece(f"[document of user {u}] ", shape.context) for u in range(shape.users)]
    prompts: list[list[list[int]]] = []
    for r in range(shape.rounds):
        this_round = []
        for u in range(shape.users):
            prompt = histories[u] + piece(f"[user {u} question {r + 1}] ", shape.question)
            this_round.append(prompt)
            histories[u] = prompt + answer
        prompts.append(this_round)
    return prompts


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK)


def working_set_tokens(prompts: list[list[list[int]]], answer: int) -> int:
    """Distinct token positions the whole run leaves in a prefix cache: the prefix tree of each user's last
    prompt and its answer (a shared prefix counted once). Sorted, each sequence shares with its neighbour the
    longest prefix it shares with any other, so the tree's size is the lengths' sum less those overlaps."""
    ends = sorted(p + [-1] * answer for p in prompts[-1])  # -1: the answer's tokens, unknown until generated
    overlap = sum(len(os.path.commonprefix([a, b])) for a, b in zip(ends, ends[1:]))
    return sum(map(len, ends)) - overlap


# ---- statistics ------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Sample:
    round: int  # 1-based
    user: int
    prompt_tokens: int
    sent_s: float  # since the round started
    ttft_s: float
    e2e_s: float
    tokens: int
    text: str


def summarize(samples: list[Sample], round_walls: list[float]) -> dict[str, Any]:
    """The per-peer figures: TTFT and end-to-end percentiles, throughput over the rounds' wall time."""
    ttft = [s.ttft_s for s in samples]
    e2e = [s.e2e_s for s in samples]
    wall = sum(round_walls)
    by_round = {r: [s.ttft_s for s in samples if s.round == r] for r in range(1, len(round_walls) + 1)}
    return {
        "requests": len(samples),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p90_s": percentile(e2e, 90),
        "requests_per_s": len(samples) / wall, "generated_tokens_per_s": sum(s.tokens for s in samples) / wall,
        "round_wall_s": round_walls,
        "round_ttft_p50_s": [percentile(v, 50) for v in by_round.values()],
        # the rounds where caches pay (the first is the same prefill for every peer)
        "warm_ttft_p50_s": percentile([s.ttft_s for s in samples if s.round > 1] or ttft, 50),
        "wall_s": wall,
    }


# ---- running one peer ------------------------------------------------------------------------------------


def run_rounds(server: Server, prompts: list[list[list[int]]], answer: int, concurrency: int
               ) -> tuple[list[Sample], list[float]]:
    samples: list[Sample] = []
    walls: list[float] = []
    with ThreadPoolExecutor(concurrency) as pool:
        for r, this_round in enumerate(prompts, 1):
            started = time.perf_counter()

            def one(user: int, prompt: list[int], r: int = r, started: float = started) -> Sample:
                sent = time.perf_counter() - started
                done: Completion = server.complete(prompt, answer)
                return Sample(r, user, len(prompt), sent, done.ttft_s, done.e2e_s, done.tokens, done.text)

            samples += list(pool.map(one, range(len(this_round)), this_round))
            walls.append(time.perf_counter() - started)
            print(f"  {server.name} round {r}: {walls[-1]:.2f}s, TTFT p50 "
                  f"{percentile([s.ttft_s for s in samples if s.round == r], 50):.3f}s", flush=True)
    return samples, walls


@dataclass
class Setup:
    model: Path
    work: Path
    env: dict[str, str]
    max_len: int
    prompts: list[list[list[int]]]
    warmup: list[int]
    answer: int
    concurrency: int
    dtype: str
    chunk: int  # the connectors' chunk size, tokens


def serve(setup: Setup, name: str, kv_blocks: int, extra: list[str], env: dict[str, str] | None = None
          ) -> dict[str, Any]:
    """Start one vLLM for a peer, warm it up, run the rounds, stop it."""
    args = ["--dtype", setup.dtype, "--enable-prefix-caching", "--block-size", str(BLOCK),
            "--num-gpu-blocks-override", str(kv_blocks),
            *extra]
    server = Server(name, setup.model, free_port(), setup.work / "logs", setup.max_len, args, env or setup.env)
    try:
        server.ready()  # inside the try: a server that never comes up is stopped too
        for _ in range(2):
            server.complete(setup.warmup, 2)
        before = server.counters(COUNTERS)
        samples, walls = run_rounds(server, setup.prompts, setup.answer, setup.concurrency)
        after = server.counters(COUNTERS)
    finally:
        server.stop()
    counted = {name: after[name] - before.get(name, 0.0) for name in sorted(after)}
    return {**summarize(samples, walls), **hit_rates(counted), "kv_blocks": kv_blocks, "counters": counted,
            "samples": [asdict(s) for s in samples]}


def hit_rates(counted: dict[str, float]) -> dict[str, float | None]:
    """Where the prompt tokens of the rounds came from, by vLLM's own counters: its prefix cache, or a connector
    (outside vLLM); None where the server did not count it."""
    queries = counted.get("vllm:prefix_cache_queries_total")
    inside = counted.get("vllm:prefix_cache_hits_total")
    outside = counted.get("vllm:external_prefix_cache_hits_total")
    external_queries = counted.get("vllm:external_prefix_cache_queries_total")
    return {"vllm_prefix_cache_hit_rate": inside / queries if queries and inside is not None else None,
            "connector_hit_rate": outside / external_queries if external_queries and outside is not None else None}


def run_kvmesh(setup: Setup, name: str, kv_blocks: int, cpu_gb: float, disk_gb: float, async_loading: bool
               ) -> dict[str, Any]:
    mesh = start_mesh(setup.work, disk_gb, name=f"{name}-mesh")
    try:
        config = mesh.engine_yaml(setup.work / f"{name}.yaml", name, cpu_gb, disk_gb, async_loading, setup.chunk)
        result = serve(setup, name, kv_blocks, ["--kv-transfer-config", json.dumps(KVMESH)],
                       {**setup.env, "LMCACHE_CONFIG_FILE": str(config)})
        return {**result, "cpu_tier_gb": cpu_gb, "disk_gb": disk_gb}
    finally:
        mesh.stop()


def run_lmcache(setup: Setup, kv_blocks: int, env: dict[str, str], l1_gb: float) -> dict[str, Any]:
    lmcache, port = start_lmcache_server(setup.work, env, l1_gb, setup.chunk)
    try:
        result = serve(setup, "LMCache", kv_blocks,
                       ["--kv-transfer-config", json.dumps(lmcache_connector(port))], env)
        return {**result, "l1_gb": l1_gb}
    finally:
        lmcache.stop()


# ---- report ----------------------------------------------------------------------------------------------


def ratios(peers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    lmcache = peers.get("LMCache")
    floor = peers.get("floor")
    for name in ("kvmesh-cpu", "kvmesh-disk"):
        if name in peers and lmcache:
            out[f"{name}_p50_ttft_over_LMCache"] = peers[name]["ttft_p50_s"] / lmcache["ttft_p50_s"]
    if floor:
        for name, result in peers.items():
            if name != "floor":
                out[f"{name}_round_wall_over_floor"] = [a / b for a, b in zip(result["round_wall_s"],
                                                                              floor["round_wall_s"])]
                # no connector can beat the floor's TTFT (it loads nothing): this is how close each comes
                out[f"{name}_warm_p50_ttft_over_floor"] = result["warm_ttft_p50_s"] / floor["warm_ttft_p50_s"]
    return out


def share(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"


def table(peers: dict[str, dict[str, Any]]) -> str:
    head = (f"{'peer':<18} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'e2e p50':>8} {'p90':>7} {'req/s':>6} "
            f"{'tok/s':>7} {'vLLM hit':>8} {'conn hit':>8}  round wall (s)")
    lines = [head, "-" * len(head)]
    for name, r in peers.items():
        walls = " ".join(f"{w:.2f}" for w in r["round_wall_s"])
        lines.append(f"{name:<18} {r['ttft_p50_s']:9.3f} {r['ttft_p90_s']:7.3f} {r['ttft_p99_s']:7.3f} "
                     f"{r['e2e_p50_s']:8.3f} {r['e2e_p90_s']:7.3f} {r['requests_per_s']:6.2f} "
                     f"{r['generated_tokens_per_s']:7.1f} {share(r.get('vllm_prefix_cache_hit_rate')):>8} "
                     f"{share(r.get('connector_hit_rate')):>8}  {walls}")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    peers = summary["peers"]
    names = list(peers)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(names))
    for offset, key in ((-0.27, "ttft_p50_s"), (0, "ttft_p90_s"), (0.27, "ttft_p99_s")):
        left.bar([x + offset for x in xs], [peers[n][key] for n in names], 0.27, label=key[5:8])
    left.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("TTFT (s)")
    left.legend()
    for name in names:
        walls = peers[name]["round_wall_s"]
        right.plot(range(1, len(walls) + 1), walls, marker="o", label=name)
    right.set_xlabel("round")
    right.set_ylabel("round wall time (s)")
    right.set_xticks(range(1, summary["workload"]["rounds"] + 1))
    right.legend(fontsize=8)
    work = summary["workload"]
    fig.suptitle(f"{work['users']} users x {work['rounds']} rounds, {work['context']}-token documents, "
                 f"concurrency {work['concurrency']}; {summary['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def bytes_per_token(model: Path, dtype: str = "auto") -> int:
    """KV bytes one token takes in this model (all layers, K and V) served in `dtype` ("auto": its config's)."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    served = config.get("dtype") or config.get("torch_dtype") if dtype == "auto" else dtype
    width = {"bfloat16": 2, "float16": 2, "float32": 4}[served]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * width


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight at most")
    parser.add_argument("--system", type=int, default=512, help="shared system prompt, tokens")
    parser.add_argument("--context", type=int, default=2048, help="each user's document, tokens")
    parser.add_argument("--question", type=int, default=64, help="each question, tokens")
    parser.add_argument("--answer", type=int, default=16, help="generated tokens per request")
    parser.add_argument("--peers", nargs="+", default=PEERS, choices=PEERS)
    parser.add_argument("--model", type=Path, help="model dir (default: build the --bench demo model)")
    parser.add_argument("--chunk-size", type=int, default=CHUNK,
                        help="the chunk size of KVMesh and LMCache, tokens (vLLM's blocks stay 128)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="vLLM's --dtype for every peer (float32 on a CPU without AVX-512, where bf16 "
                             "prefill is ~10x slower)")
    parser.add_argument("--small-kv-blocks", type=int,
                        help=f"vLLM's KV space in {BLOCK}-token blocks for all but the floor (default: "
                             "concurrency + 1 requests of the longest prompt)")
    parser.add_argument("--kvmesh-cpu-gb", type=float, default=2.0, help="kvmesh-cpu's CPU tier, GB")
    parser.add_argument("--kvmesh-disk-cpu-gb", type=float,
                        help="kvmesh-disk's CPU tier, GB (default: a quarter of the working set, at least the "
                             "requests in flight)")
    parser.add_argument("--kvmesh-disk-gb", type=float, default=4.0, help="the disk store's size, GB")
    parser.add_argument("--kvmesh-async-loading", choices=["true", "false"], default="true",
                        help="KVMesh's enable_async_loading")
    parser.add_argument("--lmcache-l1-gb", type=float, default=2.0,
                        help="the LMCache server's L1 CPU cache (its --l1-size-gb)")
    parser.add_argument("--lmcache-site", type=Path, default=LMCACHE_SITE,
                        help="a pip --target directory holding lmcache, put on PYTHONPATH for LMCache only")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from make_demo_model import ensure_model, long_text
    from transformers import AutoTokenizer

    started = time.time()
    load_start = os.getloadavg()
    model = args.model or ensure_model(Path.home() / ".cache" / "kvmesh-tests" / "models" / "bench", "bench")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    encode: Callable[[str], list[int]] = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    shape = Shape(args.users, args.rounds, args.system, args.context, args.question, args.answer)
    corpus = encode(long_text())
    prompts = build_prompts(shape, corpus, encode, tokenizer.bos_token_id)
    longest = max(len(p) for r in prompts for p in r)
    max_len = longest + args.answer
    per_request = blocks(max_len)
    working = working_set_tokens(prompts, args.answer)
    small = args.small_kv_blocks or (args.concurrency + 1) * per_request
    floor_blocks = blocks(working) + (args.concurrency + 1) * per_request
    if small < per_request:
        raise SystemExit(f"--small-kv-blocks {small} cannot hold one {max_len}-token request ({per_request} blocks)")
    if small >= blocks(working):
        print(f"warning: the small KV space ({small} blocks) holds the working set ({blocks(working)} blocks): "
              "vLLM's prefix cache will not miss", flush=True)
    token_bytes = bytes_per_token(model, args.dtype)
    disk_cpu_gb = args.kvmesh_disk_cpu_gb or round(max(working * token_bytes / 4,
                                                        (args.concurrency + 1) * max_len * token_bytes) / GB, 4)
    warmup = [tokenizer.bos_token_id, *encode("[warm-up] "), *corpus[-args.context:]]

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvmesh-serving-"))
    pin_to((os.sched_getaffinity(0) - {0}) or {0})
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="1")  # the block override sizes the KV space
    setup = Setup(model, work, env, max_len, prompts, warmup, args.answer, args.concurrency, args.dtype,
                  args.chunk_size)
    print(f"workload: {args.users} users x {args.rounds} rounds, prompts up to {longest} tokens, working set "
          f"{working} tokens ({blocks(working)} blocks, {working * token_bytes / 1e6:.0f} MB of KV); vLLM KV space "
          f"{small} blocks (floor {floor_blocks}); kvmesh-disk CPU tier {disk_cpu_gb} GB; logs {work / 'logs'}",
          flush=True)

    import torch
    import vllm  # its distribution is named vllm or vllm-cpu: ask the module

    peers: dict[str, dict[str, Any]] = {}
    not_run: dict[str, str] = {}
    summary: dict[str, Any] = {
        "benchmark": "serving",
        "workload": {**asdict(shape), "concurrency": args.concurrency, "longest_prompt": longest,
                     "working_set_tokens": working, "working_set_mb": working * token_bytes / 1e6},
        "peers": peers, "ratios": {}, "not_run": not_run,
        "model": {"name": "kvmesh demo --bench (Llama, 6 layers, hidden 512, 8 heads, 2 KV heads x 64, bf16)",
                  "path": str(model), "kv_bytes_per_token": token_bytes},
        "setup": {"vllm": vllm.__version__, "torch": torch.__version__, "lmcache": None,
                  "dtype": args.dtype, "max_model_len": max_len, "max_num_batched_tokens": max_len, "block_size": BLOCK,
                  "small_kv_blocks": small, "floor_kv_blocks": floor_blocks, "prefix_caching": True,
                  "VLLM_CPU_OMP_THREADS_BIND": "0", "chunk_size": args.chunk_size, "kvmesh_cpu_gb": args.kvmesh_cpu_gb,
                  "kvmesh_disk_cpu_gb": disk_cpu_gb, "kvmesh_async_loading": args.kvmesh_async_loading,
                  "lmcache_l1_gb": args.lmcache_l1_gb, "disk_page_cache": "not dropped"},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "load_average_start": load_start},
        "command": " ".join([sys.executable, *sys.argv]), "logs": str(work / "logs"),
    }

    def save() -> None:
        """serving.json as it stands: written after every peer, so a run cut short keeps what it measured."""
        floor_texts = {(s["round"], s["user"]): s["text"] for s in peers.get("floor", {}).get("samples", [])}
        for result in peers.values():  # a hint, not a check: bf16 sums in another order may flip a greedy token
            result["answers_equal_to_floor"] = sum(floor_texts.get((s["round"], s["user"])) == s["text"]
                                                   for s in result["samples"]) if floor_texts else None
        summary["ratios"] = ratios(peers)
        summary["machine"]["load_average_end"] = os.getloadavg()
        summary["wall_s"] = round(time.time() - started, 1)
        (args.out / "serving.json").write_text(json.dumps(summary, indent=2) + "\n")

    for name in PEERS:
        if name not in args.peers:
            continue
        print(f"== {name}", flush=True)
        try:
            if name == "vllm-prefix-cache":
                peers[name] = serve(setup, name, small, [])
            elif name == "LMCache":
                lm_env, found = lmcache_env(env, args.lmcache_site)
                if lm_env is None:
                    not_run[name] = found
                    print(f"  not run: {found}", flush=True)
                    continue
                summary["setup"]["lmcache"] = found
                peers[name] = run_lmcache(setup, small, lm_env, args.lmcache_l1_gb)
            elif name == "kvmesh-cpu":
                peers[name] = run_kvmesh(setup, name, small, args.kvmesh_cpu_gb, args.kvmesh_disk_gb,
                                         args.kvmesh_async_loading == "true")
            elif name == "kvmesh-disk":
                peers[name] = run_kvmesh(setup, name, small, disk_cpu_gb, args.kvmesh_disk_gb,
                                         args.kvmesh_async_loading == "true")
            else:
                peers[name] = serve(setup, name, floor_blocks, [])
        except (Exception, SystemExit) as error:  # one peer failing must not lose the others' figures
            not_run[name] = f"failed: {error}"
            print(f"  {name} failed: {error}", flush=True)
        save()

    save()
    if plot(summary, args.out / "serving.png"):
        print(f"plot: {args.out / 'serving.png'}")
    print(table(peers))
    loads = [summary["machine"][k] for k in ("load_average_start", "load_average_end")]
    print(json.dumps({"ratios": summary["ratios"], "not_run": not_run}, indent=2))
    print("load average (1/5/15 min) at start {:.1f}/{:.1f}/{:.1f}, at end {:.1f}/{:.1f}/{:.1f}".format(*loads[0],
                                                                                                     *loads[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
