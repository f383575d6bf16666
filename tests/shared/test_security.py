"""The mesh as an attacker on the bus sees it (docs/security.md): real NATS with KVMesh's generated users and
permissions, real engines, stores and controller, all on loopback.

Each attack is tried with the weakest credentials that could carry it out: none, another role's, another
instance's; each must be refused by NATS (a permissions violation the attacker's connection is told about) or
by the receiver (a body that disagrees with the subject it came on), and leave what the victim holds intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import nats
import pytest

from kvmesh.services.controller.config import ControllerConfig
from kvmesh.services.controller.service import ControllerService
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared import protocol
from kvmesh.shared.errors import MeshUnavailable
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.credentials import (
    MeshCredentials,
    domains_map,
    local_credentials_file,
    local_mesh_dir,
    provision,
    server_accepts,
)
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import CONTROLLER, LOCAL_CPU, OPERATOR, Principal, Subjects
from kvmesh.shared.wire.keys import KeyParams

from support.engine import CHUNK, PagedKV, disk_store_mesh, engine_config, random_tokens
from support.waiting import WAIT_S, wait_until_async

PARAMS = KeyParams(model="test-model", kv_format="")



@pytest.fixture
def mesh(nats_mesh: LocalMesh) -> LocalMesh:
    return nats_mesh


class Attacker:
    """A raw nats-py connection with some principal's credentials, collecting what the server refuses it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Any = None

    async def connect(self, url: str, auth: bus.NatsAuth | None) -> "Attacker":
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        # bus.MeshClient: its flush() returns once the server has seen every SUB sent before it (nats-py's own
        # can answer first, and a publish right after would reach no subscriber)
        self.nc = bus.MeshClient()
        await self.nc.connect(url, error_cb=on_error, allow_reconnect=False,
                              **(auth.connect_options() if auth else {}))
        return self

    async def refused(self, subject: str, kind: str = "Publish") -> None:
        """Wait until the server told us it refused `kind` on `subject`."""
        expected = f"permissions violation for {kind} to \"{subject}\"".lower()  # nats-py lowercases it
        await wait_until_async(lambda: any(expected in error.lower() for error in self.errors),
                               what=f"NATS to refuse {kind} on {subject}")

    async def close(self) -> None:
        await self.nc.close()


@contextlib.asynccontextmanager
async def controller_on(mesh: LocalMesh) -> AsyncIterator[tuple[ControllerService, httpx.AsyncClient]]:
    config = ControllerConfig(host="127.0.0.1", port=0, nats_url=mesh.nats_url, controller_id="controller-test",
                              command_timeout_s=WAIT_S, tick_interval_s=0.05, nats_auth=mesh.auth(CONTROLLER))
    service = await ControllerService(config).start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=2 * WAIT_S) as client:
            yield service, client
    finally:
        await service.stop()


def tenant_engine(mesh: LocalMesh, instance_id: str, kv: PagedKV, **overrides: object) -> CacheEngine:
    """A real engine worker that finds its own credentials (it adds its instance's user to the local mesh)."""
    engine = build_engine(engine_config(nats_url=mesh.nats_url, lmcache_instance_id=instance_id, **overrides),
                          PARAMS, kv.layout)
    assert engine.wait_connected(WAIT_S), f"{instance_id} never connected"
    return engine


# ---- authentication ------------------------------------------------------------------------------------------
async def test_without_credentials_or_with_wrong_ones_the_mesh_refuses(mesh: LocalMesh) -> None:
    assert mesh.nats_url is not None
    with pytest.raises(MeshUnavailable, match="Authorization Violation"):
        await bus.connect(mesh.nats_url, "anonymous", bus.NatsAuth(auth_retry_secs=0), first_connect_wait=WAIT_S)
    with pytest.raises(MeshUnavailable, match="Authorization Violation"):
        await bus.connect(mesh.nats_url, "guess", bus.NatsAuth(user="controller", password="guess", auth_retry_secs=0),
                          first_connect_wait=WAIT_S)
    nc = await bus.connect(mesh.nats_url, "operator", mesh.auth(OPERATOR), first_connect_wait=WAIT_S)
    await nc.close()


