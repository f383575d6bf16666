"""The controller end to end: a real nats-server (EmbeddedNats), the controller's real uvicorn on a free
loopback port (in-process, or `python -m kvmesh.services.controller` as a subprocess), httpx over real HTTP,
and producers that speak the real protocol (support/controller.py): `FakeEngineWorker` (AdmissionReporter +
WorkerCommand responder, like an engine worker), `FakeStore` (AdmissionReporter as a disk/remote store) and
`RawProducer` (hand-numbered batches, to lose some on purpose).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from typing import Any, AsyncIterator

import httpx
import pytest

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, free_port
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE, Subjects

from support.controller import (MODEL, FakeEngineWorker, FakeStore, RawProducer, _has_instance, layout,
                                running_controller, started, wait_layout)
from support.waiting import WAIT_S, ManualClock, wait_until_async

SEED_INSTANCE = "lmcache_default_instance"
SEED_TOKENS = [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]


# ---------------------------------------------------------------------------------------------------------
# LMCache's quickstart flows (docs/compatibility.md)


async def test_seed_pin_clear_lookup(nats_server: EmbeddedNats) -> None:
    """Seeds 000/001: a 12-token prompt (one partial chunk) pins 12 tokens, clears 12, then lookup is empty."""
    worker = FakeEngineWorker(nats_server.url, SEED_INSTANCE)
    async with running_controller(nats_server.url) as (service, client), started(worker):
        worker.store(SEED_TOKENS)
        await wait_layout(client, SEED_TOKENS, {SEED_INSTANCE: [LOCAL_CPU, 12]})

        pin = await client.post("/pin", json={"tokens": SEED_TOKENS, "instance_id": SEED_INSTANCE,
                                              "location": "LocalCPUBackend"})
        assert pin.status_code == 200, pin.text
        assert pin.json()["num_tokens"] == 12 and len(pin.json()["event_id"]) == 32
        assert worker.pinned == {worker.spans(SEED_TOKENS)[0].key}
        finish = await client.post("/check_finish", json={"event_id": pin.json()["event_id"]})
        assert finish.json() == {"status": "finished"}

        producer = service.core.table.producer(SEED_INSTANCE)
        assert producer is not None
        syncs_before = producer.syncs_completed
        clear = await client.post("/clear", json={"instance_id": SEED_INSTANCE, "location": "LocalCPUBackend"})
        assert clear.status_code == 200, clear.text
        assert clear.json()["num_tokens"] == 12
        # Right after the reply, not eventually: the controller drops the cleared location's keys itself.
        lookup = await client.post("/lookup", json={"tokens": SEED_TOKENS})
        assert lookup.json()["layout_info"] == {}
        assert len(lookup.json()["event_id"]) == 32
        finish = await client.post("/check_finish", json={"event_id": lookup.json()["event_id"]})
        assert finish.json() == {"status": "finished"}
        # ...and it stays empty once the worker's evictions and the confirming sync have arrived.
        await wait_until_async(lambda: producer.syncs_completed > syncs_before and not producer.needs_sync,
                               what="the full sync confirming the clear")
        assert await layout(client, SEED_TOKENS) == {}


async def test_pin_unpin_partial_prefix(nats_server: EmbeddedNats) -> None:
    worker = FakeEngineWorker(nats_server.url, "inst-a", chunk_size=4)
    tokens = list(range(1, 11))  # chunks of 4, 4, 2
    async with running_controller(nats_server.url) as (_, client), started(worker):
        worker.store(tokens, chunks=[0, 1])
        await wait_layout(client, tokens, {"inst-a": [LOCAL_CPU, 8]})
        body = {"instance_id": "inst-a", "location": LOCAL_CPU, "tokens": tokens}
        pin = await client.post("/pin", json=body)
        assert pin.json()["num_tokens"] == 8  # what was actually pinned: the held prefix
        assert len(worker.pinned) == 2
        unpin = await client.post("/unpin", json=body)
        assert unpin.status_code == 200 and unpin.json()["num_tokens"] == 8
        assert worker.pinned == set()
        assert [c.op for c in worker.commands] == ["pin", "unpin"]
        finish = await client.post("/check_finish", json={"event_id": unpin.json()["event_id"]})
        assert finish.json() == {"status": "finished"}


# ---------------------------------------------------------------------------------------------------------
# Lookup semantics


async def test_lookup_credits_each_instance_with_its_own_contiguous_prefix(nats_server: EmbeddedNats) -> None:
    tokens = list(range(100, 110))  # chunk_size 4: chunks [0:4], [4:8], [8:10]
    full = FakeEngineWorker(nats_server.url, "full", chunk_size=4)
    only_second = FakeEngineWorker(nats_server.url, "only-second", chunk_size=4)
    holey = FakeEngineWorker(nats_server.url, "holey", chunk_size=4)
    other_chunking = FakeEngineWorker(nats_server.url, "chunk8", chunk_size=8)
    async with running_controller(nats_server.url) as (_, client), \
            started(full, only_second, holey, other_chunking):
        full.store(tokens)
        only_second.store(tokens, chunks=[1])
        holey.store(tokens, chunks=[0, 2])
        other_chunking.store(tokens, chunks=[0])  # hashed its own way: 8-token chunks
        expected = {"full": [LOCAL_CPU, 10], "holey": [LOCAL_CPU, 4], "chunk8": [LOCAL_CPU, 8]}
        await wait_layout(client, tokens, expected)
        # A different prompt sharing only the first chunk.
        assert await layout(client, tokens[:4] + [999, 998]) == {"full": [LOCAL_CPU, 4], "holey": [LOCAL_CPU, 4]}
        assert await layout(client, [7, 7, 7, 7, 7]) == {}
        assert await layout(client, []) == {}


async def test_lookup_best_location_and_ties(nats_server: EmbeddedNats) -> None:
    tokens = list(range(1, 13))  # three 4-token chunks
    disk_d = FakeStore(nats_server.url, "disk-d", LOCAL_DISK)
    disk_e = FakeStore(nats_server.url, "disk-e", LOCAL_DISK)
    remote0 = FakeStore(nats_server.url, "remote-p0", REMOTE)
    remote1 = FakeStore(nats_server.url, "remote-p1", REMOTE)
    longer_on_disk = FakeEngineWorker(nats_server.url, "longer-on-disk", chunk_size=4, disk=disk_d)
    tie = FakeEngineWorker(nats_server.url, "tie", chunk_size=4, disk=disk_e, remotes=(remote0, remote1))
    remote_only = FakeEngineWorker(nats_server.url, "remote-only", chunk_size=4, remotes=(remote0, remote1))
    async with running_controller(nats_server.url) as (_, client), \
            started(disk_d, disk_e, remote0, remote1, longer_on_disk, tie, remote_only):
        longer_on_disk.store(tokens, chunks=[0])
        longer_on_disk.store(tokens, chunks=[0, 1], where=LOCAL_DISK)
        tie.store(tokens, chunks=[0, 1])
        tie.store(tokens, chunks=[0, 1], where=LOCAL_DISK)
        # Remote partitions hold alternate chunks: together, the whole prompt. "tie" shares them too, so
        # its remote prefix (12) is longer than its CPU/disk prefix (8).
        remote_only.store(tokens, where=REMOTE)
        await wait_layout(client, tokens, {"longer-on-disk": [LOCAL_DISK, 8], "tie": [REMOTE, 12],
                                           "remote-only": [REMOTE, 12]})
        # Over the first 8 tokens, "tie" holds the same prefix everywhere: the fastest tier wins.
        assert (await layout(client, tokens[:8]))["tie"] == [LOCAL_CPU, 8]
        info = (await client.get("/instances")).json()
        by_id = {i["instance_id"]: i for i in info["instances"]}
        assert by_id["tie"]["locations"] == [LOCAL_CPU, LOCAL_DISK, REMOTE]
        assert by_id["remote-only"]["locations"] == [LOCAL_CPU, REMOTE]
        assert {s["store_id"] for s in info["stores"]} == {"disk-d", "disk-e", "remote-p0", "remote-p1"}

        # Clearing the disk location clears the instance's disk store (and nothing else).
        clear = await client.post("/clear", json={"instance_id": "longer-on-disk", "location": LOCAL_DISK})
        assert clear.status_code == 200 and clear.json()["num_tokens"] == 8
        assert (await layout(client, tokens))["longer-on-disk"] == [LOCAL_CPU, 4]
        assert disk_d.chunks == {}


async def test_tensor_parallel_instance_needs_every_rank(nats_server: EmbeddedNats) -> None:
    tokens = list(range(50, 62))
    rank0 = FakeEngineWorker(nats_server.url, "tp", rank=0, world_size=2, chunk_size=4)
    rank1 = FakeEngineWorker(nats_server.url, "tp", rank=1, world_size=2, chunk_size=4)
    async with running_controller(nats_server.url) as (_, client), started(rank0, rank1):
        assert rank0.spans(tokens)[0].key != rank1.spans(tokens)[0].key  # ranks name their shards apart
        rank0.store(tokens)
        rank1.store(tokens, chunks=[0, 1])
        await wait_layout(client, tokens, {"tp": [LOCAL_CPU, 8]})
        pin = await client.post("/pin", json={"instance_id": "tp", "location": LOCAL_CPU, "tokens": tokens})
        assert pin.json()["num_tokens"] == 8  # the minimum over ranks
        assert len(rank0.commands) == len(rank1.commands) == 1
        info = (await client.post("/query_worker_info", json={"instance_id": "tp"})).json()
        assert [(w["worker_id"], w["worker_name"]) for w in info["worker_infos"]] == [(0, "tp.r0"), (1, "tp.r1")]
        only1 = (await client.post("/query_worker_info", json={"instance_id": "tp", "worker_ids": [1]})).json()
        assert [w["rank"] for w in only1["worker_infos"]] == [1]
        missing = await client.post("/query_worker_info", json={"instance_id": "tp", "worker_ids": [5]})
        assert missing.status_code == 404 and "[5]" in missing.json()["detail"]


# ---------------------------------------------------------------------------------------------------------
# Errors


async def test_a_peer_lookup_names_the_live_p2p_workers_of_other_instances_that_admitted_the_chunks_first(
        nats_server: EmbeddedNats) -> None:
    """P2P (services/controller/peers.py): one request names, per key, the peer whose CPU tier admitted it first
    (in runs), never the asker's own instance or a worker that does not serve peers; and a lookup on another
    worker's behalf gets nothing (counted as forged)."""
    tokens = list(range(4 * 256))
    asker = FakeEngineWorker(nats_server.url, "asker", p2p=True)
    near = FakeEngineWorker(nats_server.url, "near", p2p=True)
    far = FakeEngineWorker(nats_server.url, "far", p2p=True)
    closed = FakeEngineWorker(nats_server.url, "closed")  # enable_p2p off: serves no peer
    async with running_controller(nats_server.url) as (service, client), \
            started(asker), started(near), started(far), started(closed):
        asker.store(tokens)  # its own chunks never count
        closed.store(tokens)
        # each holder's admissions are applied before the next one's: the order of record is the test's premise
        await wait_layout(client, tokens, {"asker": [LOCAL_CPU, 1024], "closed": [LOCAL_CPU, 1024]})
        near.store(tokens, chunks=[0, 1])
        await wait_layout(client, tokens, {"asker": [LOCAL_CPU, 1024], "near": [LOCAL_CPU, 512],
                                           "closed": [LOCAL_CPU, 1024]})
        far.store(tokens, chunks=[0, 1, 2])  # after near: the record of chunk 2 only
        await wait_layout(client, tokens, {"asker": [LOCAL_CPU, 1024], "near": [LOCAL_CPU, 512],
                                           "far": [LOCAL_CPU, 768], "closed": [LOCAL_CPU, 1024]})
        keys = [span.key for span in asker.spans(tokens)]

        async def ask(worker: FakeEngineWorker, worker_id: str) -> protocol.PeerLookupReply:
            return await bus.request(worker.nc, Subjects.peer_lookup(worker.path), protocol.PeerLookup(
                worker_id=worker_id, keys=keys), protocol.PeerLookupReply, timeout=WAIT_S)

        assert await ask(asker, asker.worker_id) == protocol.PeerLookupReply(
            "near", near.worker_id, 2, ["far"], [far.worker_id], [1])
        assert await ask(far, far.worker_id) == protocol.PeerLookupReply("asker", asker.worker_id, 4)
        forged_before = service.feed.forged_messages
        assert await ask(near, asker.worker_id) == protocol.PeerLookupReply()  # not near's own name
        assert service.feed.forged_messages == forged_before + 1


