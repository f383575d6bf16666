"""The storage manager against a store that misbehaves: vLLM's calls never wait longer than their timeouts.

A fake `StoreTier` (slow puts, hanging gets) stands in for the disk store on a real NATS connection, so
the engine's NATS loop, write-behind queue and fetch hand-over run for real.
"""

from __future__ import annotations

import asyncio
import time
import threading
from typing import Callable, Iterator

import pytest
import torch

from kvmesh.services.engine.adapter.request_meta import KVMeshConnectorMetadata
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.tiers.base import NO_RETENTION, ChunkBuffer, Retention
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE, ChunkMeta, StatsReply
from kvmesh.shared.wire.keys import ChunkKey, KeyParams

from support.engine import BLOCK, CHUNK, PagedKV, engine_config, random_tokens
from support.waiting import WAIT_S, finishes, wait_until

PARAMS = KeyParams(model="test-model", kv_format="")


class FakeStore:
    """Holds chunks in memory; `put_gate` / `get_gate` (events on the engine's loop) hold puts / gets back while
    they are clear."""

    location = LOCAL_DISK

    def __init__(self) -> None:
        self.store_ids = ["fake"]
        self.chunks: dict[ChunkKey, tuple[ChunkMeta, bytes]] = {}
        self.put_gate: asyncio.Event | None = None
        self.get_gate: asyncio.Event | None = None
        self.key_gates: dict[ChunkKey, asyncio.Event] = {}  # gets of these keys wait for their event
        self.gets_begun: list[ChunkKey] = []
        self.puts = 0
        self.retentions: dict[ChunkKey, Retention] = {}  # what each put carried

    async def put(self, meta: ChunkMeta, buffer: ChunkBuffer, retention: Retention = NO_RETENTION) -> bool:
        if self.put_gate is not None:
            await self.put_gate.wait()
        self.chunks[meta.key] = (meta, bytes(buffer.view[:meta.nbytes]))
        self.retentions[meta.key] = retention
        self.puts += 1
        return True

    async def get_into(self, key: ChunkKey, buffer: ChunkBuffer) -> ChunkMeta | None:
        self.gets_begun.append(key)
        if self.get_gate is not None:
            await self.get_gate.wait()
        if key in self.key_gates:
            await self.key_gates[key].wait()
        if key not in self.chunks:
            return None
        meta, data = self.chunks[key]
        buffer.view[:meta.nbytes] = data
        return meta

    async def contains(self, keys: list[ChunkKey]) -> int:
        held = 0
        for key in keys:
            if key not in self.chunks:
                break
            held += 1
        return held

    async def pin(self, keys: list[ChunkKey], num_tokens: list[int], ttl_secs: float | None = None) -> int:
        return 0

    async def unpin(self, keys: list[ChunkKey], num_tokens: list[int]) -> int:
        return 0

    async def remove(self, keys: list[ChunkKey]) -> int:
        return sum(self.chunks.pop(k, None) is not None for k in keys)

    async def clear(self) -> int:
        tokens = sum(meta.num_tokens for meta, _ in self.chunks.values())
        self.chunks.clear()
        return tokens

    async def stats(self) -> list[StatsReply]:
        return []


@pytest.fixture
def nats_url() -> Iterator[str]:
    server = EmbeddedNats().start()
    yield server.url
    server.stop()


def engine_with_fake(url: str, kv: PagedKV, **overrides: object) -> tuple[CacheEngine, FakeStore]:
    engine = build_engine(engine_config(nats_url=url, local_disk="/nonexistent/kvmesh-test", **overrides),
                          PARAMS, kv.layout)
    assert engine.wait_connected(WAIT_S)
    fake = FakeStore()
    on_loop(engine, lambda: _install(engine, fake))
    return engine, fake


def _install(engine: CacheEngine, fake: FakeStore) -> None:
    fake.put_gate, fake.get_gate = asyncio.Event(), asyncio.Event()  # created on the engine's loop
    fake.put_gate.set()
    fake.get_gate.set()
    engine.storage.set_lower([fake])


