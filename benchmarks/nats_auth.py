"""What the authenticated mesh costs a store request: NATS request/reply round trips between an engine's and a
store's connection, with KVMesh's per-principal users and permissions (the NATS every KVMesh start uses) next to
the same NATS server without authorization (the ceiling), measured in one run, interleaved.

    python benchmarks/nats_auth.py [--requests 5000] [--payload 256]

The subjects and inboxes are the real ones (`Subjects.store(..., "contains", <engine path>)`, `_INBOX.engine.*`),
so the server checks the permissions of every publish and delivery as it does in the mesh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import nats

from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import Principal, Subjects

STORE = "disk-bench"


async def round_trips(url: str, engine_auth: dict, store_auth: dict, requests: int, payload: bytes) -> list[float]:
    store = await nats.connect(url, **store_auth)
    engine = await nats.connect(url, **engine_auth)

    async def answer(msg) -> None:
        await msg.respond(msg.data)

    await store.subscribe(Subjects.store_op(STORE, "contains"), cb=answer)
    await store.flush()
    subject = Subjects.store(STORE, "contains", Principal.engine("bench").producer("bench"))
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        await engine.request(subject, payload, timeout=5)
        times.append(time.perf_counter() - start)
    await engine.close()
    await store.close()
    return times


async def measure(args: argparse.Namespace) -> dict[str, object]:
    payload = bytes(args.payload)
    mesh = LocalMesh([])
    mesh.start_nats()
    open_server = EmbeddedNats().start()
    try:
        engine_auth = mesh.auth(Principal.engine("bench")).connect_options()
        store_auth = mesh.auth(Principal.store(STORE)).connect_options()
        secured: list[float] = []
        ceiling: list[float] = []
        for _ in range(args.rounds):  # interleaved, so other load on the machine hits both alike
            ceiling += await round_trips(open_server.url, {}, {}, args.requests // args.rounds, payload)
            secured += await round_trips(str(mesh.nats_url), engine_auth, store_auth, args.requests // args.rounds,
                                         payload)
    finally:
        open_server.stop()
        mesh.stop()
    secured_us, ceiling_us = statistics.median(secured) * 1e6, statistics.median(ceiling) * 1e6
    return {"requests": len(secured), "payload_bytes": args.payload,
            "median_rtt_us_with_permissions": round(secured_us, 1),
            "median_rtt_us_without_auth (ceiling)": round(ceiling_us, 1),
            "ratio": round(secured_us / ceiling_us, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5, help="alternations between the two servers")
    parser.add_argument("--payload", type=int, default=256, help="request bytes (a contains of ~14 keys)")
    result = asyncio.run(measure(parser.parse_args()))
    print(json.dumps(result, indent=2))
    print(f"request/reply with per-principal permissions: {result['median_rtt_us_with_permissions']} us, "
          f"{result['ratio']}x the same server without auth")


if __name__ == "__main__":
    main()
