"""The controller's fleet-wide KV event stream (services/controller/kv_event_stream.py) end to end: a real
nats-server, the controller's real service, producers that speak the real protocol (an engine worker's CPU
tier, a disk store, a remote store), a real ZMQ subscriber decoding with vLLM's own `KVEventBatch`. From the
events alone it rebuilds every holder's chunks, and that must equal the holder index the controller answers
/lookup from, and give /lookup's own answers, across puts, evictions, a clear, a late subscriber catching up by
replay and a controller restart."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from typing import Any, Iterable

import httpx
import pytest

from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvmesh.services.controller.config import parse_args
from kvmesh.services.controller.holder_index import HolderIndex
from kvmesh.services.controller.service import ControllerService
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, free_port
from kvmesh.services.engine.adapter.kv_events import event_digest
from kvmesh.services.engine.adapter.scheduler_lookup import engines
from kvmesh.services.engine.assembly import build_engine
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, LOCATIONS, REMOTE
from kvmesh.shared.wire.keys import KeyParams
from kvmesh.shared.wire.kv_events import ChunkDescription, external_hash, pack_tokens

from support.connector_driver import Step, blocks, prefill, request, run_worker_step, scheduler_half, worker_half
from support.engine import BLOCK, CHUNK, PagedKV, engine_config, random_tokens
from support.controller import MODEL, FakeEngineWorker, FakeStore, layout, running_controller, started
from support.engine_mesh import engine_on
from support.kv_event_stream import StreamSubscriber, subscribed
from support.kv_oracle import Forward
from support.waiting import WAIT_S, wait_until_async

class Recorder:
    """An IndexWatcher that writes down what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def changed(self, slot: int, stored: list[bytes], removed: list[bytes]) -> None:
        self.calls.append(("changed", slot, sorted(stored), sorted(removed)))

    def cleared(self, slot: int) -> None:
        self.calls.append(("cleared", slot))


def test_the_index_tells_its_watcher_exactly_the_keys_whose_bit_changed() -> None:
    index, recorder = HolderIndex(), Recorder()
    a, b = index.new_slot(), index.new_slot()
    index.set_ordered(a, True)
    k1, k2, k3 = b"1" * 16, b"2" * 16, b"3" * 16
    index.admit(a, [k1])  # before a watcher: nothing gathered, nothing told
    index.watcher = recorder
    index.admit(a, [k1, k2])  # k1 already held: only k2 is news
    index.admit(b, [k1])
    index.evict(a, [k1, k3])  # k3 was never held
    index.evict(a, [k3])  # no change: not told
    index.replace(b, {k2, k3})  # gains k2 and k3, loses k1
    index.clear_slot(b)  # emptied: one `cleared`, no key list
    index.clear_slot(b)  # already empty: nothing
    index.admit(a, [k3])
    index.release_slot(a)  # a forgotten producer: emptied too
    assert recorder.calls == [
        ("changed", a, [k2], []), ("changed", b, [k1], []), ("changed", a, [], [k1]),
        ("changed", b, sorted([k2, k3]), []), ("changed", b, [], [k1]), ("cleared", b),
        ("changed", a, [k3], []), ("cleared", a)]
    assert len(index) == 0


@pytest.mark.parametrize("argv, error", [
    (["--kv-events-replay-port", "5558"], "--kv-events-replay-port needs --kv-events-port"),
    (["--kv-events-port", "5557", "--kv-events-host", "0.0.0.0"], "beyond loopback, unauthenticated"),
])
async def test_a_stream_without_its_port_or_open_beyond_loopback_is_refused(argv: list[str], error: str) -> None:
    config = parse_args(argv + ["--host", "127.0.0.1", "--port", "0"])
    assert error in (config.kv_events_error() or "")
    with pytest.raises(ConfigError, match=error):
        await ControllerService(config).start()
    assert parse_args(argv + ["--kv-events-port", "5557", "--kv-events-public"]).kv_events_error() is None