def on_loop(engine: CacheEngine, fn: Callable[[], object]) -> None:
    """Run `fn` on the engine's NATS loop and return once it has run (e.g. to close a gate before a store)."""
    async def run() -> None:
        fn()

    engine.nats_loop.submit(run()).result(WAIT_S)


def test_a_full_write_behind_queue_skips_and_never_blocks(nats_url: str) -> None:
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, store_queue_size=2, cpu_chunks=32)
    try:
        on_loop(engine, fake.put_gate.clear)  # the store stops taking chunks
        tokens = random_tokens(320, seed=1)  # 10 chunks
        finishes(lambda: token_api.store(engine, tokens, **kv.kv(kv.slots(320))), what="a store behind a full queue")
        assert fake.puts == 0  # it returned while the store took nothing: it did not wait for the store
        stats = engine.storage.stats
        assert stats["write_behind_skipped_full"] >= 10 - 2 - 2  # queue of 2, plus the 2 writers' jobs in hand
        assert token_api.lookup(engine, tokens) == 320  # the CPU tier has everything
        on_loop(engine, fake.put_gate.set)
        assert engine.wait_write_behind(WAIT_S)
        assert 2 <= fake.puts <= 4
    finally:
        engine.close()


def test_a_slow_store_gives_a_shorter_hit_after_the_blocking_timeout(nats_url: str) -> None:
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, blocking_timeout_secs=0.5, cpu_chunks=8)
    try:
        tokens = random_tokens(128, seed=2)
        src = kv.slots(128)
        token_api.store(engine, tokens, **kv.kv(src))
        assert engine.wait_write_behind(WAIT_S) and fake.puts == 4
        keys = engine.hasher.keys(tokens)
        for key in keys[1:]:
            engine.cpu.remove(key)  # chunk 0 on the CPU, 1-3 only in the store
        on_loop(engine, fake.get_gate.clear)  # the store's gets hang until the test lets them go
        got = finishes(lambda: token_api.retrieve(engine, tokens, **kv.kv(kv.slots(128, exclude=src))),
                       what="a retrieve from a store that does not answer")
        assert int(got.sum()) == CHUNK  # only the CPU chunk: the retrieve gave up on the rest after 0.5 s
        assert engine.storage.stats["fetch_timeout"] == 1

        # once the store answers, the abandoned fetch finishes on the NATS loop and parks its chunks in the CPU
        # tier, leaking nothing
        on_loop(engine, fake.get_gate.set)
        wait_until(lambda: token_api.lookup(engine, tokens, search_range=["LocalCPUBackend"]) == 128
                   and engine.pool.num_free == engine.pool.num_slots - 4, what="the abandoned fetch parked, no leak")
        assert bool(token_api.retrieve(engine, tokens, **kv.kv(kv.slots(128, exclude=src))).all())
    finally:
        engine.close()


def _only_in_the_store(engine: CacheEngine, fake: FakeStore, kv: PagedKV, chunks: int, seed: int
                        ) -> tuple[list[int], list[ChunkKey], torch.Tensor]:
    """`chunks` chunks of fresh tokens stored, then dropped from the CPU tier: (tokens, keys, their slots)."""
    tokens = random_tokens(chunks * CHUNK, seed=seed)
    src = kv.slots(len(tokens))
    for end in range(1, chunks + 1):  # a chunk at a time: a pool smaller than the prompt takes them all so
        token_api.store(engine, tokens[:end * CHUNK], **kv.kv(src[:end * CHUNK]))
        assert engine.wait_write_behind(WAIT_S) and fake.puts == end
    keys = engine.hasher.keys(tokens)
    for key in keys:
        engine.cpu.remove(key)
    return tokens, keys, src


