"""NATS plumbing on a real nats-server: typed serve/request, garbage dropped, admissions numbered and synced."""

import asyncio
import contextlib

import pytest

from kvmesh.shared import protocol

from kvmesh.shared.errors import MeshUnavailable
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.admissions import DESCRIBED_BYTES_PER_BATCH, AdmissionReporter
from kvmesh.shared.wire.kv_events import ChunkDescription, pack_tokens, parse_description

from support.waiting import WAIT_S, wait_until_async


async def test_serve_answers_typed_requests_and_survives_garbage(nc) -> None:
    async def handler(cmd: protocol.WorkerCommand) -> protocol.CommandReply:
        if cmd.op == "boom":
            raise RuntimeError("handler bug")
        return protocol.CommandReply(ok=True, num_tokens=len(cmd.tokens))

    await bus.serve(nc, "t.cmd", protocol.WorkerCommand, handler)
    for garbage in (b"", b"\x00\xff", b"not msgpack at all", protocol.encode(protocol.Ack())):
        reply = await nc.request("t.cmd", garbage, timeout=WAIT_S)
        assert protocol.decode(reply.data, protocol.Ack).ok is False
    with pytest.raises(MeshUnavailable, match="handler bug"):
        await bus.request(nc, "t.cmd", protocol.WorkerCommand(op="boom", location="x"), protocol.CommandReply,
                          WAIT_S)
    reply = await bus.request(nc, "t.cmd", protocol.WorkerCommand(op="pin", location="x", tokens=[1, 2]),
                              protocol.CommandReply, WAIT_S)
    assert reply.num_tokens == 2


async def test_a_flush_right_after_subscribing_means_the_server_has_the_subscriptions(nats_server, nc) -> None:
    """A request sent once a new connection's subscribe + flush returned finds its responder, every time (nats-py's
    own flush could let its PING overtake the SUBs still buffered: ~1 in 10 such requests got no responders)."""

    async def answer(msg) -> None:
        await msg.respond(b"ok")

    for i in range(50):
        responder = await bus.connect(nats_server.url, f"responder-{i}")
        try:
            for op in ("put", "get", "stats"):
                await responder.subscribe(f"t.flush.{i}.{op}", cb=answer)
            await responder.flush()
            assert (await nc.request(f"t.flush.{i}.stats", b"", timeout=WAIT_S)).data == b"ok"
        finally:
            await responder.close()


async def test_a_drained_subscription_has_sent_the_replies_of_its_handlers_still_running(nats_server, nc) -> None:
    """A store moving an engine to a lane of its own drains the old subscription, then closes that connection: a
    request whose handler (one of several running at once) was still working must get its reply, not a timeout.
    So `bus.drain` returns only once those handlers are done, not when nats-py's drain is."""
    started, finish, nats_drained = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def handler(_: protocol.StatsRequest) -> protocol.Ack:
        started.set()
        await finish.wait()
        return protocol.Ack(ok=True)

    responder = await bus.connect(nats_server.url, "draining-responder")
    subscription = await bus.serve(responder, "t.drained", protocol.StatsRequest, handler, max_concurrent=4)
    await responder.flush()
    asked = asyncio.ensure_future(bus.request(nc, "t.drained", protocol.StatsRequest(), protocol.Ack, WAIT_S))
    await asyncio.wait_for(started.wait(), WAIT_S)
    nats_drain = subscription.drain

    async def drain_and_tell() -> None:
        await nats_drain()
        nats_drained.set()

    subscription.drain = drain_and_tell  # type: ignore[method-assign]
    drained = asyncio.ensure_future(bus.drain(subscription))
    await asyncio.wait_for(nats_drained.wait(), WAIT_S)
    assert not drained.done(), "bus.drain returned while a handler was still running"
    finish.set()
    await asyncio.wait_for(drained, WAIT_S)
    await responder.drain()  # as a store retires a lane
    assert (await asked).ok


async def test_request_without_responder_or_in_time_is_mesh_unavailable(nc) -> None:
    with pytest.raises(MeshUnavailable, match="no responder"):
        await bus.request(nc, "nobody.here", protocol.StatsRequest(), protocol.StatsReply, WAIT_S)

    answer = asyncio.Event()

    async def slow(_: protocol.StatsRequest) -> protocol.Ack:
        await answer.wait()  # answers only after the request has timed out
        return protocol.Ack()

    await bus.serve(nc, "slow", protocol.StatsRequest, slow)
    with pytest.raises(MeshUnavailable, match="within"):
        await bus.request(nc, "slow", protocol.StatsRequest(), protocol.Ack, 0.2)
    answer.set()


