#!/usr/bin/env python
"""Cold vs warm time to first token (TTFT) at 2k, 8k and 16k prompt tokens: KVMesh next to the CPU peers.

    python benchmarks/ttft.py [--sizes 2048 8192 16384] [--model DIR] [--peers ...] [--out benchmarks/results]

One run, one machine, the `--bench` demo model (6 layers, hidden 512, bf16; built if missing), vLLM CPU
servers started one after the other with the same flags (--max-model-len, --max-num-batched-tokens = the
longest prompt so every prompt is one prefill step, which ExampleConnector needs to store complete KV):

  no-connector       vLLM alone, its prefix cache off: warm = cold (the recompute baseline)
  vllm-prefix-cache  vLLM's own prefix cache (--enable-prefix-caching): the floor, KV never leaves the cache
  ExampleConnector   vLLM's built-in debug connector (safetensors files per layer under a tmp dir)
  kvmesh-cpu         KVMeshConnector, warm from the CPU tier (vLLM prefix cache off)
  kvmesh-disk        the same server: the CPU tier cleared through the controller's /clear, warm from the disk
                     store (the OS page cache is not dropped); a short request after each clear lets vLLM's
                     scheduler see it before the sample
KVMesh's warm samples start once the cold samples' chunks reached the disk store (their write-behind would
otherwise share the 2 cores with the first warm samples); `cpu_hits_loaded_async` counts CPU-tier hits that still
waited for vLLM's next step (with KV cache groups: none, adapter/cpu_mirror.py).
  LMCache            LMCache 0.5.6 in multiprocess mode (its CPU path): `lmcache.v1.multiprocess.server` (L1 CPU
                     cache, pinned next to the mesh) and vLLM's LMCacheMPConnector; skipped (listed under
                     "not_run") when lmcache is not installed (pip install --no-deps lmcache sortedcontainers
                     aiofile caio aiofiles; or with pip --target into /work/lmcache-site, put on PYTHONPATH for
                     the LMCache server and its vLLM only)

Compute is pinned: vLLM's OpenMP threads on core 0 (VLLM_CPU_OMP_THREADS_BIND=0), this client and the mesh
services (`kvmesh up`: NATS, controller, disk store) on the other cores. Each cold sample uses a fresh prompt (a
unique first chunk, so no cache can hold it); warm samples repeat the prompt of the last cold sample. TTFT is
the time from sending a streaming completion to its first token. A cold sample asks for 8 tokens, a warm sample
for one: with more, vLLM's API server (on the cores it shares with this client, NATS and KVMesh's threads) often
streams the first token only together with the last, which adds the whole decode to the warm figure at random
(on a 2-core machine 11 to 12 of 30 warm samples of 8 tokens, on every tree tried; the first token then comes at
about 105 ms instead of 42 at 2k). After the warm samples one more warm request of 8 tokens, not timed, checks
the output: `warm_output_equals_cold` says it equals the cold sample's text and every warm token its first one.
Writes `ttft.json` (every sample, medians, ratios) and `ttft.png` (if matplotlib is installed) to --out (`--name`
changes "ttft"), and prints the summary JSON.

Hybrid models (`--model` a directory built by `scripts/make_demo_model.py --preset hybrid`, Gemma2 with
sliding-window and full layers): vLLM keeps its hybrid KV cache manager on with every peer here that supports it
(KVMesh, its own prefix cache, LMCache's MP connector), so the figures compare the same KV memory layout:

    python benchmarks/ttft.py --model ~/.cache/kvmesh-tests/models/hybrid --sizes 2048 8000 --name ttft-hybrid

Models with recurrent state (`--preset qwen3next`: Gated DeltaNet and full-attention layers): vLLM keeps a state
per block only with its prefix cache on ("align" mode) and only where a step ends, so KVMesh's server keeps its
prefix cache on (emptied before each warm sample), LMCache's too, and every peer prefills in chunk-sized steps:

    python benchmarks/ttft.py --model ~/.cache/kvmesh-tests/models/qwen3next --sizes 2048 8000 --name ttft-gdn \
        --max-num-batched-tokens 256 --reset-prefix-cache

Where a warm sample's time goes (`warm_breakdown_ms` per peer and size, and `breakdown`: KVMesh's CPU-tier hit
against vLLM's own warm hit, part by part): each server's Prometheus histograms read around every warm sample
(PARTS): the client's TTFT = api (HTTP, streaming, the API server) + the server's TTFT; the server's = queue (in
the engine core until scheduled) + prefill (scheduled -> first token: KVMesh's lookup, its start_load_kv, the
forward) + engine_other; and KVMesh's own lookup and load (`lmcache:time_to_lookup`, `lmcache:time_to_retrieve`).
With aligned sizes (a multiple of the block size + 1: 8193, 16385) vLLM's warm hit computes one token from its
prefix cache with no copy, the in-memory limit; at 2048 or 8000 it computes the prompt's last block again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent

from vllm_peers import (CHUNK, KVMESH, Server, cpu_name, free_port, lmcache_connector, lmcache_env,  # noqa: E402
                        pin_to, start_lmcache_server, start_mesh)
from make_demo_model import ensure_model, long_text  # noqa: E402
from kvmesh.services.engine.config.engine_config import CPU_LOAD_PIPELINE, EngineConfig  # noqa: E402

PEERS = ["no-connector", "vllm-prefix-cache", "ExampleConnector", "LMCache", "kvmesh"]


class Prompts:
    """Exact-length token prompts with a unique first chunk per (label, n)."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.body = self.tokenizer.encode(long_text(), add_special_tokens=False)
        self.counter = 0

    def fresh(self, size: int, label: str) -> list[int]:
        self.counter += 1
        salt = self.tokenizer.encode(f"[{label} #{self.counter} {time.time_ns()}] ", add_special_tokens=False)
        ids = [self.tokenizer.bos_token_id, *salt]
        need = size - len(ids)
        body = self.body
        while len(body) < need:
            body = body + self.body
        return ids + body[:need]


