#!/usr/bin/env python
"""What KVMesh costs a request it has nothing for: cold TTFT with KVMesh's tiers switched on one by one, next to
vLLM's own prefix cache in the same run (issue 38's cold-path goal: <= 1.05x).

    python benchmarks/cold_path.py [--model DIR] [--size 8000] [--samples 5] [--rounds 2]
                                   [--variants vllm cpu disk sealed] [--kvmesh-python PATH] [--out FILE]

Variants (one vLLM server each, started one after the other, the same flags; every prompt is new, so nothing
is ever loaded):
  vllm    vLLM alone with its prefix cache on (the ceiling: what a request costs without any connector)
  cpu     KVMeshConnector with the CPU tier only: the save's copy into the pool, admissions on NATS, no store
  disk    the CPU tier and the mesh's disk store (write-behind of every chunk), chunks written plain
  sealed  the same with encrypt_stores on (KVMesh's default): the disk store's chunks sealed
`--rounds 2` runs the whole list twice (vllm, cpu, ..., vllm, cpu, ...), so drift of the machine shows as a
difference between rounds. Each server takes `--samples` cold prompts back to back, then `--samples` more with
--settle seconds before each (the write-behind of the earlier ones then no longer shares the machine).

Default model: the Qwen3-Next demo (`scripts/make_demo_model.py --preset qwen3next`, built if missing), prefilled
in chunk-sized steps (--max-num-batched-tokens 256), so every step saves a chunk and a state. vLLM's OpenMP
threads are pinned to core 0, this client and `kvmesh up` to the others. `--kvmesh-python`: the interpreter
whose kvmesh the KVMesh servers import (an older tree's venv, for an A/B of two trees in one run).

Prints and writes (--out) JSON: each variant's samples and medians, the ratio of each median to vllm's of the
same round, and per KVMesh variant the connector's own time in the worker's save (`lmcache:time_to_store`, its
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
from ttft import Prompts, warm_up  # noqa: E402
from make_demo_model import ensure_model  # noqa: E402

VARIANTS = ["vllm", "cpu", "disk", "sealed"]
STEP_TOKENS = 256  # vLLM's --max-num-batched-tokens: one chunk per prefill step


def kvmesh_config(mesh: Mesh, work: Path, variant: str) -> Path:
    """The variant's LMCache-style YAML: the mesh's CPU tier, with the disk store unless `cpu`."""
    path = mesh.engine_yaml(work / f"{variant}.yaml", variant, cpu_gb=2, disk_gb=8, async_loading=False)
    lines = path.read_text().splitlines()
    if variant == "cpu":
        lines = [line for line in lines if not line.startswith(("local_disk:", "max_local_disk_size:"))]
    lines.append(f"encrypt_stores: {str(variant == 'sealed').lower()}")
    path.write_text("\n".join(lines) + "\n")
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


def run_variant(variant: str, model: Path, work: Path, mesh: Mesh, prompts: Prompts, env: dict[str, str],
                size: int, samples: int, settle: float, kvmesh_python: str) -> dict[str, Any]:
    args, server_env = ["--enable-prefix-caching"], dict(env)
    if variant != "vllm":
        args += ["--kv-transfer-config", json.dumps(KVMESH)]
        server_env["LMCACHE_CONFIG_FILE"] = str(kvmesh_config(mesh, work, variant))
    python, sys.executable = sys.executable, (kvmesh_python if variant != "vllm" else sys.executable)
    try:  # Server starts vLLM with sys.executable
        server = Server(variant, model, free_port(), work / "logs", size + 64, args, server_env, STEP_TOKENS)
    finally:
        sys.executable = python
    try:
        server.ready()
        warm_up(server, prompts, size + 64)
        before = store_time(server) if variant != "vllm" else None
        back_to_back = [server.stream(prompts.fresh(size, variant))[0] for _ in range(samples)]
        settled = []
        for _ in range(samples):
            time.sleep(settle)  # a benchmark, not a test: the previous prompt's write-behind ends meanwhile
            settled.append(server.stream(prompts.fresh(size, variant))[0])
        entry: dict[str, Any] = {"back_to_back_s": back_to_back, "settled_s": settled,
                                 "back_to_back_median_s": statistics.median(back_to_back),
                                 "settled_median_s": statistics.median(settled)}
        if before is not None:
            after = store_time(server)
            saves = after["count"] - before["count"]
            entry["save_ms_per_step"] = 1e3 * (after["sum"] - before["sum"]) / saves if saves else None
            entry["save_ms_per_prompt"] = 1e3 * (after["sum"] - before["sum"]) / (2 * samples)
        return entry
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model dir (default: the qwen3next demo model, built if missing)")
    parser.add_argument("--size", type=int, default=8000, help="prompt tokens")
    parser.add_argument("--samples", type=int, default=5, help="cold prompts per server, back to back and settled")
    parser.add_argument("--rounds", type=int, default=2, help="times the variant list runs")
    parser.add_argument("--settle", type=float, default=4.0, help="seconds before each settled sample")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--kvmesh-python", default=sys.executable, help="interpreter of the KVMesh servers")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.size <= STEP_TOKENS or args.samples < 1 or args.rounds < 1:
        parser.error(f"--size must be above {STEP_TOKENS}, --samples and --rounds at least 1")
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
            for variant in args.variants:
                print(f"== round {number + 1}: {variant}", file=sys.stderr, flush=True)
                results[variant] = run_variant(variant, model, work, mesh, prompts, env, args.size, args.samples,
                                               args.settle, args.kvmesh_python)
            base = results.get("vllm")
            for variant, entry in results.items():
                if base is not None:
                    for kind in ("back_to_back", "settled"):
                        entry[f"{kind}_over_vllm"] = entry[f"{kind}_median_s"] / base[f"{kind}_median_s"]
            rounds.append(results)
    finally:
        mesh.stop()
    summary = {"model": str(model), "size": args.size, "samples": args.samples, "settle_s": args.settle,
               "kvmesh_python": args.kvmesh_python, "rounds": rounds}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for number, results in enumerate(rounds, 1):
        for variant, entry in results.items():
            ratios = "  ".join(f"{kind} {entry[f'{kind}_median_s']:.3f} s ({entry.get(f'{kind}_over_vllm', 1):.2f}x)"
                               for kind in ("back_to_back", "settled"))
            save = f"  save {entry['save_ms_per_step']:.2f} ms/step" if entry.get("save_ms_per_step") else ""
            print(f"round {number} {variant:7s} {ratios}{save}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
