"""The remote tier on a real redis-server: round trip, bad values, pins under memory pressure, clear per
instance, Redis killed and restarted; and two cache engines sharing a chunk through Redis.

Each test starts its own redis-server (tests/support/redis_server.py) on a free loopback port and stops it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterator

import pytest
import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.tiers.base import ChunkBuffer, Retention
from kvmesh.services.engine.tiers.redis import RedisTier
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.protocol import LOCAL_CPU, REMOTE
from kvmesh.shared.wire.keys import KeyParams
from kvmesh.shared.wire.redis_url import parse_redis_url

from support.redis_server import RedisClusterServers, RedisSentinelSetup, RedisServer
from support.engine import PagedKV, engine_config, random_tokens
from support.redis_tier import TIER_LOG, chunk, get, put
from support.waiting import WAIT_S, wait_until, wait_until_async


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def make_tier(server: RedisServer, caller: str = "engine.a.a", **options: object) -> RedisTier:
    options = {"timeout": WAIT_S / 3, "retry_interval": 0.0, **options}
    return RedisTier(parse_redis_url(server.url), caller, **options)  # type: ignore[arg-type]


async def test_round_trip_is_bit_exact_and_namespaced(redis_server: RedisServer) -> None:
    tier, other = make_tier(redis_server), make_tier(redis_server, key_prefix="other-deployment")
    try:
        meta, data = chunk(1, nbytes=3 * 1024 * 1024 + 7)
        assert await tier.contains([meta.key]) == 0 and await get(tier, meta) is None
        assert await put(tier, meta, data)
        assert await get(tier, meta) == data
        assert await tier.contains([meta.key, chunk(2)[0].key]) == 1
        assert await other.contains([meta.key]) == 0  # another prefix, another namespace
        with redis_server.client() as client:
            assert client.exists(f"kvmesh:chunk:{{{meta.key.hex()}}}")
            assert 0 < client.pttl(f"kvmesh:chunk:{{{meta.key.hex()}}}")  # unpinned: volatile
            assert not client.keys("kvmesh:tmp:*")  # the write went into place
        assert await put(tier, meta, data)  # a second put of a held chunk only refreshes it
        assert await get(tier, meta) == data
    finally:
        await tier.close()
        await other.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage", "oversized"])
async def test_a_bad_value_is_a_miss_with_one_warning(redis_server: RedisServer, damage: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    tier = make_tier(redis_server)
    try:
        meta, data = chunk(3)
        other, other_data = chunk(4)
        assert await put(tier, meta, data) and await put(tier, other, other_data)
        name = tier.chunk_key(meta.key)
        with redis_server.client() as client:
            value = client.get(name)
            if damage == "flip":
                client.setrange(name, len(value) - 10, bytes([value[-10] ^ 0xFF]))
            elif damage == "truncate":
                client.set(name, value[:-1])
            elif damage == "oversized":  # read only up to a slot plus a header: cut short, a miss
                client.set(name, value + bytes(4 * 1024 * 1024))
            elif damage == "foreign":
                client.set(name, client.get(tier.chunk_key(other.key)))
            else:
                client.set(name, b"not a chunk at all")
        caplog.set_level(logging.WARNING, TIER_LOG)
        assert await get(tier, meta) is None
        assert await get(tier, other) == other_data  # others are untouched
        warnings = [r for r in caplog.records if r.name == TIER_LOG and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and meta.key.hex() in warnings[0].getMessage()
        assert await tier.contains([meta.key]) == 0  # deleted: the next put stores it again
        assert await put(tier, meta, data) and await get(tier, meta) == data
    finally:
        await tier.close()


async def test_a_pinned_chunk_survives_memory_pressure() -> None:
    with RedisServer("--maxmemory", "8mb", "--maxmemory-policy", "volatile-ttl") as server:
        tier = make_tier(server)
        try:
            pinned, pinned_data = chunk(10, nbytes=512 * 1024)
            assert await put(tier, pinned, pinned_data)
            assert await tier.pin([pinned.key], [32]) == 32
            flood = [chunk(100 + i, nbytes=512 * 1024) for i in range(60)]  # 30 MiB through an 8 MiB Redis
            for meta, data in flood:
                await put(tier, meta, data)
            assert sum([await tier.contains([meta.key]) for meta, _ in flood]) < len(flood)  # Redis evicted
            assert await get(tier, pinned) == pinned_data
            # unpinned, it is an ordinary (volatile) chunk again
            assert await tier.unpin([pinned.key], [32]) == 32
            with server.client() as client:
                assert client.pttl(tier.chunk_key(pinned.key)) > 0
        finally:
            await tier.close()


async def test_pin_takes_the_held_prefix(redis_server: RedisServer) -> None:
    tier = make_tier(redis_server)
    try:
        (a, da), (b, _), (c, dc) = chunk(20), chunk(21), chunk(22)
        assert await put(tier, a, da) and await put(tier, c, dc)
        assert await tier.pin([a.key, b.key, c.key], [32, 32, 16]) == 32  # b is missing: only a stays pinned
        assert await tier.unpin([a.key, b.key, c.key], [32, 32, 16]) == 32  # c's pin was taken back
        assert await tier.unpin([a.key], [32]) == 0
    finally:
        await tier.close()


async def test_clear_takes_back_only_the_callers_claims(redis_server: RedisServer) -> None:
    one, two = make_tier(redis_server, "engine.one.one"), make_tier(redis_server, "engine.two.two")
    try:
        (k1, d1), (k2, d2), (k3, d3), (k4, d4) = chunk(31), chunk(32), chunk(33), chunk(34)
        for tier, items in ((one, [(k1, d1), (k2, d2), (k4, d4)]), (two, [(k2, d2), (k3, d3)])):
            for meta, data in items:
                assert await put(tier, meta, data)
        assert await one.pin([k4.key], [32]) == 32
        assert await one.clear() == 96  # its claims on k1, k2, k4
        assert await two.contains([k1.key]) == 0  # nobody else claimed it
        assert await two.contains([k2.key, k3.key]) == 2  # two still claims them
        assert await two.contains([k4.key]) == 1  # pinned: stays until unpinned
        assert await one.clear() == 0
        assert await one.unpin([k4.key], [32]) == 32
        assert await two.contains([k4.key]) == 0  # the last pin of an unclaimed chunk took it away
        assert await two.clear() == 64
        assert await one.contains([k2.key]) == 0 and await one.contains([k3.key]) == 0
    finally:
        await one.close()
        await two.close()


async def test_redis_down_gives_misses_and_a_restart_gives_hits(redis_server: RedisServer,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    tier = make_tier(redis_server)
    try:
        (a, da), (b, db) = chunk(40), chunk(41)
        assert await put(tier, a, da)
        caplog.set_level(logging.INFO, TIER_LOG)
        redis_server.kill()
        for _ in range(3):
            assert await tier.contains([a.key]) == 0
            assert await get(tier, a) is None
            assert not await put(tier, b, db)
            assert await tier.pin([a.key], [32]) == 0 and await tier.clear() == 0
        down = [r for r in caplog.records if r.name == TIER_LOG and "unreachable" in r.getMessage()]
        assert len(down) == 1 and down[0].levelno == logging.WARNING  # logged once, not once per call
        redis_server.start()  # same port, empty (no persistence)
        await wait_until_async(lambda: put(tier, b, db), what="puts after the restart")
        assert await get(tier, b) == db
        assert any("reachable again" in r.getMessage() for r in caplog.records if r.name == TIER_LOG)
    finally:
        await tier.close()


async def test_a_hung_redis_gives_misses_within_the_timeout(redis_server: RedisServer,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    writer, tier = make_tier(redis_server), make_tier(redis_server, timeout=0.5)
    try:
        (a, da), (b, db) = chunk(50), chunk(51)
        assert await put(writer, a, da)
        caplog.set_level(logging.INFO, TIER_LOG)
        redis_server.pause()
        try:
            assert await get(tier, a) is None  # each call gives up after its timeout: a miss, no exception
            assert await tier.contains([a.key]) == 0 and not await put(tier, b, db)
            assert any("unreachable" in r.getMessage() for r in caplog.records if r.name == TIER_LOG)
        finally:
            redis_server.resume()
        await wait_until_async(lambda: get(tier, a), what="hits once Redis answers again")
        await wait_until_async(lambda: put(tier, b, db), what="puts once Redis answers again")
        assert await get(writer, b) == db
    finally:
        await tier.close()
        await writer.close()


@pytest.mark.parametrize(("policy", "warns"), [("volatile-ttl", None), ("volatile-lru", "not honoured"),
                                               ("allkeys-lru", "evicts pinned"), ("noeviction", "refuses every write")])
async def test_start_checks_the_eviction_policy(policy: str, warns: str | None,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer("--maxmemory", "64mb", "--maxmemory-policy", policy) as server:
        tier = make_tier(server)
        try:
            caplog.set_level(logging.WARNING, TIER_LOG)
            await tier.check_settings()
            messages = [r.getMessage() for r in caplog.records if r.name == TIER_LOG]
            assert (messages == []) if warns is None else (len(messages) == 1 and warns in messages[0])
        finally:
            await tier.close()


async def test_config_disabled_warns_once_and_the_tier_still_serves(caplog: pytest.LogCaptureFixture) -> None:
    """A server with CONFIG renamed away (as managed services do): the policy cannot be read, so one WARNING says
    leases are honoured only under volatile-ttl; maxmemory comes from INFO, and Redis counts as up."""
    with RedisServer("--maxmemory", "64mb", "--maxmemory-policy", "volatile-ttl",
                     "--rename-command", "CONFIG", "") as server:
        tier = make_tier(server)
        try:
            caplog.set_level(logging.WARNING, TIER_LOG)
            await tier.check_settings()
            messages = [r.getMessage() for r in caplog.records if r.name == TIER_LOG]
            assert len(messages) == 1 and "cannot read maxmemory-policy" in messages[0], messages
            assert tier.capacity_bytes == 64 * 1024 * 1024 and not tier.link.resting
            meta, data = chunk(1)
            assert await put(tier, meta, data) and await get(tier, meta) == data
        finally:
            await tier.close()


async def put_retained(tier: RedisTier, meta, data: bytes, retention: Retention) -> bool:
    return await tier.put(meta, ChunkBuffer(memoryview(bytearray(data))), retention)


async def test_leased_and_prioritised_chunks_outlive_unretained_ones_under_volatile_ttl() -> None:
    """Under maxmemory-policy volatile-ttl, chunks put with a lease or a kv_priority carry more TTL than any
    unretained one, so Redis's eviction takes the unretained ones (older and newer) and leaves them, and they
    still read back verified."""
    with RedisServer("--maxmemory", "8mb", "--maxmemory-policy", "volatile-ttl",
                     "--maxmemory-samples", "10") as server:
        tier = make_tier(server)
        try:
            await tier.check_settings()
            assert tier.capacity_bytes == 8 * 1024 * 1024
            unretained = [chunk(10 + i, nbytes=512 * 1024) for i in range(3)]
            for meta, data in unretained:
                assert await put(tier, meta, data)
            leased = [chunk(20 + i, nbytes=512 * 1024) for i in range(2)]
            for meta, data in leased:
                assert await put_retained(tier, meta, data, Retention(lease_until=time.time() + 600))
            prioritised = chunk(30, nbytes=512 * 1024)
            assert await put_retained(tier, *prioritised, Retention(priority=5))
            assert tier.retain_refused == 0
            with server.client() as client:
                base = tier.ttl_ms
                assert base < client.pttl(tier.chunk_key(leased[0][0].key)) <= base + 600_000
                assert client.pttl(tier.chunk_key(prioritised[0].key)) > base + 600_000  # over any lease
                assert client.pttl(tier.chunk_key(unretained[0][0].key)) <= base
            flood = [chunk(100 + i, nbytes=512 * 1024) for i in range(60)]  # 30 MiB through an 8 MiB Redis
            for meta, data in flood:
                await put(tier, meta, data)
            assert sum([await tier.contains([meta.key]) for meta, _ in flood]) < len(flood)  # Redis evicted
            assert [await tier.contains([meta.key]) for meta, _ in unretained] == [0, 0, 0]
            for meta, data in [*leased, prioritised]:
                assert await get(tier, meta) == data  # held, and the value still verifies (sealed, tagged)
            assert tier.values_rejected == 0
        finally:
            await tier.close()


async def test_retention_stays_within_the_principals_share_of_maxmemory() -> None:
    """An engine principal (its ranks together) retains at most `retained_redis_share` of maxmemory: past it a
    chunk is written unretained (the base TTL) and counted; another principal has a share of its own."""
    with RedisServer("--maxmemory", "8mb", "--maxmemory-policy", "volatile-ttl") as server:
        share = 2.5 * 512 * 1024 / (8 * 1024 * 1024)  # two chunks of 512 KiB, not three
        rank_0, rank_1 = (make_tier(server, f"engine.a.{rank}", retained_share=share) for rank in ("r0", "r1"))
        other = make_tier(server, "engine.b.r0", retained_share=share)
        lease = Retention(lease_until=time.time() + 600)
        try:
            for tier in (rank_0, rank_1, other):
                await tier.check_settings()
            chunks = [chunk(40 + i, nbytes=512 * 1024) for i in range(5)]
            assert await put_retained(rank_0, *chunks[0], lease)
            assert await put_retained(rank_1, *chunks[1], lease)  # the same principal: its share is now full
            assert await put_retained(rank_0, *chunks[2], Retention(priority=9))
            assert await put_retained(rank_0, *chunks[0], lease)  # retained already: no more of the share
            assert (rank_0.retain_refused, rank_1.retain_refused) == (1, 0)
            assert await put_retained(other, *chunks[3], lease)
            assert other.retain_refused == 0
            with server.client() as client:
                ttls = [client.pttl(rank_0.chunk_key(meta.key)) for meta, _ in chunks[:4]]
            base = rank_0.ttl_ms
            assert [ttl > base for ttl in ttls] == [True, True, False, True]
            assert (await rank_0.stats())[0].details["retain_refused"] == 1
        finally:
            for tier in (rank_0, rank_1, other):
                await tier.close()


async def test_a_redis_cluster_spreads_chunks_over_its_shards() -> None:
    """Three primaries: chunks land on every shard, and round trips, pins and clear per instance work across
    them (each chunk's keys share a hash tag; a caller's claims live on another shard)."""
    with RedisClusterServers(3) as cluster:
        one = RedisTier(parse_redis_url(cluster.url), "engine.one.one", timeout=WAIT_S / 3, retry_interval=0.0)
        two = RedisTier(parse_redis_url(cluster.url), "engine.two.two", timeout=WAIT_S / 3, retry_interval=0.0)
        try:
            items = [chunk(60 + i) for i in range(12)]
            for meta, data in items:
                assert await put(one, meta, data)
            assert await put(two, *items[0])
            for meta, data in items:
                assert await get(two, meta) == data
            counts = []
            for node in cluster.nodes:
                with node.client() as client:
                    counts.append(len(client.keys("kvmesh:chunk:*")))
            assert sum(counts) == len(items) and all(counts), counts  # every shard holds some
            keys = [meta.key for meta, _ in items]
            assert await two.contains(keys) == len(items)
            assert await two.pin(keys[:3], [32] * 3) == 96
            assert await one.clear() == 32 * len(items)
            assert await two.contains([keys[0]]) == 1  # two claims it
            assert await two.contains(keys[1:3]) == 2  # pinned
            assert await two.contains([keys[3]]) == 0 and await two.contains([keys[-1]]) == 0
            assert await two.unpin(keys[:3], [32] * 3) == 96
            assert await two.contains([keys[0]]) == 1 and await two.contains(keys[1:3]) == 0
        finally:
            await one.close()
            await two.close()


async def test_sentinel_failover_keeps_the_chunks() -> None:
    """Through the sentinel: the primary killed, the replica promoted; calls during the failover are misses
    (never an exception, never a wrong value) and then the replicated chunk is served by the new primary."""
    with RedisSentinelSetup() as setup:
        tier = RedisTier(parse_redis_url(setup.url), "engine.one.one", timeout=1.0, retry_interval=0.0)
        try:
            (a, da), (b, db) = chunk(70), chunk(71)
            assert await put(tier, a, da) and await get(tier, a) == da
            with setup.replica.client() as client:
                wait_until(lambda: client.exists(tier.chunk_key(a.key)), what="the chunk on the replica")
            setup.primary.kill()
            assert await get(tier, a) in (None, da)
            await wait_until_async(lambda: get(tier, a), what="the chunk from the promoted replica")
            with setup.replica.client() as client:
                assert client.info("replication")["role"] == "master"
            assert await put(tier, b, db) and await get(tier, b) == db
        finally:
            await tier.close()


async def test_a_cluster_primary_dies_and_its_replica_takes_over() -> None:
    """Three primaries with a replica each: one primary killed, its replica promoted; reads during the failover
    are hits with the right bytes or misses, never a wrong value, and every chunk is served again after it."""
    with RedisClusterServers(3, replicas=1) as cluster:
        tier = RedisTier(parse_redis_url(cluster.url), "engine.one.one", timeout=1.0, retry_interval=0.0)
        try:
            items = [chunk(80 + i) for i in range(12)]
            for meta, data in items:
                assert await put(tier, meta, data)
            victim = cluster.primaries()[0]
            with victim.client() as client:
                on_victim = client.keys("kvmesh:chunk:*")  # this shard's chunks only
                client.wait(1, int(WAIT_S * 1000))  # its replica has every write
            assert on_victim
            victim.kill()
            for meta, data in items:  # during the failover: right bytes or a miss
                assert await get(tier, meta) in (None, data)
            wait_until(lambda: len(cluster.primaries()) == 3, what="the replica promoted")

            async def all_served() -> bool:
                return all([await get(tier, meta) == data for meta, data in items])
            await wait_until_async(all_served, what="every chunk served after the failover")
        finally:
            await tier.close()


# ---- through the cache engine ----------------------------------------------------------------------------------
def test_two_engines_share_a_chunk_through_redis(redis_server: RedisServer) -> None:
    """Engine one stores; engine two (another instance, its own CPU tier and KV cache) retrieves it bit-exact
    from Redis; no remote-store process is part of the plan."""
    with EmbeddedNats() as nats:
        kv_one, kv_two = PagedKV(num_blocks=64, seed=1), PagedKV(num_blocks=64, seed=2)
        params = KeyParams(model="test-model", kv_format="")
        engines = [build_engine(engine_config(nats_url=nats.url, remote_url=redis_server.url,
                                             lmcache_instance_id=name), params, kv.layout)
                   for name, kv in (("one", kv_one), ("two", kv_two))]
        try:
            for engine in engines:
                plan = engine.mesh.plan
                assert plan.redis and plan.remote_stores == ["redis-kvmesh"]
                assert not plan.services  # no remote-store process
                assert engine.wait_connected(WAIT_S)
                wait_until(lambda: engine.storage.lower(REMOTE) is not None, what="the Redis tier")
            one, two = engines
            tokens = random_tokens(96, seed=5)
            src = kv_one.slots(96)
            token_api.store(one, tokens, **kv_one.kv(src))
            assert one.wait_write_behind(WAIT_S)
            assert token_api.lookup(two, tokens, search_range=[LOCAL_CPU]) == 0
            assert token_api.lookup(two, tokens) == 96
            dst = kv_two.slots(96)
            assert bool(token_api.retrieve(two, tokens, **kv_two.kv(dst)).all())
            assert torch.equal(kv_two.token_kv(dst), kv_one.token_kv(src))
            assert two.storage.stats[f"fetched_{REMOTE}"] == 3
            # the controller's RemoteBackend commands reach Redis through either engine
            assert token_api.pin(two, tokens, REMOTE) == 96 and token_api.unpin(one, tokens, REMOTE) == 96
            assert token_api.clear(one, REMOTE) == 96
            assert token_api.lookup(two, tokens, search_range=["RemoteBackend"]) == 0
        finally:
            for engine in engines:
                engine.close()


def test_an_engine_serves_through_a_redis_outage(redis_server: RedisServer) -> None:
    """Redis killed under an engine: stores and retrieves go on (misses, no exception, no hang past the bounds);
    Redis back (empty): the engine stores to it and hits it again, without a restart."""
    with EmbeddedNats() as nats:
        kv = PagedKV(num_blocks=64)
        engine = build_engine(engine_config(nats_url=nats.url, remote_url=redis_server.url, local_cpu=False,
                                           redis_timeout_secs=1.0, remote_retry_interval_secs=0.0,
                                           lmcache_instance_id="outage"),
                              KeyParams(model="test-model", kv_format=""), kv.layout)
        try:
            assert engine.wait_connected(WAIT_S)
            wait_until(lambda: engine.storage.lower(REMOTE) is not None, what="the Redis tier")
            before = random_tokens(64, seed=8)
            token_api.store(engine, before, **kv.kv(kv.slots(64)))
            assert engine.wait_write_behind(WAIT_S) and token_api.lookup(engine, before) == 64

            redis_server.kill()
            during = random_tokens(64, seed=9)
            token_api.store(engine, during, **kv.kv(kv.slots(64)))  # write-behind fails: logged, the request is fine
            assert engine.wait_write_behind(WAIT_S)
            assert token_api.lookup(engine, before) == 0 and token_api.lookup(engine, during) == 0
            assert not bool(token_api.retrieve(engine, before, **kv.kv(kv.slots(64))).any())  # a miss: vLLM recomputes
            assert engine.storage.stats["write_behind_failed"] >= 1

            redis_server.start()  # same port, empty
            after = random_tokens(64, seed=10)
            src = kv.slots(64)

            def stored_and_held() -> bool:
                token_api.store(engine, after, **kv.kv(src))
                return engine.wait_write_behind(WAIT_S) and token_api.lookup(engine, after) == 64
            wait_until(stored_and_held, what="stores reaching Redis again")
            dst = kv.slots(64, exclude=src)
            assert bool(token_api.retrieve(engine, after, **kv.kv(dst)).all())
            assert torch.equal(kv.token_kv(dst), kv.token_kv(src))
        finally:
            engine.close()