async def test_command_errors_name_instance_and_location(nats_server: EmbeddedNats) -> None:
    worker = FakeEngineWorker(nats_server.url, "cpu-only")
    async with running_controller(nats_server.url) as (_, client), started(worker):
        await wait_until_async(lambda: _has_instance(client, "cpu-only"), what="registration")
        unknown = await client.post("/pin", json={"instance_id": "nope", "location": LOCAL_CPU, "tokens": [1]})
        assert unknown.status_code == 404 and "nope" in unknown.json()["detail"]
        no_disk = await client.post("/clear", json={"instance_id": "cpu-only", "location": LOCAL_DISK})
        assert no_disk.status_code == 404
        assert no_disk.json()["detail"] == "instance cpu-only has no LocalDiskBackend"
        no_remote = await client.post("/pin", json={"instance_id": "cpu-only", "location": REMOTE, "tokens": [1]})
        assert no_remote.status_code == 404 and "has no RemoteBackend" in no_remote.json()["detail"]
        bad_location = await client.post("/clear", json={"instance_id": "cpu-only", "location": "GPU"})
        assert bad_location.status_code == 422 and bad_location.json()["detail"][0]["loc"] == ["body", "location"]
        # The failed command's event id is known, and failed.
        finish = await client.post("/check_finish", json={"event_id": no_disk.json()["event_id"]})
        assert finish.json() == {"status": "failed", "error": "instance cpu-only has no LocalDiskBackend"}
        unknown_event = await client.post("/check_finish", json={"event_id": "0" * 32})
        assert unknown_event.status_code == 404
        for endpoint in ("/health", "/query_worker_info"):
            response = await client.post(endpoint, json={"instance_id": "nope"})
            assert response.status_code == 404 and "nope" in response.json()["detail"]