STREAM = dict(kv_events_port=0, kv_events_replay_port=0)
TOKENS = list(range(1, 17))  # four chunks of 4
SALT_DIGEST = event_digest(b"salt", "tenant-1")
OTHER = list(range(100, 112))  # three chunks of 4


def index_view(service: ControllerService) -> dict[tuple[str, str], set[int | bytes]]:
    """What the controller's holder index holds, per (holder, location), in the stream's hashes."""
    table = service.core.table
    view: dict[tuple[str, str], set[int | bytes]] = {}
    for producer in table.producers.values():
        bit = 1 << producer.slot
        hashes = {external_hash(key, True) for key, mask in table.index.table.items() if mask & bit}
        if hashes:
            view[(producer.producer_id, str(producer.location))] = hashes
    return view


def described_as_put(subscriber: StreamSubscriber, holder: str, worker: FakeEngineWorker, tokens: list[int],
                     chunks: Iterable[int], medium: str = LOCAL_CPU, lora_name: str | None = None,
                     extra_keys: list[tuple[object, ...]] | None = None) -> None:
    """`holder`'s BlockStored of each of `chunks` of `tokens` carried the chunk's tokens and its parent's hash."""
    spans = worker.spans(tokens)
    for index in chunks:
        span = spans[index]
        event = subscriber.blocks[(holder, external_hash(span.key, True))]
        assert event.token_ids == tokens[span.start:span.end], (holder, index)
        parent = external_hash(spans[index - 1].key, True) if index else None
        assert event.parent_block_hash == parent and event.block_size == worker.chunk_size, (holder, index)
        assert event.medium == medium and event.lora_name == lora_name and event.extra_keys == extra_keys, event


def lookup_from_events(subscriber: StreamSubscriber, worker: FakeEngineWorker,
                       tokens: list[int]) -> list[Any] | None:
    """/lookup's answer for `worker`'s instance, computed from the events alone: the longest held prefix over its
    locations (the CPU tier is the worker's, the others its stores'), ties to the faster one."""
    holders = {LOCAL_CPU: [worker.worker_id], LOCAL_DISK: [worker.disk.store_id] if worker.disk else [],
               REMOTE: [remote.store_id for remote in worker.remotes]}
    view = subscriber.view()
    best: list[Any] | None = None
    for location in LOCATIONS:
        held = set().union(*(view.get((holder, location), set()) for holder in holders[location]))
        prefix = 0
        for span in worker.spans(tokens):
            if external_hash(span.key, True) not in held:
                break
            prefix = span.end
        if prefix and (best is None or prefix > best[1]):
            best = [location, prefix]
    return best


async def agrees(service: ControllerService, client: httpx.AsyncClient, subscriber: StreamSubscriber,
                 workers: list[FakeEngineWorker], what: str) -> None:
    """Wait until the events rebuild the controller's index, then check that they answer /lookup as it does."""
    await wait_until_async(lambda: subscriber.view() == index_view(service), what=f"{what}: events == index")
    for tokens in (TOKENS, OTHER):
        answer = await layout(client, tokens)
        for worker in workers:
            assert answer.get(worker.instance_id) == lookup_from_events(subscriber, worker, tokens), (what, tokens)


