"""The controller's KV event stream: events published per second against admissions ingested, in one run.

Processes (all real, on loopback):
  - nats-server (embedded, no authentication: one producer connection plays every instance);
  - the controller: `python -m kvmesh.services.controller --kv-events-port ...`;
  - a subscriber process: a ZMQ SUB socket on every topic, decoding each KVEventBatch, counting messages and
    block hashes until it has seen every admitted key stored;
  - this process: `--instances` engine workers (one AdmissionReporter each, as the engine uses) admitting
    `--keys` chunk keys in all, as fast as they can.

Measured from the first admission: admissions/s ingested (the keys until the controller's /instances counts them
all), and events/s and block hashes/s published (until the subscriber has received them all). Prints one JSON
document and one line of text.

    python benchmarks/controller_kv_events.py          # defaults: 200k keys, 8 instances
    python benchmarks/controller_kv_events.py --keys 20000 --describe   # each admission describes its chunk

With `--describe` every admission carries its chunk's description (parent key, 256 token ids), as an engine with
describe_admissions sends it, and the stream publishes one BlockStored per chunk with its tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time
from typing import Any

from controller import free_port, http_json, wait_healthy  # benchmarks/controller.py

MODEL, KV_FORMAT, CHUNK_SIZE = "bench-model", "bfloat16/bench", 256


def subscriber_main(endpoint: str, expected_hashes: int, ready: Any, results: Any) -> None:
    """Count the stream's messages and stored hashes until `expected_hashes` were stored (or 120 s pass)."""
    import msgspec
    import zmq

    from kvmesh.shared.wire.kv_events import BlockStored, KVEventBatch

    sub = zmq.Context().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ready.set()
    messages = stored = described = 0
    first = last = None
    deadline = time.time() + 120
    while stored < expected_hashes and time.time() < deadline:
        if not sub.poll(1000):
            continue
        _, _, payload = sub.recv_multipart()
        last = time.time()
        first = first or last
        messages += 1
        for event in decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                stored += len(event.block_hashes)
                described += 1 if event.token_ids else 0
    results.put({"messages": messages, "hashes_stored": stored, "described": described, "first": first,
                 "last": last})


async def produce(nats_url: str, instances: int, keys: int, describe: bool) -> float:
    """Admit `keys` random chunk keys over `instances` workers (`describe`: each with its description); returns
    the time the first admission was made."""
    from kvmesh.shared import protocol
    from kvmesh.shared.messaging import bus
    from kvmesh.shared.messaging.admissions import AdmissionReporter
    from kvmesh.shared.protocol import LOCAL_CPU
    from kvmesh.shared.wire.kv_events import ChunkDescription, pack_tokens

    tokens = pack_tokens(range(1000, 1000 + CHUNK_SIZE))

    nc = await bus.connect(nats_url, name="bench-producer")
    reporters = []
    for i in range(instances):
        held: list[bytes] = []
        worker_id = f"bench-{i}"
        registration = protocol.RegisterEngine(worker_id=worker_id, instance_id=worker_id, model=MODEL,
                                               kv_format=KV_FORMAT, world_size=1, rank=0, chunk_size=CHUNK_SIZE,
                                               save_unfull_chunk=True, started_at=time.time())
        reporter = AdmissionReporter(worker_id, protocol.Principal.engine(worker_id).producer(worker_id), LOCAL_CPU,
                                     held_keys=lambda h=held: list(h), register=lambda r=registration: r,
                                     flush_interval=0.05)
        await reporter.start(nc)
        reporters.append((reporter, held))
    await asyncio.sleep(1.0)  # the registrations' (empty) full syncs are in before the clock starts
    started = time.time()
    for n in range(keys):
        reporter, held = reporters[n % instances]
        key = os.urandom(16)
        if describe:
            reporter.describe(key, ChunkDescription(held[-1] if held else None, tokens, None, None))
        held.append(key)
        reporter.admit(key)
        if n % 4096 == 4095:
            await asyncio.sleep(0)  # let the reporters flush as we go
    for reporter, _ in reporters:
        await reporter.flush()
    await nc.flush()
    return started


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=200_000, help="chunk keys to admit in total (default 200k)")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--describe", action="store_true", help="admissions carry descriptions (256 tokens each)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    from kvmesh.shared.messaging.embedded_nats import EmbeddedNats

    port, events_port = free_port(), free_port()
    nats = EmbeddedNats().start()
    controller = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.services.controller", "--host", "127.0.0.1", "--port", str(port),
         "--nats-url", nats.url, "--log-level", "warning", "--liveness-timeout", "60",
         "--kv-events-port", str(events_port)], stdin=subprocess.DEVNULL)
    ctx = mp.get_context("spawn")
    ready, results = ctx.Event(), ctx.Queue()
    subscriber = ctx.Process(target=subscriber_main, args=(f"tcp://127.0.0.1:{events_port}", args.keys, ready,
                                                            results))
    try:
        wait_healthy(port, controller)
        subscriber.start()
        ready.wait(30)
        time.sleep(0.5)  # ZMQ's slow joiner: the subscription reaches the controller's PUB socket
        started = asyncio.run(produce(nats.url, args.instances, args.keys, args.describe))
        while http_json(port, "GET", "/instances")["num_keys"] < args.keys:
            time.sleep(0.01)
        indexed = time.time()
        received = results.get(timeout=180)
        subscriber.join(10)
    finally:
        controller.terminate()
        controller.wait(30)
        nats.stop()
    published_s = received["last"] - started
    result = {
        "keys": args.keys, "instances": args.instances, "described": args.describe,
        "ingest_s": round(indexed - started, 3), "admissions_per_s": round(args.keys / (indexed - started)),
        "publish_s": round(published_s, 3), "messages": received["messages"],
        "hashes_stored": received["hashes_stored"], "described_events": received["described"],
        "events_per_s": round(received["messages"] / published_s),
        "hashes_per_s": round(received["hashes_stored"] / published_s),
    }
    print(json.dumps(result, indent=2))
    print(f"{args.keys} admissions ingested at {result['admissions_per_s']}/s; {result['messages']} events "
          f"({result['hashes_stored']} block hashes) published at {result['events_per_s']} events/s, "
          f"{result['hashes_per_s']} hashes/s")
    return result


if __name__ == "__main__":
    main()
