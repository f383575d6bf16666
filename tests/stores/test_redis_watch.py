"""The remote-store service in Redis mode (services/remote_store/redis_watch.py) on a real redis-server and NATS:
it reports the chunks engines put (admissions), and Redis's deletions and evictions, to the controller's
subjects; it rebuilds its view after Redis restarts; and `python -m kvmesh.services.remote_store --redis-url`
runs it as a mesh service."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import AsyncIterator

import pytest

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.tiers.redis import RedisTier
from kvmesh.services.remote_store.redis_watch import RedisWatch
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec
from kvmesh.shared.protocol import LOCAL_CPU, REMOTE
from kvmesh.shared.wire.keys import KeyParams
from kvmesh.shared.wire.redis_keys import RedisKeys
from kvmesh.shared.wire.redis_url import parse_redis_url

from support.redis_server import RedisServer
from support.store_events import admission_batches
from support.controller import running_controller, wait_layout
from support.engine import PagedKV, engine_config, random_tokens
from support.redis_tier import chunk, put
from support.waiting import WAIT_S, wait_until_async

STORE_ID = protocol.redis_store_id("kvmesh")


@pytest.fixture
async def nats() -> AsyncIterator[tuple[EmbeddedNats, object]]:
    with EmbeddedNats() as server:
        client = await bus.connect(server.url, name="test")
        yield server, client
        await client.close()


def reported(batches: list[protocol.AdmissionBatch], key: bytes) -> bool | None:
    """The last state the batches gave `key`: True admitted, False evicted, None never named."""
    state = None
    for batch in batches:
        if key in batch.admitted:
            state = True
        if key in batch.evicted:
            state = False
    return state


async def test_admissions_deletions_and_evictions_reach_the_controller(nats: tuple[EmbeddedNats, object]) -> None:
    server, nc = nats
    with RedisServer("--maxmemory", "6mb", "--maxmemory-policy", "volatile-lru") as redis_server:
        tier = RedisTier(parse_redis_url(redis_server.url), "engine.a.a", timeout=WAIT_S / 3, retry_interval=0.0)
        early, early_data = chunk(1)
        assert await put(tier, early, early_data)  # there before the service starts: found by its scan
        batches = await admission_batches(nc, STORE_ID)
        watch = RedisWatch(parse_redis_url(redis_server.url), STORE_ID, "kvmesh", server.url, timeout=1.0,
                           retry_interval=0.05)
        try:
            await watch.start(nc)
            await wait_until_async(lambda: reported(batches, early.key), what="the scanned chunk")
            with redis_server.client() as client:
                assert "K" in client.config_get("notify-keyspace-events")["notify-keyspace-events"]

            meta, data = chunk(2)
            assert await put(tier, meta, data)
            await wait_until_async(lambda: reported(batches, meta.key), what="the admission of a put")
            assert await tier.remove([meta.key]) == 1
            await wait_until_async(lambda: reported(batches, meta.key) is False, what="the deletion")

            flood = [chunk(100 + i, nbytes=512 * 1024) for i in range(30)]  # 15 MiB through a 6 MiB Redis
            for item in flood:
                await put(tier, *item)
            with redis_server.client() as client:
                gone = [m.key for m, _ in flood if not client.exists(tier.chunk_key(m.key))]
            assert gone, "Redis evicted nothing"
            await wait_until_async(lambda: all(reported(batches, k) is False for k in gone), what="the evictions")
            assert not any(k in watch.held for k in gone)

            # Redis restarts empty: the service rescans and reports everything gone
            held_before = set(watch.held)
            resyncs = watch.resyncs
            redis_server.kill()
            redis_server.start()
            await wait_until_async(lambda: watch.resyncs > resyncs, what="the rescan after the restart")
            assert not watch.held
            await wait_until_async(lambda: all(reported(batches, k) is False for k in held_before),
                                   what="the evictions of a restart")
            assert await put(tier, meta, data)
            await wait_until_async(lambda: reported(batches, meta.key), what="admissions after the restart")
        finally:
            await watch.stop()
            await tier.close()


async def test_lookup_sees_the_engines_chunks_in_redis_and_what_redis_drops(
        nats: tuple[EmbeddedNats, object]) -> None:
    """An engine with a Redis remote_url, the controller and the service in Redis mode: /lookup reports the
    chunks at RemoteBackend once the CPU tier no longer has them, and follows Redis deleting one."""
    server, _ = nats
    kv = PagedKV(num_blocks=64)
    tokens = random_tokens(96, seed=7)  # three chunks
    with RedisServer() as redis_server:
        watch = RedisWatch(parse_redis_url(redis_server.url), STORE_ID, "kvmesh", server.url, timeout=1.0)
        async with running_controller(server.url) as (_, client):
            await watch.start()
            engine = await asyncio.to_thread(build_engine, engine_config(
                nats_url=server.url, remote_url=redis_server.url, lmcache_instance_id="redis-inst"),
                KeyParams(model="test-model", kv_format=""), kv.layout)
            try:
                assert await asyncio.to_thread(engine.wait_connected, WAIT_S)
                await wait_until_async(lambda: engine.storage.lower(REMOTE) is not None, what="the Redis tier")
                await asyncio.to_thread(token_api.store, engine, tokens, **kv.kv(kv.slots(96)))
                assert await asyncio.to_thread(engine.wait_write_behind, WAIT_S)
                await wait_layout(client, tokens.tolist(), {"redis-inst": [LOCAL_CPU, 96]})
                assert await asyncio.to_thread(token_api.clear, engine, LOCAL_CPU) == 96
                await wait_layout(client, tokens.tolist(), {"redis-inst": [REMOTE, 96]})
                second = engine.hasher.keys(tokens)[1]
                with redis_server.client() as redis_client:
                    assert redis_client.delete(RedisKeys("kvmesh").chunk(second)) == 1
                await wait_layout(client, tokens.tolist(), {"redis-inst": [REMOTE, 32]})
            finally:
                await asyncio.to_thread(engine.close)
                await watch.stop()


def test_the_service_runs_in_redis_mode_and_refuses_a_bad_url() -> None:
    with RedisServer() as redis_server:
        spec = ServiceSpec("kvmesh.services.remote_store", ["--redis-url", redis_server.url], STORE_ID)
        mesh = LocalMesh([spec]).start(ready_timeout=WAIT_S)  # waits for its health answer
        mesh.stop()
    bad = subprocess.run([sys.executable, "-m", "kvmesh.services.remote_store", "--redis-url", "redis://h:0"],
                         capture_output=True, text=True, timeout=WAIT_S)
    assert bad.returncode == 2 and "bad port" in bad.stderr
