"""What sealing a Redis value costs (issue 40: every value the Redis tier writes is encrypted with AES-256-GCM on
the engine, its key name and header as associated data, under a key derived from the sharing domain's secret; every
load decrypts and checks the tag).

One 256-token chunk of Llama-3.1-8B-shaped KV (32 MiB). The figures are `RedisAuth.seal_value` (a put: encrypt into
a sealing buffer the tier reuses) and `open_value_into` (a get: decrypt into the engine's buffer) over the chunk; beside them, measured
in the same run, the machine's own ceilings: a plain memcpy of the bytes (numpy), and the xxh3 checksum the chunk
already carries. Prints one JSON line, then a summary.

    python benchmarks/redis_seal.py [--mib 32] [--repeat 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import numpy as np

from kvmesh.shared import protocol

from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.redis_keys import NONCE_BYTES, VALUE_TAG_BYTES, RedisAuth


def seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `fn()` over `repeat` runs (after one warm-up)."""
    fn()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=32, help="chunk size in MiB (default: 32)")
    parser.add_argument("--repeat", type=int, default=9, help="runs per figure (default: 9)")
    args = parser.parse_args()
    nbytes = args.mib * 2**20
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    out = np.empty_like(data)
    view = memoryview(data).cast("B")
    meta = protocol.ChunkMeta(key=b"k" * 16, num_tokens=256, shape=[nbytes], dtype="uint8", fmt="bench",
                              nbytes=nbytes, checksum=chunk_file.checksum(view))
    header = chunk_file.encode_header(meta)
    auth = RedisAuth(b"s" * 32, "benchmark")
    name = "kvmesh:chunk:{bench}"
    sealed = memoryview(bytearray(nbytes + VALUE_TAG_BYTES))  # reused, as the tier reuses its buffers
    seal = seconds(lambda: auth.seal_value(name, header, view, sealed), args.repeat)
    head = auth.seal_value(name, header, view, sealed)  # the value the opens read (each seal draws a nonce)
    nonce = head[len(head) - len(header) - NONCE_BYTES: len(head) - len(header)]
    unseal = seconds(lambda: auth.open_value_into(name, header, nonce, sealed, memoryview(out).cast("B")),
                     args.repeat)
    if not np.array_equal(out, data):
        raise RuntimeError("the bytes did not come back")
    memcpy = seconds(lambda: np.copyto(out, data), args.repeat)
    xxh3 = seconds(lambda: chunk_file.checksum(view), args.repeat)
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    result = {"chunk_bytes": nbytes, "seal_gb_s": round(gbps(seal), 3), "open_gb_s": round(gbps(unseal), 3),
              "memcpy_gb_s": round(gbps(memcpy), 3), "xxh3_gb_s": round(gbps(xxh3), 3),
              "seal_vs_memcpy": round(memcpy / seal, 3), "open_vs_memcpy": round(memcpy / unseal, 3),
              "seal_ms_per_chunk": round(seal * 1e3, 2), "open_ms_per_chunk": round(unseal * 1e3, 2)}
    print(json.dumps(result))
    print(f"AES-256-GCM of a {args.mib} MiB value: seal {result['seal_ms_per_chunk']} ms, {result['seal_gb_s']} GB/s "
          f"= {result['seal_vs_memcpy']}x memcpy; open {result['open_ms_per_chunk']} ms, {result['open_gb_s']} GB/s = "
          f"{result['open_vs_memcpy']}x memcpy ({result['memcpy_gb_s']} GB/s); xxh3 {result['xxh3_gb_s']} GB/s")

if __name__ == "__main__":
    main()
