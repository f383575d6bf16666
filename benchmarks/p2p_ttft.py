#!/usr/bin/env python
"""Time to first token (TTFT) of a P2P hit: vLLM instance B's first request for a prompt that instance A computed,
next to B computing a prompt of the same length itself and to B's second request of it (its own CPU tier).

    python benchmarks/p2p_ttft.py [--lengths 2048 8192] [--repeats 3] [--model DIR] [--out PATH]

One run, one machine: `kvmesh up --no-disk --no-remote` (NATS and the controller, no store at all: the only way
KV reaches B from A is P2P), two vLLM CPU servers A and B (`vllm.entrypoints.openai.api_server`, the `--bench`
demo model, built if missing) with KVMeshConnector, enable_p2p, chunk_size 256 and vLLM's own prefix cache off
(so every hit is KVMesh's), started with the same flags (--max-model-len the longest prompt + 64,
--max-num-batched-tokens the same: every prompt is one prefill step, as in benchmarks/ttft.py).

Per length and repeat, with fresh prompts (a unique first chunk: no tier anywhere holds them before):
  recompute  B's request for a fresh prompt: B asks the controller (a P2P miss) and computes it all
  a_compute  A's request for another fresh prompt P (A computes and stores it; for reference)
  p2p        B's first request for P, once the controller's /lookup lists A for it: B loads P's chunks from A's
             CPU tier over the P2P stream and computes only the rest
  own_cpu    B's second request for P: loaded from B's own CPU tier (where the P2P load put the chunks)
Each sample is proven: B's log has a "Retrieved N tokens" line for each p2p and own_cpu request (N at least the
prompt less one chunk), none for a recompute request; at the end B's lmcache:num_p2p_read_chunks counter has
grown by at least the chunks the p2p requests loaded (A's lmcache:num_p2p_served_chunks is reported too).

Compute is pinned as in benchmarks/ttft.py: both vLLMs' OpenMP threads on core 0 (VLLM_CPU_OMP_THREADS_BIND,
`--bind-a` / `--bind-b`; the requests are sequential, so they never compute at once), this client and the mesh
on the other cores; KVMesh's own threads move off the compute cores by themselves. After a vLLM computes, its
OpenMP threads keep spinning on the core for a while: B's request right after A's compute ran 0.7-0.8 s slower
for it (measured: 0.86-0.94 s against 0.08-0.16 s after a pause), which instances on their own machines never
see. So each timed request waits `--settle` seconds first. TTFT is the time from sending a
streaming completion to its first token; figures are medians. Untimed warm-up first: two prompts on each server
(graph capture, allocator growth) and one P2P hit (B's stream connections to A). Prints the JSON; `--out` also
writes it to a file. Logs stay in a temporary directory (named in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent

from vllm_peers import (CHUNK, KVMESH, Child, Server, completion_events, cpu_name, free_port,  # noqa: E402
                        pin_to, side_cores, wait_http)
from make_demo_model import ensure_model  # noqa: E402  (scripts/, on the path via vllm_peers)
from ttft import Prompts, model_description, warm_up  # noqa: E402

RETRIEVED = re.compile(r"Retrieved (?P<tokens>\d+) tokens for request (?P<req>\S+) in ")
READ_CHUNKS = "lmcache:num_p2p_read_chunks_total"
FAILED_READS = "lmcache:num_p2p_failed_reads_total"
SERVED_CHUNKS = "lmcache:num_p2p_served_chunks_total"
WAIT_S = 60.0


@dataclass
class Sample:
    ttft_s: float
    text: str
    request_id: str


def timed(server: Server, prompt: list[int], max_tokens: int, extra: dict[str, Any] | None = None) -> Sample:
    """One greedy streaming completion (`extra`: more fields of its body): TTFT, its text and its request id (the
    response's)."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, **(extra or {})}
    started = time.perf_counter()
    first: float | None = None
    request_id = ""
    pieces = []
    for event in completion_events(server.url, body, server.name):
        request_id = request_id or event.get("id", "")
        if event.get("choices"):
            if first is None:
                first = time.perf_counter()
            pieces.append(event["choices"][0].get("text") or "")
    return Sample((first or time.perf_counter()) - started, "".join(pieces), request_id)


def retrieved(server: Server, request_id: str) -> list[int]:
    """Tokens the worker loaded for `request_id`, from its "Retrieved N tokens" lines."""
    text = server.child.log.read_text(errors="replace")
    return [int(m["tokens"]) for m in RETRIEVED.finditer(text) if m["req"].startswith(request_id)]


def loaded_tokens(server: Server, sample: Sample, at_least: int) -> int:
    """The tokens `server` loaded for `sample`, once its log says so; raises if it never loaded `at_least`."""
    deadline = time.monotonic() + WAIT_S
    while True:
        lines = retrieved(server, sample.request_id)
        if lines and sum(lines) >= at_least:
            return sum(lines)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}: request {sample.request_id} loaded {lines or 'nothing'}, expected "
                               f"at least {at_least} tokens; see {server.child.log}")
        time.sleep(0.2)


