"""What checking a chunk before its scatter costs (issue 23: every chunk a load takes, the CPU tier's included,
is checked against its span: key, token count, format, dtype, size, shape).

Llama-3.1-8B-shaped KV (32 layers, 8 KV heads, head size 128, bf16) in vLLM's CPU layout, 256-token chunks. The
figure is the time of `CacheEngine.meta_mismatch` on a CPU-tier chunk's meta, per chunk; beside it, measured in
the same run, the copy it guards: a plain torch copy of one chunk's bytes (what the scatter moves at best), and a
dict lookup of the key (what the CPU tier's `acquire` costs at least). Prints one JSON line, then a summary.

    python benchmarks/meta_check.py [--chunk-size 256] [--checks 200000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.kv_layout import detect_layout
from kvmesh.shared.wire.keys import KeyParams

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 128


def per_call(fn: object, calls: int, repeat: int = 5) -> float:
    """Median seconds per call of `fn()` over `repeat` runs of `calls` calls."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()  # type: ignore[operator]
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--checks", type=int, default=200_000)
    args = parser.parse_args()
    torch.set_num_threads(1)

    blocks = 2 * args.chunk_size // BLOCK
    buffer = torch.zeros(LAYERS, blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.bfloat16)
    caches = {f"model.layers.{i}.self_attn": buffer[i] for i in range(LAYERS)}
    layout = detect_layout(caches, BLOCK, "CPU_ATTN", cpu_isa="vec")
    config = EngineConfig(chunk_size=args.chunk_size, max_local_cpu_size=4 * layout.chunk_nbytes(args.chunk_size) / 2**30)
    with build_engine(config, KeyParams("bench-model", ""), layout, use_mesh=False) as engine:
        tokens = list(range(args.chunk_size))
        slots = torch.arange(args.chunk_size, dtype=torch.int64)
        token_api.store(engine, tokens, kv_caches=caches, slot_mapping=slots)
        span = engine.hasher.spans(tokens)[0]
        ref = engine.cpu.acquire(span.key)
        assert ref is not None and engine.meta_mismatch(span, ref.meta) is None
        meta = ref.meta
        check = per_call(lambda: engine.meta_mismatch(span, meta), args.checks)
        held = {span.key: ref}
        lookup = per_call(lambda: held.get(span.key), args.checks)
        src = torch.randn(layout.chunk_nbytes(args.chunk_size) // 2).to(torch.bfloat16)
        dst = torch.empty_like(src)
        copy = per_call(lambda: dst.copy_(src), 200)
        ref.release()
    result = {"benchmark": "meta_check", "chunk_tokens": args.chunk_size,
              "chunk_mib": round(layout.chunk_nbytes(args.chunk_size) / 2**20, 2),
              "check_us": round(check * 1e6, 3), "dict_lookup_us": round(lookup * 1e6, 3),
              "chunk_copy_us": round(copy * 1e6, 1), "check_per_copy": round(check / copy, 5)}
    print(json.dumps(result))
    print(f"check per chunk {check * 1e6:.2f} us = {check / copy:.2%} of copying the chunk's "
          f"{result['chunk_mib']} MiB ({copy * 1e6:.0f} us, the ceiling of its scatter); "
          f"{check / lookup:.1f}x a dict lookup ({lookup * 1e6:.3f} us)")


if __name__ == "__main__":
    main()