async def test_the_stream_rebuilds_the_index_through_puts_evictions_a_clear_and_a_late_joiner(
        nats_server: EmbeddedNats) -> None:
    disk = FakeStore(nats_server.url, "disk-1", LOCAL_DISK)
    remote = FakeStore(nats_server.url, "remote-1", REMOTE)
    worker_a = FakeEngineWorker(nats_server.url, "inst-a", chunk_size=4, disk=disk, remotes=(remote,))
    # a real worker id's tag is "<pid>-<hex>"; this one has a "%" too, to show the topic's escaping reverses
    worker_b = FakeEngineWorker(nats_server.url, "inst-b", chunk_size=4, incarnation="7%40x")
    workers = [worker_a, worker_b]
    async with running_controller(nats_server.url, **STREAM) as (service, client):
        stream = service.kv_events
        assert stream is not None and stream.replay_endpoint is not None
        assert stream.endpoint.startswith("tcp://127.0.0.1:")
        async with subscribed(stream.endpoint, stream.replay_endpoint) as subscriber, \
                started(disk, remote, worker_a, worker_b):
            # A's CPU tier first, its admissions describing the chunks (as an engine's saves do); then the stores,
            # which admit keys only (the disk store's chunks were A's: the controller describes them from A's)
            worker_a.store(TOKENS, describe=True)
            await wait_until_async(lambda: len(index_view(service).get((worker_a.worker_id, LOCAL_CPU), ())) == 4,
                                   what="A's chunks indexed")
            worker_a.store(TOKENS, chunks=[0, 1], where=LOCAL_DISK)
            worker_a.store(OTHER, where=REMOTE)
            worker_b.store(TOKENS, chunks=[0])
            await wait_until_async(lambda: len(index_view(service)) == 4, what="every holder indexed")
            await agrees(service, client, subscriber, workers, "puts")
            # Each described chunk is one BlockStored with the tokens put and its parent's hash, as vLLM's
            # classes decode it; B's admission of A's first chunk (same key) is described from A's; the remote
            # store's chunks were never described (no engine's admission of them): hashes only.
            described_as_put(subscriber, worker_a.worker_id, worker_a, TOKENS, range(4))
            described_as_put(subscriber, "disk-1", worker_a, TOKENS, range(2), medium=LOCAL_DISK)
            described_as_put(subscriber, worker_b.worker_id, worker_a, TOKENS, range(1))
            assert not [holder for holder, _ in subscriber.blocks if holder == "remote-1"]
            assert len(subscriber.blocks) == 4 + 2 + 1 and stream.descriptions.refused == 0
            assert await layout(client, TOKENS) == {"inst-a": [LOCAL_CPU, 16], "inst-b": [LOCAL_CPU, 4]}
            # The media are KVMesh's location names, one per holder; topics name the engine's model.
            assert dict(subscriber.media) == {worker_a.worker_id: {LOCAL_CPU}, worker_b.worker_id: {LOCAL_CPU},
                                              "disk-1": {LOCAL_DISK}, "remote-1": {REMOTE}}
            assert subscriber.models == {worker_a.worker_id: MODEL, worker_b.worker_id: MODEL,
                                         "disk-1": "", "remote-1": ""}
            # three "@"-separated parts, as llm-d's indexer splits kv@<pod>@<model>: the worker id's "@" escaped
            assert subscriber.topics == {b"kv@inst-a@" + MODEL.encode(), b"kv@inst-b%407%2540x@" + MODEL.encode(),
                                         b"kv@disk-1@", b"kv@remote-1@"}
            # The hashes are vLLM's own form of the keys (its default: ints), as the engine's in-vLLM events.
            key = worker_a.spans(TOKENS)[0].key
            assert external_hash(key, True) == maybe_convert_block_hash(BlockHash(key))

            # Evictions: from the CPU tier (a chunk in the middle) and from the disk store.
            for span in worker_a.spans(TOKENS)[2:3]:
                del worker_a.chunks[span.key]
                worker_a.reporter.evict(span.key)
            second = worker_a.spans(TOKENS)[1].key
            del disk.chunks[second]
            disk.reporter.evict(second)
            await wait_until_async(lambda: len(index_view(service)[(worker_a.worker_id, LOCAL_CPU)]) == 3,
                                   what="the CPU-tier eviction indexed")
            await agrees(service, client, subscriber, workers, "evictions")
            assert (await layout(client, TOKENS))["inst-a"] == [LOCAL_CPU, 8]

            # A clear of A's CPU tier empties that holder: one AllBlocksCleared on its topic.
            cleared = await client.post("/clear", json={"instance_id": "inst-a", "location": LOCAL_CPU})
            assert cleared.status_code == 200, cleared.text
            await wait_until_async(lambda: worker_a.worker_id in subscriber.cleared, what="AllBlocksCleared")
            assert subscriber.cleared == [worker_a.worker_id]
            await agrees(service, client, subscriber, workers, "clear")
            assert (await layout(client, TOKENS))["inst-a"] == [LOCAL_DISK, 4]

            # A subscriber joining now catches up by replay from seq 0, then follows the live stream.
            async with subscribed(stream.endpoint, stream.replay_endpoint, replay_first=True) as late:
                assert late.replays == 1 and late.received == 0
                await agrees(service, client, late, workers, "late joiner, replayed")
                worker_b.store(OTHER, describe=True, lora_name="adapter-x", extra_keys=(SALT_DIGEST,))
                worker_a.store(TOKENS, chunks=[3])
                await wait_until_async(lambda: (worker_b.worker_id, LOCAL_CPU) in index_view(service)
                                       and len(index_view(service)[(worker_b.worker_id, LOCAL_CPU)]) == 4,
                                       what="B's new chunks indexed")
                await agrees(service, client, late, workers, "late joiner, live")
                described_as_put(late, worker_b.worker_id, worker_b, OTHER, range(3), lora_name="adapter-x",
                                 extra_keys=[(SALT_DIGEST,)])
                await agrees(service, client, subscriber, workers, "first subscriber, live")
                assert late.view() == subscriber.view() and late.next_seq == subscriber.next_seq
            assert stream.replays_served >= 1
            metrics = (await client.get("/metrics")).text
            assert f'kvmesh_controller_kv_events_total{{what="messages"}} {stream.messages_published}' in metrics
            assert stream.messages_published >= subscriber.next_seq > 0