def counter(server: Server, name: str) -> float:
    return server.counters((name.removesuffix("_total"),)).get(name, 0.0)


def start_mesh(work: Path) -> tuple[Child, int, str]:
    """`kvmesh up --no-disk --no-remote` on the side cores: (its child, NATS port, controller URL)."""
    nats_port, port = free_port(), free_port()
    child = Child("kvmesh-up", ["taskset", "-c", side_cores(), sys.executable, "-m", "kvmesh.cli", "up",
                                "--nats-port", str(nats_port), "--port", str(port), "--host", "127.0.0.1",
                                "--no-disk", "--no-remote", "--log-dir", str(work / "logs" / "kvmesh-up")],
                  work / "logs" / "kvmesh-up.log")
    controller = f"http://127.0.0.1:{port}"
    try:
        wait_http(child, f"{controller}/healthz", 60, "kvmesh up")
    except BaseException:
        child.stop()
        raise
    return child, nats_port, controller


def engine_yaml(path: Path, instance: str, nats_port: int, cpu_gb: float, pd: bool = False) -> Path:
    """A KVMesh config with P2P on (`pd`: with prefill/decode, enable_pd, too)."""
    path.write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: {cpu_gb}\n"
                    f'lmcache_instance_id: "{instance}"\ncontroller_url: "localhost:{nats_port}"\n'
                    f"enable_p2p: true\n{'enable_pd: true' if pd else ''}\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Progress (and the helpers' messages) go to stderr; stdout gets the JSON only."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192], help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="samples per length, each with fresh prompts")
    parser.add_argument("--model", type=Path, help="model dir (default: build the --bench demo model)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--cpu-gb", type=float, default=1.0, help="each instance's KVMesh CPU tier")
    parser.add_argument("--bind-a", default="0", help="A's VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--bind-b", default="0", help="B's VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--settle", type=float, default=1.5,
                        help="seconds before each timed request, so that the other vLLM's OpenMP threads, which "
                             "spin on the shared core for a while after it computed, are asleep (default 1.5)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    return run_and_print(parser, run, argv)


def run_and_print(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], dict[str, Any]],
                  argv: list[str] | None) -> int:
    """Parse and check `argv` (--lengths, --repeats, --out), `run` with its progress on stderr, then its JSON
    on stdout and in --out."""
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.lengths) <= CHUNK:
        parser.error(f"--repeats must be at least 1 and every length above {CHUNK} tokens (one chunk)")
    with contextlib.redirect_stdout(sys.stderr):
        summary = run(args)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


@dataclass
class Bench:
    """What a run with two vLLMs starts from (this file's and benchmarks/pd_push_pull.py's)."""

    model: Path
    max_len: int  # the longest prompt + 64
    work: Path  # logs and configs
    env: dict[str, str]  # the vLLMs' environment, without the caller's LMCACHE_* / KVMESH_*
    prompts: Prompts
    started: float  # time.time()


