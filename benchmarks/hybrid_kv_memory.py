#!/usr/bin/env python
"""What vLLM's hybrid KV cache manager gives a sliding-window model, and whether KVMesh keeps it.

    python benchmarks/hybrid_kv_memory.py [--model DIR] [--kv-mib 64] [--requests 12] [--prompt-tokens 4000]

Before KVMesh implemented vLLM's `SupportsHMA`, vLLM turned its hybrid KV cache manager off for our connector: a
sliding-window layer then keeps every token's KV, like a full-attention one. With it on, vLLM frees a
sliding-window layer's blocks once they leave the window, so a request needs less KV memory and more requests
run at once in the same KV space. Three vLLM CPU servers, one after the other, on the same model and the same
fixed KV space (`--kv-cache-memory-bytes`):

  vllm            vLLM alone (hybrid manager on)
  kvmesh          vLLM with KVMeshConnector (hybrid manager on: SupportsHMA)
  kvmesh-hma-off  vLLM with KVMeshConnector and --disable-hybrid-kv-cache-manager (what vLLM did before)

For each: vLLM's own start-up figures (KV cache size in tokens, "maximum concurrency" at --max-model-len), then
`--requests` concurrent greedy completions of distinct `--prompt-tokens`-token prompts (32 tokens each, EOS
ignored) while /metrics is sampled: the most requests running at once, the KV usage, the wall time. The ceiling
next to it: how many such requests fit in the KV space by arithmetic (the model's KV bytes per token and layer,
sliding-window layers counted at their window when the hybrid manager is on), and the ratio to it.
Model: the "hybrid" demo model by default (Gemma2: 2 sliding-window layers of window 128, 2 full-attention
layers, float32), built if missing. Writes benchmarks/results/hybrid_kv_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vllm_peers import KVMESH, Server, cpu_name, free_port  # noqa: E402

from make_demo_model import ensure_model, long_text  # noqa: E402  (scripts/, on the path via vllm_peers)

STARTUP = re.compile(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                     r"([\d.]+)x")
CONFIGS = {
    "vllm": [],
    "kvmesh": ["--kv-transfer-config", json.dumps(KVMESH)],
    "kvmesh-hma-off": ["--kv-transfer-config", json.dumps(KVMESH), "--disable-hybrid-kv-cache-manager"],
}


def kv_bytes_per_token(model: Path) -> tuple[int, int, int, int]:
    """(bytes of one token's K and V in one layer, full-attention layers, sliding-window layers, window)."""
    config = json.loads((model / "config.json").read_text())
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[config.get("torch_dtype") or config.get("dtype")]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_layer = 2 * config["num_key_value_heads"] * head_dim * itemsize
    types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    sliding = sum(t == "sliding_attention" for t in types)
    return per_layer, len(types) - sliding, sliding, int(config.get("sliding_window") or 0)


def run_config(name: str, model: Path, work: Path, args: argparse.Namespace, prompts: list[list[int]],
               env: dict[str, str]) -> dict[str, Any]:
    import httpx

    flags = ["--kv-cache-memory-bytes", str(args.kv_mib * 2**20), "--no-enable-prefix-caching", "--max-num-seqs",
             str(max(args.requests, 1)), "--dtype", "float32", *CONFIGS[name]]
    server = Server(name, model, free_port(), work, args.max_len, flags, env)
    try:
        server.ready()
        log = server.child.log.read_text(errors="replace")
        found = STARTUP.search(log)
        startup = ({"kv_cache_tokens": int(found[1].replace(",", "")), "max_concurrency_reported": float(found[3])}
                   if found else {})
        hma_off = "Turning off hybrid kv cache manager" in log or "--disable-hybrid-kv-cache-manager" in flags
        peak = {"running": 0.0, "kv_usage": 0.0, "samples": 0.0}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    text = httpx.get(f"{server.url}/metrics", timeout=10).text
                except httpx.HTTPError:
                    continue
                peak["samples"] += 1
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        peak["running"] = max(peak["running"], float(line.rsplit(" ", 1)[1]))
                    elif line.startswith("vllm:kv_cache_usage_perc"):
                        peak["kv_usage"] = max(peak["kv_usage"], float(line.rsplit(" ", 1)[1]))
                stop.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            done = list(pool.map(lambda p: server.complete(p, max_tokens=32), prompts))
        wall = time.perf_counter() - started
        stop.set()
        sampler.join(15)
        return {"hybrid_manager": not hma_off, **startup, "peak_running": peak["running"],
                "peak_kv_usage": peak["kv_usage"], "metrics_samples": int(peak["samples"]), "wall_s": wall,
                "tokens_generated": sum(c.tokens for c in done)}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--kv-mib", type=int, default=64, help="KV space of every server, MiB")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    model = args.model or ensure_model(Path.home() / ".cache" / "kvmesh-tests" / "models" / "hybrid", "hybrid")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    body = tokenizer.encode(long_text(), add_special_tokens=False)
    # distinct prompts (each its own start), so nothing is shared between requests
    prompts = [[tokenizer.bos_token_id, *body[i * 997:][:args.prompt_tokens - 1]] for i in range(args.requests)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "VLLM_CPU_KVCACHE_SPACE"))}
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    work = Path(tempfile.mkdtemp(prefix="kvmesh-hybrid-"))
    per_layer, full, sliding, window = kv_bytes_per_token(model)
    budget = args.kv_mib * 2**20
    request_tokens = args.prompt_tokens + 32
    results: dict[str, Any] = {}
    for name in args.configs:
        print(f"== {name}", flush=True)
        result = run_config(name, model, work, args, prompts, env)
        # the ceiling: requests that fit in the KV space by arithmetic (a window's layers hold window + a block
        # of tokens per request with the hybrid manager on; 128-token blocks)
        kept = min(request_tokens, window + 128) if result["hybrid_manager"] and sliding else request_tokens
        per_request = per_layer * (full * request_tokens + sliding * kept)
        result["ceiling_requests"] = budget / per_request
        result["peak_running_over_ceiling"] = result["peak_running"] / result["ceiling_requests"]
        results[name] = result
        print(json.dumps({name: result}), flush=True)
    summary = {"benchmark": "hybrid_kv_memory", "model": str(model), "cpu": cpu_name(), "kv_mib": args.kv_mib,
               "requests": args.requests, "prompt_tokens": args.prompt_tokens, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid_kv_memory.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'server':16} {'hybrid':>6} {'KV tokens':>10} {'reported':>9} {'peak running':>12} {'ceiling':>8} "
          f"{'ratio':>6} {'wall s':>7}")
    for name, r in results.items():
        print(f"{name:16} {str(r['hybrid_manager']):>6} {r.get('kv_cache_tokens', 0):>10} "
              f"{r.get('max_concurrency_reported', 0):>8.2f}x {r['peak_running']:>12.0f} {r['ceiling_requests']:>8.1f} "
              f"{r['peak_running_over_ceiling']:>6.2f} {r['wall_s']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