async def test_an_engines_saved_chunks_reach_the_stream_with_their_tokens_and_parents(
        nats_server: EmbeddedNats) -> None:
    """A real cache engine with describe_admissions, driven by the connector's two halves as vLLM drives them,
    saves a prompt of three chunks, a partial one and its block prefix: each is one BlockStored on the engine
    worker's topic with the prompt's tokens and its parent's hash, as vLLM's classes decode them."""
    kv = PagedKV(num_blocks=128)
    tokens = random_tokens(3 * CHUNK + BLOCK + 5, seed=3).tolist()  # chunks [0,32) [32,64) [64,96) [96,117)
    async with running_controller(nats_server.url, **STREAM) as (service, client):
        stream = service.kv_events
        assert stream is not None and stream.replay_endpoint is not None
        async with subscribed(stream.endpoint, stream.replay_endpoint) as subscriber:
            engine = await asyncio.to_thread(engine_on, nats_server.url, kv, lmcache_instance_id="inst-e",
                                             describe_admissions=True)
            engines.add(0, engine)
            sched = scheduler_half(engine.config, BLOCK, saves_off_forward=False)
            try:
                work = worker_half(engine, kv.caches, BLOCK, saves_off_forward=False)
                await asyncio.to_thread(prefill, sched, work, Forward(kv), "r1", tokens, list(range(8)))
                mine = lambda: {h: e for (holder, h), e in subscriber.blocks.items() if holder == engine.worker_id}
                await wait_until_async(lambda: len(mine()) == 5, what="the prompt's five chunks described")
            finally:
                sched.shutdown()
                engines.remove(engine)
                await asyncio.to_thread(engine.close)
    tracker = sched.scheduler_side.tracker("r1")
    assert tracker is not None
    chain = tracker.chain
    events = mine()
    hashes = [external_hash(span.key, True) for span in chain]
    assert len(hashes) == 4, chain
    for index, span in enumerate(chain):
        event = events.pop(hashes[index])
        assert event.token_ids == tokens[span.start:span.end], index
        assert event.parent_block_hash == (hashes[index - 1] if index else None), index
        assert event.block_size == CHUNK and event.medium == LOCAL_CPU and event.extra_keys is None
    (prefix,) = events.values()  # the last chunk's block prefix: tokens [96, 112) under the third chunk
    assert prefix.token_ids == tokens[3 * CHUNK:3 * CHUNK + BLOCK] and prefix.parent_block_hash == hashes[2]


