"""Where the engine finds NATS: the join/embed decision, and the disk-offload setup's embedded mesh for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.mesh import embedded as embedded_mesh
from kvmesh.services.engine.mesh.embedded import EMBED, JOIN, plan_mesh
from kvmesh.shared.ops import local_mesh
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, disk_store_id
from kvmesh.shared.wire.keys import KeyParams

from support.processes import pid_alive, wait_dead
from support.engine import PagedKV, engine_config, random_tokens
from support.waiting import WAIT_S, wait_until

PARAMS = KeyParams(model="test-model", kv_format="")
JOIN_PROBE = """
import sys
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.mesh.embedded import plan_mesh, registry
from kvmesh.shared.ops import local_mesh
share = registry.acquire(plan_mesh(EngineConfig(local_disk=sys.argv[1], max_local_disk_size=0.05)))
print(share.url, "joined" if share.mesh is None else "started")
registry.release(share)
"""


def test_plan_joins_a_configured_mesh_and_embeds_otherwise() -> None:
    plan = plan_mesh(EngineConfig(nats_url="nats://10.0.0.1:4222", controller_url="localhost:9001"))
    assert (plan.mode, plan.nats_url) == (JOIN, "nats://10.0.0.1:4222")
    plan = plan_mesh(EngineConfig(controller_url="localhost:9001", local_disk="file:///tmp/x"))
    assert (plan.mode, plan.nats_url, plan.disk_store) == (JOIN, "nats://localhost:9001", disk_store_id())
    assert plan.services == []  # joining spawns nothing
    plan = plan_mesh(EngineConfig(remote_url="nats://remote-host:4222", remote_partitions=2))
    assert (plan.mode, plan.nats_url, plan.remote_stores) == (JOIN, "nats://remote-host:4222", ["remote-0", "remote-1"])

    plan = plan_mesh(EngineConfig())  # the disk-offload setup without a disk: just NATS
    assert (plan.mode, plan.services, plan.disk_store, plan.remote_stores) == (EMBED, [], None, [])
    plan = plan_mesh(EngineConfig(local_disk="file://local/disk_test/local_disk/", max_local_disk_size=5.0,
                                  remote_url="lm://localhost:65432", remote_partitions=2, remote_size=1.5,
                                  cache_policy="lfu"))
    assert plan.mode == EMBED
    assert [s.service_id for s in plan.services] == [disk_store_id(), "remote-0", "remote-1"]
    disk = plan.services[0]
    assert disk.module == "kvmesh.services.disk_store"
    assert disk.args[:8] == ["--dir", "local/disk_test/local_disk", "--max-size-gb", "5.0", "--store-id",
                             disk_store_id(), "--cache-policy", "LFU"]  # the engine's cache_policy reaches the stores
    assert plan.services[2].args[:10] == ["--max-size-gb", "1.5", "--partition", "1", "--partitions", "2",
                                          "--store-id", "remote-1", "--cache-policy", "LFU"]
    assert plan.services[2].args[-2:] == ["--prefault-gb", "1.0"]  # remote_prefault_size's default
    small = plan_mesh(EngineConfig(remote_url="lm://localhost:65432", remote_size=0.5, remote_prefault_size=2.0))
    assert small.services[0].args[-2:] == ["--prefault-gb", "0.5"]  # never more than the store's memory
    none = plan_mesh(EngineConfig(remote_url="lm://localhost:65432", remote_prefault_size=0))
    assert "--prefault-gb" not in none.services[0].args


def test_seed_002_embeds_nats_and_a_disk_store_shared_by_workers(tmp_path: Path) -> None:
    kv = PagedKV(num_blocks=128)
    config = engine_config(local_disk=f"file://{tmp_path}/disk/", max_local_disk_size=0.05, cpu_chunks=4,
                           local_cpu=False)
    first = build_engine(config, PARAMS, kv.layout)
    second: CacheEngine | None = None
    mesh = embedded_mesh.registry.current()
    try:
        assert first.mesh is not None and first.mesh.plan.mode == EMBED and mesh is not None
        assert first.wait_connected(WAIT_S)
        assert mesh.services_ready.wait(WAIT_S) and mesh.services_ok
        assert len(mesh.pids) == 2 and all(pid_alive(p) for p in mesh.pids)  # nats-server + disk store

        second = build_engine(config, KeyParams(model="test-model", kv_format="", world_size=2, rank=1),
                              kv.layout)
        assert embedded_mesh.registry.current() is mesh and embedded_mesh.registry.users() == 2

        # another worker process of this vLLM (tensor parallelism) joins this mesh instead of starting one
        probe = subprocess.run([sys.executable, "-c", JOIN_PROBE, config.local_disk or ""], capture_output=True,
                               text=True, timeout=120)
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.split() == [first.nats_loop.url, "joined"]

        tokens = random_tokens(128, seed=1)
        src = kv.slots(128)
        expected = kv.token_kv(src)
        client = wait_until(lambda: first.storage.lower(LOCAL_DISK), what="the disk store client")
        token_api.store(first, tokens, **kv.kv(src))
        assert first.wait_write_behind(WAIT_S)
        assert first.nats_loop.call(client.wait_written(WAIT_S), WAIT_S + 2, default=False)
        assert token_api.lookup(first, tokens, search_range=[LOCAL_CPU]) == 0  # local_cpu: false -> staging only
        assert token_api.lookup(first, tokens) == 128
        dst = kv.slots(128, exclude=src)
        assert bool(token_api.retrieve(first, tokens, **kv.kv(dst)).all())
        assert torch.equal(kv.token_kv(dst), expected)

        first.close()
        assert embedded_mesh.registry.current() is mesh and all(pid_alive(p) for p in mesh.pids)
        assert second.wait_connected(WAIT_S)
    finally:
        first.close()
        if second is not None:
            second.close()
    assert embedded_mesh.registry.current() is None
    assert all(wait_dead(p) for p in mesh.pids)


def test_an_engine_whose_mesh_cannot_start_serves_from_its_cpu_tier(monkeypatch) -> None:
    from kvmesh.shared.errors import NatsServerError

    class NoNats:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def start(self) -> "NoNats":
            raise NatsServerError("nats-server binary not found (test)")

    monkeypatch.setattr(local_mesh, "EmbeddedNats", NoNats)
    kv = PagedKV()
    engine = build_engine(engine_config(), PARAMS, kv.layout)
    try:
        assert engine.nats_loop is None and embedded_mesh.registry.current() is None
        tokens = random_tokens(64, seed=2)
        token_api.store(engine, tokens, **kv.kv(kv.slots(64)))
        assert token_api.lookup(engine, tokens) == 64
    finally:
        engine.close()


def test_host_claim_has_one_owner_and_hands_over(tmp_path: Path) -> None:
    from kvmesh.shared.ops.local_mesh import ServiceSpec

    specs = [ServiceSpec("kvmesh.services.disk_store", ["--dir", str(tmp_path)], "disk-x")]
    first, second = embedded_mesh.HostClaim(specs), embedded_mesh.HostClaim(specs)
    assert first.path == second.path
    assert first.try_own()
    try:
        assert not second.try_own()
        assert second.owner_url() is None  # owned, but no URL yet
        first.publish("nats://127.0.0.1:4999")
        assert second.owner_url() == "nats://127.0.0.1:4999"
    finally:
        first.release()
    assert second.owner_url() is None and not first.path.exists()
    assert second.try_own()
    second.release()