async def test_slow_dead_or_failing_worker_pending_then_504_or_502(nats_server: EmbeddedNats) -> None:
    """While a worker has not answered, the operation's event is pending; a worker that never answers is a 504
    naming the instance once the command timeout runs out (check_finish says failed); no responder is a 504, a
    refusal a 502."""
    slow = RawProducer(nats_server.url, "slow")
    gone = RawProducer(nats_server.url, "gone")
    failing = RawProducer(nats_server.url, "failing")
    body = {"location": LOCAL_CPU, "tokens": [1, 2, 3]}
    async with running_controller(nats_server.url) as (service, client), started(slow, gone, failing):
        held: list[Any] = []

        async def hold(msg: Any) -> None:
            held.append(msg)  # answered when the test says so

        await slow.nc.subscribe(Subjects.worker("slow", "slow", "pin"), cb=hold)

        async def refuse(_command: protocol.WorkerCommand) -> protocol.CommandReply:
            return protocol.CommandReply(ok=False, error="pool exhausted")

        await bus.serve(failing.nc, Subjects.worker("failing", "failing", "pin"), protocol.WorkerCommand, refuse)
        for producer in (slow, failing):
            await producer.nc.flush()
        for name in ("slow", "gone", "failing"):
            await wait_until_async(lambda n=name: _has_instance(client, n), what=f"registration of {name}")

        request = asyncio.create_task(client.post("/pin", json={"instance_id": "slow", **body}))
        # While the worker keeps us waiting, the operation's event is pending.
        await wait_until_async(lambda: bool(held), what="the pin reaching the worker")
        events = service.core.events
        pending_id = next(i for i, r in events.items() if r.kind == "pin" and r.status == "pending")
        pending = await client.post("/check_finish", json={"event_id": pending_id})
        assert pending.json() == {"status": "pending"}
        await held[0].respond(protocol.encode(protocol.CommandReply(ok=True, num_tokens=0)))
        answered = await request
        assert answered.status_code == 200 and answered.json()["event_id"] == pending_id, answered.text
        finish = await client.post("/check_finish", json={"event_id": pending_id})
        assert finish.json() == {"status": "finished"}

        no_responder = await client.post("/pin", json={"instance_id": "gone", **body})
        assert no_responder.status_code == 504 and "gone" in no_responder.json()["detail"]

        refused = await client.post("/pin", json={"instance_id": "failing", **body})
        assert refused.status_code == 502 and "pool exhausted" in refused.json()["detail"]
        assert "failing" in refused.json()["detail"]

    silent = RawProducer(nats_server.url, "silent")
    async with running_controller(nats_server.url, command_timeout_s=0.4) as (_, client), started(silent):
        never_answered: list[Any] = []

        async def hang(msg: Any) -> None:
            never_answered.append(msg)  # and no reply, ever

        await silent.nc.subscribe(Subjects.worker("silent", "silent", "pin"), cb=hang)
        await silent.nc.flush()
        await wait_until_async(lambda: _has_instance(client, "silent"), what="registration of silent")
        timed_out = await client.post("/pin", json={"instance_id": "silent", **body})
        assert timed_out.status_code == 504, timed_out.text
        assert "silent" in timed_out.json()["detail"] and "0.4s" in timed_out.json()["detail"]
        assert len(never_answered) == 1
        finish = await client.post("/check_finish", json={"event_id": timed_out.json()["event_id"]})
        assert finish.json()["status"] == "failed" and "silent" in finish.json()["error"]


