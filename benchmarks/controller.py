"""Controller benchmark: index ~1M chunk keys from 8 instances, then /lookup 8k-token prompts over real HTTP.

Processes (all real, on loopback):
  - the controller: `python -m kvmesh.services.controller` (embedded nats-server on its monitor port)
  - a producer process: 8 engine workers (one AdmissionReporter each, as the engine uses) registering over
    NATS and admitting their chunk keys (32 chunks of 256 tokens per prompt) as AdmissionBatch events
  - a load process: threads with raw keep-alive HTTP/1.1 sockets, one connection each, sending pre-encoded
    /lookup requests of 8192-token prompts the instances hold (every lookup hashes 32 chunks and probes them)

Measured: the controller's RSS growth per indexed key; /lookup closed-loop throughput and latency with
`--connections` connections; /lookup latency open-loop at a fixed `--rate` (latency counted from each
request's scheduled time, so queueing shows); and the ceiling: the same closed loop against GET /healthz, a
trivial endpoint of the same server. Prints one JSON document and one line of text.

    python benchmarks/controller.py            # defaults: 1M keys, 8 instances, 4 connections, 1000 req/s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

CHUNK_SIZE = 256
CHUNKS_PER_PROMPT = 32
PROMPT_TOKENS = CHUNK_SIZE * CHUNKS_PER_PROMPT  # 8192
MODEL, KV_FORMAT = "bench-model", "bfloat16/bench"
VOCAB = 128_000


def prompt_tokens(instance: int, prompt: int) -> np.ndarray:
    """The deterministic 8192-token prompt number `prompt` held by instance `instance`."""
    return np.random.default_rng([instance, prompt]).integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int64)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ---------------------------------------------------------------------------------------------------------
# Producer process


def producer_main(nats_url: str, instances: int, prompts: int, ready: Any, stop: Any) -> None:
    """8 engine workers admitting `prompts` prompts each; keeps heartbeating until `stop` is set."""
    import logging
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(_produce(nats_url, instances, prompts, ready, stop))


async def _produce(nats_url: str, instances: int, prompts: int, ready: Any, stop: Any) -> None:
    from kvmesh.shared import protocol
    from kvmesh.shared.messaging import bus
    from kvmesh.shared.messaging.admissions import AdmissionReporter
    from kvmesh.shared.protocol import LOCAL_CPU
    from kvmesh.shared.wire.keys import ChunkHasher, KeyParams

    nc = await bus.connect(nats_url, name="bench-producer")
    hasher = ChunkHasher(KeyParams(MODEL, KV_FORMAT), CHUNK_SIZE)
    reporters = []
    for i in range(instances):
        held: list[bytes] = []
        worker_id = f"bench-{i}"
        registration = protocol.RegisterEngine(worker_id=worker_id, instance_id=worker_id, model=MODEL,
                                               kv_format=KV_FORMAT, world_size=1, rank=0, chunk_size=CHUNK_SIZE,
                                               save_unfull_chunk=True, started_at=time.time())
        reporter = AdmissionReporter(worker_id, protocol.Principal.engine(worker_id).producer(worker_id), LOCAL_CPU,
                                     held_keys=lambda h=held: list(h),
                                     register=lambda r=registration: r, flush_interval=0.05)
        await reporter.start(nc)
        reporters.append((reporter, held))
    for p in range(prompts):
        for i, (reporter, held) in enumerate(reporters):
            for key in hasher.keys(prompt_tokens(i, p)):
                held.append(key)
                reporter.admit(key)
        if p % 64 == 63:
            await asyncio.sleep(0)  # let the reporters flush as we go
    for reporter, _ in reporters:
        await reporter.flush()
    await nc.flush()
    ready.set()
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for reporter, _ in reporters:
        await reporter.stop()
    await nc.close()


# ---------------------------------------------------------------------------------------------------------
# Load process


def _http_request(method: str, path: str, body: bytes = b"") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


def _round_trip(sock: socket.socket, request: bytes, buffer: bytearray) -> int:
    """Send one request, read one response (Content-Length framed); returns the status code."""
    sock.sendall(request)
    buffer.clear()
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buffer += chunk
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            break
    head = bytes(buffer[:end]).lower()
    at = head.find(b"content-length:")
    length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
    while len(buffer) < end + 4 + length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buffer += chunk
    return int(head[9:12])


def load_main(port: int, requests: list[bytes], connections: int, duration: float, rate: float | None,
              results: Any) -> None:
    """Closed loop (rate None: each connection sends as soon as it has its answer) or open loop at `rate`
    req/s over all connections (latency from the scheduled send time). Puts a dict on `results`."""
    # Threads waiting on sockets release the GIL, but one that wakes up must get it back: with the default
    # 5 ms switch interval that wait would be counted as server latency.
    sys.setswitchinterval(0.0002)
    latencies: list[list[float]] = [[] for _ in range(connections)]
    errors = [0] * connections
    start_barrier = threading.Barrier(connections + 1)
    t0_holder: list[float] = []

    def worker(index: int) -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = bytearray()
        mine = latencies[index]
        start_barrier.wait()
        t0 = t0_holder[0]
        end = t0 + duration
        j = 0
        while True:
            if rate:
                scheduled = t0 + (index + j * connections) / rate
                if scheduled >= end:
                    break
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            else:
                scheduled = time.perf_counter()
                if scheduled >= end:
                    break
            request = requests[(index + j * connections) % len(requests)]
            status = _round_trip(sock, request, buffer)
            mine.append(time.perf_counter() - scheduled)
            if status != 200:
                errors[index] += 1
            j += 1
        sock.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(connections)]
    for thread in threads:
        thread.start()
    t0_holder.append(time.perf_counter() + 0.05)
    start_barrier.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - t0_holder[0]
    client_cpu = time.process_time()
    all_latencies = np.array([x for per in latencies for x in per]) * 1e3
    results.put({
        "requests": int(all_latencies.size), "errors": sum(errors), "connections": connections,
        "target_rate": rate, "req_per_s": round(all_latencies.size / elapsed, 1),
        "p50_ms": round(float(np.percentile(all_latencies, 50)), 3),
        "p99_ms": round(float(np.percentile(all_latencies, 99)), 3),
        "max_ms": round(float(all_latencies.max()), 3),
        "client_cpu_us_per_req": round(client_cpu / max(all_latencies.size, 1) * 1e6, 1),
    })


def run_load(ctx: Any, server_pid: int, port: int, requests: list[bytes], connections: int, duration: float,
             rate: float | None = None) -> dict[str, Any]:
    """One load phase; adds the server's CPU time per request (robust to other work on the machine: the
    max req/s of one dedicated server core is 1e6 / server_cpu_us_per_req)."""
    results = ctx.Queue()
    process = ctx.Process(target=load_main, args=(port, requests, connections, duration, rate, results))
    cpu_before = cpu_seconds(server_pid)
    process.start()
    try:
        result = results.get(timeout=duration + 60)
        result["server_cpu_us_per_req"] = round((cpu_seconds(server_pid) - cpu_before) / result["requests"] * 1e6, 1)
        return result
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


# ---------------------------------------------------------------------------------------------------------
# Orchestration


def wait_healthy(port: int, controller: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Until the controller on `port` answers /healthz (RuntimeError if it exits or `timeout` s pass)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            http_json(port, "GET", "/healthz", timeout=1)
            return
        except Exception:
            if controller.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("controller did not start")
            time.sleep(0.1)


def http_json(port: int, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
    import httpx
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=timeout) as client:
        response = client.request(method, path, json=body)
        response.raise_for_status()
        return response.json() if "json" in response.headers.get("content-type", "") else response.text


def metric(port: int, name: str) -> float:
    for line in http_json(port, "GET", "/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="chunk keys to index in total (default 1M)")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--connections", type=int, default=4, help="concurrent HTTP connections (default 4)")
    parser.add_argument("--rate", type=float, default=1000.0, help="open-loop request rate (default 1000/s)")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per load phase (default 8)")
    parser.add_argument("--distinct-prompts", type=int, default=64, help="distinct lookup bodies to cycle")
    args = parser.parse_args(argv)

    prompts = -(-args.keys // (args.instances * CHUNKS_PER_PROMPT))
    expected_keys = prompts * args.instances * CHUNKS_PER_PROMPT
    from kvmesh.shared.messaging.embedded_nats import EmbeddedNats

    port = free_port()
    # A NATS without authentication: the one producer connection below plays every instance, which a mesh with
    # per-instance credentials (docs/security.md) would rightly refuse.
    nats = EmbeddedNats().start()
    nats_port = nats.port
    ctx = mp.get_context("spawn")
    controller = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.services.controller", "--host", "127.0.0.1", "--port", str(port),
         "--nats-url", nats.url, "--log-level", "warning", "--liveness-timeout", "60"],
        stdin=subprocess.DEVNULL)
    stop = ctx.Event()
    producer = None
    load_before = os.getloadavg()
    try:
        wait_healthy(port, controller)
        # Lookup bodies: prompts the instances hold, spread over all of them.
        rng = np.random.default_rng(0)
        bodies, expected = [], []
        for n in range(args.distinct_prompts):
            instance, prompt = n % args.instances, int(rng.integers(0, prompts))
            tokens = prompt_tokens(instance, prompt).tolist()
            bodies.append(_http_request("POST", "/lookup", json.dumps({"tokens": tokens}).encode()))
            expected.append((f"bench-{instance}", tokens))
        for _ in range(20):  # warm the controller's imports and caches before the memory baseline
            http_json(port, "POST", "/lookup", {"tokens": expected[0][1]})
        rss_before = rss_bytes(controller.pid)

        ready = ctx.Event()
        producer = ctx.Process(target=producer_main, args=(f"nats://127.0.0.1:{nats_port}", args.instances,
                                                           prompts, ready, stop))
        ingest_started = time.perf_counter()
        producer.start()
        if not ready.wait(timeout=600):
            raise RuntimeError("producer did not finish admitting its keys")
        deadline = time.monotonic() + 120
        while (indexed := metric(port, "kvmesh_controller_index_keys")) < expected_keys:
            if time.monotonic() > deadline:
                raise RuntimeError(f"index holds {indexed:.0f} keys, expected {expected_keys}")
            time.sleep(0.2)
        ingest_s = time.perf_counter() - ingest_started
        time.sleep(1.0)
        rss_after = rss_bytes(controller.pid)
        indexed = int(metric(port, "kvmesh_controller_index_keys"))

        # Correctness spot check: each body is credited to its instance with the whole prompt.
        for instance_id, tokens in expected[: args.instances]:
            layout = http_json(port, "POST", "/lookup", {"tokens": tokens})["layout_info"]
            assert layout == {instance_id: ["LocalCPUBackend", PROMPT_TOKENS]}, layout

        healthz = [_http_request("GET", "/healthz")]
        closed = run_load(ctx, controller.pid, port, bodies, args.connections, args.duration)
        open_loop = run_load(ctx, controller.pid, port, bodies, args.connections, args.duration, rate=args.rate)
        ceiling = run_load(ctx, controller.pid, port, healthz, args.connections, args.duration)
        result = {
            "benchmark": "controller",
            "keys_indexed": indexed, "instances": args.instances, "prompt_tokens": PROMPT_TOKENS,
            "chunks_per_lookup": CHUNKS_PER_PROMPT, "ingest_s": round(ingest_s, 2),
            "controller_rss_mb": {"before": round(rss_before / 2**20, 1), "after": round(rss_after / 2**20, 1)},
            "bytes_per_key": round((rss_after - rss_before) / max(indexed, 1), 1),
            "lookup_closed_loop": closed,
            "lookup_open_loop": open_loop,
            "ceiling_healthz_closed_loop": ceiling,
            "lookup_vs_ceiling": round(closed["req_per_s"] / ceiling["req_per_s"], 3),
            "cpus": os.cpu_count(),
            # Other work on the machine shows up in every figure above: the 1-minute load average before/after.
            "loadavg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        }
    finally:
        stop.set()
        if producer is not None:
            producer.join(timeout=10)
            if producer.is_alive():
                producer.kill()
        controller.send_signal(signal.SIGTERM)
        try:
            controller.wait(timeout=15)
        except subprocess.TimeoutExpired:
            controller.kill()
            controller.wait()
        nats.stop()
    print(json.dumps(result, indent=2))
    print(f"controller: {indexed} keys from {args.instances} instances, {result['bytes_per_key']} B/key (RSS); "
          f"/lookup of {PROMPT_TOKENS}-token prompts: {closed['req_per_s']} req/s closed-loop x{args.connections} "
          f"(p50 {closed['p50_ms']} ms, p99 {closed['p99_ms']} ms); at {args.rate:g} req/s open-loop "
          f"p50 {open_loop['p50_ms']} ms, p99 {open_loop['p99_ms']} ms ({open_loop['req_per_s']} req/s); "
          f"ceiling GET /healthz {ceiling['req_per_s']} req/s (lookup = {result['lookup_vs_ceiling']:.1%}); "
          f"server CPU {closed['server_cpu_us_per_req']} us/lookup vs {ceiling['server_cpu_us_per_req']} us/healthz; "
          f"load average {result['loadavg_1m']}")
    return result


if __name__ == "__main__":
    main()
