"""Chunk-hashing rate for 32k-token prompts, next to the machine's raw blake2b rate over the same bytes.

Plain keys (a text request), and keys with every extra a request can carry (a LoRA adapter, a cache_salt,
eight multimodal items and per-chunk prompt-embeds digests).

    python benchmarks/keys.py [--tokens 32768] [--chunk-size 256] [--repeat 200]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np

from kvmesh.shared.wire.keys import ChunkHasher, KeyExtras, KeyParams


def best_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    hasher = ChunkHasher(KeyParams("meta-llama/Llama-3.1-8B-Instruct", "bfloat16/LBHNC-128"), args.chunk_size)
    rng = np.random.default_rng(0)
    as_array = rng.integers(0, 128_000, args.tokens)
    as_list = [int(t) for t in as_array]
    raw = as_array.astype("<i8").tobytes()
    ceiling = best_seconds(lambda: hashlib.blake2b(raw, digest_size=16).digest(), args.repeat)
    from_list = best_seconds(lambda: hasher.keys(as_list), args.repeat)
    from_array = best_seconds(lambda: hasher.keys(as_array), args.repeat)
    num_chunks = -(-args.tokens // args.chunk_size)
    items = 8
    extras = KeyExtras(lora_id="files:" + "ab" * 16, cache_salt="tenant-42",
                       mm_identifiers=[f"{i:064x}" for i in range(items)],
                       mm_offsets=[i * args.tokens // items for i in range(items)], mm_lengths=[576] * items,
                       embeds_digests=[bytes(16)] * num_chunks)
    with_extras = best_seconds(lambda: hasher.keys(as_array, extras), args.repeat)
    result = {
        "tokens": args.tokens, "chunk_size": args.chunk_size,
        "list_tokens_per_s": args.tokens / from_list, "list_ms": from_list * 1e3,
        "array_tokens_per_s": args.tokens / from_array, "array_ms": from_array * 1e3,
        "raw_blake2b_tokens_per_s": args.tokens / ceiling,
        "array_ratio_to_raw_blake2b": ceiling / from_array,
        "extras_tokens_per_s": args.tokens / with_extras, "extras_ms": with_extras * 1e3,
        "extras_ratio_to_raw_blake2b": ceiling / with_extras,
    }
    print(json.dumps(result))
    print(f"chunk keys for {args.tokens} tokens: {result['list_tokens_per_s'] / 1e6:.1f} M tokens/s from a list "
          f"({from_list * 1e3:.2f} ms), {result['array_tokens_per_s'] / 1e6:.1f} M tokens/s from an array; "
          f"raw blake2b over the same bytes {result['raw_blake2b_tokens_per_s'] / 1e6:.1f} M tokens/s "
          f"(ratio {result['array_ratio_to_raw_blake2b']:.2f}); with every extra (LoRA, salt, {items} images, "
          f"prompt embeds) {result['extras_tokens_per_s'] / 1e6:.1f} M tokens/s "
          f"(ratio {result['extras_ratio_to_raw_blake2b']:.2f})")


if __name__ == "__main__":
    main()