async def test_bad_input_is_422_or_413_never_500(nats_server: EmbeddedNats) -> None:
    async with running_controller(nats_server.url, max_tokens=100) as (_, client):
        bad_lookups: list[Any] = [
            {"tokens": "abc"}, {"tokens": [1, -2]}, {"tokens": [1.5]}, {"tokens": [True]}, {"tokens": ["1"]},
            {"tokens": [2**64]}, {"tokens": None}, {}, [], "tokens", {"tokens": [[1]]},
        ]
        for body in bad_lookups:
            response = await client.post("/lookup", json=body)
            assert response.status_code == 422, (body, response.text)
        # JSON Schema counts 1.0 as an integer; so do we (never "1", true or 1.5).
        assert (await client.post("/lookup", json={"tokens": [1.0, 2]})).status_code == 200
        pin_float = await client.post("/pin", json={"instance_id": "x", "location": LOCAL_CPU, "tokens": [1.0]})
        assert pin_float.status_code == 404  # valid body; unknown instance
        assert (await client.post("/lookup", json={"tokens": [2**31]})).status_code == 422  # vLLM ids are int32
        field = (await client.post("/lookup", json={"tokens": [1, -2]})).json()["detail"][0]
        assert field["loc"] == ["body", "tokens", 1]
        assert (await client.post("/lookup", json={"tokens": "abc"})).json()["detail"][0]["loc"] == ["body", "tokens"]
        for raw in (b"not json", b"", b'{"tokens": [1, 2', b"\xff\xfe", b"\x00"):
            response = await client.post("/lookup", content=raw, headers={"content-type": "application/json"})
            assert response.status_code == 422, (raw, response.text)
        for endpoint, body in [("/pin", {"instance_id": "x", "location": LOCAL_CPU, "tokens": "abc"}),
                               ("/pin", {"instance_id": "x", "location": LOCAL_CPU, "tokens": [-1]}),
                               ("/pin", {"location": LOCAL_CPU, "tokens": [1]}),
                               ("/unpin", {"instance_id": "", "location": LOCAL_CPU, "tokens": [1]}),
                               ("/clear", {"instance_id": "x"}), ("/check_finish", {}),
                               ("/check_finish", {"event_id": 5}), ("/health", []),
                               ("/query_worker_info", {"instance_id": "x", "worker_ids": ["a"]})]:
            response = await client.post(endpoint, json=body)
            assert response.status_code == 422, (endpoint, body, response.text)
        missing = (await client.post("/pin", json={"location": LOCAL_CPU, "tokens": [1]})).json()
        assert missing["detail"][0]["loc"] == ["body", "instance_id"]
        for raw in (b"{", b"\xff,", b"\x00"):  # FastAPI alone would say 400 for undecodable bytes
            response = await client.post("/pin", content=raw, headers={"content-type": "application/json"})
            assert response.status_code == 422, (raw, response.text)

        too_many = await client.post("/lookup", json={"tokens": list(range(101))})
        assert too_many.status_code == 413 and "100" in too_many.json()["detail"]
        assert (await client.post("/lookup", json={"tokens": list(range(100))})).status_code == 200
        pin_too_many = await client.post("/pin", json={"instance_id": "x", "location": LOCAL_CPU,
                                                       "tokens": list(range(101))})
        assert pin_too_many.status_code == 413
        huge = b'{"tokens": [' + b"1," * 2_000_000 + b"1]}"  # refused before it is read
        assert (await client.post("/lookup", content=huge)).status_code == 413

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(100):
                yield b" " * 65536

        assert (await client.post("/lookup", content=chunked())).status_code == 413


