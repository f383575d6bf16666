"""Shared controller tables per principal, InstanceConflict notices, and who answered a ping-all (issue 24,
finding 5): one engine principal's registrations never refuse another principal's; 1,500 registrations of
one rank cost O(N) conflict notices, not N²/2; an engine answering the operator's ping-all as a disk store is
shown as the engine it is.

Real nats-server with per-principal credentials, the in-process ControllerService, a real remote store process
and the `kvmesh health` command; each principal speaks the wire protocol over its own connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmesh.services.controller.config import parse_args
from kvmesh.services.controller.service import ControllerService
from kvmesh.shared import protocol
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.credentials import credentials_for
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec
from kvmesh.shared.protocol import Principal, Subjects

from support.controller import running_controller
from support.waiting import WAIT_S, ManualClock, wait_until_async


class Tenant:
    """One engine principal (`engine.<instance_id>`) on its own connection, registering workers by hand."""

    def __init__(self, nats_url: str, instance_id: str) -> None:
        self.nats_url, self.instance_id = nats_url, instance_id
        self.principal = Principal.engine(instance_id)
        self.nc: Any = None

    async def __aenter__(self) -> "Tenant":
        self.nc = await bus.connect(self.nats_url, name=self.instance_id,
                                    auth=credentials_for(self.nats_url, self.principal, None))
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.nc.close()

    async def register(self, worker_id: str, rank: int = 0, world_size: int = 1, chunk_size: int = 16,
                       kv_replicated: bool = False) -> None:
        await bus.publish(self.nc, Subjects.register(self.principal.producer(worker_id)), protocol.RegisterEngine(
            worker_id=worker_id, instance_id=self.instance_id, model="test-model", kv_format="bfloat16/test",
            world_size=world_size, rank=rank, chunk_size=chunk_size, save_unfull_chunk=True, started_at=1.0,
            kv_replicated=kv_replicated))


def _registered(service: ControllerService, worker_id: str) -> bool:
    producer = service.core.table.producer(worker_id)
    return producer is not None and producer.engine is not None


def _handled(service: ControllerService) -> int:
    """Registrations the controller took or refused."""
    stats = service.core.table.stats
    return stats.registrations + sum(stats.registrations_refused.values())


async def test_one_principals_key_parameter_sets_never_refuse_another(nats_server: EmbeddedNats) -> None:
    """100 ranks of one flooding instance, each its own key parameter set (the default global bound was 64):
    the flood gets its share, and an honest instance of another principal still registers."""
    async with running_controller(nats_server.url, ManualClock()) as (service, _), \
            Tenant(nats_server.url, "flood") as flood, Tenant(nats_server.url, "honest") as honest:
        for rank in range(100):
            await flood.register(protocol.worker_id_for("flood", 100, rank), rank=rank, world_size=100)
        await wait_until_async(lambda: _handled(service) == 100, what="the flood handled")
        await honest.register("honest", chunk_size=32)
        await wait_until_async(lambda: _registered(service, "honest"), what="the honest instance registered")
        limits = service.core.table.quotas.limits
        refused = service.core.table.stats.registrations_refused
        assert refused["principal_key_param_sets"] == 100 - limits.max_key_param_sets_per_principal
        assert limits.max_key_param_sets_per_principal * 2 <= limits.max_key_param_sets


async def test_one_principals_producers_never_refuse_another(nats_server: EmbeddedNats) -> None:
    """700 workers of one principal against --max-producers 600: its share stops it, another gets in."""
    async with running_controller(nats_server.url, ManualClock(), max_producers=600) as (service, _), \
            Tenant(nats_server.url, "flood") as flood, Tenant(nats_server.url, "honest") as honest:
        for rank in range(700):  # one key parameter set (replicated KV), 700 ranks: no conflicts either
            await flood.register(protocol.worker_id_for("flood", 700, rank), rank=rank, world_size=700,
                                 kv_replicated=True)
        await wait_until_async(lambda: _handled(service) == 700, what="the flood handled")
        await honest.register("honest")
        await wait_until_async(lambda: _registered(service, "honest"), what="the honest instance registered")
        share = service.core.table.quotas.limits.max_workers_per_principal
        assert service.core.table.stats.registrations_refused["principal_producers"] == 700 - share


async def test_a_principal_at_its_share_makes_room_from_its_own_down_workers(nats_server: EmbeddedNats) -> None:
    """A restarted engine's new incarnation replaces its down ones; one whose workers are all up is refused."""
    clock = ManualClock()
    async with running_controller(nats_server.url, clock, max_workers_per_principal=2) as (service, _), \
            Tenant(nats_server.url, "inst") as inst:
        table = service.core.table
        for tag in ("1-a", "2-b"):
            await inst.register(f"inst@{tag}")
        await wait_until_async(lambda: _handled(service) == 2, what="two incarnations")
        await inst.register("inst@3-c")  # both others are up: refused
        await wait_until_async(lambda: table.stats.registrations_refused["principal_producers"] == 1,
                               what="the third refused")
        clock.advance(service.config.liveness_timeout_s + 1)  # all go silent: down
        await wait_until_async(lambda: not table.producer("inst@1-a").alive, what="down")
        await inst.register("inst@3-c")
        await wait_until_async(lambda: _registered(service, "inst@3-c"), what="the new incarnation registered")
        assert len(table.quotas.usage[Principal.engine("inst").path].producers) == 2


