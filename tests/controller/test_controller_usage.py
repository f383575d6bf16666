"""GET /usage through a real controller (in-process uvicorn, REST auth on), a real cache engine and a real disk store
process on an authenticated NATS: what /usage answers follows what was put, read, evicted, pinned and cleared."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.tiers.base import Retention
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import CONTROLLER, LOCAL_CPU, LOCAL_DISK

from support.controller import running_controller
from support.engine import CHUNK, PagedKV, random_tokens
from support.engine_mesh import _store_and_settle, disk_mesh, engine_on  # noqa: F401 (disk_mesh: a fixture)
from support.waiting import wait_until_async

TOKEN = "usage-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CPU_CHUNKS = 6


async def _usage(client: httpx.AsyncClient, **params: str) -> dict[str, Any]:
    response = await client.get("/usage", params=params, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def _module(body: dict[str, Any], backend: str) -> dict[str, Any]:
    (instance,) = body["instances"]
    (module,) = [m for m in instance["modules"] if m["backend"] == backend]
    return module


async def _settled(client: httpx.AsyncClient, backend: str, **expected: Any) -> dict[str, Any]:
    """The instance's `backend` module once its figures are `expected` (admissions arrive within a flush)."""
    found: dict[str, Any] = {}

    async def matches() -> bool:
        nonlocal found
        found = _module(await _usage(client, instance_id="metered"), backend)
        return all(found[name] == value for name, value in expected.items())
    try:
        await wait_until_async(matches, what=f"{backend} usage {expected}")
    except TimeoutError:
        raise AssertionError(f"{backend} usage: got {found}, expected {expected}") from None
    return found


