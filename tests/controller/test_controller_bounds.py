"""The controller's bounds (issue 13): every limit a client can push on is a flag, refuses with a clear error
(HTTP 429/404, or a WARNING and a counter for NATS registrations), and the controller keeps serving.

Real NATS (EmbeddedNats), the in-process ControllerService and the protocol-speaking producers of
support/controller.py; time passes on a ManualClock where liveness matters.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from kvmesh.shared import protocol

from kvmesh.services.controller.service import ControllerService
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.protocol import LOCAL_CPU, Subjects

from support.controller import FakeEngineWorker, RawProducer, _has_instance, running_controller, started, wait_layout
from support.waiting import ManualClock, wait_until_async


def _refused(service: ControllerService, reason: str) -> int:
    return service.core.table.stats.registrations_refused[reason]


async def _register_again(producer: RawProducer) -> None:
    await bus.publish(producer.nc, Subjects.register(producer.path), protocol.RegisterEngine(
        worker_id=producer.worker_id, instance_id=producer.instance_id, model="test-model", kv_format="bfloat16/test",
        world_size=1, rank=0, chunk_size=producer.chunk_size, save_unfull_chunk=True, started_at=1.0))
    await producer.publish_sync()


async def test_producer_cap_refuses_and_expired_producers_free_their_slot(nats_server: EmbeddedNats) -> None:
    a, b, c = (RawProducer(nats_server.url, name) for name in ("a", "b", "c"))
    a_tokens, c_tokens = list(range(1, 9)), list(range(100, 108))
    clock = ManualClock()
    async with running_controller(nats_server.url, clock, max_producers=2, producer_expiry_s=100.0) \
            as (service, client), started(a, b):
        table = service.core.table
        for name in ("a", "b"):
            await wait_until_async(lambda n=name: _has_instance(client, n), what=f"registration of {name}")
        await a.batch(admitted=a.keys(a_tokens))
        await wait_layout(client, a_tokens, {"a": [LOCAL_CPU, 8]})
        a_slot = table.producer("a").slot

        async with started(c):  # a third producer: past --max-producers
            await wait_until_async(lambda: _refused(service, "max_producers") == 1, what="c refused")
            assert not await _has_instance(client, "c")
            metrics = (await client.get("/metrics")).text
            assert 'kvmesh_controller_registrations_refused_total{reason="max_producers"} 1' in metrics
            await wait_layout(client, a_tokens, {"a": [LOCAL_CPU, 8]}, "still serving")

            # a goes silent for longer than the liveness timeout, then the expiry; b keeps heartbeating.
            clock.advance(service.config.liveness_timeout_s + 1)
            await b.heartbeat()
            await wait_until_async(lambda: not table.producer("a").alive, what="a down")
            clock.advance(101)
            await b.heartbeat()
            await wait_until_async(lambda: table.producer("a") is None, what="a forgotten")
            assert len(table.index) == 0 and table.stats.producers_forgotten == 1
            assert not await _has_instance(client, "a")

            # c now fits, and takes a's slot: the masks stay as narrow as before, lookups exact.
            await _register_again(c)
            await wait_until_async(lambda: _has_instance(client, "c"), what="c registered")
            assert table.producer("c").slot == a_slot and table.index.num_slots == 2
            await c.batch(admitted=c.keys(c_tokens))
            await wait_layout(client, c_tokens, {"c": [LOCAL_CPU, 8]})
            await wait_layout(client, a_tokens, {}, "a's keys gone")


async def test_chunk_size_bounds_and_key_param_set_cap(nats_server: EmbeddedNats) -> None:
    tiny, huge = RawProducer(nats_server.url, "tiny", chunk_size=4), RawProducer(nats_server.url, "huge", chunk_size=2048)
    c16, c32 = RawProducer(nats_server.url, "c16", chunk_size=16), RawProducer(nats_server.url, "c32", chunk_size=32)
    c64 = RawProducer(nats_server.url, "c64", chunk_size=64)
    also16 = RawProducer(nats_server.url, "also16", chunk_size=16)
    tokens = list(range(1, 33))
    async with running_controller(nats_server.url, min_chunk_size=16, max_chunk_size=1024, max_key_param_sets=2) \
            as (service, client), started(tiny, huge, c16, c32):
        await wait_until_async(lambda: _refused(service, "chunk_size") == 2, what="chunk_size 4 and 2048 refused")
        for name in ("c16", "c32"):
            await wait_until_async(lambda n=name: _has_instance(client, n), what=f"registration of {name}")
        assert not await _has_instance(client, "tiny") and not await _has_instance(client, "huge")

        async with started(c64, also16):  # a third key parameter set is refused, a known one is not
            await wait_until_async(lambda: _refused(service, "key_param_sets") == 1, what="c64 refused")
            await wait_until_async(lambda: _has_instance(client, "also16"), what="also16 registered")
            assert not await _has_instance(client, "c64")
            assert len(service.core.table.quotas.key_specs) == 2
            metrics = (await client.get("/metrics")).text
            assert 'kvmesh_controller_registrations_refused_total{reason="chunk_size"} 2' in metrics
            assert 'kvmesh_controller_registrations_refused_total{reason="key_param_sets"} 1' in metrics
            await also16.batch(admitted=also16.keys(tokens))
            await wait_layout(client, tokens, {"also16": [LOCAL_CPU, 32]})


async def test_commands_in_flight_are_capped_with_429(nats_server: EmbeddedNats) -> None:
    silent = RawProducer(nats_server.url, "silent")
    body = {"instance_id": "silent", "location": LOCAL_CPU, "tokens": [1, 2, 3]}
    async with running_controller(nats_server.url, max_commands=2) as (service, client), started(silent):
        held: list[Any] = []

        async def hold(msg: Any) -> None:
            held.append(msg)  # answered when the test says so

        await silent.nc.subscribe(Subjects.worker("silent", "silent", "pin"), cb=hold)
        await silent.nc.flush()
        await wait_until_async(lambda: _has_instance(client, "silent"), what="registration")
        pending = [asyncio.create_task(client.post("/pin", json=body)) for _ in range(2)]
        await wait_until_async(lambda: len(held) == 2, what="both pins reaching the worker")

        refused = await client.post("/pin", json=body)
        assert refused.status_code == 429, refused.text
        assert "--max-commands 2" in refused.json()["detail"]
        assert (await client.get("/healthz")).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'kvmesh_controller_commands_total{op="pin",outcome="TooManyCommands"} 1' in metrics
        assert "kvmesh_controller_commands_in_flight 2" in metrics

        for msg in held:
            await msg.respond(protocol.encode(protocol.CommandReply(ok=True, num_tokens=3)))
        assert [r.status_code for r in await asyncio.gather(*pending)] == [200, 200]
        assert service.core.commands_in_flight == 0
        again = asyncio.create_task(client.post("/pin", json=body))  # room again
        await wait_until_async(lambda: len(held) == 3, what="the next pin reaching the worker")
        await held[2].respond(protocol.encode(protocol.CommandReply(ok=True, num_tokens=3)))
        assert (await again).status_code == 200


async def _status(client: httpx.AsyncClient, event_id: str) -> tuple[int, Any]:
    response = await client.post("/check_finish", json={"event_id": event_id})
    return response.status_code, response.json()


async def test_lookups_never_evict_command_event_ids(nats_server: EmbeddedNats) -> None:
    worker = FakeEngineWorker(nats_server.url, "w", chunk_size=4)
    tokens = list(range(1, 9))
    async with running_controller(nats_server.url, event_window_size=2, lookup_window_size=3) as (_, client), \
            started(worker):
        worker.store(tokens)
        await wait_layout(client, tokens, {"w": [LOCAL_CPU, 8]})
        pin = await client.post("/pin", json={"instance_id": "w", "location": LOCAL_CPU, "tokens": tokens})
        assert pin.status_code == 200, pin.text
        lookup_ids = [(await client.post("/lookup", json={"tokens": tokens})).json()["event_id"] for _ in range(10)]
        assert await _status(client, pin.json()["event_id"]) == (200, {"status": "finished"})
        assert (await _status(client, lookup_ids[-1]))[1] == {"status": "finished"}
        code, body = await _status(client, lookup_ids[0])  # past the lookup window
        assert code == 404 and "3 lookup" in body["detail"]

        clears = [(await client.post("/clear", json={"instance_id": "w", "location": LOCAL_CPU})).json()["event_id"]
                  for _ in range(2)]
        assert (await _status(client, pin.json()["event_id"]))[0] == 404  # commands have their own window of 2
        assert [(await _status(client, i))[1] for i in clears] == [{"status": "finished"}] * 2
        metrics = (await client.get("/metrics")).text
        assert 'kvmesh_controller_tracked_events{window="commands"} 2' in metrics
        assert 'kvmesh_controller_tracked_events{window="lookups"} 3' in metrics


async def test_heartbeats_of_unknown_producers_cost_o1_each_and_sync_requests_are_budgeted_per_principal(
        nats_server: EmbeddedNats) -> None:
    """One engine heartbeats under 30,000 producer ids of its own that never registered: each used to make the
    controller ask that id for a full sync (30,000 NATS requests). Now its principal gets --sync-requests-per-principal
    requests a second at most; the rest are dropped and counted. The clock never moves, so the budget never refills:
    exactly one burst goes out. Another principal's unknown producer is still asked at once."""
    flood_ids = [f"ghost-{i}" for i in range(30_000)]
    clock = ManualClock()
    async with running_controller(nats_server.url, clock) as (service, client):
        feed = service.feed
        assert feed is not None
        budget = 64  # --sync-requests-per-principal, default
        flood, other = await bus.connect(nats_server.url, "flood"), await bus.connect(nats_server.url, "other")
        asked: dict[str, list[str]] = {"flood": [], "other": []}
        try:
            for name, nc in (("flood", flood), ("other", other)):
                async def note(msg: Any, name: str = name) -> None:
                    asked[name].append(msg.subject)
                await nc.subscribe(f"kvmesh.sync.{protocol.Principal.engine(name).path}.>", cb=note)
                await nc.flush()
            for producer_id in flood_ids:
                path = protocol.Principal.engine("flood").producer(producer_id)
                await bus.publish(flood, Subjects.heartbeat(path), protocol.Heartbeat(producer_id=producer_id,
                                                                                         last_seq=0))
            await flood.flush()

            def handled() -> bool:
                return feed.sync_requests_sent + getattr(feed, "sync_requests_limited", 0) >= len(flood_ids)
            await wait_until_async(handled, what="every heartbeat of the flood handled")
            assert feed.sync_requests_sent == budget, f"{feed.sync_requests_sent} sync requests for one principal"
            assert service.config.sync_requests_per_principal == budget
            assert feed.sync_requests_limited == len(flood_ids) - budget
            metrics = (await client.get("/metrics")).text
            assert f'kvmesh_controller_syncs_total{{outcome="limited"}} {len(flood_ids) - budget}' in metrics

            lone = protocol.Principal.engine("other").producer("other")
            await bus.publish(other, Subjects.heartbeat(lone), protocol.Heartbeat(producer_id="other", last_seq=0))
            await wait_until_async(lambda: asked["other"] == [Subjects.sync(lone)], what="the other principal asked")
            await wait_until_async(lambda: len(asked["flood"]) == budget, what="the flood's budget of requests")
        finally:
            await flood.close()
            await other.close()
