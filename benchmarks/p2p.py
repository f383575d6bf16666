"""P2P load throughput (`PeerTier.get_from`) against a raw TCP loopback stream of the same bytes in the same run;
prints JSON.

    python benchmarks/p2p.py [--total-gib 1] [--chunk-mib 2] [--rounds 3] [--tls] [--out PATH]

Two engine processes on one embedded NATS, as two vLLM instances on one host (no controller is needed: the
loading engine names the holder, as a lookup answer would):

  * the serving engine, this file with `--serve`, in its own process: a CacheEngine with enable_p2p whose CPU
    tier holds N chunks of C MiB (256 tokens each, in a synthetic vLLM CPU layout: bf16, blocks of 16, 8 KV
    heads of 128 per layer, so C layers; keys from its own hasher over random tokens, the meta the engine
    writes for them, random bytes with every 4 KiB page stamped with the chunk's index). Its PeerServer streams
    them from its own stream loop thread, computing each chunk's checksum on the way out, as for any chunk only
    the CPU tier holds (the write-behind computes it only for the stores).
  * the loading engine, this process: a CacheEngine with enable_p2p whose peer tier reads every chunk with
    `get_from` into slots of its own pool, on its NATS loop, the way a fetch does (`StorageManager._get_many`):
    a sliding window of `fetch_concurrency` (4) reads in flight, over the peer tier's kept stream connections
    (`p2p_stream_connections`, 4). Also one chunk at a time.

Ceiling ("raw"): the serving engine also runs a bare TCP server on that stream loop that sends chunk i straight from
the same pool slot on a 12-byte request (no ticket, no header message, no meta, no checksum on either end); the
loading engine's NATS loop reads it with `recv_exactly` into the same destination slots, with the same
concurrency (1 connection, or 4 connections with a window of 4 reads). So raw and P2P move the same bytes
between the same memory on the same two event loops; what differs is the P2P protocol: NATS-negotiated tickets
(once per connection), msgpack headers, the xxh3 checksum on both ends, the stream pool.

With `--tls`, a second pair of engines does the same with TLS on both P2P ports (a CA and an `engine`
certificate made here: the TLS handshake, then AES-GCM frames, shared/wire/tls_socket.py); the two pairs' rounds
alternate, and `tls_to_clear` is the TLS pair's P2P throughput over the clear pair's (the goal: >= 0.7), beside
each pair's own raw ceiling.

Rounds alternate raw and P2P (raw-1, P2P-1, raw-4, P2P-4) after one untimed warm-up round (connections,
page faults); figures are medians over `--rounds`. Before every pass the destination slots are zeroed, and after
it every byte is compared with what the serving engine holds, and every P2P chunk's meta with what the loading
engine expects for its key (the check a fetch makes before anything is scattered into vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import numpy as np
import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.core.kv_layout import KVLayout, detect_layout
from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.peer import PeerTier, PeerWorker
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, _die_with_parent
from kvmesh.shared.options_cli import GB
from kvmesh.shared.protocol import PEER, ChunkMeta
from kvmesh.shared.tls import TlsMaterial
from kvmesh.shared.wire.keys import ChunkKey, KeyParams
from kvmesh.shared.wire.stream_wire import StreamError, recv_exactly, tune_socket

MiB = 1024 * 1024
CHUNK_TOKENS = 256
HEADS, HEAD_SIZE, BLOCK = 8, 128, 16  # one layer of a 256-token bf16 chunk: 256 * 2 * 8 * 128 * 2 B = 1 MiB
UNIT = CHUNK_TOKENS * 2 * HEAD_SIZE * 2  # bytes of one KV head of one layer in a chunk (128 KiB)
PARAMS = KeyParams(model="bench-p2p-model", kv_format="")
SEED = 7
RAW_REQUEST = struct.Struct("<IQ")  # chunk index, bytes
FETCH_CONCURRENCY = EngineConfig().fetch_concurrency
GOAL = 0.7
T = TypeVar("T")

log = logging.getLogger("bench.p2p")


# ---- what both engines agree on -------------------------------------------------------------------------------
def synthetic_layout(chunk_mib: float) -> KVLayout:
    """A vLLM CPU layout (LBHNC, bf16, blocks of 16) whose 256-token chunk is `chunk_mib` MiB."""
    units = chunk_mib * MiB / UNIT
    if units < 1 or units != int(units):
        raise SystemExit(f"--chunk-mib must be a multiple of {UNIT / MiB} (got {chunk_mib})")
    units = int(units)
    layers, heads = (units // HEADS, HEADS) if units % HEADS == 0 else (1, units)
    caches = {f"model.layers.{i}.self_attn": torch.zeros(1, heads, BLOCK, 2 * HEAD_SIZE, dtype=torch.bfloat16)
              for i in range(layers)}
    return detect_layout(caches, BLOCK, "CPU_ATTN", cpu_isa="vec")


def engine_config(instance: str, nats_url: str, chunks: int, chunk_bytes: int,
                  tls_dir: str | None = None) -> EngineConfig:
    """`tls_dir`: a TlsMaterial directory with an `engine` certificate: the P2P port is TLS-only with it, and the
    peers' ports are verified against its CA."""
    slot = -(-chunk_bytes // 4096) * 4096
    tls = {}
    if tls_dir is not None:
        files = TlsMaterial(tls_dir).files("engine")
        tls = {"p2p_tls_cert": str(files.cert), "p2p_tls_key": str(files.key), "p2p_tls_ca": str(files.ca)}
    # generous request timeout: a loaded 2-core machine; it bounds a stalled transfer, never a throughput
    return EngineConfig(chunk_size=CHUNK_TOKENS, local_cpu=True, max_local_cpu_size=(chunks * slot + 100) / GB,
                        lmcache_instance_id=instance, nats_url=nats_url, enable_p2p=True, request_timeout_secs=10.0,
                        **tls)


def chunk_tokens(chunks: int) -> list[int]:
    return np.random.default_rng(SEED).integers(0, 50_000, chunks * CHUNK_TOKENS).tolist()


def base_bytes(chunk_bytes: int) -> np.ndarray:
    return np.random.default_rng(SEED + 1).integers(0, 256, chunk_bytes, dtype=np.uint8)


def fill_chunk(out: np.ndarray, base: np.ndarray, index: int) -> None:
    """Chunk `index`'s bytes: `base` with the first 4 bytes of every 4 KiB page set to the index."""
    out[:] = base
    out.view(np.uint32)[::1024] = index


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def started_engine(config: EngineConfig, layout: KVLayout) -> CacheEngine:
    engine = build_engine(config, PARAMS, layout)
    try:
        if not engine.wait_connected(60):
            raise RuntimeError(f"engine {config.lmcache_instance_id} did not reach NATS")
        assert engine.storage is not None
        wait_for(lambda: engine.storage.lower(PEER) is not None, 30, "the peer tier")
    except BaseException:
        engine.close()
        raise
    return engine


# ---- the serving engine (its own process) ---------------------------------------------------------------------
async def start_raw_server(views: list[memoryview]) -> tuple[socket.socket, list[asyncio.Task[None]]]:
    """The ceiling's sender, on the serving engine's stream loop: chunk i from its slot, on request."""
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    tasks: list[asyncio.Task[None]] = []

    async def serve(sock: socket.socket) -> None:
        head = bytearray(RAW_REQUEST.size)
        try:
            while True:
                await recv_exactly(sock, memoryview(head))
                index, nbytes = RAW_REQUEST.unpack(head)
                await loop.sock_sendall(sock, views[index][:nbytes])
        except (StreamError, OSError):
            pass
        finally:
            sock.close()

    async def accept() -> None:
        while True:
            sock, _ = await loop.sock_accept(listener)
            tune_socket(sock)
            tasks.append(loop.create_task(serve(sock)))

    tasks.append(loop.create_task(accept()))
    return listener, tasks


async def stop_raw_server(listener: socket.socket, tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    listener.close()


def serve(args: argparse.Namespace) -> None:
    """Fill the CPU tier, print (one JSON line) who holds what and the raw port, serve until stdin closes, then
    print what was served."""
    layout = synthetic_layout(args.chunk_mib)
    chunk_bytes = layout.chunk_nbytes(CHUNK_TOKENS)
    chunks = args.chunks
    engine = started_engine(engine_config(f"bench-p2p-server{args.instance_suffix}", args.nats_url, chunks,
                                          chunk_bytes, args.tls_dir), layout)
    refs = []
    listener = tasks = stream_loop = None
    try:
        assert engine.hasher is not None and engine.cpu is not None and engine.nats_loop is not None
        assert engine.mesh.peer_server is not None and engine.mesh.peer_server.server.listening
        base = base_bytes(chunk_bytes)
        spans = engine.hasher.spans(chunk_tokens(chunks))
        assert len(spans) == chunks
        for index, span in enumerate(spans):
            slot = engine.cpu.allocate()
            if slot is None:
                raise RuntimeError(f"the serving engine's pool holds fewer than {chunks} chunks")
            fill_chunk(slot.tensor.numpy()[:chunk_bytes], base, index)
            if not engine.cpu.put(engine._chunk_meta(span), slot):
                raise RuntimeError(f"chunk {index} not admitted to the CPU tier")
        for span in spans:  # held for the raw server (its bytes are the CPU tier's, in place)
            ref = engine.cpu.acquire(span.key)
            assert ref is not None
            refs.append(ref)
        views = [ref.slot.chunk_buffer(ref.meta.nbytes).view for ref in refs]
        stream_loop = engine.mesh.peer_server.loop  # the P2P stream's own loop: raw and P2P send from the same one
        assert stream_loop is not None
        listener, tasks = asyncio.run_coroutine_threadsafe(start_raw_server(views), stream_loop).result(10)
        print(json.dumps({"instance_id": engine.config.lmcache_instance_id, "worker_id": engine.worker_id,
                          "keys": [span.key.hex() for span in spans], "chunk_bytes": chunk_bytes,
                          "raw_port": listener.getsockname()[1], "peer_endpoint": engine.mesh.peer_server.endpoint}),
              flush=True)
        sys.stdin.read()  # the benchmark closes our stdin when done
        assert engine.storage is not None
        stats = engine.storage.stats
        served = ("p2p_served_chunks", "p2p_served_bytes", "p2p_served_misses")
        print(json.dumps({key: stats[key] for key in served}), flush=True)
    finally:
        if listener is not None and tasks is not None and stream_loop is not None:
            asyncio.run_coroutine_threadsafe(stop_raw_server(listener, tasks), stream_loop).result(10)
        for ref in refs:
            ref.release()
        engine.close()


# ---- the loading engine (this process) ------------------------------------------------------------------------
class Loader:
    """The timed reads, run on the loading engine's NATS loop."""

    def __init__(self, peers: PeerTier, holder: PeerWorker, keys: list[ChunkKey], buffers: list[ChunkBuffer],
                 raw_port: int, chunk_bytes: int) -> None:
        self.peers = peers
        self.holder = holder
        self.keys = keys
        self.buffers = buffers
        self.raw_port = raw_port
        self.chunk_bytes = chunk_bytes
        self.raw: list[socket.socket] = []
        self.free_raw: list[socket.socket] = []

    async def connect_raw(self, count: int) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(count):
            sock = socket.socket()
            tune_socket(sock)
            await loop.sock_connect(sock, ("127.0.0.1", self.raw_port))
            self.raw.append(sock)

    def close_raw(self) -> None:
        for sock in self.raw:
            sock.close()
        self.raw = []

    async def _raw_get(self, index: int) -> None:
        sock = self.free_raw.pop()  # one request at a time per connection, like a stream pool's
        try:
            await asyncio.get_running_loop().sock_sendall(sock, RAW_REQUEST.pack(index, self.chunk_bytes))
            await recv_exactly(sock, self.buffers[index].view[:self.chunk_bytes])
        finally:
            self.free_raw.append(sock)

    async def raw_pass(self, concurrency: int) -> float:
        self.free_raw = self.raw[:concurrency]
        start = time.perf_counter()
        await windowed(len(self.keys), concurrency, self._raw_get)
        return time.perf_counter() - start

    async def p2p_pass(self, concurrency: int) -> tuple[float, list[ChunkMeta | None]]:
        start = time.perf_counter()
        metas = await windowed(len(self.keys), concurrency,
                               lambda i: self.peers.get_from(self.holder, self.keys[i], self.buffers[i]))
        return time.perf_counter() - start, metas


async def windowed(count: int, concurrency: int, read: Callable[[int], Awaitable[T]]) -> list[T]:
    """`read(i)` for every i < count, `concurrency` in flight, the next one started as soon as the oldest ends:
    the sliding window of `StorageManager._get_many`."""
    loop = asyncio.get_running_loop()
    window: collections.deque[asyncio.Task[T]] = collections.deque()
    results: list[T] = []
    for index in range(count):
        if len(window) == concurrency:
            results.append(await window.popleft())
        window.append(loop.create_task(read(index)))
    while window:
        results.append(await window.popleft())
    return results


def read_line(process: subprocess.Popen[bytes], timeout: float, what: str) -> dict[str, Any]:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else b""
    if not line:
        raise RuntimeError(f"the serving engine gave no {what} (exit code {process.poll()})")
    return json.loads(line)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


class Pair:
    """A serving engine (its own process) and a loading engine (this process) on one NATS: the unit the passes
    time. `tls_dir`: both P2P ports TLS-only (engine_config)."""

    def __init__(self, args: argparse.Namespace, nats_url: str, layout: KVLayout, chunks: int,
                 tls_dir: str | None = None) -> None:
        self.chunk_bytes = layout.chunk_nbytes(CHUNK_TOKENS)
        self.chunks = chunks
        self.base = base_bytes(self.chunk_bytes)
        suffix = "-tls" if tls_dir else ""
        self.server = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--nats-url", nats_url, "--chunk-mib", str(args.chunk_mib),
             "--chunks", str(chunks), f"--instance-suffix={suffix}", *(["--tls-dir", tls_dir] if tls_dir else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
            preexec_fn=_die_with_parent)
        self.client: CacheEngine | None = None
        self.loader: Loader | None = None
        self.slots: list[Any] = []
        try:
            self.client = started_engine(engine_config(f"bench-p2p-client{suffix}", nats_url, chunks,
                                                       self.chunk_bytes, tls_dir), layout)
            held = read_line(self.server, 300, "chunk list")
            hasher, storage, pool, loop = self.client.hasher, self.client.storage, self.client.pool, \
                self.client.nats_loop
            assert hasher is not None and storage is not None and pool is not None and loop is not None
            self.storage, self.loop = storage, loop
            assert held["chunk_bytes"] == self.chunk_bytes
            keys = [bytes.fromhex(key) for key in held["keys"]]
            self.spans = hasher.spans(chunk_tokens(chunks))
            if [span.key for span in self.spans] != keys:
                raise RuntimeError("the serving engine's keys differ from the loading engine's for the same tokens")
            for _ in range(chunks):
                slot = pool.allocate()
                if slot is None:
                    raise RuntimeError(f"the loading engine's pool holds fewer than {chunks} chunks")
                self.slots.append(slot)
            buffers = [slot.chunk_buffer(self.chunk_bytes) for slot in self.slots]
            self.arrays = [slot.tensor.numpy()[:self.chunk_bytes] for slot in self.slots]
            peers = storage.lower(PEER)
            assert isinstance(peers, PeerTier)
            self.mismatch = self.client.meta_mismatch  # what a fetch checks before a chunk is scattered into vLLM
            self.loader = Loader(peers, PeerWorker(held["instance_id"], held["worker_id"]), keys, buffers,
                                 held["raw_port"], self.chunk_bytes)
            loop.submit(self.loader.connect_raw(FETCH_CONCURRENCY)).result(30)
        except BaseException:
            self.close()
            raise

    def verify(self, kind: str, metas: list[ChunkMeta | None] | None = None) -> None:
        expected = np.empty(self.chunk_bytes, dtype=np.uint8)
        for index, array in enumerate(self.arrays):
            fill_chunk(expected, self.base, index)
            if not np.array_equal(array, expected):
                raise RuntimeError(f"{kind}: chunk {index}'s bytes differ from the serving engine's")
        for span, meta in zip(self.spans, metas or []):
            problem = "missed" if meta is None else self.mismatch(span, meta)
            if problem:
                raise RuntimeError(f"{kind}: chunk {span.key.hex()}: {problem}")

    def one(self, kind: str, concurrency: int) -> float:
        assert self.loader is not None
        for array in self.arrays:  # nothing of an earlier pass can pass the comparison
            array.fill(0)
        if kind == "raw":
            seconds = self.loop.submit(self.loader.raw_pass(concurrency)).result(600)
            self.verify(f"raw x{concurrency}")
        else:
            seconds, metas = self.loop.submit(self.loader.p2p_pass(concurrency)).result(600)
            self.verify(f"P2P x{concurrency}", metas)
        return seconds

    def finish(self, p2p_passes: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """What the loading engine counted and what the serving engine served (checked against `p2p_passes`)."""
        loader_counters = {k: v for k, v in self.storage.stats.items() if k.startswith("p2p_") and v}
        assert self.server.stdin is not None
        self.server.stdin.close()
        served = read_line(self.server, 60, "served counts")
        if served["p2p_served_chunks"] != p2p_passes * self.chunks or served["p2p_served_misses"]:
            raise RuntimeError(f"the serving engine served {served}, expected {p2p_passes * self.chunks} chunks")
        return loader_counters, served

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close_raw()
        for slot in self.slots:
            slot.release()
        if self.client is not None:
            self.client.close()
        if self.server.stdin is not None and not self.server.stdin.closed:
            self.server.stdin.close()
        try:
            self.server.wait(30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = synthetic_layout(args.chunk_mib)
    chunk_bytes = layout.chunk_nbytes(CHUNK_TOKENS)
    chunks = max(1, int(args.total_gib * GB) // chunk_bytes)
    total = chunks * chunk_bytes
    started = time.monotonic()
    order = [("raw", 1), ("p2p", 1), ("raw", FETCH_CONCURRENCY), ("p2p", FETCH_CONCURRENCY)]
    names = ["clear", "tls"] if args.tls else ["clear"]
    times: dict[tuple[str, str, int], list[float]] = {(name, *key): [] for name in names for key in order}
    with EmbeddedNats() as nats_server, tempfile.TemporaryDirectory(prefix="kvmesh-bench-p2p-") as tmp, \
            contextlib.ExitStack() as stack:
        tls_dir = str(Path(tmp) / "tls")
        if args.tls:
            TlsMaterial(tls_dir).ensure(["engine"], hosts=["127.0.0.1", "localhost"])
        pairs: dict[str, Pair] = {}
        for name in names:
            pairs[name] = Pair(args, nats_server.url, layout, chunks, tls_dir if name == "tls" else None)
            stack.callback(pairs[name].close)
        for name in names:
            for kind, concurrency in order:  # warm-up: connections, tickets, page faults
                pairs[name].one(kind, concurrency)
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:  # the machine's speed drifts
                for kind, concurrency in order:
                    times[(name, kind, concurrency)].append(pairs[name].one(kind, concurrency))
        p2p_passes = 2 * (args.rounds + 1)
        finished = {name: pairs[name].finish(p2p_passes) for name in names}

    def gbps(seconds: float) -> float:
        return round(total / seconds / 1e9, 3)

    loader_counters, served = finished["clear"]
    result: dict[str, Any] = {
        "benchmark": "p2p", "total_bytes": total, "chunk_bytes": chunk_bytes, "chunk_mib": chunk_bytes / MiB,
        "chunk_tokens": CHUNK_TOKENS, "chunks": chunks, "rounds": args.rounds, "statistic": "median",
        "cpu": cpu_model(), "cpus": os.cpu_count(), "fetch_concurrency": FETCH_CONCURRENCY,
        "goal_ratio": GOAL,
    }
    for name in names:
        prefix = "" if name == "clear" else "tls_"
        for concurrency, suffix in ((FETCH_CONCURRENCY, ""), (1, "_1")):
            raw, p2p = times[(name, "raw", concurrency)], times[(name, "p2p", concurrency)]
            result[f"{prefix}p2p{suffix}_gbps"] = gbps(statistics.median(p2p))
            result[f"{prefix}raw_tcp{suffix}_gbps"] = gbps(statistics.median(raw))
            result[f"{prefix}ratio{suffix}"] = round(statistics.median(raw) / statistics.median(p2p), 3)
            result[f"{prefix}p2p{suffix}_gbps_rounds"] = [gbps(s) for s in p2p]
            result[f"{prefix}raw_tcp{suffix}_gbps_rounds"] = [gbps(s) for s in raw]
            if name == "tls":  # the goal of TLS: this share of the same P2P reads in clear
                result[f"tls_to_clear{suffix}"] = round(
                    statistics.median(times[("clear", "p2p", concurrency)]) / statistics.median(p2p), 3)
    result.update({"meets_goal": result["ratio"] >= GOAL, "verified_bit_exact": True, "meta_checked": True,
                   "served_chunks": served["p2p_served_chunks"], "loader_p2p_counters": loader_counters,
                   "wall_s": round(time.monotonic() - started, 1)})
    if args.tls:
        result["tls_served_chunks"] = finished["tls"][1]["p2p_served_chunks"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-gib", type=float, default=1.0, help="bytes moved per pass")
    parser.add_argument("--chunk-mib", type=float, default=2.0,
                        help="chunk size (256 tokens; a multiple of 0.125 MiB)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (each: raw and P2P, x1 and x4)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--tls", action="store_true",
                        help="also a pair of engines with TLS on their P2P ports, its passes alternating with the "
                             "clear pair's: tls_* figures and tls_to_clear (TLS throughput / clear)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--instance-suffix", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tls-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.serve:
        serve(args)
        return
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