def test_a_reload_returns_once_the_server_runs_the_new_users(mesh: LocalMesh) -> None:
    """nats-server applies a reload in the background: `reload_server()` returns only once the server accepts the
    reload probe of the users just written, so a principal added before it is accepted at once (an engine
    started right after `kvmesh credentials` must not be refused)."""
    assert mesh.credentials is not None
    port = int(str(mesh.nats_url).rsplit(":", 1)[1])
    for i in range(5):
        path = Principal.engine(f"reloaded-{i}").path
        assert mesh.credentials.ensure(path) and mesh.credentials.reload_server()
        assert server_accepts("127.0.0.1", port, bus.NatsAuth.from_file(mesh.credentials.file(path)))
    # a move to another domain rewrites permissions only: the probe's password changes with them
    assert mesh.credentials.ensure(Principal.engine("reloaded-0").path, domain="elsewhere")
    assert mesh.credentials.reload_server()


def test_a_reload_the_server_does_not_carry_out_is_an_error_naming_it(mesh: LocalMesh) -> None:
    assert mesh.credentials is not None and mesh.credentials.server_pid() is not None
    pid = mesh.credentials.server_pid()
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # it can take the signal, not act on it
    try:
        mesh.credentials.ensure(Principal.engine("never-loaded").path)
        with pytest.raises(MeshUnavailable, match=r"did not load its new users within 0\.5s"):
            mesh.credentials.reload_server(timeout=0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert mesh.credentials.reload_server()  # woken up: it loads them


@pytest.mark.parametrize("allow_reconnect", [True, False])
async def test_a_first_connect_retries_credentials_the_server_has_not_loaded_yet(
        mesh: LocalMesh, allow_reconnect: bool, caplog: pytest.LogCaptureFixture) -> None:
    """An engine started right after its user was added, before the server loaded it, is refused at first: it
    keeps trying for auth_retry_secs (logged once) and connects once the server has the user; with no retry
    window it gives up at the first refusal, naming it."""
    assert mesh.credentials is not None
    path = Principal.engine(f"early-{allow_reconnect}").path
    mesh.credentials.ensure(path)  # written, not yet loaded
    auth = bus.NatsAuth.from_file(mesh.credentials.file(path))
    with pytest.raises(MeshUnavailable, match=r"rejected early-bird .*for 0s"):
        await bus.connect(str(mesh.nats_url), "early-bird", dataclasses.replace(auth, auth_retry_secs=0),
                          allow_reconnect=allow_reconnect)
    caplog.set_level(logging.WARNING, logger="kvmesh.shared.messaging.bus")
    connecting = asyncio.ensure_future(bus.connect(
        str(mesh.nats_url), "early-bird", dataclasses.replace(auth, auth_retry_secs=WAIT_S),
        allow_reconnect=allow_reconnect, first_connect_wait=WAIT_S))
    await wait_until_async(lambda: "retrying for up to" in caplog.text or connecting.done(),
                           what="the first refusal logged")
    assert not connecting.done()
    await asyncio.to_thread(mesh.credentials.reload_server)
    nc = await asyncio.wait_for(connecting, WAIT_S)
    await nc.close()
    assert caplog.text.count("retrying for up to") == 1


def test_credentials_are_private_files(mesh: LocalMesh) -> None:
    assert mesh.credentials is not None
    root = mesh.credentials.root
    assert root == local_mesh_dir(int(str(mesh.nats_url).rsplit(":", 1)[1]))
    assert root.stat().st_mode & 0o777 == 0o700
    files = list(root.iterdir())
    assert files and all(f.stat().st_mode & 0o077 == 0 for f in files)
    # a principal added later (an engine on this host) is loaded into the running server
    auth = provision(str(mesh.nats_url), Principal.engine("late").path)
    assert auth is not None and auth.user == "engine.late" and auth.inbox_prefix == "_INBOX.engine.late"


def test_a_mesh_on_a_port_it_picked_starts_without_what_an_earlier_mesh_there_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory outlives its mesh (a restart on a given port takes its users back), but a new mesh that drew
    the same free port must not inherit the earlier one's engines and domains map (a store would open lanes for
    them and see several sharing domains)."""
    import kvmesh.shared.ops.local_mesh as local_mesh

    earlier = LocalMesh([])
    earlier.start_nats()
    assert earlier.credentials is not None and earlier._nats is not None
    port = earlier._nats.port
    earlier.credentials.ensure(Principal.engine("left-behind").path, domain="theirs")
    earlier.stop()
    assert "engine.left-behind" in earlier.credentials.domains_file.read_text()
    monkeypatch.setattr(local_mesh, "free_port", lambda host: port)
    later = LocalMesh([])
    later.start_nats()
    try:
        assert later.credentials is not None and later.credentials.root == earlier.credentials.root
        assert not later.credentials.file("engine.left-behind").exists()
        assert not later.credentials.domains_file.exists()
    finally:
        later.stop()


def test_a_mesh_directory_left_for_a_port_does_not_speak_for_another_nats_now_on_that_port() -> None:
    from kvmesh.shared.messaging.credentials import PID_FILE
    from kvmesh.shared.messaging.embedded_nats import EmbeddedNats

    with EmbeddedNats(token="tok-" + os.urandom(8).hex()) as other:  # not KVMesh's: its own token, no user list
        stale = MeshCredentials(local_mesh_dir(other.port))  # what a mesh that ran on this port before left
        try:
            stale.server_config(f"127.0.0.1:{other.port}")
            assert other.process is not None
            (stale.root / PID_FILE).write_text(str(other.process.pid))  # even the pid of a live nats-server
            assert stale.server_pid() is None and not stale.reload_server()
            assert provision(other.url, Principal.store("late").path) is None  # so a client says "no credentials"
            # nor do the files it left: a store there would serve only the engines its domains map lists
            stale.ensure(Principal.store("late").path, Principal.engine("left-behind").path)
            assert local_credentials_file(other.url, Principal.store("late").path) is None
            assert domains_map(None, other.url, Principal.store("late").path).engines() == []
        finally:
            for file in stale.root.iterdir():
                file.unlink()
            stale.root.rmdir()


def test_a_credentials_directory_others_could_write_is_refused_one_they_could_read_is_closed(
        tmp_path: Path) -> None:
    shared = tmp_path / "creds"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="writable by other users"):
        MeshCredentials(shared)
    shared.chmod(0o755)
    MeshCredentials(shared).ensure(OPERATOR.path)
    assert shared.stat().st_mode & 0o777 == 0o700
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(ValueError, match="not a plain directory"):
        MeshCredentials(link)


# ---- authorization: each role only its own subjects -----------------------------------------------------------
async def test_an_engine_cannot_act_as_another_instance_a_store_or_the_controller(mesh: LocalMesh) -> None:
    url = str(mesh.nats_url)
    victim = Principal.engine("tenant-a").producer("tenant-a")
    attacker = await Attacker().connect(url, mesh.auth(Principal.engine("tenant-b")))
    try:
        attempts = [
            Subjects.worker("tenant-a", "tenant-a", "clear"),  # a command to another instance's worker
            Subjects.register(victim), Subjects.heartbeat(victim), Subjects.events(victim),  # speak as it
            Subjects.events(protocol.store_path("disk-x")),  # a store's admissions
            Subjects.CONTROLLER_HELLO,  # make every producer re-register and full-sync
            Subjects.sync(protocol.store_path("disk-x")),  # make a store publish everything it holds
            Subjects.store("disk-x", "put", victim),  # a put in another instance's name
            Subjects.store("disk-x", "clear", victim),  # a clear of another instance's claims
            Subjects.store("disk-x", "wipe", Principal.engine("tenant-b").producer("tenant-b")),  # an operator's op
        ]
        for subject in attempts:
            await attacker.nc.publish(subject, b"x")
        for subject in ("kvmesh.events.>", "kvmesh.worker.tenant-a.>", "kvmesh.store.disk-x.>",
                        "_INBOX.controller.>"):
            await attacker.nc.subscribe(subject)  # read admissions (every key), commands, store traffic, replies
        await attacker.nc.flush()
        for subject in attempts:
            await attacker.refused(subject)
        for subject in ("kvmesh.events.>", "kvmesh.worker.tenant-a.>", "kvmesh.store.disk-x.>",
                        "_INBOX.controller.>"):
            await attacker.refused(subject, "Subscription")
    finally:
        await attacker.close()


async def test_engines_ask_peers_for_streams_only_within_their_sharing_domain(mesh: LocalMesh) -> None:
    """P2P: an engine may request a stream of a peer's CPU tier only from engines of its own sharing domain, and
    only in its own name; only the peer itself hears such requests. Another domain's engine is refused by NATS
    and hears nothing."""
    assert mesh.credentials is not None
    port = int(str(mesh.nats_url).rsplit(":", 1)[1])
    for instance, domain in (("red-a", "red"), ("red-b", "red"), ("blue-c", "blue")):
        mesh.credentials.ensure(Principal.engine(instance).path, domain=domain)
    mesh.credentials.reload_server()
    auths = {instance: bus.NatsAuth.from_file(mesh.credentials.file(Principal.engine(instance).path))
             for instance in ("red-a", "red-b", "blue-c")}
    await wait_until_async(lambda: all(server_accepts("127.0.0.1", port, auth) for auth in auths.values()),
                           what="the reloaded users")
    url = str(mesh.nats_url)
    server, peer, outsider = [await Attacker().connect(url, auths[name]) for name in ("red-a", "red-b", "blue-c")]
    try:
        heard = await server.nc.subscribe("kvmesh.p2p.red.red-a.>")
        await server.nc.flush()
        asked = Subjects.peer_stream("red", "red-a", "red-a", Principal.engine("red-b").producer("red-b"))
        await peer.nc.publish(asked, b"stream please")
        await peer.nc.flush()
        message = await heard.next_msg(timeout=WAIT_S)
        assert message.subject == asked
        attempts = [
            Subjects.peer_stream("red", "red-a", "red-a", Principal.engine("blue-c").producer("blue-c")),
            Subjects.peer_stream("red", "red-a", "red-a", Principal.engine("red-b").producer("red-b")),  # not its own
        ]
        for subject in attempts:
            await outsider.nc.publish(subject, b"x")
        # its own domain's subject naming red-a goes out, but nobody of another domain listens there
        await outsider.nc.publish(Subjects.peer_stream("blue", "red-a", "red-a",
                                                       Principal.engine("blue-c").producer("blue-c")), b"x")
        await peer.nc.publish(Subjects.peer_stream("red", "red-a", "red-a",
                                                   Principal.engine("blue-c").producer("blue-c")), b"x")
        await outsider.nc.subscribe("kvmesh.p2p.red.>")
        await outsider.nc.flush()
        for subject in attempts:
            await outsider.refused(subject)
        await outsider.refused("kvmesh.p2p.red.>", "Subscription")
        await peer.refused(attempts[0])  # a peer of the domain asks in its own name only
        await server.nc.flush()
        assert heard.pending_msgs == 0 and not server.errors  # red-a heard only red-b's request
    finally:
        for connection in (server, peer, outsider):
            await connection.close()


async def test_a_store_and_the_operator_keep_to_their_roles(mesh: LocalMesh) -> None:
    url = str(mesh.nats_url)
    store = await Attacker().connect(url, mesh.auth(Principal.store("disk-x")))
    operator = await Attacker().connect(url, mesh.auth(OPERATOR))
    try:
        engine_path = Principal.engine("tenant-a").producer("tenant-a")
        for subject in (Subjects.events(engine_path), Subjects.events(protocol.store_path("disk-y")),
                        Subjects.worker("tenant-a", "tenant-a", "pin"), Subjects.CONTROLLER_HELLO):
            await store.nc.publish(subject, b"x")
            await store.refused(subject)
        await store.nc.subscribe("kvmesh.store.disk-y.>")
        await store.refused("kvmesh.store.disk-y.>", "Subscription")
        for subject in (Subjects.worker("tenant-a", "tenant-a", "clear"), Subjects.events(engine_path),
                        Subjects.store("disk-x", "put", OPERATOR.path)):
            await operator.nc.publish(subject, b"x")
            await operator.refused(subject)
        await operator.nc.subscribe("kvmesh.events.>")
        await operator.refused("kvmesh.events.>", "Subscription")
    finally:
        await store.close()
        await operator.close()


# ---- identity: what gets past NATS is checked against the subject ----------------------------------------------
async def test_an_instance_cannot_be_hijacked_and_forged_admissions_are_ignored(mesh: LocalMesh) -> None:
    kv = PagedKV(num_blocks=128)
    victim = await asyncio.to_thread(tenant_engine, mesh, "tenant-a", kv)
    attacker = await Attacker().connect(str(mesh.nats_url), mesh.auth(Principal.engine("tenant-b")))
    try:
        async with controller_on(mesh) as (service, client):
            tokens = random_tokens(2 * CHUNK, seed=11)
            await asyncio.to_thread(token_api.store, victim, tokens, **kv.kv(kv.slots(len(tokens))))

            async def lookup(token_list: list[int]) -> dict[str, Any]:
                response = await client.post("/lookup", json={"tokens": token_list})
                assert response.status_code == 200, response.text
                return response.json()["layout_info"]

            await wait_until_async(lambda: lookup(tokens.tolist()), what="the victim's prompt listed")
            assert service.feed is not None
            forged_before = service.feed.forged_messages

            # tenant-b registers tenant-a's worker from its own path: the body disagrees with the subject
            own_path = Principal.engine("tenant-b").producer(victim.worker_id)
            registration = victim.mesh.registration()
            await attacker.nc.publish(Subjects.register(own_path), protocol.encode(registration))
            # ...and reports chunks no one holds: as the victim, and as a store
            ghost = random_tokens(2 * CHUNK, seed=12)
            ghost_keys = victim.hasher.keys(ghost.tolist())
            for producer_id, location in ((victim.worker_id, LOCAL_CPU), ("disk-x", protocol.LOCAL_DISK)):
                await attacker.nc.publish(
                    Subjects.events(Principal.engine("tenant-b").producer(producer_id)),
                    protocol.encode(protocol.AdmissionBatch(producer_id=producer_id, location=location, seq=99,
                                                            admitted=ghost_keys, evicted=[])))
            await attacker.nc.flush()
            # (the batch of the never-registered "disk-x" is dropped as a stranger's, without counting as forged)
            await wait_until_async(lambda: service.feed.forged_messages >= forged_before + 2,
                                   what="the controller to refuse the forged registration and batch")
            assert await lookup(ghost.tolist()) == {}, "forged admissions are not reported"
            metrics = (await client.get("/metrics")).text
            assert f"kvmesh_controller_forged_messages_total {service.feed.forged_messages}" in metrics
            assert await lookup(tokens.tolist()) == {"tenant-a": [LOCAL_CPU, len(tokens)]}
            # a pin for tenant-a still reaches the real tenant-a
            pinned = await client.post("/pin", json={"tokens": tokens.tolist(), "instance_id": "tenant-a",
                                                     "location": LOCAL_CPU})
            assert pinned.status_code == 200 and pinned.json()["num_tokens"] == len(tokens), pinned.text
            assert all(victim.cpu._policy.is_pinned(key) for key in victim.hasher.keys(tokens.tolist()))
    finally:
        await attacker.close()
        await asyncio.to_thread(victim.close)


def test_the_controller_s_embedded_nats_listens_on_loopback_whatever_host_the_api_uses() -> None:
    from kvmesh.services.controller.config import parse_args

    config = parse_args(["--host", "0.0.0.0", "--port", "0", "--monitor-port", "0", "--insecure-no-auth"])
    assert config.host == "0.0.0.0" and config.nats_host == "127.0.0.1"

    async def run() -> str:
        service = await ControllerService(config).start()
        try:
            assert service.embedded is not None and service.embedded.credentials is not None
            return (service.embedded.credentials.root / "nats-server.conf").read_text()
        finally:
            await service.stop()

    server_config = asyncio.run(run())
    assert server_config.startswith("listen: 127.0.0.1:") and "include ./authorization.conf" in server_config


def test_compose_runs_nats_with_credentials_and_publishes_no_nats_port() -> None:
    import yaml

    services = yaml.safe_load((Path(__file__).parents[2] / "compose.yaml").read_text())["services"]
    assert "ports" not in services["nats"], "NATS must not be reachable from outside the compose network"
    assert services["nats"]["command"] == ["-c", "/nats/nats-server.conf"]
    assert services["controller"]["ports"] == ["127.0.0.1:9000:9000"]
    script = services["credentials"]["command"][0]
    nats_volume = "kvmesh-nats:/nats"
    assert [name for name, service in services.items() if nats_volume in service.get("volumes", [])] == [
        "credentials", "nats"], "every password is in the NATS volume: only NATS and the maker mount it"
    for name, variable in (("controller", "KVMESH_NATS_CREDENTIALS"), ("disk-store", "KVMESH_NATS_CREDENTIALS"),
                           ("remote-store", "KVMESH_NATS_CREDENTIALS"), ("vllm", "LMCACHE_NATS_CREDENTIALS")):
        file = Path(services[name]["environment"][variable])
        principal = file.name.removesuffix(".json")
        assert principal == "controller" or f" {principal}" in script, f"{name}'s principal is never made"
        if principal.startswith("store."):
            assert principal.removeprefix("store.") in services[name]["command"], f"{name} runs as another store"
        # its own volume holds its own file, copied there by the credentials service
        volume = next(v.split(":")[0] for v in services[name]["volumes"] if v.split(":")[1] == str(file.parent))
        target = next(v.split(":")[1] for v in services["credentials"]["volumes"] if v.startswith(volume + ":"))
        assert f"cp -p /nats/{file.name} {target}/" in script
        if name != "vllm":  # the stores and the controller take each engine's sharing domain from this map
            assert f"cp -p /nats/domains.json {target}/" in script


async def test_a_controller_takes_each_workers_domain_from_the_map_of_the_nats_it_embeds_or_joins(
        tmp_path: Path) -> None:
    """Issue 36, finding 2, in both set-ups. A controller that embeds its NATS (lmcache_controller; `kvmesh up`
    passes the mesh's credentials file) reads domains.json in that NATS's credentials directory: a worker of a
    blue principal saying "default" is refused and counted, one saying "blue" is taken. One that joins another
    NATS (compose) reads it beside its --nats-credentials file, unless --domains-file names one."""
    from kvmesh.services.controller.config import parse_args
    from support.controller import FakeEngineWorker, started

    service = await ControllerService(parse_args(["--port", "0", "--monitor-port", "0"])).start()
    try:
        assert service.embedded is not None and service.embedded.credentials is not None
        credentials = service.embedded.credentials
        credentials.ensure(Principal.engine("blue-a").path, Principal.engine("blue-b").path, domain="blue")
        assert credentials.reload_server()
        liar = FakeEngineWorker(service.nats_url, "blue-a", p2p=True)  # says "default"
        member = FakeEngineWorker(service.nats_url, "blue-b", p2p=True, domain="blue")
        async with started(liar, member):
            table = service.core.table
            await wait_until_async(lambda: table.producer(member.worker_id) and table.stats.registrations_refused[
                "domain"], what="blue-b registered and blue-a refused")
            assert table.producer(member.worker_id).domain == "blue" and table.producer(liar.worker_id) is None
    finally:
        await service.stop()

    joined = MeshCredentials(tmp_path / "compose")
    joined.ensure(CONTROLLER.path)
    file = str(joined.file(CONTROLLER.path))
    config = parse_args(["--nats-url", "nats://nats:4222", "--nats-credentials", file])
    assert config.domains_file == tmp_path / "compose" / "domains.json"
    config = parse_args(["--nats-url", "nats://nats:4222", "--nats-credentials", file, "--domains-file", "/m.json"])
    assert config.domains_file == Path("/m.json")


# ---- ownership: a clear takes back only the caller's chunks ------------------------------------------------------
async def test_a_clear_for_one_tenant_leaves_the_other_tenants_chunks_in_the_shared_disk_store(
        tmp_path: Path) -> None:
    kv = PagedKV(num_blocks=256)
    started = disk_store_mesh(tmp_path / "disk")
    mesh = await asyncio.to_thread(started.__enter__)  # it waits for the store with an event loop of its own
    try:
        def tenant(instance_id: str) -> CacheEngine:  # the CPU tier only stages: every hit is the disk store's
            return tenant_engine(mesh, instance_id, kv, local_disk=str(tmp_path / "disk"), local_cpu=False)

        a, b = await asyncio.to_thread(tenant, "tenant-a"), await asyncio.to_thread(tenant, "tenant-b")
        try:
            async with controller_on(mesh) as (_, client):
                own_a, own_b, both = (random_tokens(2 * CHUNK, seed=seed) for seed in (21, 22, 23))
                for engine, prompts in ((a, (own_a, both)), (b, (own_b, both))):
                    for tokens in prompts:
                        await asyncio.to_thread(token_api.store, engine, tokens, **kv.kv(kv.slots(len(tokens))))
                    assert await asyncio.to_thread(engine.wait_write_behind, WAIT_S)

                async def holders(tokens: Any) -> dict[str, Any]:
                    response = await client.post("/lookup", json={"tokens": tokens.tolist()})
                    assert response.status_code == 200, response.text
                    return response.json()["layout_info"]

                on_disk = {"tenant-a": [protocol.LOCAL_DISK, 2 * CHUNK], "tenant-b": [protocol.LOCAL_DISK, 2 * CHUNK]}
                for tokens in (own_a, own_b, both):
                    await wait_until_async(lambda t=tokens: _equal(holders(t), on_disk), what="every prompt on disk")

                cleared = await client.post("/clear", json={"instance_id": "tenant-a",
                                                            "location": protocol.LOCAL_DISK})
                assert cleared.status_code == 200, cleared.text
                assert cleared.json()["num_tokens"] == 4 * CHUNK, "tenant-a's own prompt and the shared one"
                await wait_until_async(lambda: _equal(holders(own_a), {}), what="tenant-a's own prompt gone")
                # tenant-b's prompts stay on disk (the shared one: tenant-b still claims it), listed and loadable
                assert await holders(own_b) == on_disk and await holders(both) == on_disk
                for tokens in (own_b, both):
                    assert await asyncio.to_thread(token_api.lookup, b, tokens) == len(tokens)
                    assert bool((await asyncio.to_thread(token_api.retrieve, b, tokens,
                                                         **kv.kv(kv.slots(len(tokens))))).all())
        finally:
            await asyncio.to_thread(a.close)
            await asyncio.to_thread(b.close)
    finally:
        await asyncio.to_thread(started.__exit__, None, None, None)


async def _equal(value: Any, expected: Any) -> bool:
    return await value == expected


async def test_a_store_started_by_hand_next_to_a_kvmesh_nats_adds_its_own_user(mesh: LocalMesh,
                                                                               tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_NATS_")}
    store = subprocess.Popen([sys.executable, "-m", "kvmesh.services.disk_store", "--nats-url", str(mesh.nats_url),
                              "--dir", str(tmp_path / "disk"), "--max-size-gb", "0.01", "--store-id", "disk-hand"],
                             stdin=subprocess.DEVNULL, env=env)
    nc = await bus.connect(str(mesh.nats_url), "operator", mesh.auth(OPERATOR), first_connect_wait=WAIT_S)
    try:
        async def healthy() -> protocol.HealthReply | None:
            assert store.poll() is None, "the store exited"
            try:
                return await bus.request(nc, Subjects.health(protocol.store_path("disk-hand")),
                                         protocol.HealthRequest(), protocol.HealthReply, 1.0)
            except MeshUnavailable:
                return None

        reply = await wait_until_async(healthy, what="the hand-started store answering health", interval=0.2)
        assert reply.service_id == "disk-hand"
        assert mesh.credentials is not None and mesh.credentials.file("store.disk-hand").exists()
    finally:
        await nc.close()
        store.terminate()
        await asyncio.to_thread(store.wait, WAIT_S)


def test_a_credentials_file_others_can_read_or_that_is_missing_is_a_config_error_naming_the_key(
        tmp_path: Path) -> None:
    from kvmesh.services.engine.config.engine_auth import auth_from_config
    from kvmesh.services.engine.config.engine_config import EngineConfig
    from kvmesh.shared.errors import ConfigError

    loose = tmp_path / "engine.x.json"
    loose.write_text('{"user": "engine.x", "password": "p", "inbox_prefix": "_INBOX.engine.x"}')
    loose.chmod(0o644)
    for path, reason in ((loose, "readable by other users"), (tmp_path / "missing.json", "No such file")):
        with pytest.raises(ConfigError, match=f"nats_credentials: .*{reason}"):
            auth_from_config(EngineConfig(nats_credentials=str(path)))
    loose.chmod(0o600)
    auth = auth_from_config(EngineConfig(nats_credentials=str(loose)))
    assert auth is not None and auth.user == "engine.x" and auth.connect_options()["inbox_prefix"] == "_INBOX.engine.x"


def test_external_nats_credentials_that_cannot_work_are_config_errors_naming_the_option(tmp_path: Path) -> None:
    """The flags (and engine keys) for an external NATS: a password without a user, an nkey seed or .creds file
    that is not there, or one that needs the `nkeys` package where it is not installed, each name the option."""
    import argparse
    import importlib.util

    from kvmesh.services.engine.config.engine_auth import auth_from_config
    from kvmesh.services.engine.config.engine_config import EngineConfig
    from kvmesh.shared.errors import ConfigError
    from kvmesh.shared.messaging.nats_auth import add_nats_auth_flags, nats_auth_from_args

    parser = argparse.ArgumentParser()
    add_nats_auth_flags(parser)

    def from_flags(*argv: str, **environ: str) -> bus.NatsAuth:
        return nats_auth_from_args(parser.parse_args(list(argv)), environ)

    with pytest.raises(ConfigError, match="--nats-password is set but --nats-user is not"):
        from_flags("--nats-password", "p")
    with pytest.raises(ConfigError, match="--nats-password is set but --nats-user is not"):
        from_flags(KVMESH_NATS_PASSWORD="p")
    with pytest.raises(ConfigError, match="nats_password is set but nats_user is not"):
        auth_from_config(EngineConfig(nats_password="p"))
    for flag, key in (("--nats-nkey-seed", "nats_nkey_seed"), ("--nats-creds-file", "nats_creds_file")):
        with pytest.raises(ConfigError, match=f"{flag}: no file at"):
            from_flags(flag, str(tmp_path / "absent"))
        with pytest.raises(ConfigError, match=f"{key}: no file at"):
            auth_from_config(EngineConfig(**{key: str(tmp_path / "absent")}))
        if importlib.util.find_spec("nkeys") is None:  # here the server's answer cannot be tested: say so clearly
            present = tmp_path / "present"
            present.write_text("not read: the missing package is found first\n")
            with pytest.raises(ConfigError, match=f"{flag} needs the `nkeys` package"):
                from_flags(flag, str(present))
    assert from_flags("--nats-user", "u", KVMESH_NATS_PASSWORD="p") == bus.NatsAuth(user="u", password="p")
    assert from_flags("--nats-token", "flag", KVMESH_NATS_TOKEN="env").token == "flag", "a flag wins over its variable"


def test_no_password_is_on_a_command_line_or_in_a_child_s_environment_but_its_own(tmp_path: Path) -> None:
    """A mesh that KVMesh starts hands out credentials by file: no process's command line holds a password, and
    a service's environment names only its own credentials file (`ps` and /proc/<pid>/environ show nothing else)."""
    import json

    with disk_store_mesh(tmp_path / "disk") as mesh:
        assert mesh.credentials is not None
        entries = [json.loads(file.read_text()) for file in mesh.credentials.root.glob("*.json")]
        passwords = {entry["password"] for entry in entries if "password" in entry}  # not domains.json's
        assert len(passwords) >= 3, passwords  # the controller, the operator and the store at least
        pids = mesh.pids
        assert len(pids) == 2, "the NATS server and the disk store"
        for pid in pids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            assert not [p for p in passwords if p in cmdline], f"a password on the command line of {cmdline!r}"
        store = mesh.processes[0]
        environ = Path(f"/proc/{store.pid}/environ").read_bytes().decode(errors="replace").split("\0")
        assert not [p for p in passwords if any(p in entry for entry in environ)]
        named = [entry for entry in environ if entry.startswith("KVMESH_NATS_CREDENTIALS=")]
        assert named == [f"KVMESH_NATS_CREDENTIALS={mesh.credentials.file(mesh.services[0].principal.path)}"]


async def test_rotating_one_principal_disconnects_its_old_password_and_admits_the_new_one(mesh: LocalMesh) -> None:
    """docs/security.md's rotation of one principal: delete its file, `kvmesh credentials --dir D <principal>`
    makes a new password and reloads the server, which drops the client still on the old one."""
    from kvmesh.shared.messaging.credentials import server_accepts

    assert mesh.credentials is not None and mesh.nats_url is not None
    host, port = "127.0.0.1", int(mesh.nats_url.rsplit(":", 1)[1])
    principal = Principal.store("rotated")
    old = await asyncio.to_thread(mesh.credentials.admit, principal.path)
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    client = await nats.connect(mesh.nats_url, allow_reconnect=False, closed_cb=on_closed, **old.connect_options())
    try:
        mesh.credentials.file(principal.path).unlink()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_NATS_")}
        made = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "kvmesh.cli", "credentials", "--dir",
                                                        str(mesh.credentials.root), principal.path],
                                       env=env, capture_output=True, text=True, timeout=WAIT_S)
        assert made.returncode == 0, made.stderr
        new = bus.NatsAuth.from_file(mesh.credentials.file(principal.path))
        assert new.password != old.password
        # `kvmesh credentials` returned once the server runs the new password: accepted at once, the old refused
        assert server_accepts(host, port, new) and not server_accepts(host, port, old)
        await asyncio.wait_for(closed.wait(), WAIT_S)  # the reload dropped the old password's connection
        nc = await bus.connect(mesh.nats_url, "rotated", new, first_connect_wait=WAIT_S)
        await nc.close()
    finally:
        if not client.is_closed:
            await client.close()