async def test_auth_on_and_off(nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_controller(nats_server.url, auth_token="s3cret") as (_, client):
        body = {"tokens": [1, 2, 3]}
        assert (await client.post("/lookup", json=body)).status_code == 401
        wrong = await client.post("/lookup", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        assert (await client.post("/lookup", json=body, headers={"Authorization": "Bearer s3cret"})).status_code == 200
        assert (await client.post("/lookup", content=b"junk")).status_code == 401  # auth before parsing
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/instances", headers={"Authorization": "bearer s3cret"})).status_code == 200
        assert (await client.get("/healthz")).status_code == 200
        schema = (await client.get("/openapi.json")).json()
        assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    async with running_controller(nats_server.url) as (_, client):
        assert (await client.post("/lookup", json={"tokens": [1]})).status_code == 200
    from kvmesh.services.controller.config import parse_args
    monkeypatch.setenv("KVMESH_CONTROLLER_TOKEN", "from-env")
    assert parse_args([]).auth_token == "from-env"
    assert parse_args(["--auth-token", "flag"]).auth_token == "flag"


# ---------------------------------------------------------------------------------------------------------
# Consistency: gaps, restarts, liveness


async def test_sequence_gap_is_repaired_by_a_full_sync(nats_server: EmbeddedNats) -> None:
    producer = RawProducer(nats_server.url, "gappy")
    tokens = list(range(1, 13))
    k0, k1, k2 = producer.keys(tokens)
    stray = producer.keys([9, 9, 9, 9])[0]
    async with running_controller(nats_server.url) as (service, client), started(producer):
        await wait_until_async(lambda: _has_instance(client, "gappy"), what="registration")
        await producer.heartbeat()  # known, in step: no sync needed yet
        await producer.batch(admitted=[k0, stray])
        await wait_layout(client, tokens, {"gappy": [LOCAL_CPU, 4]})
        await producer.batch(admitted=[k1], evicted=[stray], lose=True)  # seq 2 never arrives
        await producer.batch(admitted=[k2])  # seq 3: a gap
        await wait_layout(client, tokens, {"gappy": [LOCAL_CPU, 12]}, "after the resync")
        assert "sequence gap" in producer.sync_requests, "the gap must trigger a SyncRequest"
        assert service.core.table.index.mask(stray) == 0  # dropped by the sync: not in the producer's keys
        assert service.core.table.stats.seq_gaps >= 1
        # Later batches apply on top of the synced state.
        await producer.batch(evicted=[k1])
        await wait_layout(client, tokens, {"gappy": [LOCAL_CPU, 4]}, "a batch after the sync")
        metrics = (await client.get("/metrics")).text
        assert "kvmesh_controller_seq_gaps_total 1" in metrics
        assert 'kvmesh_controller_syncs_total{outcome="completed"}' in metrics


async def test_heartbeat_reveals_lost_batch_and_unknown_producer(nats_server: EmbeddedNats) -> None:
    tokens = list(range(1, 9))
    behind = RawProducer(nats_server.url, "behind")
    stranger = RawProducer(nats_server.url, "stranger")
    async with running_controller(nats_server.url) as (_, client), started(behind):
        await wait_until_async(lambda: _has_instance(client, "behind"), what="registration")
        k0, k1 = behind.keys(tokens)
        await behind.batch(admitted=[k0])
        await wait_layout(client, tokens, {"behind": [LOCAL_CPU, 4]})
        await behind.batch(admitted=[k1], lose=True)  # the last batch is lost: only a heartbeat tells
        await behind.heartbeat()
        await wait_layout(client, tokens, {"behind": [LOCAL_CPU, 8]}, "after the heartbeat-triggered sync")
        assert behind.sync_requests

        # A producer the controller has never heard of, showing up by heartbeat alone, is asked for a sync.
        await stranger.start(register=False)
        try:
            await stranger.heartbeat()
            await wait_until_async(lambda: bool(stranger.sync_requests), what="a SyncRequest to the unknown producer")
        finally:
            await stranger.stop()


async def test_controller_restart_rebuilds_the_index(nats_server: EmbeddedNats) -> None:
    tokens = list(range(300, 312))
    disk = FakeStore(nats_server.url, "disk-r", LOCAL_DISK)
    worker = FakeEngineWorker(nats_server.url, "survivor", chunk_size=4, disk=disk)
    async with started(disk, worker):
        async with running_controller(nats_server.url) as (_, client):
            worker.store(tokens, chunks=[0])
            worker.store(tokens, where=LOCAL_DISK)
            await wait_layout(client, tokens, {"survivor": [LOCAL_DISK, 12]})
        # The producers keep running; a new controller starts with an empty index and says hello.
        async with running_controller(nats_server.url, controller_id="controller-2") as (service, client):
            await wait_layout(client, tokens, {"survivor": [LOCAL_DISK, 12]}, "after the restart")
            assert (await layout(client, tokens[:4])) == {"survivor": [LOCAL_CPU, 4]}
            assert len(service.core.table.index) == 3  # the CPU's chunk-0 key is the disk's: one entry, two bits
            info = (await client.post("/query_worker_info", json={"instance_id": "survivor"})).json()
            assert info["worker_infos"][0]["disk_store"] == "disk-r" and info["worker_infos"][0]["in_sync"]


async def test_liveness_timeout_hides_a_silent_producer_until_it_returns(nats_server: EmbeddedNats) -> None:
    tokens = list(range(1, 9))
    producer = RawProducer(nats_server.url, "flaky")
    clock = ManualClock()  # time passes only when the test says so: the producer is silent for exactly that long
    async with running_controller(nats_server.url, clock) as (service, client), started(producer):
        await wait_until_async(lambda: _has_instance(client, "flaky"), what="registration")
        await producer.batch(admitted=producer.keys(tokens))
        await producer.heartbeat()
        await wait_layout(client, tokens, {"flaky": [LOCAL_CPU, 8]})
        health = (await client.post("/health", json={"instance_id": "flaky"})).json()
        assert health["healthy"] and health["workers"]["flaky"]["alive"]
        # Silence: no heartbeats for longer than the liveness timeout.
        clock.advance(service.config.liveness_timeout_s + 1)
        await wait_layout(client, tokens, {}, "the silent producer dropped from lookups")
        health = (await client.post("/health", json={"instance_id": "flaky"})).json()
        assert not health["healthy"] and health["error_codes"] == {"0": 1}
        assert len(service.core.table.index) == 2  # its keys are kept, only filtered
        # It returns: its keys come back without a resync.
        syncs_before = len(producer.sync_requests)
        await producer.heartbeat()
        await wait_layout(client, tokens, {"flaky": [LOCAL_CPU, 8]}, "the producer back")
        assert len(producer.sync_requests) == syncs_before


async def test_nats_restart_makes_the_controller_say_hello_again(nats_server: EmbeddedNats,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """After a NATS outage the controller may have missed registrations: it says hello again on reconnect.

    The hello is seen where the controller publishes it: a listener on NATS would have to reconnect first, and
    under load the controller can reconnect and say hello before the listener is back (the hello is then lost)."""
    async with running_controller(nats_server.url) as (service, client):
        hellos: list[protocol.ControllerHello] = []
        publish = bus.publish

        async def recording(nc: Any, subject: str, message: Any) -> None:
            if subject == Subjects.CONTROLLER_HELLO:
                hellos.append(message)
            await publish(nc, subject, message)

        monkeypatch.setattr(bus, "publish", recording)
        port = nats_server.port
        nats_server.stop()
        replacement = EmbeddedNats(port=port).start()
        try:
            await wait_until_async(lambda: bool(hellos), what="a hello after the reconnect")
            assert hellos[0].controller_id == "controller-test"
            assert service.nc.stats["reconnects"] >= 1  # said on the reconnect, not at start-up
            assert (await client.get("/healthz")).json()["nats_connected"]
        finally:
            replacement.stop()


# ---------------------------------------------------------------------------------------------------------
# Introspection


async def test_nats_health_metrics_docs(nats_server: EmbeddedNats) -> None:
    worker = FakeEngineWorker(nats_server.url, "observed")
    async with running_controller(nats_server.url) as (_, client), started(worker):
        worker.store(SEED_TOKENS)
        await wait_layout(client, SEED_TOKENS, {"observed": [LOCAL_CPU, 12]})
        nc = await bus.connect(nats_server.url, name="probe")
        try:
            reply = await bus.request(nc, Subjects.health(protocol.CONTROLLER.path), protocol.HealthRequest(),
                                      protocol.HealthReply, timeout=WAIT_S)
        finally:
            await nc.close()
        assert (reply.service, reply.service_id, reply.status) == ("controller", "controller-test", "ok")
        assert reply.details["num_keys"] == 1
        metrics = (await client.get("/metrics")).text
        assert "kvmesh_controller_index_keys 1" in metrics
        assert 'kvmesh_controller_producers{state="up"} 1' in metrics
        assert "kvmesh_controller_lookup_seconds_count" in metrics
        docs = await client.get("/docs")
        assert docs.status_code == 200 and "swagger" in docs.text.lower()
        paths = (await client.get("/openapi.json")).json()["paths"]
        for path in ("/lookup", "/pin", "/unpin", "/clear", "/check_finish", "/health", "/query_worker_info",
                     "/instances", "/metrics"):
            assert path in paths
        assert "tokens" in paths["/lookup"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
        healthz = (await client.get("/healthz")).json()
        assert healthz == {"status": "ok", "controller_id": "controller-test", "nats_connected": True}
        info = (await client.post("/query_worker_info", json={"instance_id": "observed"})).json()["worker_infos"][0]
        assert (info["model"], info["chunk_size"], info["alive"], info["num_keys"]) == (MODEL, 256, True, 1)


# ---------------------------------------------------------------------------------------------------------
# The command line, as the seeds run it


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def test_command_line_seed_flow_and_sigterm() -> None:
    """`python -m kvmesh.services.controller --host … --port … --monitor-port …` embeds NATS on the monitor port,
    serves the quickstarts' curl bodies, and stops everything on SIGTERM."""
    port, monitor_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.services.controller", "--host", "127.0.0.1", "--port", str(port),
         "--monitor-port", str(monitor_port), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as client:
            async def up() -> bool:
                assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                try:
                    return (await client.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False
            await wait_until_async(up, what="the controller subprocess")
            worker = FakeEngineWorker(f"nats://127.0.0.1:{monitor_port}", SEED_INSTANCE)
            async with started(worker):
                worker.store(SEED_TOKENS)
                await wait_layout(client, SEED_TOKENS, {SEED_INSTANCE: [LOCAL_CPU, 12]})
                pin = await client.post("/pin", content=(
                    b'{"tokens": [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13],'
                    b' "instance_id": "lmcache_default_instance", "location": "LocalCPUBackend"}'),
                    headers={"Content-Type": "application/json"})
                assert pin.status_code == 200 and pin.json()["num_tokens"] == 12
                clear = await client.post("/clear", content=(
                    b'{"instance_id": "lmcache_default_instance", "location": "LocalCPUBackend"}'),
                    headers={"Content-Type": "application/json"})
                assert clear.json()["num_tokens"] == 12
                lookup = await client.post("/lookup", content=(
                    b'{"tokens": [128000, 849, 21435, 279, 26431, 315, 85748, 6636, 304, 4221, 4211, 13]}'),
                    headers={"Content-Type": "application/json"})
                assert lookup.json()["layout_info"] == {}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0
        assert not _port_open(port) and not _port_open(monitor_port)  # REST and embedded NATS both gone
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        if process.stdout:
            process.stdout.close()
