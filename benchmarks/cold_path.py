#!/usr/bin/env python
"""What KVMesh costs a request it has nothing for: cold TTFT with KVMesh's tiers switched on one by one, next to
vLLM's own prefix cache in the same run (issue 38's cold-path goal: <= 1.05x).

    python benchmarks/cold_path.py [--model DIR] [--size 8000] [--samples 5] [--rounds 2] [--interleave]
                                   [--variants vllm cpu disk sealed] [--kvmesh-python PATH] [--out FILE]

Variants (one vLLM server each, started one after the other, the same flags; every prompt is new, so nothing
is ever loaded):
  vllm    vLLM alone with its prefix cache on (the ceiling: what a request costs without any connector)
  cpu     KVMeshConnector with the CPU tier only: the save's copy into the pool, admissions on NATS, no store
  disk    the CPU tier and the mesh's disk store (write-behind of every chunk), chunks written plain
  sealed  the same with encrypt_stores on (KVMesh's default): the disk store's chunks sealed
A KVMesh variant may carry config keys after a colon, e.g. `sealed:write_behind_defer_secs=0` (an A/B of one
setting: `--variants vllm sealed sealed:write_behind_defer_secs=0`).
`--rounds 2` runs the whole list twice (vllm, cpu, ..., vllm, cpu, ...), so drift of the machine shows as a
difference between rounds. Each server takes `--samples` cold prompts back to back, then `--samples` more with
--settle seconds before each (the write-behind of the earlier ones then no longer shares the machine).
`--interleave` starts every variant's server at once and takes the settled samples in turns (vllm, cpu, ...,
vllm, cpu, ...), so the VM's drift over minutes falls on all alike (this VM's vLLM-alone medians moved by 30%
between runs minutes apart): no back-to-back samples then, and an idle server only waits (settle > 1.5 s: vLLM's
worker spins for a second after its last step).

Default model: the Qwen3-Next demo (`scripts/make_demo_model.py --preset qwen3next`, built if missing), prefilled
in chunk-sized steps (--max-num-batched-tokens 256), so every step saves a chunk and a state. vLLM's OpenMP
threads are pinned to core 0, this client and `kvmesh up` to the others. `--kvmesh-python`: the interpreter
whose kvmesh the KVMesh servers import (an older tree's venv, for an A/B of two trees in one run).

Prints and writes (--out) JSON: each variant's samples and medians, the ratio of each median to vllm's of the
same round, where a settled sample's time went (`settled_breakdown_ms`: ttft.py's parts from the server's own
histograms, medians), and per KVMesh variant the connector's own time in the worker's save (`lmcache:time_to_store`, its
sum and count from vLLM's /metrics: the part of the cold cost spent on vLLM's model thread).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_peers import KVMESH, Mesh, Server, free_port, pin_to, start_mesh  # noqa: E402
from ttft import Prompts, median_parts, sample_parts, warm_up  # noqa: E402
from make_demo_model import ensure_model  # noqa: E402

VARIANTS = ["vllm", "cpu", "disk", "sealed"]
STEP_TOKENS = 256  # vLLM's --max-num-batched-tokens: one chunk per prefill step


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """A --variants entry: its kind (VARIANTS) and its config lines ("key: value")."""
    kind, _, rest = spec.partition(":")
    settings = [item.split("=", 1) for item in rest.split(",") if item]
    if kind not in VARIANTS or any(len(item) != 2 for item in settings) or (settings and kind == "vllm"):
        raise ValueError(f"variant {spec!r}: one of {', '.join(VARIANTS)}, a KVMesh one optionally followed by "
                         ":key=value[,key=value]")
    return kind, [f"{key.strip()}: {value.strip()}" for key, value in settings]


def file_name(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in spec)


def kvmesh_config(mesh: Mesh, work: Path, spec: str) -> Path:
    """The variant's LMCache-style YAML: the mesh's CPU tier, with the disk store unless `cpu`; its own keys
    last."""
    kind, settings = parse_variant(spec)
    path = mesh.engine_yaml(work / f"{file_name(spec)}.yaml", file_name(spec), cpu_gb=2, disk_gb=8,
                            async_loading=False)
    lines = path.read_text().splitlines()
    if kind == "cpu":
        lines = [line for line in lines if not line.startswith(("local_disk:", "max_local_disk_size:"))]
    lines.append(f"encrypt_stores: {str(kind == 'sealed').lower()}")
    path.write_text("\n".join(lines + settings) + "\n")
    return path


def store_time(server: Server) -> dict[str, float]:
    """The worker's save time so far (`lmcache:time_to_store` sum and count, over every label)."""
    import httpx

    totals = {"sum": 0.0, "count": 0.0}
    for line in httpx.get(f"{server.url}/metrics", timeout=60).text.splitlines():
        for part in totals:
            if line.startswith(f"lmcache:time_to_store_{part}"):
                totals[part] += float(line.rsplit(" ", 1)[1])
    return totals


