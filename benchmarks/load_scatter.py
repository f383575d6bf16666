#!/usr/bin/env python
"""One CPU-tier load into vLLM's CPU (LBHNC) paged cache, three ways in one process, rounds alternating:

  per-chunk  the chunks scattered one by one (`PagedCopier.scatter` per chunk: how loads ran before issue 38)
  together   `ChunkLoad.scatter`, which hands the whole load to `PagedCopier.scatter_chunks` (what loads do now)
  copies     the same chunks acquired the same way, then only their copies (one `copy_` per chunk, no slot
             checks): the floor for this chunk format

    python benchmarks/load_scatter.py [--tokens 16384] [--rounds 15]

The bench model's shape (benchmarks/ttft.py: 6 layers, 2 KV heads, head size 64, block 128, bf16), chunks of 256
tokens, one buffer for all layers as vLLM allocates it, destination blocks consecutive. No mesh: the engine's CPU
tier only. torch runs one thread, as in vLLM's worker pinned to one core. Prints one JSON object (medians and
minima in ms).
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
from kvmesh.services.engine.core.chunk_load import release_after_copies
from kvmesh.services.engine.core.kv_layout import detect_layout
from kvmesh.shared.wire.keys import KeyParams

LAYERS, HEADS, HEAD_SIZE, BLOCK, CHUNK = 6, 2, 64, 128, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="a multiple of the block size (128)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    blocks = args.tokens // BLOCK
    buffer = torch.zeros(LAYERS, 3 * blocks, HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.bfloat16)
    caches = [buffer[layer] for layer in range(LAYERS)]
    layout = detect_layout({str(i): c for i, c in enumerate(caches)}, BLOCK, "CPU_ATTN")
    config = EngineConfig(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=1.0)
    engine = build_engine(config, KeyParams("bench", layout.chunk_format()), layout, use_mesh=False)

    def slots(first_block: int) -> torch.Tensor:
        ids = torch.arange(first_block, first_block + blocks)
        return (ids.repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(blocks))

    tokens = list(range(args.tokens))
    token_api.store(engine, tokens, kv_caches=caches, slot_mapping=slots(0))
    spans = engine.hasher.spans(tokens)
    dst = slots(blocks)
    pages = buffer.view(LAYERS, 3 * blocks, -1)

    def per_chunk() -> None:
        load = engine.load(spans, dst)
        refs = load._take(0, None)
        for span, ref in zip(load.spans, refs):
            engine.copier.scatter(load._view(span, ref), caches, dst[span.start:span.end], 0)
        release_after_copies(caches, refs)

    def together() -> None:
        engine.load(spans, dst).scatter(caches, dst)

    def copies() -> None:
        load = engine.load(spans, dst)
        refs = load._take(0, None)
        per = CHUNK // BLOCK
        for i, (span, ref) in enumerate(zip(load.spans, refs)):
            pages[:, blocks + per * i:blocks + per * (i + 1)].copy_(load._view(span, ref).view(LAYERS, per, -1))
        release_after_copies(caches, refs)

    ways = {"per_chunk": per_chunk, "together": together, "copies": copies}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            started = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - started)
    engine.close()
    print(json.dumps({"tokens": args.tokens, "chunks": len(spans),
                      "bytes": args.tokens // CHUNK * layout.chunk_nbytes(CHUNK), "rounds": args.rounds,
                      **{f"{name}_ms": {"median": round(statistics.median(t) * 1e3, 2), "min": round(min(t) * 1e3, 2)}
                         for name, t in times.items()}}))


if __name__ == "__main__":
    main()