WARM_TOKENS = 1  # a warm sample's completion: its first token is its last (see the docstring)

# Where a warm sample's time goes, from the server's own histograms: each part's sum over its count, per sample.
# The client's TTFT = api (HTTP, streaming, the API server) + the server's TTFT; the server's TTFT = queue + prefill
# + engine_other (the request's way into the engine core, the output's way back).
PARTS = {
    "server_ttft_ms": "vllm:time_to_first_token_seconds",
    "queue_ms": "vllm:request_queue_time_seconds",  # in the engine until vLLM stamps it scheduled
    # scheduled -> first token: KVMesh's lookup (it runs after that stamp), start_load_kv, the forward
    "prefill_ms": "vllm:request_prefill_time_seconds",
    "kvmesh_lookup_ms": "lmcache:time_to_lookup",  # KVMesh's scheduler lookup of the request
    "kvmesh_load_ms": "lmcache:time_to_retrieve",  # its start_load_kv (with the layer pipeline: the planning)
}
RECORDED_BY = "vllm:request_prefill_time_seconds"  # recorded when the request ends: the sample's parts are in


def sample_parts(server: Server, before: dict[str, tuple[float, float]], ttft_s: float,
                 loaded: bool = True) -> dict[str, float]:
    """The sample's parts in ms (PARTS), once the server recorded the request (a generous deadline). `loaded`:
    the request loaded KV (a warm sample), whose record is waited for too."""
    # KVMesh's server: its load is recorded too (the worker's stats come with a later step's output)
    waited = [RECORDED_BY, *(["lmcache:time_to_retrieve"] if loaded and "lmcache:time_to_retrieve" in before
                             else [])]

    def counts(snapshot: dict[str, tuple[float, float]]) -> list[float]:
        return [snapshot.get(name, (0.0, 0.0))[1] for name in waited]

    deadline = time.monotonic() + 30
    after = server.histograms(("vllm:", "lmcache:"))
    while time.monotonic() < deadline and any(a <= b for a, b in zip(counts(after), counts(before))):
        time.sleep(0.05)
        after = server.histograms(("vllm:", "lmcache:"))
    parts: dict[str, float] = {}
    for part, name in PARTS.items():
        total, count = after.get(name, (0.0, 0.0))
        total_before, count_before = before.get(name, (0.0, 0.0))
        if count > count_before:
            parts[part] = (total - total_before) / (count - count_before) * 1e3
    if "server_ttft_ms" in parts:
        parts["api_ms"] = ttft_s * 1e3 - parts["server_ttft_ms"]
        if "queue_ms" in parts and "prefill_ms" in parts:
            parts["engine_other_ms"] = parts["server_ttft_ms"] - parts["queue_ms"] - parts["prefill_ms"]
    return parts