def start_variant(spec: str, model: Path, work: Path, mesh: Mesh, prompts: Prompts, env: dict[str, str],
                  size: int, kvmesh_python: str) -> Server:
    """The variant's vLLM server, ready and warmed up."""
    args, server_env = ["--enable-prefix-caching"], dict(env)
    kvmesh = spec != "vllm"
    if kvmesh:
        args += ["--kv-transfer-config", json.dumps(KVMESH)]
        server_env["LMCACHE_CONFIG_FILE"] = str(kvmesh_config(mesh, work, spec))
    python, sys.executable = sys.executable, (kvmesh_python if kvmesh else sys.executable)
    try:  # Server starts vLLM with sys.executable
        server = Server(file_name(spec), model, free_port(), work / "logs", size + 64, args, server_env, STEP_TOKENS)
    finally:
        sys.executable = python
    try:
        server.ready()
        warm_up(server, prompts, size + 64)
    except BaseException:
        server.stop()
        raise
    return server


def settled_sample(server: Server, prompts: Prompts, size: int, spec: str, settle: float
                   ) -> tuple[float, dict[str, float]]:
    """(TTFT, where it went: ttft.py's parts from the server's histograms) of a cold prompt after `settle` s."""
    time.sleep(settle)  # a benchmark, not a test: the previous prompt's write-behind ends meanwhile
    recorded = server.histograms(("vllm:", "lmcache:"))
    seconds = server.stream(prompts.fresh(size, spec))[0]
    return seconds, sample_parts(server, recorded, seconds, loaded=False)


def entry_of(back_to_back: list[float], settled: list[tuple[float, dict[str, float]]],
             before: dict[str, float] | None, after: dict[str, float] | None, prompts: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"back_to_back_s": back_to_back, "settled_s": [ttft for ttft, _ in settled],
                             "settled_median_s": statistics.median(ttft for ttft, _ in settled),
                             "settled_breakdown_ms": median_parts([parts for _, parts in settled])}
    if back_to_back:
        entry["back_to_back_median_s"] = statistics.median(back_to_back)
    if before is not None and after is not None:
        saves = after["count"] - before["count"]
        entry["save_ms_per_step"] = 1e3 * (after["sum"] - before["sum"]) / saves if saves else None
        entry["save_ms_per_prompt"] = 1e3 * (after["sum"] - before["sum"]) / prompts
    return entry


def run_variant(spec: str, model: Path, work: Path, mesh: Mesh, prompts: Prompts, env: dict[str, str],
                size: int, samples: int, settle: float, kvmesh_python: str) -> dict[str, Any]:
    server = start_variant(spec, model, work, mesh, prompts, env, size, kvmesh_python)
    try:
        before = store_time(server) if spec != "vllm" else None
        back_to_back = [server.stream(prompts.fresh(size, spec))[0] for _ in range(samples)]
        settled = [settled_sample(server, prompts, size, spec, settle) for _ in range(samples)]
        after = store_time(server) if spec != "vllm" else None
        return entry_of(back_to_back, settled, before, after, 2 * samples)
    finally:
        server.stop()


