"""Engines in sharing domains (issue 24): a real disk store process and a real controller on a KVMesh-started NATS,
engines in two domains made by `kvmesh credentials --domain`. Each engine mixes its domain's secret into its
chunk keys, so two tenants with the same prompt both cache it, neither can compute (and so probe or occupy) the
other's keys, and the controller's /lookup still credits each instance with what it holds."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Iterator

import pytest
import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.mesh.domain import key_domain
from kvmesh.shared.messaging.credentials import MeshCredentials, SharingDomain, local_mesh_dir
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import CONTROLLER, LOCAL_CPU, LOCAL_DISK, Principal
from kvmesh.shared.wire.keys import ChunkHasher, KeyParams

from support.controller import running_controller
from support.engine import CHUNK, PagedKV, disk_store_mesh, engine_config, random_tokens
from support.waiting import WAIT_S, wait_until, wait_until_async


@pytest.fixture
def disk_mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    with disk_store_mesh(tmp_path / "disk") as mesh:
        yield mesh


def engine_in(mesh: LocalMesh, instance: str, domain: str, kv: PagedKV, disk: Path) -> CacheEngine:
    credentials = MeshCredentials(local_mesh_dir(int(mesh.nats_url.rsplit(":", 1)[1])))
    path = Principal.engine(instance).path
    credentials.ensure(path, domain=domain)
    assert credentials.reload_server()
    engine = build_engine(engine_config(nats_url=mesh.nats_url, lmcache_instance_id=instance,
                                       nats_credentials=str(credentials.file(path)), local_disk=str(disk)),
                          KeyParams(model="test-model", kv_format=""), kv.layout)
    assert engine.wait_connected(WAIT_S), f"engine {instance} did not reach NATS"
    wait_until(lambda: engine.storage.lower(LOCAL_DISK) is not None, what=f"{instance}'s disk store client")
    return engine


def test_the_key_root_takes_the_domain_secret_not_only_its_name() -> None:
    name_only = KeyParams("m", "f", domain="tenant-a")
    a1 = KeyParams("m", "f", domain=key_domain(SharingDomain("tenant-a", b"1" * 32)))
    a2 = KeyParams("m", "f", domain=key_domain(SharingDomain("tenant-a", b"2" * 32)))
    default = KeyParams("m", "f", domain=key_domain(SharingDomain()))
    assert len({name_only.root(), a1.root(), a2.root(), default.root()}) == 4
    assert default.root() == KeyParams("m", "f").root()  # the default domain's keys are as before domains


async def test_two_domains_cache_one_prompt_apart_and_lookup_credits_each(disk_mesh: LocalMesh,
                                                                          tmp_path: Path) -> None:
    kv = PagedKV(num_blocks=128)
    disk = tmp_path / "disk"
    alpha = await asyncio.to_thread(engine_in, disk_mesh, "alpha", "tenant-a", kv, disk)
    beta = await asyncio.to_thread(engine_in, disk_mesh, "beta", "tenant-b", kv, disk)
    try:
        tokens = random_tokens(4 * CHUNK, seed=31)
        plain = ChunkHasher(KeyParams("test-model", alpha.key_params.kv_format), CHUNK).keys(tokens.tolist())
        alpha_keys, beta_keys = (engine.hasher.keys(tokens.tolist()) for engine in (alpha, beta))
        assert len({tuple(plain), tuple(alpha_keys), tuple(beta_keys)}) == 3

        for engine in (alpha, beta):  # the same prompt: each tenant stores its own copy, neither is refused
            src = kv.slots(len(tokens))
            token_api.store(engine, tokens, **kv.kv(src))
            assert engine.wait_write_behind(WAIT_S)
            disk_client = engine.storage.lower(LOCAL_DISK)
            assert engine.nats_loop.call(disk_client.wait_written(WAIT_S), WAIT_S + 2, default=False)
            assert token_api.lookup(engine, tokens, search_range=[LOCAL_DISK]) == len(tokens)

        async with running_controller(str(disk_mesh.nats_url), nats_auth=disk_mesh.auth(CONTROLLER)) as (_, client):
            async def credited() -> bool:
                response = await client.post("/lookup", json={"tokens": tokens.tolist()})
                assert response.status_code == 200, response.text
                layout = response.json()["layout_info"]
                return all(layout.get(instance) == [LOCAL_CPU, len(tokens)] for instance in ("alpha", "beta"))
            await wait_until_async(credited, what="/lookup crediting both instances with the prompt")
    finally:
        for engine in (alpha, beta):
            await asyncio.to_thread(engine.close)
