"""What authenticating a Redis value costs (issue 24: every value the Redis tier writes or loads carries an
HMAC-SHA256 over its key name, header and bytes, keyed by the sharing domain's secret).

One 256-token chunk of Llama-3.1-8B-shaped KV (32 MiB). The figure is `RedisAuth.value_tag` over the chunk, as
the tier computes it on a put and checks it on a get; beside it, measured in the same run, the machine's own
ceilings: a plain memcpy of the bytes (numpy), and the xxh3 checksum the chunk already carries. Prints one JSON
line, then a summary.

    python benchmarks/redis_mac.py [--mib 32] [--repeat 9]
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
from kvmesh.shared.wire.redis_keys import RedisAuth


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
    mac = seconds(lambda: auth.value_tag("kvmesh:chunk:{bench}", header, view), args.repeat)
    memcpy = seconds(lambda: np.copyto(out, data), args.repeat)
    xxh3 = seconds(lambda: chunk_file.checksum(view), args.repeat)
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    result = {"chunk_bytes": nbytes, "mac_gb_s": round(gbps(mac), 3), "memcpy_gb_s": round(gbps(memcpy), 3),
              "xxh3_gb_s": round(gbps(xxh3), 3), "mac_vs_memcpy": round(memcpy / mac, 3),
              "mac_ms_per_chunk": round(mac * 1e3, 2)}
    print(json.dumps(result))
    print(f"HMAC-SHA256 of a {args.mib} MiB value: {result['mac_ms_per_chunk']} ms, {result['mac_gb_s']} GB/s = "
          f"{result['mac_vs_memcpy']}x memcpy ({result['memcpy_gb_s']} GB/s); xxh3 {result['xxh3_gb_s']} GB/s")


if __name__ == "__main__":
    main()