def median_parts(samples: list[dict[str, float]]) -> dict[str, float]:
    names = {name for sample in samples for name in sample}
    return {name: round(statistics.median(s[name] for s in samples if name in s), 3) for name in sorted(names)}


def measure(server: Server, prompts: Prompts, sizes: list[int], cold_repeats: int, warm_repeats: int,
            warm_equals_cold: bool = False, after_cold: Callable[[list[int]], None] | None = None,
            extra_warm: Callable[[list[int], int, str], dict[str, Any]] | None = None,
            before_warm: Callable[[], None] = lambda: None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for size in sizes:
        cold, warm, cold_texts, warm_texts, parts = [], [], [], [], []
        prompt: list[int] = []
        for _ in range(cold_repeats):
            prompt = prompts.fresh(size, server.name)
            seconds, text = server.stream(prompt)
            cold.append(seconds)
            cold_texts.append(text)
        if after_cold is not None:
            after_cold(prompt)
        reference = cold_texts[-1]
        if not warm_equals_cold:
            for _ in range(warm_repeats):
                before_warm()
                recorded = server.histograms(("vllm:", "lmcache:"))
                seconds, text = server.stream(prompt, max_tokens=WARM_TOKENS)
                warm.append(seconds)
                warm_texts.append(text)
                parts.append(sample_parts(server, recorded, seconds))
            before_warm()
            warm_texts.append(server.stream(prompt)[1])  # the untimed check of a whole warm completion
        entry = {"cold_s": cold, "warm_s": warm or cold, "cold_median_s": statistics.median(cold),
                 "warm_median_s": statistics.median(warm or cold),
                 "warm_output_equals_cold": same_output(reference, warm_texts)}
        if parts:
            entry["warm_breakdown_ms"] = median_parts(parts)
        if extra_warm is not None:
            entry.update(extra_warm(prompt, size, reference))
        results[str(size)] = entry
        print(f"  {server.name} {size}: cold {entry['cold_median_s']:.3f}s warm {entry['warm_median_s']:.3f}s",
              flush=True)
    return results


def same_output(cold: str, warm: list[str]) -> bool:
    """Every warm text is the cold text (a whole completion) or its start (a WARM_TOKENS sample)."""
    return all(text == cold or (len(text) < len(cold) and cold.startswith(text)) for text in warm)


def warm_up(server: Server, prompts: Prompts, max_len: int) -> None:
    """First requests pay one-time costs (graph capture, allocator growth): not part of any sample."""
    for size in (600, min(2500, max_len - 16)):
        server.stream(prompts.fresh(size, f"{server.name}-warmup"), max_tokens=2)


def run_kvmesh(model: Path, work: Path, sizes: list[int], prompts: Prompts, env: dict[str, str], max_len: int,
               cold_repeats: int, warm_repeats: int, async_loading: bool, batched_tokens: int,
               reset_prefix_cache: bool, encrypt_stores: bool = True,
               cpu_load_pipeline: str = "auto") -> tuple[dict[str, Any], dict[str, Any]]:
    """KVMesh: CPU-tier warm, then disk warm after clearing the CPU tier through the controller. With
    `reset_prefix_cache` vLLM's own prefix cache stays on (a model with recurrent state needs it) and is emptied
    before every warm sample, so each warm figure is a load by KVMesh."""
    import httpx

    mesh = start_mesh(work, disk_gb=8)
    controller = mesh.controller
    instance = "bench"
    config = mesh.engine_yaml(work / "kvmesh.yaml", instance, cpu_gb=2, disk_gb=8, async_loading=async_loading)
    config.write_text(config.read_text() + f"encrypt_stores: {str(encrypt_stores).lower()}\n"
                      f"cpu_load_pipeline: {cpu_load_pipeline}\n")
    server = None
    try:
        server = Server("kvmesh", model, free_port(), work / "logs", max_len,
                        [*prefix_cache_flags(reset_prefix_cache), "--kv-transfer-config", json.dumps(KVMESH)],
                        {**env, "LMCACHE_CONFIG_FILE": str(config), "VLLM_SERVER_DEV_MODE": "1"}, batched_tokens)
        server.ready()  # inside the try: a server that never comes up is stopped too
        warm_up(server, prompts, max_len)
        empty_vllms_prefix_cache = reset_between(server, reset_prefix_cache)

        def lookup(prompt: list[int]) -> list[Any] | None:
            reply = httpx.post(f"{controller}/lookup", json={"tokens": prompt}, timeout=30).json()
            return reply["layout_info"].get(instance)

        def clear_cpu() -> None:
            httpx.post(f"{controller}/clear", json={"instance_id": instance, "location": "LocalCPUBackend"},
                       timeout=30).raise_for_status()

        def disk_warm(prompt: list[int], size: int, reference: str) -> dict[str, Any]:
            samples, texts = [], []
            for sample in range(warm_repeats + 1):  # the last one: the untimed check of a whole completion
                clear_cpu()
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # the write-behind to disk is asynchronous
                    entry = lookup(prompt)
                    if entry and entry[0] == "LocalDiskBackend" and entry[1] >= size - CHUNK:
                        break
                    time.sleep(0.2)
                else:
                    print(f"  disk store did not report the {size}-token prompt: {lookup(prompt)}", flush=True)
                # one short request, so that vLLM's scheduler sees the clear (its mirror learns of the CPU tier's
                # evictions from a step's output): a load it promised before that would still read the chunks the
                # worker holds for it (adapter/cpu_mirror.py), and this sample would not be the disk store's
                server.stream(prompts.fresh(CHUNK // 2, "flush"), max_tokens=1)
                empty_vllms_prefix_cache()
                if sample == warm_repeats:
                    texts.append(server.stream(prompt)[1])
                    break
                seconds, text = server.stream(prompt, max_tokens=WARM_TOKENS)
                samples.append(seconds)
                texts.append(text)
            return {"disk_warm_s": samples, "disk_warm_median_s": statistics.median(samples),
                    "disk_output_equals_cold": same_output(reference, texts)}

        def disk_chunks() -> int:
            reply = httpx.get(f"{controller}/usage", params={"location": "LocalDiskBackend"}, timeout=30).json()
            return sum(int(module.get("num_chunks") or 0) for module in reply["shared_modules"])

        log = work / "logs" / "kvmesh.log"
        results = {}
        for size in sizes:  # per size: how many CPU-tier hits still waited for vLLM's next step
            before, on_disk = cpu_hits_loaded_async(log), disk_chunks()

            def written(prompt: list[int], at_least: int = on_disk + cold_repeats * (size // CHUNK)) -> None:
                # warm samples start once the cold samples' chunks reached the disk store: on 2 cores their
                # write-behind (sealing, NATS, the store's writes) would otherwise share the first warm samples'
                # cores (seen: 0.154 s, then 0.124, 0.093, 0.087, 0.055 at 8,000 tokens on the hybrid demo)
                deadline = time.monotonic() + 120
                while disk_chunks() < at_least and time.monotonic() < deadline:
                    time.sleep(0.2)

            results.update(measure(server, prompts, [size], cold_repeats, warm_repeats, after_cold=written,
                                   extra_warm=disk_warm, before_warm=empty_vllms_prefix_cache))
            results[str(size)]["cpu_hits_loaded_async"] = cpu_hits_loaded_async(log) - before
        cpu = {size: {k: v for k, v in r.items() if not k.startswith("disk")} for size, r in results.items()}
        disk = {size: {"cold_s": r["cold_s"], "cold_median_s": r["cold_median_s"], "warm_s": r["disk_warm_s"],
                       "warm_median_s": r["disk_warm_median_s"],
                       "warm_output_equals_cold": r["disk_output_equals_cold"]} for size, r in results.items()}
        return cpu, disk
    finally:
        if server is not None:
            server.stop()
        mesh.stop()


ASYNC_LOAD = re.compile(r"loads asynchronously: (\d+) of its (\d+) tokens to load were in the CPU tier")


def cpu_hits_loaded_async(log: Path) -> int:
    """KVMesh's loads whose every token was in the CPU tier but that ran between steps (its scheduler's INFO
    lines): with KV cache groups, hits that could not be promised in-step (adapter/cpu_mirror.py)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return sum(1 for m in ASYNC_LOAD.finditer(text) if int(m[1]) == int(m[2]) > 0)


def prefix_cache_flags(reset: bool) -> list[str]:
    """A connector peer's vLLM prefix cache: off, or on and emptied before each warm sample (`reset_between`)."""
    return ["--enable-prefix-caching" if reset else "--no-enable-prefix-caching"]


def reset_between(server: Server, reset: bool) -> Callable[[], None]:
    """Empties the server's own prefix cache (VLLM_SERVER_DEV_MODE's POST /reset_prefix_cache) when `reset`."""
    import httpx

    def empty() -> None:
        if reset:
            httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()

    return empty


def run_lmcache(model: Path, work: Path, sizes: list[int], prompts: Prompts, env: dict[str, str], max_len: int,
                cold_repeats: int, warm_repeats: int, batched_tokens: int, reset_prefix_cache: bool) -> dict[str, Any]:
    """LMCache's multiprocess server (CPU L1) + vLLM's LMCacheMPConnector."""
    server_proc, port = start_lmcache_server(work, env, l1_gb=2)
    config = lmcache_connector(port)
    server = None
    try:
        server = Server("LMCache", model, free_port(), work / "logs", max_len,
                        [*prefix_cache_flags(reset_prefix_cache), "--kv-transfer-config", json.dumps(config)],
                        {**env, "VLLM_SERVER_DEV_MODE": "1"}, batched_tokens)
        server.ready()
        warm_up(server, prompts, max_len)
        return measure(server, prompts, sizes, cold_repeats, warm_repeats,
                       before_warm=reset_between(server, reset_prefix_cache))
    finally:
        if server is not None:
            server.stop()
        server_proc.stop()


def plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    peers = [p for p in summary["peers"] if summary["peers"][p]]
    sizes = summary["sizes"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4.5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        cold = [summary["peers"][p][str(size)]["cold_median_s"] for p in peers]
        warm = [summary["peers"][p][str(size)]["warm_median_s"] for p in peers]
        xs = range(len(peers))
        ax.bar([x - 0.2 for x in xs], cold, 0.4, label="cold")
        ax.bar([x + 0.2 for x in xs], warm, 0.4, label="warm")
        ax.set_xticks(list(xs), peers, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{size} prompt tokens")
        for x, value in zip(xs, warm):
            ax.annotate(f"{value:.3f}", (x + 0.2, value), ha="center", va="bottom", fontsize=7)
    axes[0][0].legend()
    fig.suptitle(f"TTFT on {summary['machine']['cpu']} ({summary['model']['name']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def model_description(model: Path) -> str:
    """What the model is: the demo builder's preset and shape when it built it, else its architecture."""
    try:
        marker = json.loads((model / "kvmesh_demo.json").read_text())["spec"]
        return "kvmesh demo model " + ", ".join(f"{k} {v}" for k, v in marker.items())
    except (OSError, ValueError, KeyError):
        try:
            return ", ".join(json.loads((model / "config.json").read_text()).get("architectures") or [str(model)])
        except (OSError, ValueError):
            return str(model)


def _last_error(log: str) -> str:
    """The first line of a start-up log that names an exception, vLLM's wrappers last (the root cause; else the
    log's last line)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\b[A-Z]\w*(Error|Exception): ", line) and "WARNING" not in line]
    causes = [line for line in errors if "RuntimeError: Engine core initialization failed" not in line
              and "RuntimeError: Worker failed" not in line]  # vLLM's wrappers name no cause
    return (causes or errors or lines[-1:] or ["no output"])[0][:400]


def overhead_breakdown(peers: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """Per size, where KVMesh's warm CPU-tier hit spends its time beyond vLLM's own warm hit (the prefix cache
    peer; with aligned sizes the in-memory limit): each part's median ms for both, and KVMesh's minus vLLM's."""
    out: dict[str, Any] = {}
    for size in map(str, sizes):
        ours = peers.get("kvmesh-cpu", {}).get(size, {}).get("warm_breakdown_ms")
        limit = peers.get("vllm-prefix-cache", {}).get(size, {}).get("warm_breakdown_ms")
        if not ours or not limit:
            continue
        out[size] = {"kvmesh-cpu": ours, "vllm-prefix-cache": limit,
                     "kvmesh_minus_vllm_ms": {part: round(ours[part] - limit[part], 3) for part in ours
                                              if part in limit}}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--model", type=Path, help="model dir (default: build the --bench demo model)")
    parser.add_argument("--peers", nargs="+", default=PEERS, choices=PEERS)
    parser.add_argument("--cold-repeats", type=int, default=2)
    parser.add_argument("--warm-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--name", default="ttft", help="file name of the results in --out (NAME.json, NAME.png)")
    parser.add_argument("--kvmesh-async-loading", choices=["true", "false"],
                        default=str(EngineConfig().enable_async_loading).lower(),
                        help="KVMesh's enable_async_loading (default: KVMesh's default)")
    parser.add_argument("--kvmesh-encrypt-stores", choices=["true", "false"],
                        default=str(EngineConfig().encrypt_stores).lower(),
                        help="KVMesh's encrypt_stores: the disk store's chunks sealed (default: KVMesh's default)")
    parser.add_argument("--kvmesh-cpu-load-pipeline", choices=sorted(CPU_LOAD_PIPELINE),
                        default=EngineConfig().cpu_load_pipeline,
                        help="KVMesh's cpu_load_pipeline: in-step loads written layer by layer beside the forward "
                             "(default: KVMesh's default)")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="vLLM's, for every peer (default: the longest prompt + 64, each prompt one prefill step)")
    parser.add_argument("--reset-prefix-cache", action="store_true",
                        help="KVMesh's and LMCache's vLLM keep their own prefix cache on, emptied before each warm "
                             "sample (a model with recurrent state, e.g. Qwen3-Next, needs it: vLLM keeps states per "
                             "block only then)")
    args = parser.parse_args(argv)

    model = args.model or ensure_model(Path.home() / ".cache" / "kvmesh-tests" / "models" / "bench", "bench")
    max_len = max(args.sizes) + 64
    batched_tokens = args.max_num_batched_tokens or max_len
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvmesh-ttft-"))
    client_cores = os.sched_getaffinity(0) - {0}
    pin_to(client_cores or {0})
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    prompts = Prompts(model)
    peers: dict[str, Any] = {}
    started = time.time()

    not_run: dict[str, str] = {}

    def simple(name: str, args_: list[str], warm_equals_cold: bool = False) -> None:
        print(f"== {name}", flush=True)
        server = Server(name, model, free_port(), work / "logs", max_len, args_, env, batched_tokens)
        try:
            server.ready()
            warm_up(server, prompts, max_len)
            peers[name] = measure(server, prompts, args.sizes, args.cold_repeats, 1 if warm_equals_cold else
                                  args.warm_repeats, warm_equals_cold=warm_equals_cold)
        except SystemExit:  # it did not start with this model: say why, measure the others
            not_run[name] = f"vLLM did not start: {_last_error(server.child.log.read_text(errors='replace'))}"
            print(f"  {name} not run: {not_run[name]}", flush=True)
        finally:
            server.stop()

    if "no-connector" in args.peers:
        simple("no-connector", ["--no-enable-prefix-caching"], warm_equals_cold=True)
    if "vllm-prefix-cache" in args.peers:
        simple("vllm-prefix-cache", ["--enable-prefix-caching"])
    if "ExampleConnector" in args.peers:
        storage = work / "example-connector"
        storage.mkdir()
        config = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        simple("ExampleConnector", ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(config)])
    lmcache_version: str | None = None
    if "LMCache" in args.peers:
        lm_env, lmcache_version = lmcache_env(env)
        if lm_env is None:
            not_run["LMCache"] = lmcache_version
            lmcache_version = None
        else:
            print("== LMCache", flush=True)
            try:
                peers["LMCache"] = run_lmcache(model, work, args.sizes, prompts, lm_env, max_len, args.cold_repeats,
                                               args.warm_repeats, batched_tokens, args.reset_prefix_cache)
            except SystemExit:  # its vLLM did not start with this model: say why, measure the others
                log = (work / "logs" / "LMCache.log").read_text(errors="replace")
                not_run["LMCache"] = f"vLLM with LMCacheMPConnector did not start: {_last_error(log)}"
                print(f"  LMCache not run: {not_run['LMCache']}", flush=True)
    if "kvmesh" in args.peers:
        print("== kvmesh", flush=True)
        peers["kvmesh-cpu"], peers["kvmesh-disk"] = run_kvmesh(model, work, args.sizes, prompts, env, max_len,
                                                               args.cold_repeats, args.warm_repeats,
                                                               args.kvmesh_async_loading == "true", batched_tokens,
                                                               args.reset_prefix_cache,
                                                               args.kvmesh_encrypt_stores == "true",
                                                               args.kvmesh_cpu_load_pipeline)

    ratios: dict[str, Any] = {}
    for size in map(str, args.sizes):
        row: dict[str, float] = {}
        floor = peers.get("vllm-prefix-cache", {}).get(size, {}).get("warm_median_s")
        base = peers.get("no-connector", {}).get(size, {}).get("cold_median_s")
        ours = peers.get("kvmesh-cpu", {}).get(size)
        if ours and floor:
            row["kvmesh_cpu_warm_over_prefix_cache_floor"] = ours["warm_median_s"] / floor
        if ours and base:
            row["kvmesh_cold_over_no_connector_cold"] = ours["cold_median_s"] / base
        if ours and "kvmesh-disk" in peers and floor:
            row["kvmesh_disk_warm_over_prefix_cache_floor"] = peers["kvmesh-disk"][size]["warm_median_s"] / floor
        for name, result in peers.items():
            if not name.startswith("kvmesh") and ours:
                row[f"kvmesh_cpu_warm_over_{name}_warm"] = ours["warm_median_s"] / result[size]["warm_median_s"]
        ratios[size] = row
    breakdown = overhead_breakdown(peers, args.sizes)
    import torch
    import vllm

    summary = {
        "benchmark": "ttft", "sizes": args.sizes, "peers": peers, "ratios": ratios, "breakdown": breakdown,
        "not_run": not_run,
        "model": {"name": model_description(model), "path": str(model)},
        "setup": {"vllm": vllm.__version__, "torch": torch.__version__, "lmcache": lmcache_version, "max_model_len": max_len,
                  "max_num_batched_tokens": batched_tokens, "reset_prefix_cache": args.reset_prefix_cache,
                  "VLLM_CPU_OMP_THREADS_BIND": "0",
                  "VLLM_CPU_KVCACHE_SPACE_GiB": env["VLLM_CPU_KVCACHE_SPACE"], "chunk_size": CHUNK,
                  "cold_repeats": args.cold_repeats, "warm_repeats": args.warm_repeats,
                  "kvmesh_async_loading": args.kvmesh_async_loading,
                  "kvmesh_encrypt_stores": args.kvmesh_encrypt_stores,
                  "kvmesh_cpu_load_pipeline": args.kvmesh_cpu_load_pipeline,
                  "statistic": "median", "disk_warm_page_cache": "not dropped"},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join([sys.executable, *sys.argv]), "wall_s": round(time.time() - started, 1),
        "logs": str(work / "logs"),
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    if plot(summary, args.out / f"{args.name}.png"):
        print(f"plot: {args.out / (args.name + '.png')}")
    medians = {p: {s: (r[s]["cold_median_s"], r[s]["warm_median_s"]) for s in r} for p, r in peers.items()}
    print(json.dumps({"ratios": ratios, "breakdown": breakdown, "medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