async def test_tensor_parallel_ranks_describe_their_chunks_under_their_own_shard_keys(
        nats_server: EmbeddedNats) -> None:
    """Two ranks of one instance (real engines, the scheduler half's lookups over both, one step's metadata run
    by each worker half): each rank's topic carries its shard keys, its parents as its shard names them, and the
    prompt's tokens."""
    tokens = random_tokens(2 * CHUNK, seed=4).tolist()
    ranks = [KeyParams(model="test-model", kv_format="", world_size=2, rank=rank) for rank in range(2)]
    kvs = [PagedKV(num_blocks=128, seed=rank) for rank in range(2)]
    async with running_controller(nats_server.url, **STREAM) as (service, client):
        stream = service.kv_events
        assert stream is not None and stream.replay_endpoint is not None
        async with subscribed(stream.endpoint, stream.replay_endpoint) as subscriber:
            config = engine_config(nats_url=nats_server.url, lmcache_instance_id="inst-tp", describe_admissions=True)
            workers = [await asyncio.to_thread(build_engine, config, params, kv.layout)
                       for params, kv in zip(ranks, kvs)]
            for rank, engine in enumerate(workers):
                assert await asyncio.to_thread(engine.wait_connected, WAIT_S)
                engines.add(rank, engine)
            sched = scheduler_half(config, BLOCK, saves_off_forward=False, world_size=2)
            try:
                halves = [worker_half(engine, kv.caches, BLOCK, saves_off_forward=False)
                          for engine, kv in zip(workers, kvs)]
                req = request("r1", tokens)
                assert await asyncio.to_thread(sched.get_num_new_matched_tokens, req, 0) == (0, False)
                sched.update_state_after_alloc(req, blocks(list(range(4))), 0)
                metadata = sched.build_connector_meta(Step(new=[("r1", list(range(4)), 0, len(tokens))]).output())
                for half in halves:
                    await asyncio.to_thread(run_worker_step, half, metadata, set())
                described = lambda rank: {h: e for (holder, h), e in subscriber.blocks.items()  # noqa: E731
                                          if holder == workers[rank].worker_id}
                await wait_until_async(lambda: all(len(described(rank)) == 2 for rank in range(2)),
                                       what="both ranks' two chunks described")
            finally:
                sched.shutdown()
                for engine in workers:
                    engines.remove(engine)
                    await asyncio.to_thread(engine.close)
    tracker = sched.scheduler_side.tracker("r1")
    assert tracker is not None and len(tracker.chain) == 2
    for rank, params in enumerate(ranks):
        events = described(rank)
        first, second = (external_hash(params.shard_key(span.key), True) for span in tracker.chain)
        assert set(events) == {first, second}, rank
        assert events[first].parent_block_hash is None and events[first].token_ids == tokens[:CHUNK]
        assert events[second].parent_block_hash == first and events[second].token_ids == tokens[CHUNK:]


async def test_descriptions_over_the_bounds_or_with_a_value_in_clear_are_refused(nats_server: EmbeddedNats) -> None:
    """Descriptions are untrusted input: more tokens than the engine's chunk size, or an extra key that is not a
    digest (a salt in clear), is refused and counted; the chunk is still indexed and published, hashes only."""
    worker = FakeEngineWorker(nats_server.url, "inst-a", chunk_size=4)
    spans = worker.spans(TOKENS)
    async with running_controller(nats_server.url, **STREAM) as (service, client):
        stream = service.kv_events
        assert stream is not None and stream.replay_endpoint is not None
        async with subscribed(stream.endpoint, stream.replay_endpoint) as subscriber, started(worker):
            bad = {0: ChunkDescription(None, pack_tokens(TOKENS[:5]), None, None),  # 5 tokens, chunk size 4
                   1: ChunkDescription(spans[0].key, pack_tokens(TOKENS[4:8]), ("tenant-1",), None),  # in clear
                   2: ChunkDescription(spans[1].key, pack_tokens(TOKENS[8:12]), None, None)}  # a good one
            for index, description in bad.items():
                worker.chunks[spans[index].key] = 4
                worker.reporter.describe(spans[index].key, description)
                worker.reporter.admit(spans[index].key)
            await wait_until_async(lambda: len(index_view(service).get((worker.worker_id, LOCAL_CPU), ())) == 3,
                                   what="the three chunks indexed")
            await agrees(service, client, subscriber, [worker], "refused descriptions")
            assert stream.descriptions.refused == 2
            assert list(subscriber.blocks) == [(worker.worker_id, external_hash(spans[2].key, True))]
            described_as_put(subscriber, worker.worker_id, worker, TOKENS, [2])
            metrics = (await client.get("/metrics")).text
            assert 'kvmesh_controller_kv_events_total{what="descriptions_refused"} 2' in metrics


