"""POST /prefetch through a real controller (in-process uvicorn, REST auth on), a real cache engine and a real disk
store process on an authenticated NATS: a prompt cleared from the CPU tier comes back into it from the disk store,
with the KV it was stored with."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import torch

from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import CONTROLLER, LOCAL_CPU, LOCAL_DISK

from support.controller import running_controller
from support.engine import CHUNK, PagedKV, random_tokens
from support.engine_mesh import _store_and_settle, disk_mesh, engine_on  # noqa: F401 (disk_mesh: a fixture)
from support.waiting import wait_until_async

TOKEN = "prefetch-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INSTANCE = "warmed"
MAX_TOKENS = 64 * CHUNK


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    response = await client.post(path, json=body, headers=AUTH)
    assert response.status_code == status, response.text
    return response.json()


def _held(engine: CacheEngine, tokens: torch.Tensor, location: str) -> int:
    return token_api.lookup(engine, tokens, [location])


async def test_prefetch_brings_a_cleared_prompt_back_into_the_cpu_tier(disk_mesh: LocalMesh, tmp_path: Path) -> None:
    kv = PagedKV(num_blocks=128)
    engine: CacheEngine = await asyncio.to_thread(engine_on, str(disk_mesh.nats_url), kv,
                                                  local_disk=str(tmp_path / "disk"), lmcache_instance_id=INSTANCE)
    prompt, unknown = random_tokens(4 * CHUNK, seed=1), random_tokens(3 * CHUNK, seed=2)
    async with running_controller(str(disk_mesh.nats_url), nats_auth=disk_mesh.auth(CONTROLLER),
                                  auth_token=TOKEN, max_tokens=MAX_TOKENS) as (_, client):
        try:
            await wait_until_async(lambda: engine.storage.lower(LOCAL_DISK) is not None, what="the disk client")

            async def registered() -> bool:
                return (await client.post("/health", json={"instance_id": INSTANCE}, headers=AUTH)).status_code == 200
            await wait_until_async(registered, what="the engine registered")
            src = kv.slots(4 * CHUNK)
            await asyncio.to_thread(_store_and_settle, engine, prompt, kv, src)

            # Cleared from the CPU tier; the disk store still holds it.
            clear = await _post(client, "/clear", {"instance_id": INSTANCE, "location": LOCAL_CPU})
            assert clear["num_tokens"] == 4 * CHUNK
            assert await asyncio.to_thread(_held, engine, prompt, LOCAL_CPU) == 0
            assert len(engine.cpu) == 0
            assert await asyncio.to_thread(_held, engine, prompt, LOCAL_DISK) == 4 * CHUNK

            # Unknown tokens: nothing to warm, nothing moves.
            nothing = await _post(client, "/prefetch", {"instance_id": INSTANCE, "tokens": unknown.tolist()})
            assert nothing["num_tokens"] == 0
            assert (await _post(client, "/check_finish", {"event_id": nothing["event_id"]}))["status"] == "finished"
            assert len(engine.cpu) == 0

            # The prompt and 3 chunks no tier holds: the held prefix (the prompt) is answered and warmed.
            longer = torch.cat([prompt, unknown])
            warm = await _post(client, "/prefetch", {"instance_id": INSTANCE, "location": LOCAL_CPU,
                                                     "tokens": longer.tolist()})
            assert warm["num_tokens"] == 4 * CHUNK and warm["event_id"] != nothing["event_id"]
            assert (await _post(client, "/check_finish", {"event_id": warm["event_id"]}))["status"] == "finished"

            async def in_cpu_tier() -> bool:
                return await asyncio.to_thread(_held, engine, prompt, LOCAL_CPU) == 4 * CHUNK
            await wait_until_async(in_cpu_tier, what="the prompt back in the CPU tier")
            assert len(engine.cpu) == 4  # the prompt's chunks, nothing of the unknown tokens

            async def indexed_on_cpu() -> bool:
                layout = await _post(client, "/lookup", {"tokens": prompt.tolist()})
                return layout["layout_info"].get(INSTANCE) == [LOCAL_CPU, 4 * CHUNK]
            await wait_until_async(indexed_on_cpu, what="the controller's index showing the prompt on the CPU tier")

            # What came back is the KV the prompt was stored with.
            dst = kv.slots(4 * CHUNK, exclude=src)
            assert bool((await asyncio.to_thread(token_api.retrieve, engine, prompt, **kv.kv(dst))).all())
            assert torch.equal(kv.token_kv(dst), kv.token_kv(src))
        finally:
            await asyncio.to_thread(engine.close)


async def test_prefetch_refuses_bad_bodies_and_unauthenticated_requests(nats_server: Any) -> None:
    async with running_controller(nats_server.url, auth_token=TOKEN, max_tokens=MAX_TOKENS) as (_, client):
        body = {"instance_id": INSTANCE, "tokens": [1, 2, 3]}
        assert (await client.post("/prefetch", json=body)).status_code == 401
        wrong = await client.post("/prefetch", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"

        bad = {"instance_id": {**body, "instance_id": ""}, "tokens": {**body, "tokens": [1, -2]},
               "location": {**body, "location": LOCAL_DISK}, "cache_salt": {**body, "cache_salt": "s" * 129}}
        for field, invalid in bad.items():
            refused = await _post(client, "/prefetch", invalid, status=422)
            assert refused["detail"][0]["loc"][:2] == ["body", field], (field, refused)
        missing = await _post(client, "/prefetch", {"instance_id": INSTANCE}, status=422)
        assert missing["detail"][0]["loc"] == ["body", "tokens"]

        too_many = await _post(client, "/prefetch", {**body, "tokens": [1] * (MAX_TOKENS + 1)}, status=413)
        assert "--max-tokens" in too_many["detail"]
        unknown = await _post(client, "/prefetch", body, status=404)
        assert INSTANCE in unknown["detail"]
        assert (await _post(client, "/check_finish", {"event_id": unknown["event_id"]}))["status"] == "failed"
