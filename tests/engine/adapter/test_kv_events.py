"""KV events for routers (services/engine/adapter/kv_events.py), on the connector's scheduler side without a
running vLLM: a real cache engine in this process (vLLM's single-process case) stores a request's chunks, its
CPU tier's admissions and evictions reach the scheduler side as each step's worker metadata, and
`take_events()` returns them as vLLM's BlockStored / BlockRemoved, which must survive vLLM's msgspec wire format.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import msgspec
import pytest

from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents, StepEventLog
from kvmesh.services.engine.adapter.scheduler_lookup import SchedulerLookup, engines
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.protocol import LOCAL_CPU
from kvmesh.shared.wire.keys import ChunkSpan, KeyExtras, KeyParams, state_key

from support.engine import CHUNK, PagedKV, engine_config, random_tokens

connector = pytest.importorskip("kvmesh.services.engine.connector")
kv_events = pytest.importorskip("kvmesh.services.engine.adapter.kv_events")
scheduler_side = pytest.importorskip("kvmesh.services.engine.adapter.scheduler_side")
vllm_events = pytest.importorskip("vllm.distributed.kv_events")

PARAMS = KeyParams(model="test-model", kv_format="")


@pytest.fixture
def worker() -> Iterator[tuple[CacheEngine, PagedKV, StepEventLog]]:
    """A worker's engine in this process, without NATS, reporting its CPU tier like the connector does."""
    kv = PagedKV(num_blocks=128)
    engine = build_engine(engine_config(), PARAMS, kv.layout)
    events = StepEventLog()
    engine.cpu.listen(events)
    engines.add(0, engine)
    try:
        yield engine, kv, events
    finally:
        engines.remove(engine)
        engine.close()


def scheduler(capacity: int | None = 1000) -> Any:
    """The connector's scheduler side as vLLM builds it with --kv-events-config (without a VllmConfig);
    `capacity` None: without it."""
    lookup = SchedulerLookup(world_size=1, timeout=5.0, nats_name="test-scheduler")
    events = kv_events.KVEventLog(capacity, CHUNK) if capacity is not None else None
    side = scheduler_side.SchedulerSide(engine_config(), 16, lookup, kv_events=events)
    return connector.KVMeshConnector.from_sides(scheduler_side=side)


def request(req_id: str, tokens: list[int], cache_salt: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, num_tokens=len(tokens), num_prompt_tokens=len(tokens),
                           all_token_ids=tokens, lora_request=None, mm_features=[], prompt_embeds=None,
                           cache_salt=cache_salt)


def step(conn: Any, events: StepEventLog) -> list[Any]:
    """One step's worker output reaching the scheduler, then vLLM taking the connector's events."""
    conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CpuTierEvents({0: events.take()})))
    return list(conn.take_events())


def wire(batch_events: list[Any]) -> list[Any]:
    """Through vLLM's wire format: what a router subscribed to the ZMQ publisher decodes."""
    batch = vllm_events.KVEventBatch(ts=0.0, events=batch_events)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=vllm_events.KVEventBatch).events


