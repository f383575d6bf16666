"""The whole engine path: store and retrieve a long prompt through `CacheEngine` (CPU tier hits).

Llama-3.1-8B-shaped KV (32 layers, 8 KV heads, head size 128, bf16) in vLLM's CPU layout (one buffer, each layer
``[num_blocks, heads, block_size, 2 * head_size]``), random block-structured slot mappings. Store = hash the
tokens, gather the pages into pool slots, admit them to the CPU tier; retrieve = look the chunks up in the CPU
tier and scatter them into other blocks of the paged cache. The ceiling is a plain torch copy of the same number
of bytes between two preallocated contiguous tensors, measured in the same run; the result is a ratio to it.

    python benchmarks/engine.py [--tokens 8192] [--repeat 7] [--block-size 128] [--chunk-size 256] [--mesh]
                                [--threads 1,2]

`--mesh` runs with an embedded NATS (worker agent registered, admission events published); reads are still
CPU-tier hits and never touch NATS. `--device cuda` puts the paged cache on the GPU in vLLM >= 0.3x's per-token
layout (logical ``[num_blocks, heads, block_size, 2 * head_size]``, physical LBNHC, block 16 by default): store =
gather GPU -> pinned pool, retrieve = scatter pinned pool -> GPU, next to ``copy_`` device -> pinned host and
back of the same bytes. Prints one JSON line, then a human summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from collections.abc import Callable

import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.core.kv_layout import detect_layout
from kvmesh.shared.options_cli import GB
from kvmesh.shared.wire.keys import KeyParams

LAYERS, KV_HEADS, HEAD_SIZE = 32, 8, 128


def block_slots(blocks: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    offsets = torch.arange(block_size).repeat(len(blocks))
    return (blocks.repeat_interleave(block_size) * block_size + offsets)[:num_tokens]


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(engine: CacheEngine, tokens: torch.Tensor, caches: dict[str, torch.Tensor], src: torch.Tensor,
            dst: torch.Tensor, ceiling: tuple[torch.Tensor, torch.Tensor], repeat: int,
            threads: int) -> dict[str, object]:
    """Interleaved timings (engine store, ceiling copy, engine retrieve, ceiling copy back, ...).

    Interleaving makes the engine and the ceiling share the same (noisy, shared) memory bandwidth. `ceiling` is
    (a, b): the store ceiling copies a -> b, the retrieve ceiling b -> a (host -> host on CPU; device -> pinned
    host and back on CUDA).
    """
    torch.set_num_threads(threads)
    near, far = ceiling
    kv_bytes = near.numel()
    sync = torch.cuda.synchronize if near.is_cuda else (lambda: None)

    def copy_out() -> None:
        far.copy_(near, non_blocking=True)
        sync()

    def copy_in() -> None:
        near.copy_(far, non_blocking=True)
        sync()

    token_api.store(engine, tokens, kv_caches=caches, slot_mapping=src)  # warm-up (faults the pool's pages in once)
    token_api.retrieve(engine, tokens, kv_caches=caches, slot_mapping=dst)
    copy_out()
    copy_in()
    store_times: list[float] = []
    retrieve_times: list[float] = []
    out_times: list[float] = []
    in_times: list[float] = []
    lookup_times: list[float] = []
    for _ in range(repeat):
        token_api.clear(engine)
        store_times += timed(lambda: token_api.store(engine, tokens, kv_caches=caches, slot_mapping=src), 1)
        out_times += timed(copy_out, 1)
        retrieve_times += timed(lambda: token_api.retrieve(engine, tokens, kv_caches=caches, slot_mapping=dst), 1)
        in_times += timed(copy_in, 1)
        lookup_times += timed(lambda: token_api.lookup(engine, tokens), 1)
    assert token_api.lookup(engine, tokens) == tokens.numel(), "the prompt was not fully stored"

    def gbps(seconds: list[float]) -> float:
        return kv_bytes / statistics.median(seconds) / 1e9

    return {
        "torch_threads": threads,
        "store_ms": statistics.median(store_times) * 1e3, "store_gbps": gbps(store_times),
        "retrieve_ms": statistics.median(retrieve_times) * 1e3, "retrieve_gbps": gbps(retrieve_times),
        "lookup_ms": statistics.median(lookup_times) * 1e3,
        "ceiling_out_gbps": gbps(out_times), "ceiling_in_gbps": gbps(in_times),
        "store_ratio": gbps(store_times) / gbps(out_times), "retrieve_ratio": gbps(retrieve_times) / gbps(in_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--block-size", type=int, default=0, help="tokens per block (default: 128 CPU, 16 CUDA)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mesh", action="store_true", help="run with an embedded NATS (CPU tier hits only)")
    parser.add_argument("--threads", default="",
                        help="comma-separated torch thread counts to measure (default: 1 and torch's default)")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("KVMESH_LOG_LEVEL", "WARNING"))
    default_threads = torch.get_num_threads()
    thread_counts = ([int(t) for t in args.threads.split(",")] if args.threads
                     else sorted({1, default_threads}))
    cuda = args.device == "cuda"
    device = torch.device(args.device)

    bs, n = args.block_size or (16 if cuda else 128), args.tokens
    blocks_per_prompt = -(-n // bs)
    num_blocks = 2 * blocks_per_prompt  # source and destination blocks of the same prompt
    if cuda:  # vLLM >= 0.3x GPU backends: one buffer, physical [L, B, N, H, C], per-layer logical [B, H, N, C]
        buffer = torch.empty(LAYERS, num_blocks, bs, KV_HEADS, 2 * HEAD_SIZE, dtype=torch.bfloat16, device=device)
        caches = {f"model.layers.{i}.self_attn.attn": buffer[i].permute(0, 2, 1, 3) for i in range(LAYERS)}
        backend, isa = "FLASH_ATTN", None
    else:  # vLLM's CPU backend: physical = logical [L, B, H, N, C]
        buffer = torch.empty(LAYERS, num_blocks, KV_HEADS, bs, 2 * HEAD_SIZE, dtype=torch.bfloat16, device=device)
        caches = {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(LAYERS)}
        backend, isa = "CPU_ATTN", "vec"
    buffer.view(torch.int16).random_()  # every byte touched: no page faults inside the timings
    layout = detect_layout(caches, bs, backend, cpu_isa=isa)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(num_blocks, generator=gen)
    src = block_slots(order[:blocks_per_prompt], bs, n).to(device)
    dst = block_slots(order[blocks_per_prompt:], bs, n).to(device)
    tokens = torch.randint(0, 128_000, (n,), generator=gen)
    num_chunks = -(-n // args.chunk_size)
    chunk_bytes = layout.chunk_nbytes(args.chunk_size)
    kv_bytes = LAYERS * 2 * KV_HEADS * HEAD_SIZE * 2 * n  # the prompt's K and V, what both paths move
    near = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    near.random_()
    far = torch.empty(kv_bytes, dtype=torch.uint8, pin_memory=cuda)
    far.copy_(near)  # both touched: no page faults inside the timings

    config = EngineConfig(chunk_size=args.chunk_size, max_local_cpu_size=(num_chunks * chunk_bytes + 2**20) / GB,
                          lmcache_instance_id="bench-engine")
    engine = build_engine(config, KeyParams("meta-llama/Llama-3.1-8B-Instruct", ""), layout, use_mesh=args.mesh,
                          device=device)
    try:
        if args.mesh:
            engine.wait_connected(10)
        runs = [measure(engine, tokens, caches, src, dst, (near, far), args.repeat, t) for t in thread_counts]
        shm, pinned, copier = engine.pool.segment is not None, engine.pool.pinned, engine.copier.backend
    finally:
        engine.close()
        torch.set_num_threads(default_threads)
    # whole blocks moved (n is a multiple of the block size). Random bf16 holds NaN patterns: compare bits.
    ok = torch.equal(buffer[:, order[:blocks_per_prompt].to(device)].view(torch.int16),
                     buffer[:, order[blocks_per_prompt:].to(device)].view(torch.int16))
    result = {
        "benchmark": "engine", "tokens": n, "chunk_size": args.chunk_size, "block_size": bs,
        "shape": f"{LAYERS}x{KV_HEADS}x{HEAD_SIZE} bf16", "bytes": kv_bytes, "chunks": num_chunks,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "layout": layout.name, "copier": copier,
        "mesh": args.mesh, "pool_in_shared_memory": shm, "pool_pinned": pinned, "repeat": args.repeat,
        "bit_exact": ok, "runs": runs,
    }
    print(json.dumps(result))
    for run in runs:
        print(f"{n} tokens ({kv_bytes / 2**30:.2f} GiB), {run['torch_threads']} torch thread(s): store "
              f"{run['store_gbps']:.2f} GB/s ({run['store_ratio']:.2f}x torch copy {run['ceiling_out_gbps']:.2f}), "
              f"retrieve {run['retrieve_gbps']:.2f} GB/s ({run['retrieve_ratio']:.2f}x torch copy "
              f"{run['ceiling_in_gbps']:.2f}), lookup {run['lookup_ms']:.2f} ms")
    if not ok:
        raise SystemExit("retrieved blocks differ from the stored ones")


if __name__ == "__main__":
    main()