async def test_a_stores_chunk_is_described_while_the_controller_remembers_an_engines_description(
        nats_server: EmbeddedNats) -> None:
    """With --kv-events-chunks 2 the controller remembers the last two descriptions: of four chunks an engine
    described, a store admitting all four afterwards is published with tokens and parents for the last two only,
    and hashes only for the others."""
    disk = FakeStore(nats_server.url, "disk-1", LOCAL_DISK)
    worker = FakeEngineWorker(nats_server.url, "inst-a", chunk_size=4, disk=disk)
    async with running_controller(nats_server.url, kv_events_chunks=2, **STREAM) as (service, client):
        stream = service.kv_events
        assert stream is not None and stream.replay_endpoint is not None
        async with subscribed(stream.endpoint, stream.replay_endpoint) as subscriber, started(disk, worker):
            worker.store(TOKENS, describe=True)
            await wait_until_async(lambda: len(index_view(service).get((worker.worker_id, LOCAL_CPU), ())) == 4,
                                   what="the engine's chunks indexed")
            worker.store(TOKENS, where=LOCAL_DISK)
            await wait_until_async(lambda: len(index_view(service).get(("disk-1", LOCAL_DISK), ())) == 4,
                                   what="the store's chunks indexed")
            await agrees(service, client, subscriber, [worker], "a store after the engine")
            assert len(stream.descriptions) == 2
            described_as_put(subscriber, worker.worker_id, worker, TOKENS, range(4))
            described_as_put(subscriber, "disk-1", worker, TOKENS, [2, 3], medium=LOCAL_DISK)
            assert sorted(h for holder, h in subscriber.blocks if holder == "disk-1") == sorted(
                external_hash(span.key, True) for span in worker.spans(TOKENS)[2:])


async def test_a_restarted_store_is_followed_through_its_full_sync(nats_server: EmbeddedNats) -> None:
    """A store that restarts holding less (here: its first chunk only) full-syncs; the keys it lost leave the
    index as BlockRemoved on its topic, and the events still rebuild the index and /lookup's answers."""
    remote = FakeStore(nats_server.url, "remote-1", REMOTE)
    worker = FakeEngineWorker(nats_server.url, "inst-a", chunk_size=4, remotes=(remote,))
    first = worker.spans(OTHER)[0].key
    async with running_controller(nats_server.url, **STREAM) as (service, client):
        stream = service.kv_events
        assert stream is not None and stream.replay_endpoint is not None
        async with subscribed(stream.endpoint, stream.replay_endpoint) as subscriber, started(worker):
            async with started(remote):
                worker.store(OTHER, where=REMOTE)
                await wait_until_async(lambda: len(index_view(service).get(("remote-1", REMOTE), ())) == 3,
                                       what="the store's chunks indexed")
                await agrees(service, client, subscriber, [worker], "before the restart")
            reborn = FakeStore(nats_server.url, "remote-1", REMOTE)
            reborn.chunks = {first: 4}
            async with started(reborn):
                await wait_until_async(lambda: index_view(service).get(("remote-1", REMOTE)) == {
                    external_hash(first, True)}, what="the restarted store's full sync indexed")
                await agrees(service, client, subscriber, [worker], "after the restart")
                assert (await layout(client, OTHER))["inst-a"] == [REMOTE, 4]
                assert subscriber.cleared == []  # a full sync removes what is gone, key by key