def run_interleaved(specs: list[str], model: Path, work: Path, mesh: Mesh, prompts: Prompts, env: dict[str, str],
                    size: int, samples: int, settle: float, kvmesh_python: str) -> dict[str, dict[str, Any]]:
    servers: dict[str, Server] = {}
    try:
        for spec in specs:
            servers[spec] = start_variant(spec, model, work, mesh, prompts, env, size, kvmesh_python)
        before = {spec: store_time(server) for spec, server in servers.items() if spec != "vllm"}
        settled: dict[str, list[tuple[float, dict[str, float]]]] = {spec: [] for spec in specs}
        for _ in range(samples):
            for spec, server in servers.items():
                settled[spec].append(settled_sample(server, prompts, size, spec, settle))
        return {spec: entry_of([], settled[spec], before.get(spec),
                               store_time(servers[spec]) if spec in before else None, samples) for spec in specs}
    finally:
        for server in servers.values():
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model dir (default: the qwen3next demo model, built if missing)")
    parser.add_argument("--size", type=int, default=8000, help="prompt tokens")
    parser.add_argument("--samples", type=int, default=5, help="cold prompts per server, back to back and settled")
    parser.add_argument("--rounds", type=int, default=2, help="times the variant list runs")
    parser.add_argument("--settle", type=float, default=4.0, help="seconds before each settled sample")
    parser.add_argument("--variants", nargs="+", default=VARIANTS,
                        help=f"of {', '.join(VARIANTS)}; a KVMesh one may add :key=value[,key=value]")
    parser.add_argument("--interleave", action="store_true",
                        help="every variant's server up at once, settled samples in turns (no back-to-back ones)")
    parser.add_argument("--kvmesh-python", default=sys.executable, help="interpreter of the KVMesh servers")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.size <= STEP_TOKENS or args.samples < 1 or args.rounds < 1:
        parser.error(f"--size must be above {STEP_TOKENS}, --samples and --rounds at least 1")
    if len(set(args.variants)) != len(args.variants):
        parser.error("--variants names a variant twice")
    for spec in args.variants:
        try:
            parse_variant(spec)
        except ValueError as exc:
            parser.error(str(exc))
    model = args.model or ensure_model(Path.home() / ".cache" / "kvmesh-tests" / "models" / "qwen3next", "qwen3next")
    work = Path(tempfile.mkdtemp(prefix="kvmesh-cold-path-"))
    pin_to(os.sched_getaffinity(0) - {0} or {0})
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    prompts = Prompts(model)
    rounds: list[dict[str, Any]] = []
    mesh = start_mesh(work, disk_gb=8)
    try:
        for number in range(args.rounds):
            results = {}
            if args.interleave:
                print(f"== round {number + 1}: {', '.join(args.variants)} interleaved", file=sys.stderr, flush=True)
                results = run_interleaved(args.variants, model, work, mesh, prompts, env, args.size, args.samples,
                                          args.settle, args.kvmesh_python)
            for variant in args.variants if not args.interleave else []:
                print(f"== round {number + 1}: {variant}", file=sys.stderr, flush=True)
                results[variant] = run_variant(variant, model, work, mesh, prompts, env, args.size, args.samples,
                                               args.settle, args.kvmesh_python)
            base = results.get("vllm")
            for variant, entry in results.items():
                for kind in ("back_to_back", "settled"):
                    if base is not None and f"{kind}_median_s" in entry:
                        entry[f"{kind}_over_vllm"] = entry[f"{kind}_median_s"] / base[f"{kind}_median_s"]
            rounds.append(results)
    finally:
        mesh.stop()
    summary = {"model": str(model), "size": args.size, "samples": args.samples, "settle_s": args.settle,
               "interleaved": args.interleave, "kvmesh_python": args.kvmesh_python, "rounds": rounds}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for number, results in enumerate(rounds, 1):
        for variant, entry in results.items():
            ratios = "  ".join(f"{kind} {entry[f'{kind}_median_s']:.3f} s ({entry.get(f'{kind}_over_vllm', 1):.2f}x)"
                               for kind in ("back_to_back", "settled") if f"{kind}_median_s" in entry)
            save = f"  save {entry['save_ms_per_step']:.2f} ms/step" if entry.get("save_ms_per_step") else ""
            parts = entry["settled_breakdown_ms"]
            where = "  ".join(f"{part[:-3]} {parts[part]:.0f}" for part in ("queue_ms", "prefill_ms", "api_ms")
                              if part in parts)
            print(f"round {number} {variant:7s} {ratios}{save}  settled ms: {where}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
