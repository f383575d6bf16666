#!/usr/bin/env python
"""Prefill/decode: the consumer pulling a prompt's KV from the producer when its request comes (what KVMesh does)
against the KV pushed into the consumer's CPU tier ahead of its request (issue 27: "pushed ahead or pulled,
measure which is faster here").

    python benchmarks/pd_push_pull.py [--lengths 2048 8192] [--repeats 3] [--model DIR] [--out PATH]

One run, one machine, set up as benchmarks/p2p_ttft.py: `kvmesh up --no-disk --no-remote`, two vLLM CPU servers
with the `--bench` demo model and vLLM's prefix cache off, A a kv_producer and B a kv_consumer (enable_pd), both
vLLMs' compute on core 0, this client and the mesh on the other cores. Per length and repeat, two fresh prompts:

  pull  A prefills P as `kvmesh pd-proxy` asks it to (max_tokens 1, kv_transfer_params do_remote_decode); B gets
        P with the kv_transfer_params A answered: its lookup names A's workers and its load streams P's chunks
        from A's CPU tier (the P2P stream) before its first token.
  push  A prefills Q the same way; the mesh then moves Q's chunks into B's CPU tier (the controller's `/move`
        from A's LocalCPUBackend to B's with should_copy: B's workers stream them from A's CPU tier, the transfer
        a push would make, answered once they arrived); then B gets Q with no kv_transfer_params: a hit in its
        own CPU tier.

Figures, medians over the repeats: prefill_s (A's request), transfer_s (push: the /move request), decode_ttft_s
(B's time to first token), after_prefill_s = transfer_s + decode_ttft_s (what differs between the two ways: the
prefill is the same work) and total_s = prefill_s + after_prefill_s, the time from the proxy's first request to
the client's first token when the transfer follows the prefill (a producer pushes its chunks once its forward
stored them). The ratio push / pull of after_prefill_s says which is faster; a push could only win where its
transfer overlaps something else (the prefill itself, or the time before the consumer's request arrives).
Each vLLM's OpenMP threads keep spinning on the shared core after a forward, which instances on their own
machines never see: each step waits `--settle` seconds first, not counted in any figure.

Proof, per sample: B's log has a "Retrieved N tokens" line for its request, N at least the prompt less one
chunk; /move answered at least as many tokens; B's lmcache:num_p2p_read_chunks counter grew by at least the
chunks the pull requests loaded plus those the moves brought. Prints the JSON; `--out` also writes it. Logs
stay in a temporary directory (named in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from vllm_peers import KVMESH, Server, cpu_name, free_port  # noqa: E402
from ttft import model_description, warm_up  # noqa: E402
from p2p_ttft import (CHUNK, READ_CHUNKS, WAIT_S, counter, engine_yaml, loaded_tokens, prepare,  # noqa: E402
                      run_and_print, start_mesh, timed)

PRODUCER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}  # what kvmesh pd-proxy sends

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192], help="prompt lengths in tokens")
parser.add_argument("--repeats", type=int, default=3, help="samples per length, each with fresh prompts")
parser.add_argument("--model", type=Path, help="model dir (default: build the --bench demo model)")
parser.add_argument("--max-tokens", type=int, default=8, help="tokens B generates per request")
parser.add_argument("--cpu-gb", type=float, default=1.0, help="each instance's KVMesh CPU tier")
parser.add_argument("--settle", type=float, default=1.5,
                    help="seconds before each timed step, for the other vLLM's OpenMP threads to sleep")
parser.add_argument("--out", type=Path, help="also write the JSON here")


def main(argv: list[str] | None = None) -> int:
    """Progress goes to stderr; stdout gets the JSON only."""
    return run_and_print(parser, run, argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    bench = prepare(args, "kvmesh-pd-push-pull-")
    model, max_len, work, env, prompts, started = (bench.model, bench.max_len, bench.work, bench.env, bench.prompts,
                                                   bench.started)
    mesh, nats_port, controller = start_mesh(work)
    servers: dict[str, Server] = {}
    try:
        for name, role in (("pd-a", "kv_producer"), ("pd-b", "kv_consumer")):
            config = engine_yaml(work / f"{name}.yaml", name, nats_port, args.cpu_gb, pd=True)
            servers[name] = Server(name, model, free_port(), work / "logs", max_len,
                                   ["--no-enable-prefix-caching", "--kv-transfer-config",
                                    json.dumps({**KVMESH, "kv_role": role})],
                                   {**env, "LMCACHE_CONFIG_FILE": str(config), "VLLM_CPU_OMP_THREADS_BIND": "0"})
        a, b = servers["pd-a"], servers["pd-b"]
        for server in (a, b):  # started together above: their start-ups overlap
            server.ready()

        def prefill(prompt: list[int]) -> tuple[float, dict[str, Any]]:
            """A's prefill as the proxy asks for it: (seconds, the kv_transfer_params it answered)."""
            body = {"model": a.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": PRODUCER_PARAMS}
            begun = time.perf_counter()
            response = httpx.post(f"{a.url}/v1/completions", json=body, timeout=600)
            seconds = time.perf_counter() - begun
            response.raise_for_status()
            params = response.json().get("kv_transfer_params")
            if not params:
                raise RuntimeError(f"A answered no kv_transfer_params: {response.text[:300]}")
            return seconds, params

        def pull(size: int) -> dict[str, Any]:
            prompt = prompts.fresh(size, "pull")
            prefill_s, params = prefill(prompt)
            time.sleep(args.settle)
            decode = timed(b, prompt, args.max_tokens, {"kv_transfer_params": params})
            loaded = loaded_tokens(b, decode, size - CHUNK)
            return {"prefill_s": prefill_s, "transfer_s": 0.0, "decode_ttft_s": decode.ttft_s,
                    "after_prefill_s": decode.ttft_s, "total_s": prefill_s + decode.ttft_s, "loaded_tokens": loaded,
                    "p2p_chunks": loaded // CHUNK}

        def push(size: int) -> dict[str, Any]:
            prompt = prompts.fresh(size, "push")
            prefill_s, _ = prefill(prompt)
            time.sleep(args.settle)
            body = {"old_position": [a.child.name, "LocalCPUBackend"], "new_position": [b.child.name,
                    "LocalCPUBackend"], "tokens": prompt, "should_copy": True}
            begun = time.perf_counter()
            moved = httpx.post(f"{controller}/move", json=body, timeout=600)
            transfer_s = time.perf_counter() - begun
            moved.raise_for_status()
            moved_tokens = moved.json()["num_tokens"]
            if moved_tokens < size - CHUNK:
                raise RuntimeError(f"/move brought {moved.json()} of a {size}-token prompt")
            time.sleep(args.settle)
            decode = timed(b, prompt, args.max_tokens)
            loaded = loaded_tokens(b, decode, size - CHUNK)
            return {"prefill_s": prefill_s, "transfer_s": transfer_s, "decode_ttft_s": decode.ttft_s,
                    "after_prefill_s": transfer_s + decode.ttft_s, "total_s": prefill_s + transfer_s + decode.ttft_s,
                    "loaded_tokens": loaded, "p2p_chunks": -(-moved_tokens // CHUNK)}

        for server in (a, b):
            warm_up(server, prompts, max_len)
        pull(min(600, max_len - 16))  # B's stream connections to A, its first peer load
        push(min(600, max_len - 16))
        timed(b, prompts.fresh(300, "counters"), 2)  # an idle vLLM reports its counters with its next step
        reads_before = counter(b, READ_CHUNKS)

        results: dict[str, Any] = {}
        p2p_chunks = 0
        for size in args.lengths:
            samples: dict[str, list[dict[str, Any]]] = {"pull": [], "push": []}
            for _ in range(args.repeats):
                samples["pull"].append(pull(size))
                samples["push"].append(push(size))
                p2p_chunks += samples["pull"][-1]["p2p_chunks"] + samples["push"][-1]["p2p_chunks"]
            row: dict[str, Any] = {}
            for way, rows in samples.items():
                row[way] = {"samples": rows, **{f"{key}_median": statistics.median(r[key] for r in rows)
                                                for key in ("prefill_s", "transfer_s", "decode_ttft_s",
                                                            "after_prefill_s", "total_s")}}
            row["push_over_pull_after_prefill"] = (row["push"]["after_prefill_s_median"]
                                                   / row["pull"]["after_prefill_s_median"])
            results[str(size)] = row
            print(f"  {size}: after the prefill, pull {row['pull']['after_prefill_s_median']:.3f}s (B's TTFT), push "
                  f"{row['push']['after_prefill_s_median']:.3f}s (transfer {row['push']['transfer_s_median']:.3f}s "
                  f"+ B's TTFT {row['push']['decode_ttft_s_median']:.3f}s)", file=sys.stderr, flush=True)

        timed(b, prompts.fresh(300, "counters"), 2)
        deadline = time.monotonic() + WAIT_S
        while counter(b, READ_CHUNKS) - reads_before < p2p_chunks and time.monotonic() < deadline:
            time.sleep(0.5)
        proof = {"b_p2p_read_chunks": counter(b, READ_CHUNKS) - reads_before,
                 "b_p2p_read_chunks_of_pulls_and_moves": p2p_chunks, "every_b_request_loaded": True,
                 "every_move_arrived": True}
        if proof["b_p2p_read_chunks"] < p2p_chunks:
            raise RuntimeError(f"B's P2P read counter did not grow by the chunks its pulls and moves read: {proof}")
    finally:
        for server in servers.values():
            server.stop()
        mesh.stop()

    import torch
    import vllm

    return {
        "benchmark": "pd_push_pull", "lengths": args.lengths, "repeats": args.repeats, "statistic": "median",
        "results": results, "proof": proof,
        "model": {"name": model_description(model), "path": str(model)},
        "setup": {"vllm": vllm.__version__, "torch": torch.__version__, "max_model_len": max_len,
                  "vllm_prefix_cache": False, "chunk_size": CHUNK, "kvmesh_cpu_gb": args.cpu_gb,
                  "max_tokens": args.max_tokens, "settle_s": args.settle, "mesh": "kvmesh up --no-disk --no-remote",
                  "VLLM_CPU_OMP_THREADS_BIND": {"a": "0", "b": "0"},
                  "VLLM_CPU_KVCACHE_SPACE_GiB": env["VLLM_CPU_KVCACHE_SPACE"]},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join([sys.executable, *sys.argv]), "wall_s": round(time.time() - started, 1),
        "logs": str(work / "logs"),
    }


if __name__ == "__main__":
    sys.exit(main())