def test_a_slow_read_does_not_hold_back_the_reads_behind_it(nats_url: str) -> None:
    """A fetch keeps fetch_concurrency reads in flight, starting the next as soon as the oldest ends: a slow read
    holds only its own place in the prefix (batches would each wait for their slowest read)."""
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, cpu_chunks=16, fetch_concurrency=2, blocking_timeout_secs=WAIT_S)
    try:
        tokens, keys, src = _only_in_the_store(engine, fake, kv, 6, seed=6)
        gate: list[asyncio.Event] = []
        on_loop(engine, lambda: gate.append(fake.key_gates.setdefault(keys[1], asyncio.Event())))
        fake.gets_begun.clear()
        retrieved: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: retrieved.append(
            token_api.retrieve(engine, tokens, **kv.kv(kv.slots(len(tokens), exclude=src)))))
        reader.start()
        # chunk 0 landed, so chunk 2 started beside the held chunk 1; the window (2) is full: nothing more
        wait_until(lambda: fake.gets_begun[:3] == keys[:3], what="the read after the slow one to start")
        assert keys[3] not in fake.gets_begun
        on_loop(engine, gate[0].set)
        reader.join(WAIT_S)
        assert retrieved and bool(retrieved[0].all())
        assert fake.gets_begun == keys
    finally:
        engine.close()


def test_a_miss_ends_the_fetch_and_frees_the_slots_of_the_reads_after_it(nats_url: str) -> None:
    """The hit is the prefix before the first miss; the reads in flight behind it end, their slots freed."""
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, cpu_chunks=16, fetch_concurrency=3)
    try:
        tokens, keys, src = _only_in_the_store(engine, fake, kv, 6, seed=7)
        del fake.chunks[keys[2]]
        got = token_api.retrieve(engine, tokens, **kv.kv(kv.slots(len(tokens), exclude=src)))
        assert int(got.sum()) == 2 * CHUNK  # the prefix before the miss
        assert keys[5] not in fake.gets_begun  # the window was full up to the miss; nothing started after it
        # chunks 0 and 1 stay in the CPU tier; the slots of the reads in flight behind the miss are free again
        wait_until(lambda: engine.pool.num_free == engine.pool.num_slots - 2, what="the slots after the miss freed")
        assert token_api.lookup(engine, tokens, search_range=["LocalCPUBackend"]) == 2 * CHUNK
    finally:
        engine.close()


def test_a_fetch_that_fills_the_pool_keeps_the_reads_already_in_flight(nats_url: str) -> None:
    """Past the pool's last free slot no read starts, but those in flight land: the hit is every slot's chunk."""
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, cpu_chunks=4, fetch_concurrency=3)
    try:
        tokens, keys, src = _only_in_the_store(engine, fake, kv, 6, seed=8)
        got = token_api.retrieve(engine, tokens, **kv.kv(kv.slots(len(tokens), exclude=src)))
        assert int(got.sum()) == 4 * CHUNK  # the retrieve holds every fetched chunk until it is scattered
        assert engine.storage.stats["fetch_no_memory"] == 1 and fake.gets_begun == keys[:4]
    finally:
        engine.close()


def test_a_pool_full_of_chunks_in_flight_skips_stores(nats_url: str) -> None:
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, cpu_chunks=2)
    try:
        on_loop(engine, fake.put_gate.clear)
        a, b = random_tokens(64, seed=3), random_tokens(64, seed=4)
        token_api.store(engine, a, **kv.kv(kv.slots(64)))  # both slots now held by the CPU tier and by write-behind
        # nothing can be freed now: skipped, not waited for (a slot frees only once the store takes a put)
        finishes(lambda: token_api.store(engine, b, **kv.kv(kv.slots(64))),
                 what="a store into a pool held by write-behind")
        assert fake.puts == 0
        assert token_api.lookup(engine, b) == 0 and token_api.lookup(engine, a) == 64
        on_loop(engine, fake.put_gate.set)
        assert engine.wait_write_behind(WAIT_S)
        token_api.store(engine, b, **kv.kv(kv.slots(64)))  # a's chunks are idle now: LRU makes room
        assert token_api.lookup(engine, b) == 64
        assert token_api.lookup(engine, a) == 64  # a is back from the store below
    finally:
        engine.close()


