"""Remote store throughput against a raw TCP loopback stream measured in the same run; prints JSON.

Three processes besides nats-server: this one is the engine-side client (RemoteStoreClient), the store runs
as `python -m kvmesh.services.remote_store`, and a raw peer (this file with `--raw-peer`) serves the ceiling:
the same bytes in the same chunks over TCP with `loop.sock_sendall` / `loop.sock_recv_into` into a
preallocated buffer, one request and a 1-byte answer per chunk, as the store does. Rounds alternate raw and
store (the machine's speed drifts); raw figures are medians over its rounds.

    python benchmarks/remote_store.py --total-gib 1 --chunk-mib 32 [--prefault-gb 1] [--fault-ahead-gb 0]

Store puts are timed twice: "cold" into a fresh store (every buffer is page-faulted for the first time, unless the
store was started with `--prefault-gb`: then they are carved from memory it faulted in before serving) and "warm"
with new keys into the full store (each put evicts the LRU chunk and reuses its buffer: the steady state of a
cache). A timed put includes computing the chunk's checksum, as the engine's write-behind
does once per chunk before it puts (the store verifies the bytes against it). Gets go into a preallocated
destination; every byte is compared with the source after the run. With `--nats-mib N` the raw peer also moves N
MiB through NATS in frames of 1 and 8 MiB, the alternative data path (the reason the store uses a stream: see
shared/wire/stream_wire.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

import numpy as np

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, _die_with_parent
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KEY_BYTES

MiB = 1024 * 1024
GiB = 1024 * MiB
STORE_ID = "bench-remote"
CALLER = protocol.Principal.engine("bench").producer("bench")  # puts and gets as one engine worker would
_RAW_HEAD = struct.Struct("<cQ")  # op (P put / G get), chunk bytes


# ---- the raw peer (its own process) ---------------------------------------------------------------------------
async def raw_peer(nats_url: str, chunk_bytes: int) -> None:
    """Serve raw puts/gets on a TCP port (printed on stdout) and NATS frames, until stdin closes."""
    loop = asyncio.get_running_loop()
    buffer = np.zeros(chunk_bytes, dtype=np.uint8)  # preallocated and faulted in: the ceiling's receiver
    view = memoryview(buffer)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)

    async def serve(sock: socket.socket) -> None:
        head = bytearray(_RAW_HEAD.size)
        while True:
            got = 0
            while got < len(head):
                n = await loop.sock_recv_into(sock, memoryview(head)[got:])
                if not n:
                    return
                got += n
            op, nbytes = _RAW_HEAD.unpack(head)
            if op == b"P":
                got = 0
                while got < nbytes:
                    got += await loop.sock_recv_into(sock, view[got:nbytes])
                await loop.sock_sendall(sock, b"k")
            else:
                await loop.sock_sendall(sock, view[:nbytes])

    async def accept() -> None:
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            loop.create_task(serve(sock))

    nc = await bus.connect(nats_url, "bench-raw-peer")
    frames: dict[str, int] = {}

    async def on_frame(msg) -> None:  # one frame of a NATS put; the last one is a request
        offset = frames.get(msg.subject, 0)
        view[offset:offset + len(msg.data)] = msg.data
        frames[msg.subject] = 0 if msg.reply else offset + len(msg.data)
        if msg.reply:
            await msg.respond(b"k")

    async def on_get(msg) -> None:  # a NATS get: the chunk in frames of the requested size to the inbox
        frame = int(msg.data)
        for offset in range(0, chunk_bytes, frame):
            await nc.publish(msg.reply, bytes(view[offset:offset + frame]))

    await nc.subscribe("bench.frames.put", cb=on_frame, pending_msgs_limit=bus.PENDING_MSGS_LIMIT,
                       pending_bytes_limit=bus.PENDING_BYTES_LIMIT)
    await nc.subscribe("bench.frames.get", cb=on_get, pending_msgs_limit=bus.PENDING_MSGS_LIMIT,
                       pending_bytes_limit=bus.PENDING_BYTES_LIMIT)
    await nc.flush()
    task = loop.create_task(accept())
    print(listener.getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # the benchmark closes our stdin when done
    task.cancel()
    await nc.close()


# ---- the client side ------------------------------------------------------------------------------------------
class RawClient:
    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None

    async def connect(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        self.sock = sock

    async def put(self, data: memoryview) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, _RAW_HEAD.pack(b"P", len(data)))
        await loop.sock_sendall(self.sock, data)
        assert await loop.sock_recv(self.sock, 1) == b"k"

    async def get(self, out: memoryview) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, _RAW_HEAD.pack(b"G", len(out)))
        got = 0
        while got < len(out):
            n = await loop.sock_recv_into(self.sock, out[got:])
            assert n, "raw peer closed"
            got += n

    async def timed_round(self, chunks: list[memoryview], outs: list[memoryview]) -> tuple[float, float]:
        """Every chunk put, then every one read back into `outs`: (put seconds, get seconds)."""
        start = time.perf_counter()
        for data in chunks:
            await self.put(data)
        put = time.perf_counter() - start
        start = time.perf_counter()
        for out in outs:
            await self.get(out)
        return put, time.perf_counter() - start


def chunk_key(tag: int, index: int) -> bytes:
    return tag.to_bytes(8, "little") + index.to_bytes(KEY_BYTES - 8, "little")


async def run(args: argparse.Namespace) -> dict:
    chunk_bytes = int(args.chunk_mib * MiB)
    count = max(1, int(args.total_gib * GiB) // chunk_bytes)
    total = count * chunk_bytes
    rng = np.random.default_rng(7)
    block = rng.integers(0, 256, MiB, dtype=np.uint8)
    source = np.tile(block, -(-total // MiB))[:total]  # faulted in by np.tile
    source[::chunk_bytes] = np.arange(count, dtype=np.uint8)  # distinct chunks
    destination = np.zeros(total, dtype=np.uint8)
    chunks = [memoryview(source[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(count)]
    outs = [memoryview(destination[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(count)]

    with EmbeddedNats() as nats_server:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        store = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.services.remote_store", "--nats-url", nats_server.url,
             "--max-size-gb", str(total / GiB), "--store-id", STORE_ID, "--log-level", "WARNING",
             *(["--prefault-gb", str(args.prefault_gb)] if args.prefault_gb else []),
             *(["--fault-ahead-gb", str(args.fault_ahead_gb)] if args.fault_ahead_gb is not None else [])],
            stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)
        peer = subprocess.Popen(
            [sys.executable, __file__, "--raw-peer", "--nats-url", nats_server.url, "--chunk-mib", str(args.chunk_mib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, preexec_fn=_die_with_parent)
        try:
            port = int(peer.stdout.readline())
            nc = await bus.connect(nats_server.url, "bench-client")
            client = RemoteStoreClient(nc, [STORE_ID], CALLER, request_timeout=5.0)
            deadline = time.monotonic() + 30
            while not await client.stats():
                if time.monotonic() > deadline or store.poll() is not None:
                    raise RuntimeError("the remote store did not come up")
                await asyncio.sleep(0.1)
            raw = RawClient(port)
            await raw.connect()

            async def store_puts(tag: int) -> float:
                start = time.perf_counter()
                for i, data in enumerate(chunks):
                    meta = protocol.ChunkMeta(key=chunk_key(tag, i), num_tokens=256, shape=[chunk_bytes],
                                              dtype="uint8", fmt="bench", nbytes=chunk_bytes,
                                              checksum=chunk_file.checksum(data))
                    if not await client.put(meta, ChunkBuffer(data)):
                        raise RuntimeError(f"put {i} of pass {tag} failed")
                return time.perf_counter() - start

            async def store_gets(tag: int) -> float:
                destination.fill(1)  # nothing left over from a previous pass can pass the comparison
                start = time.perf_counter()
                for i, out in enumerate(outs):
                    if await client.get_into(chunk_key(tag, i), ChunkBuffer(out)) is None:
                        raise RuntimeError(f"get {i} of pass {tag} missed")
                elapsed = time.perf_counter() - start
                if not np.array_equal(destination, source):
                    raise RuntimeError(f"pass {tag}: bytes read back differ from those written")
                return elapsed

            raw_puts, raw_gets = [], []
            await raw.timed_round(chunks, outs)  # warm-up: connection, caches
            for kind in ("raw", "store-cold", "raw", "store-warm", "raw"):
                if kind == "raw":
                    p, g = await raw.timed_round(chunks, outs)
                    raw_puts.append(p)
                    raw_gets.append(g)
                elif kind == "store-cold":
                    put_cold = await store_puts(1)
                    get_a = await store_gets(1)
                else:
                    put_warm = await store_puts(2)  # new keys into the full store: evict + reuse buffers
                    get_b = await store_gets(2)
            stats = (await client.stats())[0]
            nats_frames = await measure_nats_frames(nc, args, chunk_bytes) if args.nats_mib else {}
            await client.close()
            await nc.close()
        finally:
            for process in (store, peer):
                if process.poll() is None:
                    if process is peer:
                        peer.stdin.close()
                    else:
                        process.terminate()
            for process in (store, peer):
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    gbps = lambda seconds: round(total / seconds / 1e9, 3)  # noqa: E731
    raw_put, raw_get = statistics.median(raw_puts), statistics.median(raw_gets)
    get = statistics.median([get_a, get_b])
    return {
        "benchmark": "remote_store", "total_bytes": total, "chunk_bytes": chunk_bytes, "chunks": count,
        "cpus": os.cpu_count(), "verified_bit_exact": True,
        "raw_tcp_put_gbps": gbps(raw_put), "raw_tcp_get_gbps": gbps(raw_get),
        "raw_tcp_put_gbps_rounds": [gbps(s) for s in raw_puts], "raw_tcp_get_gbps_rounds": [gbps(s) for s in raw_gets],
        "store_put_warm_gbps": gbps(put_warm), "store_put_cold_gbps": gbps(put_cold), "store_get_gbps": gbps(get),
        "store_get_gbps_passes": [gbps(get_a), gbps(get_b)],
        "ratio_put_warm": round(raw_put / put_warm, 3), "ratio_put_cold": round(raw_put / put_cold, 3),
        "ratio_get": round(raw_get / get, 3),
        "store_buffers_allocated": stats.details.get("buffers_allocated"),
        "store_prefaulted_bytes": stats.details.get("prefaulted_bytes", 0),
        "store_fault_ahead_gb": args.fault_ahead_gb,  # None: the store's default
        **nats_frames,
    }


async def measure_nats_frames(nc, args: argparse.Namespace, chunk_bytes: int) -> dict:
    """Put and get `--nats-mib` MiB through NATS in frames (publish frames, request on the last)."""
    chunk = memoryview(np.random.default_rng(3).integers(0, 256, chunk_bytes, dtype=np.uint8))
    out = memoryview(np.zeros(chunk_bytes, dtype=np.uint8))
    rounds = max(1, int(args.nats_mib * MiB) // chunk_bytes)
    result = {}
    for frame_mib in (1, 8):
        frame = frame_mib * MiB
        start = time.perf_counter()
        for _ in range(rounds):
            for offset in range(0, chunk_bytes, frame):
                data = bytes(chunk[offset:offset + frame])
                if offset + frame >= chunk_bytes:
                    await nc.request("bench.frames.put", data, timeout=30)
                else:
                    await nc.publish("bench.frames.put", data)
        put = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(rounds):
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox, pending_msgs_limit=bus.PENDING_MSGS_LIMIT,
                                     pending_bytes_limit=bus.PENDING_BYTES_LIMIT)
            await nc.publish("bench.frames.get", str(frame).encode(), reply=inbox)
            got = 0
            while got < chunk_bytes:
                msg = await sub.next_msg(timeout=30)
                out[got:got + len(msg.data)] = msg.data
                got += len(msg.data)
            await sub.unsubscribe()
        get = time.perf_counter() - start
        moved = rounds * chunk_bytes
        result[f"nats_{frame_mib}mib_frames_put_gbps"] = round(moved / put / 1e9, 3)
        result[f"nats_{frame_mib}mib_frames_get_gbps"] = round(moved / get / 1e9, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-gib", type=float, default=1.0)
    parser.add_argument("--chunk-mib", type=float, default=32.0)
    parser.add_argument("--nats-mib", type=float, default=128.0, help="MiB moved through NATS frames (0: skip)")
    parser.add_argument("--prefault-gb", type=float, default=0.0,
                        help="the store's --prefault-gb (memory faulted in at start; up to --total-gib)")
    parser.add_argument("--fault-ahead-gb", type=float, default=None,
                        help="the store's --fault-ahead-gb (default: the store's own; 0: puts into an empty store "
                        "fault their own buffers, as before the background faulting)")
    parser.add_argument("--raw-peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_peer:
        asyncio.run(raw_peer(args.nats_url, int(args.chunk_mib * MiB)))
        return
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
