"""The Redis remote tier (RedisTier) against a bare redis-py client on the same Redis, in the same run; prints JSON.

One redis-server (Debian's, started here on a free loopback port, no persistence, no maxmemory) and one event
loop. Rounds alternate: bare `SET` / `GET` of the chunks' bytes with `redis.asyncio`, then the same bytes through
`RedisTier.put` / `get_into` (the chunk-file header, the bytes sealed with AES-256-GCM, the claim script, the write
into a temporary key moved into place; on get the header check and the decryption, which checks the tag, into a
preallocated destination, as into an engine slot). The Redis is flushed before each round's puts, so both write new keys. Figures are medians over rounds;
the ratio is bare time / tier time (1.0: as fast as the bare client). A tier put is timed with and without the
chunk's checksum, which the engine's write-behind computes once per chunk before it puts to any store.

    python benchmarks/redis_tier.py --total-mib 512 --chunk-mib 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test suite's redis-server helper

from support.redis_server import RedisServer  # noqa: E402

from kvmesh.services.engine.tiers.redis import RedisTier  # noqa: E402
from kvmesh.shared import protocol  # noqa: E402
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.redis_url import parse_redis_url  # noqa: E402
from kvmesh.services.engine.tiers.base import ChunkBuffer  # noqa: E402


def chunks(count: int, nbytes: int) -> list[tuple[protocol.ChunkMeta, bytearray]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        data = bytearray(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
        meta = protocol.ChunkMeta(key=i.to_bytes(16, "little"), num_tokens=256, shape=[nbytes], dtype="uint8",
                                  fmt="bench", nbytes=nbytes, checksum=chunk_file.checksum(data))
        out.append((meta, data))
    return out


async def bare_round(client: object, items: list[tuple[protocol.ChunkMeta, bytearray]]) -> tuple[float, float]:
    await client.flushall()  # type: ignore[attr-defined]
    start = time.perf_counter()
    for meta, data in items:
        await client.set(f"raw:{meta.key.hex()}", memoryview(data))  # type: ignore[attr-defined]
    put = time.perf_counter() - start
    start = time.perf_counter()
    for meta, data in items:
        value = await client.get(f"raw:{meta.key.hex()}")  # type: ignore[attr-defined]
        assert len(value) == meta.nbytes
    return put, time.perf_counter() - start


async def tier_round(tier: RedisTier, client: object, items: list[tuple[protocol.ChunkMeta, bytearray]],
                     out: bytearray) -> tuple[float, float, float]:
    await client.flushall()  # type: ignore[attr-defined]
    checksum_s = 0.0
    start = time.perf_counter()
    for meta, data in items:
        t = time.perf_counter()
        await asyncio.to_thread(chunk_file.checksum, data)  # what the write-behind does before a put
        checksum_s += time.perf_counter() - t
        assert await tier.put(meta, ChunkBuffer(memoryview(data)))
    put = time.perf_counter() - start
    start = time.perf_counter()
    for meta, data in items:
        assert await tier.get_into(meta.key, ChunkBuffer(memoryview(out))) == meta
    get = time.perf_counter() - start
    assert out[: items[-1][0].nbytes] == items[-1][1]
    return put, put - checksum_s, get


async def main(args: argparse.Namespace) -> dict[str, object]:
    nbytes = args.chunk_mib * 2**20
    items = chunks(max(1, args.total_mib // args.chunk_mib), nbytes)
    out = bytearray(nbytes)
    with RedisServer() as server:
        from redis.asyncio import Redis

        client = Redis(host="127.0.0.1", port=server.port, socket_timeout=60)
        tier = RedisTier(parse_redis_url(server.url), "engine.bench.bench", timeout=60.0)
        bare: list[tuple[float, float]] = []
        ours: list[tuple[float, float, float]] = []
        try:
            await bare_round(client, items[:1])  # warm both paths (connections, scripts)
            await tier_round(tier, client, items[:1], out)
            for _ in range(args.rounds):
                bare.append(await bare_round(client, items))
                ours.append(await tier_round(tier, client, items, out))
        finally:
            await tier.close()
            await client.aclose()
    total = len(items) * nbytes
    bare_put, bare_get = (statistics.median(b[i] for b in bare) for i in (0, 1))
    put, put_no_sum, get = (statistics.median(o[i] for o in ours) for i in (0, 1, 2))
    gbps = lambda seconds: round(total / seconds / 1e9, 3)  # noqa: E731
    return {
        "chunks": len(items), "chunk_mib": args.chunk_mib, "rounds": args.rounds,
        "bare_set_GBps": gbps(bare_put), "bare_get_GBps": gbps(bare_get),
        "tier_put_GBps": gbps(put), "tier_put_without_checksum_GBps": gbps(put_no_sum), "tier_get_GBps": gbps(get),
        "put_ratio": round(bare_put / put, 3), "put_ratio_without_checksum": round(bare_put / put_no_sum, 3),
        "get_ratio": round(bare_get / get, 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=512, help="bytes moved per round (default 512)")
    parser.add_argument("--chunk-mib", type=int, default=32, help="chunk size (default 32)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