async def test_same_rank_registrations_cost_linear_conflict_notices(nats_server: EmbeddedNats) -> None:
    """1,500 live workers claiming one instance id and rank: each registration notifies the newcomer and the
    worker it displaces (the old code notified every claimant each time: 1,124,250 notices), and an honest
    registration of another principal during the flood is admitted."""
    count = 1500
    notices: list[str] = []
    marker = "flood@marker"
    async with running_controller(nats_server.url, ManualClock(), max_workers_per_principal=count + 1) \
            as (service, _), Tenant(nats_server.url, "flood") as flood, Tenant(nats_server.url, "honest") as honest:

        async def on_notice(msg: Any) -> None:
            notices.append(msg.subject)

        await flood.nc.subscribe(f"{Subjects.PREFIX}.worker.flood.>", cb=on_notice,
                                 pending_msgs_limit=bus.PENDING_MSGS_LIMIT, pending_bytes_limit=bus.PENDING_BYTES_LIMIT)
        await flood.nc.flush()
        for i in range(count):
            await flood.register(f"flood@{i}")
            if i == count // 2:
                await honest.register("honest")
        await wait_until_async(lambda: _registered(service, "honest"), what="the honest registration admitted",
                               timeout=6 * WAIT_S)
        await flood.register(marker)  # notices arrive in order: the marker's comes after every other
        marker_subject = Subjects.worker("flood", marker, protocol.CONFLICT_OP)
        await wait_until_async(lambda: marker_subject in notices, what="the marker's notice", timeout=6 * WAIT_S)
        assert len(notices) <= 3 * (count + 1), f"{len(notices)} notices for {count + 1} registrations"
        assert len(notices) >= count  # every newcomer into the conflict hears of it
        assert service.core.feed.conflict_notices_sent == len(notices)


async def test_one_principals_admissions_stop_at_its_key_share_and_never_crowd_out_another(
        nats_server: EmbeddedNats) -> None:
    """A flooding principal reports 30,000 keys (in batches and in a full sync) against --max-keys-per-principal
    10,000: the controller indexes 10,000 of them, counts the rest, and another principal's keys still index."""
    share = 10_000
    async with running_controller(nats_server.url, ManualClock(), max_keys_per_principal=share) as (service, _), \
            Tenant(nats_server.url, "flood") as flood, Tenant(nats_server.url, "honest") as honest:
        table = service.core.table
        for tenant in (flood, honest):
            await tenant.register(tenant.instance_id)
        await wait_until_async(lambda: _registered(service, "flood") and _registered(service, "honest"),
                               what="both registered")
        keys = [i.to_bytes(16, "little") for i in range(30_000)]

        async def admit(tenant: Tenant, seq: int, batch: list[bytes]) -> None:
            await bus.publish(tenant.nc, Subjects.events(tenant.principal.producer(tenant.instance_id)),
                              protocol.AdmissionBatch(producer_id=tenant.instance_id, location=protocol.LOCAL_CPU,
                                                      seq=seq, admitted=batch))

        for seq, start in enumerate(range(0, 20_000, 5_000), start=1):
            await admit(flood, seq, keys[start:start + 5_000])
        await wait_until_async(lambda: table.stats.batches >= 4, what="the flood's batches")
        flood_slot = table.producer("flood").slot
        assert table.index.count(flood_slot) == share and table.stats.keys_refused == 10_000
        sync_id = "s1"  # a full sync of 30,000 keys: its buffer stops at the share too
        for part, start in enumerate(range(0, 30_000, 10_000)):
            await bus.publish(flood.nc, Subjects.events(flood.principal.producer("flood")), protocol.SyncChunk(
                producer_id="flood", location=protocol.LOCAL_CPU, sync_id=sync_id, seq=4, part=part,
                keys=keys[start:start + 10_000], final=start + 10_000 == 30_000))
        await wait_until_async(lambda: table.stats.syncs_completed >= 1, what="the flood's sync")
        assert table.index.count(flood_slot) == share and table.stats.keys_refused == 30_000

        await admit(honest, 1, keys[:100])
        await wait_until_async(lambda: table.index.count(table.producer("honest").slot) == 100,
                               what="the honest principal's keys indexed")