def test_chunks_a_store_dropped_are_sent_again(nats_url: str) -> None:
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, cpu_chunks=8)
    try:
        tokens = random_tokens(128, seed=5)
        src = kv.slots(128)
        token_api.store(engine, tokens, **kv.kv(src))
        assert engine.wait_write_behind(WAIT_S) and fake.puts == 4
        token_api.clear(engine)
        token_api.store(engine, tokens, **kv.kv(src))  # every chunk is known to be in the store: nothing is copied
        assert engine.wait_write_behind(WAIT_S) and fake.puts == 4 and token_api.lookup(engine, tokens) == 128
        fake.chunks.clear()  # the store evicted them
        assert token_api.lookup(engine, tokens) == 0  # ... which the lookup learns
        token_api.store(engine, tokens, **kv.kv(src))
        assert engine.wait_write_behind(WAIT_S) and fake.puts == 8 and token_api.lookup(engine, tokens) == 128
    finally:
        engine.close()


def test_store_tiers_and_retention_reach_the_stores(nats_url: str) -> None:
    """A save's store tiers (a request's kv_store_tiers) choose where its chunks go, and its retention goes with
    every put: stored to the disk tier only, the CPU tier keeps nothing (it only staged the chunks); to the CPU
    tier only, no store gets a put."""
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv)
    try:
        hasher, cpu = engine.ready()[1], engine.ready()[2]
        below, above = random_tokens(64, seed=70), random_tokens(64, seed=71)
        lease = Retention(priority=3, lease_until=time.time() + 600)
        engine.save(hasher.spans(below), **kv.kv(kv.slots(64)), retention=lease, store_to=frozenset({LOCAL_DISK}))
        assert engine.wait_write_behind(WAIT_S)
        assert fake.puts == 2 and set(fake.retentions.values()) == {lease}
        assert token_api.lookup(engine, below, [LOCAL_CPU]) == 0 and len(cpu) == 0
        assert token_api.lookup(engine, below, [LOCAL_DISK]) == 64
        engine.save(hasher.spans(above), **kv.kv(kv.slots(64)), store_to=frozenset({LOCAL_CPU, REMOTE}))
        assert engine.wait_write_behind(WAIT_S)
        assert fake.puts == 2 and token_api.lookup(engine, above, [LOCAL_CPU]) == 64
    finally:
        engine.close()


# ---- the write-behind yields to vLLM's forward (core/write_behind.py) -------------------------------------------
def test_chunks_saved_during_a_forward_are_written_once_it_ends(nats_url: str) -> None:
    """Driven as vLLM's model runner drives the worker connector: the writers hold their jobs back from the
    forward's start_load_kv to its get_finished, then write every chunk."""
    connector = pytest.importorskip("kvmesh.services.engine.connector")
    worker_side = pytest.importorskip("kvmesh.services.engine.adapter.worker_side")
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, write_behind_defer_secs=3600.0)
    try:
        side = worker_side.WorkerSide(engine.config, BLOCK)
        side.engine, side.kv_caches = engine, kv.caches
        conn = connector.KVMeshConnector.from_sides(worker_side=side)
        conn.bind_connector_metadata(KVMeshConnectorMetadata())
        conn.start_load_kv(None)  # the forward runs from here
        tokens = random_tokens(4 * CHUNK, seed=80)
        token_api.store(engine, tokens, **kv.kv(kv.slots(4 * CHUNK)))
        write_behind = engine.storage.write_behind
        wait_until(lambda: write_behind.held_back == engine.config.write_behind_workers,
                   what="both writers holding their job back")
        assert fake.puts == 0 and write_behind.queue_depth == 2
        conn.wait_for_save()
        conn.get_finished(set())  # the forward has ended
        conn.clear_connector_metadata()
        assert engine.wait_write_behind(WAIT_S) and fake.puts == 4
        assert write_behind.held_back == 0
        assert token_api.lookup(engine, tokens, search_range=[LOCAL_DISK]) == 4 * CHUNK
    finally:
        engine.close()