async def test_reporter_numbers_batches_and_answers_sync(nc) -> None:
    held: set[bytes] = set()
    registration = protocol.RegisterStore(store_id="s1", location=protocol.LOCAL_DISK)
    received: list[object] = []
    registered = asyncio.Event()

    async def on_event(msg) -> None:
        for kind in (protocol.AdmissionBatch, protocol.SyncChunk):
            try:
                received.append(protocol.decode(msg.data, kind))
            except Exception:
                continue

    async def on_register(msg) -> None:
        registered.set()

    await nc.subscribe(protocol.Subjects.events(protocol.store_path("s1")), cb=on_event)
    await nc.subscribe(protocol.Subjects.register(protocol.store_path("s1")), cb=on_register)
    reporter = AdmissionReporter("s1", protocol.store_path("s1"), protocol.LOCAL_DISK, lambda: list(held),
                                 lambda: registration,
                                 flush_interval=0.01)
    await reporter.start(nc)
    await asyncio.wait_for(registered.wait(), WAIT_S)
    for i in range(3):
        key = bytes([i]) * 16
        held.add(key)
        reporter.admit(key)
        await reporter.flush()
    held.discard(bytes([0]) * 16)
    reporter.evict(bytes([0]) * 16)
    await reporter.flush()
    await bus.request(nc, protocol.Subjects.sync(protocol.store_path("s1")), protocol.SyncRequest(reason="test"), protocol.Ack, WAIT_S)
    await wait_until_async(lambda: any(isinstance(m, protocol.SyncChunk) and m.final and m.seq == 4 for m in received),
                           what="the requested full sync")
    await reporter.stop()
    batches = [m for m in received if isinstance(m, protocol.AdmissionBatch)]
    assert [b.seq for b in batches] == [1, 2, 3, 4]
    assert batches[-1].evicted == [bytes([0]) * 16]
    syncs = [m for m in received if isinstance(m, protocol.SyncChunk)]
    assert syncs[0].keys == [] and syncs[0].seq == 0  # the start-up sync, before any admission
    assert set(syncs[-1].keys) == held and syncs[-1].seq == 4 and syncs[-1].final


async def test_a_store_that_subscribes_a_moment_late_still_gets_the_request(nc, monkeypatch) -> None:
    """A store opens a newly listed principal's lane within a moment (shared/store_kit/store_endpoint.py): a reachable
    store's "no responder" is taken for that gap and the request sent again (nobody got it), not a store down."""
    import logging

    from kvmesh.services.engine.tiers.base import StoreLink
    from kvmesh.shared.errors import NoResponder

    link = StoreLink("late", "store late", logging.getLogger("test"), "engine.a.w0", retry_interval=60.0)
    tries: list[str] = []
    request = bus.request

    async def answer(msg) -> None:
        await msg.respond(protocol.encode(protocol.ContainsReply(prefix=0)))

    async def subscribing_after_the_first_miss(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return await request(*args, **kwargs)
        except NoResponder:
            tries.append("no responder")
            if len(tries) == 1:
                await nc.subscribe(link.subject("contains"), cb=answer)
                await nc.flush()
            raise

    monkeypatch.setattr(bus, "request", subscribing_after_the_first_miss)
    reply = await link.request(nc, "contains", protocol.ChunkKeys(keys=[]), protocol.ContainsReply, WAIT_S)
    assert reply == protocol.ContainsReply(prefix=0) and tries == ["no responder"] and link.reachable

    gone = StoreLink("gone", "store gone", logging.getLogger("test"), "engine.a.w0", retry_interval=60.0)
    tries.clear()
    assert await gone.request(nc, "contains", protocol.ChunkKeys(keys=[]), protocol.ContainsReply, WAIT_S) is None
    assert not gone.reachable and 1 < len(tries) <= 10  # retried for a moment, then taken for down
    assert await gone.request(nc, "contains", protocol.ChunkKeys(keys=[]), protocol.ContainsReply, WAIT_S) is None
    assert len(tries) <= 10  # resting: not even sent


async def test_described_admissions_are_cut_into_batches_nats_takes(nc) -> None:
    """An admission noted with a description carries it in its batch; 600 chunks of 256 tokens (~600 KiB of
    token ids) go out in several numbered batches, each under the budget, every description once, with its key
    admitted in the same batch; a description of a chunk evicted before the flush is not sent."""
    received: list[protocol.AdmissionBatch] = []

    async def on_event(msg) -> None:
        with contextlib.suppress(Exception):
            received.append(protocol.decode(msg.data, protocol.AdmissionBatch))

    path = protocol.Principal.engine("inst").producer("w0")
    await nc.subscribe(protocol.Subjects.events(path), cb=on_event)
    reporter = AdmissionReporter("w0", path, protocol.LOCAL_CPU, lambda: [],
                                 lambda: protocol.RegisterStore(store_id="w0", location=protocol.LOCAL_CPU),
                                 flush_interval=3600)
    await reporter.start(nc)
    keys = [i.to_bytes(16, "big") for i in range(600)]
    for index, key in enumerate(keys):
        reporter.describe(key, ChunkDescription(keys[index - 1] if index else None,
                                                pack_tokens(range(index, index + 256)), None, None))
        reporter.admit(key)
    reporter.evict(keys[-1])
    await reporter.flush()
    await wait_until_async(lambda: sum(len(b.admitted) + len(b.evicted) for b in received) == 600,
                           what="every admission's batch")
    await reporter.stop()
    assert len(received) >= 3 and [b.seq for b in received] == list(range(1, len(received) + 1))
    seen: dict[bytes, ChunkDescription] = {}
    for batch in received:
        assert sum(len(item[2]) for item in batch.described) <= DESCRIBED_BYTES_PER_BATCH
        for item in batch.described:
            parsed = parse_description(item, 256)
            assert parsed is not None and parsed[0] in batch.admitted and parsed[0] not in seen
            seen[parsed[0]] = parsed[1]
    assert sorted(seen) == keys[:-1]
    assert all(seen[key].tokens() == list(range(i, i + 256)) for i, key in enumerate(keys[:-1]))
    assert all(seen[key].parent == (keys[i - 1] if i else None) for i, key in enumerate(keys[:-1]))