async def test_a_restarted_controller_republishes_every_holding(nats_server: EmbeddedNats) -> None:
    """A new controller counts from seq 0 again and, as producers full-sync to it, publishes all they hold: a
    subscriber that starts over on the new stream rebuilds the same index."""
    disk = FakeStore(nats_server.url, "disk-1", LOCAL_DISK)
    worker = FakeEngineWorker(nats_server.url, "inst-a", chunk_size=4, disk=disk)
    async with started(disk, worker):
        worker.store(TOKENS, chunks=[0, 1, 2])
        worker.store(TOKENS, chunks=[0], where=LOCAL_DISK)
        views = []
        for _ in range(2):
            async with running_controller(nats_server.url, **STREAM) as (service, client):
                stream = service.kv_events
                assert stream is not None and stream.replay_endpoint is not None
                async with subscribed(stream.endpoint, stream.replay_endpoint, replay_first=True) as subscriber:
                    await wait_until_async(lambda: len(index_view(service)) == 2, what="both holders indexed")
                    await agrees(service, client, subscriber, [worker], "restart")
                    views.append(subscriber.view())
        assert views[0] == views[1] and len(views[0][(worker.worker_id, LOCAL_CPU)]) == 3


@pytest.mark.parametrize("setting", ["1", "0", None])
def test_the_streams_hash_form_is_vllms_under_its_own_setting(monkeypatch: pytest.MonkeyPatch,
                                                             setting: str | None) -> None:
    """The controller reads VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES as vLLM does, and gives a key the hash vLLM's
    `maybe_convert_block_hash` (and so the engine's in-vLLM events) gives it: ints by default, else the bytes."""
    from kvmesh.services.engine.adapter import kv_events as engine_events
    from kvmesh.shared.wire.kv_events import USE_INT_BLOCK_HASHES_ENV, use_int_block_hashes

    if setting is None:
        monkeypatch.delenv(USE_INT_BLOCK_HASHES_ENV, raising=False)
    else:
        monkeypatch.setenv(USE_INT_BLOCK_HASHES_ENV, setting)
    key = bytes(range(16))
    published = external_hash(key, use_int_block_hashes())
    assert published == maybe_convert_block_hash(BlockHash(key)) == engine_events.external_hash(key)
    assert published == (int.from_bytes(key[8:], "big") if setting != "0" else key)


async def test_the_command_line_flags_start_the_stream_and_sigterm_closes_it(nats_server: EmbeddedNats) -> None:
    """`python -m kvmesh.services.controller --kv-events-port P --kv-events-replay-port R`: a worker's chunks
    arrive on 127.0.0.1:P as BlockStored with its topic and medium, and SIGTERM closes both ports."""
    port, events_port, replay_port = free_port(), free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.services.controller", "--host", "127.0.0.1", "--port", str(port),
         "--nats-url", nats_server.url, "--log-level", "warning", "--kv-events-port", str(events_port),
         "--kv-events-replay-port", str(replay_port), "--min-chunk-size", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    worker = FakeEngineWorker(nats_server.url, "inst-a", chunk_size=4)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            async def up() -> bool:
                assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
                try:
                    return (await client.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False
            await wait_until_async(up, what="the controller subprocess")
            async with subscribed(f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}") as subscriber, \
                    started(worker):
                worker.store(TOKENS)
                expected = {(worker.worker_id, LOCAL_CPU): {external_hash(span.key, True)
                                                             for span in worker.spans(TOKENS)}}
                await wait_until_async(lambda: subscriber.view() == expected, what="the worker's chunks streamed")
                assert await layout(client, TOKENS) == {"inst-a": lookup_from_events(subscriber, worker, TOKENS)}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        for closed in (port, events_port, replay_port):
            with socket.socket() as sock:
                assert sock.connect_ex(("127.0.0.1", closed)) != 0, closed
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        if process.stdout:
            process.stdout.close()