def test_per_principal_shares_are_flags_at_most_half_their_global_bound() -> None:
    config = parse_args(["--max-workers-per-principal", "8", "--max-producers", "16",
                         "--max-key-param-sets-per-principal", "3", "--max-key-param-sets", "6"])
    assert (config.max_workers_per_principal, config.max_key_param_sets_per_principal) == (8, 3)
    with pytest.raises(SystemExit):
        parse_args(["--max-workers-per-principal", "9", "--max-producers", "16"])
    with pytest.raises(SystemExit):
        parse_args(["--max-key-param-sets-per-principal", "100"])


# ---------------------------------------------------------------------------------------------------------
# Health replies bound to their sender


class Impostor:
    """An engine principal that answers the ping-all (and its own health subject) claiming to be the disk
    store `claimed_id`, naming `path` as its own."""

    def __init__(self, nats_url: str, instance_id: str, claimed_id: str, path: str | None = None) -> None:
        self.nats_url, self.instance_id, self.claimed_id = nats_url, instance_id, claimed_id
        self.own_path = Principal.engine(instance_id).producer(instance_id)
        self.path = path or self.own_path
        self.pings = 0
        self.nc: Any = None

    async def start(self) -> "Impostor":
        self.nc = await bus.connect(self.nats_url, name=self.instance_id,
                                    auth=credentials_for(self.nats_url, Principal.engine(self.instance_id), None))

        async def answer(_: protocol.HealthRequest) -> protocol.HealthReply:
            self.pings += 1
            return protocol.HealthReply(service="disk_store", service_id=self.claimed_id, path=self.path,
                                        details={"pid": 1})

        await bus.serve(self.nc, Subjects.PING_ALL, protocol.HealthRequest, answer)
        await bus.serve(self.nc, Subjects.health(self.own_path), protocol.HealthRequest, answer)
        await self.nc.flush()
        return self


def test_kvmesh_health_shows_who_really_answered() -> None:
    store_id = protocol.remote_store_id(0)
    mesh = LocalMesh([ServiceSpec("kvmesh.services.remote_store", ["--max-size-gb", "0.05", "--store-id", store_id],
                                  store_id)]).start(ready_timeout=WAIT_S)
    try:
        url = str(mesh.nats_url)
        store_path = protocol.store_path(store_id)

        async def run() -> list[dict[str, Any]]:
            impostors = [await Impostor(url, "rogue-own", store_id).start(),  # its own path, a store's claim
                         await Impostor(url, "rogue-real", store_id, store_path).start(),  # the real store's
                         await Impostor(url, "rogue-none", "disk-nowhere",
                                        protocol.store_path("disk-nowhere")).start()]  # a store nobody runs
            try:
                env = {**os.environ, "PYTHONUNBUFFERED": "1"}
                health = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "kvmesh.cli", "health", "--nats-url", url, "--expect", "2",
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
                out, err = await asyncio.wait_for(health.communicate(), 4 * WAIT_S)
                assert health.returncode == 0, err.decode()
                assert all(impostor.pings for impostor in impostors)  # each did answer the ping-all
                return json.loads(out)
            finally:
                for impostor in impostors:
                    await impostor.nc.close()

        replies = asyncio.run(run())
    finally:
        mesh.stop()
    impostors = [reply for reply in replies if reply["details"]["pid"] == 1]
    assert [reply["service"] for reply in impostors] == ["engine"], replies  # never shown as a store
    by_path = {reply["path"]: reply for reply in replies}
    assert sorted(by_path) == sorted([store_path, Principal.engine("rogue-own").producer("rogue-own")]), replies
    assert len(replies) == 2  # the real store once, though an impostor named its path too
    store = by_path[store_path]
    assert (store["service"], store["service_id"]) == ("remote_store", store_id)
    assert store["details"]["pid"] != 1  # the store's own answer, not the impostor's
    rogue = by_path[Principal.engine("rogue-own").producer("rogue-own")]
    assert (rogue["service"], rogue["service_id"]) == ("engine", "rogue-own")