def test_admitted_chunks_are_published_as_blocks_with_their_tokens_and_parents(
        worker: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    engine, kv, events = worker
    conn = scheduler()
    tokens = random_tokens(3 * CHUNK + 5, seed=1).tolist()  # three full chunks and a partial one
    assert conn.get_num_new_matched_tokens(request("r1", tokens), 0) == (0, False)
    chain = conn.scheduler_side.tracker("r1").chain
    assert len(chain) == 4

    token_api.store(engine, tokens, **kv.kv(kv.slots(len(tokens))))
    stored = wire(step(conn, events))
    assert [type(e).__name__ for e in stored] == ["BlockStored"] * 4
    hashes = [kv_events.external_hash(span.key) for span in chain]
    assert [e.block_hashes for e in stored] == [[h] for h in hashes]
    assert [e.parent_block_hash for e in stored] == [None] + hashes[:3]
    assert [e.token_ids for e in stored] == [tokens[s.start:s.end] for s in chain]
    assert all(e.medium == "CPU" and e.block_size == CHUNK and e.extra_keys is None for e in stored)
    assert step(conn, events) == [], "each admission is published once"

    # a clear of the CPU tier removes every chunk
    token_api.clear(engine, LOCAL_CPU)
    removed = wire(step(conn, events))
    assert all(type(e).__name__ == "BlockRemoved" and e.medium == "CPU" for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)
    conn.shutdown()


def test_a_request_that_shares_a_prefix_publishes_only_its_new_chunks_under_the_shared_parent(
        worker: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    engine, kv, events = worker
    conn = scheduler()
    prefix = random_tokens(2 * CHUNK, seed=2).tolist()
    first, second = prefix + random_tokens(CHUNK, seed=3).tolist(), prefix + random_tokens(CHUNK, seed=4).tolist()
    conn.get_num_new_matched_tokens(request("a", first), 0)
    token_api.store(engine, first, **kv.kv(kv.slots(len(first))))
    step(conn, events)
    conn.get_num_new_matched_tokens(request("b", second), 0)
    # the prefix is held: only the last chunk is admitted
    token_api.store(engine, second, **kv.kv(kv.slots(len(second))))
    stored = step(conn, events)
    chain = conn.scheduler_side.tracker("b").chain
    assert len(stored) == 1
    assert stored[0].parent_block_hash == kv_events.external_hash(chain[1].key)
    assert stored[0].token_ids == second[2 * CHUNK:]


def test_chunks_beyond_the_bound_are_forgotten_and_their_admissions_not_published(
        worker: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    engine, kv, events = worker
    conn = scheduler(capacity=2)
    tokens = random_tokens(4 * CHUNK, seed=5).tolist()
    conn.get_num_new_matched_tokens(request("r", tokens), 0)
    assert len(conn.scheduler_side.kv_events) == 2
    token_api.store(engine, tokens, **kv.kv(kv.slots(len(tokens))))
    stored = step(conn, events)
    assert [e.token_ids for e in stored] == [tokens[2 * CHUNK:3 * CHUNK], tokens[3 * CHUNK:]]


def test_only_a_published_block_is_published_as_removed() -> None:
    """An eviction of a key whose BlockStored never went out (a recurrent state stored beside a chunk, a chunk
    admitted before it was noted) is no event: a router never knew it."""
    log = kv_events.KVEventLog(100, CHUNK)
    params = KeyParams("m", "")
    a, unknown = bytes([1]) * 16, bytes([3]) * 16
    log.note([ChunkSpan(0, 0, CHUNK, a)], list(range(CHUNK)), params, None, None, None)
    log.apply(CpuTierEvents({0: [(False, a), (True, a), (True, state_key(a)), (True, unknown)]}))
    assert [type(e).__name__ for e in log.take()] == ["BlockStored"]
    log.apply(CpuTierEvents({0: [(False, state_key(a)), (False, unknown), (False, a), (False, a)]}))
    removed = log.take()
    assert [(type(e).__name__, e.block_hashes) for e in removed] == [("BlockRemoved", [kv_events.external_hash(a)])]


def test_without_kv_events_the_connector_returns_none(worker: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    engine, kv, events = worker
    conn = scheduler(capacity=None)  # vLLM started without --kv-events-config
    tokens = random_tokens(2 * CHUNK, seed=6).tolist()
    conn.get_num_new_matched_tokens(request("r", tokens), 0)
    token_api.store(engine, tokens, **kv.kv(kv.slots(len(tokens))))
    assert step(conn, events) == []
    chain = conn.scheduler_side.tracker("r").chain
    assert conn.scheduler_side.lookup.mirror.prefix(0, [s.key for s in chain]) == 2  # the mirror still works


def test_sharded_ranks_publish_rank_0s_keys_and_extras_untagged() -> None:
    """Tensor parallelism: the workers report shard keys; the events name chunks by rank 0's."""
    log = kv_events.KVEventLog(100, CHUNK)
    rank0 = KeyParams("m", "", world_size=2, rank=0)
    a, b = bytes([1]) * 16, bytes([2]) * 16
    spans = [ChunkSpan(0, 0, CHUNK, a), ChunkSpan(1, CHUNK, 2 * CHUNK, b)]
    extras = KeyExtras(cache_salt="salt", mm_identifiers=["img"], mm_offsets=[40], mm_lengths=[4])
    log.note(spans, list(range(2 * CHUNK)), rank0, extras, "my-lora", None)
    rank1 = KeyParams("m", "", world_size=2, rank=1)
    log.apply(CpuTierEvents({1: [(True, rank1.shard_key(a))], 0: [(True, rank0.shard_key(a)),
                                                                 (True, rank0.shard_key(b))]}))
    first, second = wire(log.take())
    assert first.block_hashes == [kv_events.external_hash(rank0.shard_key(a))]
    assert second.parent_block_hash == kv_events.external_hash(rank0.shard_key(a))
    lora, salt, img = (kv_events.event_digest(kind, value)
                       for kind, value in ((b"lora", "my-lora"), (b"salt", "salt"), (b"mm", "img")))
    assert first.extra_keys == [(lora, salt)] and first.lora_name == "my-lora"
    assert second.extra_keys == [(lora, [img, 40 - CHUNK])]  # (identifier's digest, offset in the chunk)


def test_the_cache_salt_is_published_only_as_a_digest_equal_for_equal_salts(
        worker: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    """Issue 24, finding 2: the event stream is unauthenticated, so a salt in clear would let anyone recompute
    the salted keys of the published tokens. Requests of one salt still carry equal digests, so a router can
    tell tenants apart."""
    engine, kv, events = worker
    conn = scheduler()
    salts = {"a1": "tenant-a-secret-salt-7f3e", "a2": "tenant-a-secret-salt-7f3e", "b": "tenant-b-secret-salt-91c2"}
    first_chunks: dict[str, Any] = {}
    for seed, (req_id, salt) in enumerate(salts.items(), start=10):
        tokens = random_tokens(2 * CHUNK, seed=seed).tolist()
        conn.get_num_new_matched_tokens(request(req_id, tokens, cache_salt=salt), 0)
        token_api.store(engine, tokens, **kv.kv(kv.slots(len(tokens))), extras=KeyExtras(cache_salt=salt))
        batch = step(conn, events)
        payload = msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=0.0, events=batch))
        assert salt.encode() not in payload, "the salt is on the wire in clear"
        stored = wire(batch)
        assert [type(e).__name__ for e in stored] == ["BlockStored"] * 2
        assert stored[1].extra_keys is None  # the salt is mixed into the first chunk only
        first_chunks[req_id] = stored[0]
    digest = {req_id: event.extra_keys for req_id, event in first_chunks.items()}
    assert digest["a1"] == digest["a2"] == [(kv_events.event_digest(b"salt", salts["a1"]),)]
    assert digest["b"] != digest["a1"] and digest["b"] is not None
    conn.shutdown()