def prepare(args: argparse.Namespace, prefix: str) -> Bench:
    """The bench demo model (built if missing, or --model), a work directory, and this process off core 0."""
    model = args.model or ensure_model(Path.home() / ".cache" / "kvmesh-tests" / "models" / "bench", "bench")
    pin_to(os.sched_getaffinity(0) - {0} or {0})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVMESH_"))}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return Bench(model, max(args.lengths) + 64, Path(tempfile.mkdtemp(prefix=prefix)), env, Prompts(model),
                 time.time())


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    bench = prepare(args, "kvmesh-p2p-ttft-")
    model, max_len, work, env, prompts, started = (bench.model, bench.max_len, bench.work, bench.env, bench.prompts,
                                                   bench.started)
    mesh, nats_port, controller = start_mesh(work)
    servers: dict[str, Server] = {}
    try:
        for name, bind in (("p2p-a", args.bind_a), ("p2p-b", args.bind_b)):
            config = engine_yaml(work / f"{name}.yaml", name, nats_port, args.cpu_gb)
            servers[name] = Server(name, model, free_port(), work / "logs", max_len,
                                   ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(KVMESH)],
                                   {**env, "LMCACHE_CONFIG_FILE": str(config), "VLLM_CPU_OMP_THREADS_BIND": bind})
        a, b = servers["p2p-a"], servers["p2p-b"]
        for server in (a, b):  # started together above: their start-ups overlap
            server.ready()

        def listed(prompt: list[int]) -> None:
            """Wait until the controller lists A as holding `prompt` (all but the last partial chunk)."""
            deadline = time.monotonic() + WAIT_S
            while True:
                reply = httpx.post(f"{controller}/lookup", json={"tokens": prompt}, timeout=30).json()
                entry = reply["layout_info"].get(a.child.name)
                if entry and entry[1] >= len(prompt) - CHUNK:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the controller does not list A for a {len(prompt)}-token prompt: {reply}")
                time.sleep(0.1)

        def p2p_hit(size: int, label: str) -> tuple[Sample, Sample, list[int]]:
            prompt = prompts.fresh(size, label)
            computed = timed(a, prompt, args.max_tokens)
            listed(prompt)
            time.sleep(args.settle)
            return computed, timed(b, prompt, args.max_tokens), prompt

        def report_counters() -> None:
            """An idle vLLM reports its connector's counters with its next step: one short request each."""
            for server in (a, b):
                timed(server, prompts.fresh(300, "counters"), 2)

        for server in (a, b):
            warm_up(server, prompts, max_len)
        _, first_hit, _ = p2p_hit(min(600, max_len - 16), "p2p-warmup")
        loaded_tokens(b, first_hit, 1)
        report_counters()
        reads_before, failed_before = counter(b, READ_CHUNKS), counter(b, FAILED_READS)
        served_before = counter(a, SERVED_CHUNKS)

        results: dict[str, Any] = {}
        p2p_chunks_min = 0
        for size in args.lengths:
            row: dict[str, list[Any]] = {key: [] for key in (
                "recompute_s", "a_compute_s", "p2p_s", "own_cpu_s", "p2p_loaded_tokens", "own_cpu_loaded_tokens",
                "p2p_output_equals_a", "own_cpu_output_equals_p2p")}
            for _ in range(args.repeats):
                time.sleep(args.settle)
                recompute = timed(b, prompts.fresh(size, "recompute"), args.max_tokens)
                computed, hit, prompt = p2p_hit(size, "p2p")
                time.sleep(args.settle)
                own = timed(b, prompt, args.max_tokens)
                row["recompute_s"].append(recompute.ttft_s)
                row["a_compute_s"].append(computed.ttft_s)
                row["p2p_s"].append(hit.ttft_s)
                row["own_cpu_s"].append(own.ttft_s)
                p2p_tokens = loaded_tokens(b, hit, size - CHUNK)
                row["p2p_loaded_tokens"].append(p2p_tokens)
                row["own_cpu_loaded_tokens"].append(loaded_tokens(b, own, size - CHUNK))
                row["p2p_output_equals_a"].append(hit.text == computed.text)
                row["own_cpu_output_equals_p2p"].append(own.text == hit.text)
                if retrieved(b, recompute.request_id):
                    raise RuntimeError(f"B loaded KV for the fresh prompt {recompute.request_id}: not a recompute")
                p2p_chunks_min += p2p_tokens // CHUNK
            medians = {key.replace("_s", "_median_s"): statistics.median(row[key])
                       for key in ("recompute_s", "a_compute_s", "p2p_s", "own_cpu_s")}
            results[str(size)] = {**row, **medians,
                                  "recompute_over_p2p": medians["recompute_median_s"] / medians["p2p_median_s"],
                                  "p2p_over_own_cpu": medians["p2p_median_s"] / medians["own_cpu_median_s"]}
            print(f"  {size}: recompute {medians['recompute_median_s']:.3f}s  p2p {medians['p2p_median_s']:.3f}s  "
                  f"own cpu {medians['own_cpu_median_s']:.3f}s", file=sys.stderr, flush=True)

        report_counters()
        deadline = time.monotonic() + WAIT_S
        while counter(b, READ_CHUNKS) - reads_before < p2p_chunks_min and time.monotonic() < deadline:
            time.sleep(0.5)
        proof = {"b_p2p_read_chunks": counter(b, READ_CHUNKS) - reads_before,
                 "b_p2p_read_chunks_expected_at_least": p2p_chunks_min,
                 "b_p2p_failed_reads": counter(b, FAILED_READS) - failed_before,
                 "a_p2p_served_chunks": counter(a, SERVED_CHUNKS) - served_before,
                 "every_p2p_and_own_cpu_request_loaded": True, "no_recompute_request_loaded": True}
        if proof["b_p2p_read_chunks"] < p2p_chunks_min:
            raise RuntimeError(f"B's P2P read counter did not grow by the chunks its P2P requests loaded: {proof}")
    finally:
        for server in servers.values():
            server.stop()
        mesh.stop()

    import torch
    import vllm

    return {
        "benchmark": "p2p_ttft", "lengths": args.lengths, "repeats": args.repeats, "statistic": "median",
        "results": results, "proof": proof,
        "model": {"name": model_description(model), "path": str(model)},
        "setup": {"vllm": vllm.__version__, "torch": torch.__version__, "max_model_len": max_len,
                  "max_num_batched_tokens": max_len, "vllm_prefix_cache": False, "chunk_size": CHUNK,
                  "kvmesh_cpu_gb": args.cpu_gb, "max_tokens": args.max_tokens,
                  "mesh": "kvmesh up --no-disk --no-remote",
                  "VLLM_CPU_OMP_THREADS_BIND": {"a": args.bind_a, "b": args.bind_b},
                  "VLLM_CPU_KVCACHE_SPACE_GiB": env["VLLM_CPU_KVCACHE_SPACE"]},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join([sys.executable, *sys.argv]), "wall_s": round(time.time() - started, 1),
        "logs": str(work / "logs"),
    }


if __name__ == "__main__":
    sys.exit(main())