async def test_usage_follows_puts_hits_evictions_pins_and_clears(disk_mesh: LocalMesh, tmp_path: Path) -> None:
    kv = PagedKV(num_blocks=128)
    engine: CacheEngine = await asyncio.to_thread(engine_on, str(disk_mesh.nats_url), kv,
                                                  local_disk=str(tmp_path / "disk"), lmcache_instance_id="metered",
                                                  cpu_chunks=CPU_CHUNKS, retained_cpu_share=0.2)  # 1 chunk
    slot_nbytes = engine.cpu.pool.slot_nbytes
    first, second = random_tokens(4 * CHUNK, seed=1), random_tokens(4 * CHUNK, seed=2)
    async with running_controller(str(disk_mesh.nats_url), nats_auth=disk_mesh.auth(CONTROLLER),
                                  auth_token=TOKEN) as (_, client):
        try:
            await wait_until_async(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk client")

            async def registered() -> bool:
                return (await client.get("/usage", params={"instance_id": "metered"}, headers=AUTH)).status_code == 200
            await wait_until_async(registered, what="the engine registered")
            src = kv.slots(4 * CHUNK)
            await asyncio.to_thread(_store_and_settle, engine, first, kv, src)

            # A put: 4 chunks on the CPU tier and in the disk store, by the index and by their own count.
            cpu = await _settled(client, LOCAL_CPU, num_chunks=4, reported_chunks=4)
            assert cpu["used_bytes"] == 4 * slot_nbytes and cpu["capacity_bytes"] == engine.cpu.pool.capacity_bytes
            assert cpu["pinned_chunks"] == 0 and cpu["evictions"] == 0 and cpu["hits"] == 0
            assert cpu["retains_refused"] == 0
            assert (cpu["producers"], cpu["reporting"], cpu["tier"], cpu["shared"]) == (1, 1, "l1", False)
            assert cpu["usage_ratio"] == round(4 * slot_nbytes / engine.cpu.pool.capacity_bytes, 6)
            disk = await _settled(client, LOCAL_DISK, num_chunks=4, reported_chunks=4)
            body = await _usage(client)
            (store,) = body["shared_modules"]
            assert disk["shared"] and disk["store_ids"] == [store["store_id"]] and store["tier"] == "l2"
            assert disk["used_bytes"] == store["used_bytes"] > 0 and store["num_chunks"] == 4
            (worker,) = body["instances"][0]["workers"]
            assert worker["worker_id"] == engine.worker_id and worker["num_chunks"] == 4
            (domain,) = body["domains"]
            assert domain["instance_ids"] == ["metered"] and domain["modules"][0]["num_chunks"] == 4

            # A request asks to keep the 4 chunks (kv_priority): the CPU tier's retained share holds 1 of them.
            engine.cpu.retain_keys([span.key for span in engine.hasher.spans(first)], Retention(priority=1))
            await _settled(client, LOCAL_CPU, retains_refused=3)
            (worker,) = (await _usage(client, instance_id="metered"))["instances"][0]["workers"]
            assert worker["retains_refused"] == 3
            assert _module(await _usage(client, instance_id="metered"), LOCAL_DISK)["retains_refused"] == 0

            # Reads: every chunk of the prefix is a CPU-tier hit.
            dst = kv.slots(4 * CHUNK, exclude=src)
            assert bool((await asyncio.to_thread(token_api.retrieve, engine, first, **kv.kv(dst))).all())
            await _settled(client, LOCAL_CPU, hits=4)

            # Evictions: 4 more chunks in a 6-chunk CPU tier push 2 out (the disk store keeps all 8).
            await asyncio.to_thread(_store_and_settle, engine, second, kv, kv.slots(4 * CHUNK))
            cpu = await _settled(client, LOCAL_CPU, num_chunks=CPU_CHUNKS, reported_chunks=CPU_CHUNKS)
            assert cpu["evictions"] == 8 - CPU_CHUNKS and cpu["used_bytes"] == CPU_CHUNKS * slot_nbytes
            await _settled(client, LOCAL_DISK, num_chunks=8, reported_chunks=8, evictions=0)

            # Pins: the second prompt's 4 chunks, on the CPU tier and in the store.
            for location in (LOCAL_CPU, LOCAL_DISK):
                pin = await client.post("/pin", headers=AUTH, json={"instance_id": "metered", "location": location,
                                                                    "tokens": second.tolist()})
                assert pin.status_code == 200 and pin.json()["num_tokens"] == 4 * CHUNK, pin.text
            await _settled(client, LOCAL_CPU, pinned_chunks=4)
            await _settled(client, LOCAL_DISK, pinned_chunks=4)

            # A clear of the CPU tier empties it in the index at once (pins and all), and by its own count.
            clear = await client.post("/clear", headers=AUTH, json={"instance_id": "metered", "location": LOCAL_CPU})
            assert clear.status_code == 200, clear.text
            assert _module(await _usage(client, instance_id="metered"), LOCAL_CPU)["num_chunks"] == 0
            await _settled(client, LOCAL_CPU, num_chunks=0, reported_chunks=0, used_bytes=0, pinned_chunks=0)
            await _settled(client, LOCAL_DISK, num_chunks=8)

            # Filters: one location only.
            only_disk = await _usage(client, location=LOCAL_DISK)
            assert [m["backend"] for m in only_disk["instances"][0]["modules"]] == [LOCAL_DISK]
            assert only_disk["instances"][0]["workers"] == [] and len(only_disk["shared_modules"]) == 1
            only_cpu = await _usage(client, location=LOCAL_CPU)
            assert only_cpu["shared_modules"] == [] and len(only_cpu["instances"][0]["workers"]) == 1
            alias = await client.get("/instances/metered/usage", headers=AUTH)
            assert alias.status_code == 200 and alias.json()["instances"][0]["instance_id"] == "metered"
            fleet = await client.get("/instances/usage", headers=AUTH)
            assert fleet.status_code == 200 and [i["instance_id"] for i in fleet.json()["instances"]] == ["metered"]
        finally:
            await asyncio.to_thread(engine.close)


async def test_usage_refuses_bad_filters_and_unauthenticated_requests(nats_server: Any) -> None:
    async with running_controller(nats_server.url, auth_token=TOKEN) as (_, client):
        for path in ("/usage", "/instances/usage", "/instances/x/usage"):
            assert (await client.get(path)).status_code == 401
            wrong = await client.get(path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        empty = await client.get("/usage", headers=AUTH)
        assert empty.status_code == 200
        assert empty.json() == {"controller_id": "controller-test", "instances": [], "shared_modules": [],
                                "domains": []}
        bad_location = await client.get("/usage", params={"location": "GPU"}, headers=AUTH)
        assert bad_location.status_code == 422 and bad_location.json()["detail"][0]["loc"] == ["query", "location"]
        too_long = await client.get("/usage", params={"instance_id": "i" * 257}, headers=AUTH)
        assert too_long.status_code == 422 and too_long.json()["detail"][0]["loc"] == ["query", "instance_id"]
        unknown = await client.get("/usage", params={"instance_id": "nobody"}, headers=AUTH)
        assert unknown.status_code == 404 and "nobody" in unknown.json()["detail"]
        assert (await client.get("/instances/nobody/usage", headers=AUTH)).status_code == 404


def test_usage_figures_from_a_producer_are_checked() -> None:
    """A producer's figures are untrusted input: a missing, negative, huge or non-integer one drops them all."""
    from kvmesh.shared.protocol import USAGE_DETAIL, TierUsage

    good = TierUsage(num_chunks=3, used_bytes=300, capacity_bytes=1000, pinned_chunks=1, hits=7, evictions=2)
    assert TierUsage.from_details({USAGE_DETAIL: good.as_detail()}) == good
    for bad in ({"num_chunks": -1}, {"hits": 2**63}, {"used_bytes": 1.0}, {"evictions": True}, {"pinned_chunks": None}):
        assert TierUsage.from_details({USAGE_DETAIL: {**good.as_detail(), **bad}}) is None, bad
    assert TierUsage.from_details({USAGE_DETAIL: {"num_chunks": 3}}) is None
    older = {name: value for name, value in good.as_detail().items() if name != "retains_refused"}
    assert TierUsage.from_details({USAGE_DETAIL: older}) == good, "a producer that predates the figure: 0"
    assert TierUsage.from_details({USAGE_DETAIL: {**good.as_detail(), "retains_refused": -1}}) is None
    assert TierUsage.from_details({"pid": 1}) is None and TierUsage.from_details([]) is None


async def test_usage_sums_producers_and_leaves_out_the_figures_of_those_that_do_not_answer(nats_server: Any) -> None:
    """Two instances of one sharing domain, one of them on two remote store partitions. These producers speak the
    protocol but answer no health request: /usage counts their chunks from the index and reports no bytes, pins,
    hits or evictions for them (never a partial sum)."""
    from kvmesh.shared.protocol import REMOTE

    from support.controller import FakeEngineWorker, FakeStore, started

    r0, r1 = FakeStore(nats_server.url, "r0", REMOTE), FakeStore(nats_server.url, "r1", REMOTE)
    a = FakeEngineWorker(nats_server.url, "a", chunk_size=4)
    b = FakeEngineWorker(nats_server.url, "b", chunk_size=4, remotes=(r0, r1))
    async with running_controller(nats_server.url, auth_token=TOKEN, usage_timeout_s=0.2) as (_, client), \
            started(r0, r1, a, b):
        a.store(list(range(8)))  # 2 chunks
        b.store(list(range(100, 104)))  # 1 chunk
        b.store(list(range(200, 208)), where=REMOTE)  # 1 chunk on each partition
        body: dict[str, Any] = {}

        async def settled() -> bool:
            nonlocal body
            body = await _usage(client)
            return ([i["modules"][0]["num_chunks"] for i in body["instances"]] == [2, 1]
                    and [s["num_chunks"] for s in body["shared_modules"]] == [1, 1])
        await wait_until_async(settled, what="the index holding every admission")
        (domain,) = body["domains"]
        assert domain["domain"] == "default" and domain["instance_ids"] == ["a", "b"]
        cpu, remote = domain["modules"]
        assert (cpu["backend"], cpu["num_chunks"], cpu["producers"], cpu["reporting"]) == (LOCAL_CPU, 3, 2, 0)
        assert (remote["backend"], remote["store_ids"], remote["num_chunks"], remote["producers"]) == (
            REMOTE, ["r0", "r1"], 2, 2)
        for module in (cpu, remote, *body["shared_modules"], *body["instances"][1]["workers"]):
            assert [module[name] for name in ("reported_chunks", "used_bytes", "capacity_bytes", "pinned_chunks",
                                              "hits", "evictions", "usage_ratio")] == [None] * 7, module
        assert [s["store_id"] for s in body["shared_modules"]] == ["r0", "r1"]
        only_a = await _usage(client, instance_id="a")
        assert [i["instance_id"] for i in only_a["instances"]] == ["a"] and only_a["shared_modules"] == []
        assert [m["backend"] for m in only_a["instances"][0]["modules"]] == [LOCAL_CPU]
        only_b = await _usage(client, instance_id="b", location=REMOTE)
        assert [s["store_id"] for s in only_b["shared_modules"]] == ["r0", "r1"]
        assert only_b["instances"][0]["modules"][0]["num_chunks"] == 2