def test_chunks_wait_while_forwards_follow_each_other_and_are_written_once_vllm_is_idle(nats_url: str) -> None:
    """A chunked prefill's forwards follow each other a few milliseconds apart, and a job started in such a gap
    would run on through the next forward: none starts until vLLM has run no forward for write_behind_idle_secs."""
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, write_behind_defer_secs=3600.0, write_behind_idle_secs=3.0)
    try:
        write_behind = engine.storage.write_behind
        write_behind.forward_started()
        token_api.store(engine, random_tokens(4 * CHUNK, seed=83), **kv.kv(kv.slots(4 * CHUNK)))
        wait_until(lambda: write_behind.held_back == engine.config.write_behind_workers,
                   what="both writers holding their job back")
        steps_until = time.monotonic() + 0.5  # drives vLLM's steps for a while; nothing is timed
        while time.monotonic() < steps_until:
            write_behind.forward_ended()
            write_behind.forward_started()
        assert fake.puts == 0 and write_behind.queue_depth == 2
        write_behind.forward_ended()  # the last forward: vLLM is idle from here
        assert engine.wait_write_behind(WAIT_S) and fake.puts == 4
    finally:
        engine.close()


def test_chunks_queued_after_each_forward_wake_the_writers_only_for_the_first(nats_url: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill's save queues chunks after every forward, while the writers hold theirs back until vLLM is idle:
    a wake-up of the loop for each would only take the GIL from vLLM's model thread. Only a job queued into an
    empty queue wakes them (once per writer that takes one, and once more); all are written once vLLM is idle."""
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, write_behind_defer_secs=3600.0, write_behind_idle_secs=3.0)
    try:
        write_behind = engine.storage.write_behind
        pokes: list[None] = []
        poke = write_behind._poke
        monkeypatch.setattr(write_behind, "_poke", lambda: (pokes.append(None), poke()))
        tokens = random_tokens(8 * CHUNK, seed=87)
        for step in range(1, 9):  # one chunk per step, saved after its forward
            write_behind.forward_started()
            write_behind.forward_ended()
            token_api.store(engine, tokens[:step * CHUNK], **kv.kv(kv.slots(step * CHUNK)))
        on_loop(engine, lambda: None)  # every wake-up queued before this has run
        assert len(pokes) <= engine.config.write_behind_workers + 1
        assert engine.wait_write_behind(WAIT_S) and fake.puts == 8
    finally:
        engine.close()


def test_a_chunk_waits_for_the_forward_no_longer_than_write_behind_defer_secs(nats_url: str) -> None:
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, write_behind_defer_secs=0.2)
    try:
        engine.storage.write_behind.forward_started()  # and it never ends
        token_api.store(engine, random_tokens(6 * CHUNK, seed=81), **kv.kv(kv.slots(6 * CHUNK)))
        assert engine.wait_write_behind(WAIT_S) and fake.puts == 6
    finally:
        engine.close()


@pytest.mark.parametrize("overrides, pressing_depth", [
    ({"store_queue_size": 6}, 3),  # half the queue
    ({"cpu_chunks": 8}, 2),  # a quarter of the pool's slots: queued chunks cannot be evicted
], ids=["queue-half-full", "pool-quarter-held"])
def test_a_pressing_queue_is_written_during_the_forward(nats_url: str, overrides: dict[str, object],
                                                       pressing_depth: int) -> None:
    """Deferring never makes the queue skip a chunk nor the pool refuse a save: from `pressing_depth` queued
    chunks on, the writers start during the forward; what is left below it waits for the forward's end."""
    kv = PagedKV(num_blocks=256)
    engine, fake = engine_with_fake(nats_url, kv, write_behind_defer_secs=3600.0, **overrides)
    try:
        write_behind = engine.storage.write_behind
        write_behind.forward_started()
        token_api.store(engine, random_tokens(6 * CHUNK, seed=82), **kv.kv(kv.slots(6 * CHUNK)))
        workers = engine.config.write_behind_workers
        wait_until(lambda: fake.puts >= 6 - (pressing_depth - 1) - workers, what="the pressing part written")
        assert engine.storage.stats["write_behind_skipped_full"] == 0
        write_behind.forward_ended()
        assert engine.wait_write_behind(WAIT_S) and fake.puts == 6
    finally:
        engine.close()
