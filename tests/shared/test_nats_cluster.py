"""The mesh on a three-node NATS cluster: the server everyone is connected to dies, the mesh goes on.

A real cluster (tests/support/nats_cluster.py), a real controller, real disk store and remote store processes and two
CacheEngines, all given the three servers' URLs. Node 0 starts alone, so every client's first connection lands
on it; nodes 1 and 2 join the cluster after. Node 0 is then SIGKILLed: every client reconnects to node 1 or 2
(the cluster's monitoring shows them there), both engines keep storing and hitting through the disk store
(engine B loads what engine A stored, and the other way round; B also from the remote store, over a stream whose
ticket came over the new server), and the controller's /lookup index sees what was stored before and after.

The cluster requires credentials (docs/security.md: on a NATS cluster, which KVMesh never starts, clients
bring their own): one token on every node, or a user per principal on every node (the users `kvmesh
credentials` makes, each process with its own file, the operator's for LocalMesh's health check); a reconnect
to another node presents them again. The engines' CPU pools are lent to the disk store through a socket named
by the cluster, so an engine and the store on different servers of one cluster share it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.config.engine_config import load_engine_config
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.errors import ConfigError, MeshUnavailable
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.bus import NatsAuth
from kvmesh.shared.messaging.credentials import MeshCredentials
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, free_port
from kvmesh.shared.messaging.nats_auth import CREDENTIALS_ENV
from kvmesh.shared.ops.local_mesh import LocalMesh, ServiceSpec
from kvmesh.shared.protocol import CONTROLLER, LOCAL_DISK, OPERATOR, REMOTE, Principal, disk_store_id
from kvmesh.shared.wire.keys import KeyParams

from support.nats_cluster import NatsCluster
from support.controller import running_controller
from support.engine import CHUNK, PagedKV, engine_config, random_tokens
from support.waiting import WAIT_S, wait_until, wait_until_async

PARAMS = KeyParams(model="test-model", kv_format="")
REMOTE_ID = "remote-0"
TOKEN = "cluster-test-token"
TOKENS = 128


class ClusterAuth:
    """The credentials of a test's cluster: one token for everyone, or (`users`) a user per principal, made in
    `root` for the principals named."""

    def __init__(self, root: Path, users: bool, *principals: Principal) -> None:
        self.credentials = MeshCredentials(root) if users else None
        if self.credentials is not None:
            self.credentials.ensure(CONTROLLER.path, OPERATOR.path, *(principal.path for principal in principals))

    def cluster(self) -> NatsCluster:
        return NatsCluster(credentials=self.credentials) if self.credentials else NatsCluster(token=TOKEN)

    def of(self, principal: Principal) -> NatsAuth:
        return NatsAuth.from_file(self.credentials.file(principal.path)) if self.credentials else NatsAuth(token=TOKEN)

    def engine_keys(self, instance_id: str) -> dict[str, str]:
        """The engine config keys of its credentials."""
        if self.credentials is None:
            return {"nats_token": TOKEN}
        return {"nats_credentials": str(self.credentials.file(Principal.engine(instance_id).path))}

    def store_flags(self, store_id: str) -> list[str]:
        return ["--nats-credentials", str(self.credentials.file(Principal.store(store_id).path))] \
            if self.credentials else []

    def environ(self) -> tuple[str, str]:
        """The variable LocalMesh's health check (and, with a token, its services) connect with."""
        if self.credentials is None:
            return "KVMESH_NATS_TOKEN", TOKEN
        return CREDENTIALS_ENV, str(self.credentials.file(OPERATOR.path))


def _stores_mesh(url: str, auth: ClusterAuth, disk: Path, store_id: str, remote: bool = False) -> LocalMesh:
    """A disk store with id `store_id` and, with `remote`, a remote store (`REMOTE_ID`) on the NATS at `url`."""
    services = [ServiceSpec("kvmesh.services.disk_store", ["--dir", str(disk), "--max-size-gb", "0.05", "--store-id",
                                                           store_id, *auth.store_flags(store_id)], store_id)]
    if remote:
        services.append(ServiceSpec("kvmesh.services.remote_store", ["--max-size-gb", "0.05", "--store-id", REMOTE_ID,
                                                                     *auth.store_flags(REMOTE_ID)], REMOTE_ID))
    return LocalMesh(services, nats_url=url)


def _engine(url: str, kv: PagedKV, disk: Path, instance_id: str, auth: ClusterAuth,
            remote: bool = False) -> CacheEngine:
    engine = build_engine(engine_config(nats_url=url, local_disk=str(disk), lmcache_instance_id=instance_id,
                                       **({"remote_url": "lm://localhost:65432"} if remote else {}),
                                       **auth.engine_keys(instance_id)), PARAMS, kv.layout)
    assert engine.wait_connected(WAIT_S), f"engine {instance_id} did not reach NATS"
    for tier in (LOCAL_DISK, REMOTE) if remote else (LOCAL_DISK,):
        wait_until(lambda: engine.storage.lower(tier) is not None, what=f"{instance_id}'s {tier} client")
    return engine


def _store_on_disk(engine: CacheEngine, kv: PagedKV, tokens: torch.Tensor) -> torch.Tensor:
    """Store `tokens` from fresh slots, written through to the disk store; their K/V."""
    slots = kv.slots(TOKENS)
    token_api.store(engine, tokens, **kv.kv(slots))
    assert engine.wait_write_behind(WAIT_S)
    client = engine.storage.lower(LOCAL_DISK)
    assert client is not None
    assert engine.nats_loop.call(client.wait_written(WAIT_S), WAIT_S + 2, default=False)
    return kv.token_kv(slots)


def _loads(engine: CacheEngine, kv: PagedKV, tokens: torch.Tensor, expected: torch.Tensor) -> bool:
    """A full hit with exactly the expected K/V, into fresh slots."""
    slots = kv.slots(TOKENS)
    return bool(token_api.retrieve(engine, tokens, **kv.kv(slots)).all()) and torch.equal(kv.token_kv(slots), expected)


@pytest.mark.parametrize("users", [False, True], ids=["token", "user-per-principal"])
async def test_the_mesh_survives_the_death_of_its_nats_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              users: bool) -> None:
    disk = tmp_path / "disk"
    store_id = disk_store_id()
    auth = ClusterAuth(tmp_path / "credentials", users, Principal.store(store_id), Principal.store(REMOTE_ID),
                       Principal.engine("cluster-a"), Principal.engine("cluster-b"))
    cluster = auth.cluster()
    monkeypatch.setenv(*auth.environ())
    mesh = _stores_mesh(cluster.url, auth, disk, store_id, remote=True)
    kv_a, kv_b = PagedKV(num_blocks=128, seed=1), PagedKV(num_blocks=128, seed=2)
    engines: list[CacheEngine] = []
    try:
        await asyncio.to_thread(cluster.start, 0)
        await asyncio.to_thread(mesh.start, WAIT_S)
        async with running_controller(cluster.url, nats_auth=auth.of(CONTROLLER)) as (_, client):
            for name, kv in (("cluster-a", kv_a), ("cluster-b", kv_b)):
                engines.append(await asyncio.to_thread(_engine, cluster.url, kv, disk, name, auth, True))
            a, b = engines
            await asyncio.to_thread(cluster.start, 1, 2)
            on_node0 = await asyncio.to_thread(cluster.clients, 0)
            # the stores, the controller and both engines are on node 0 (named as they connect)
            for prefix in ("disk_store:", "remote_store:", "kvmesh-controller-test", "cluster-a@", "cluster-b@"):
                assert any(name.startswith(prefix) for name in on_node0), (prefix, on_node0)
            assert await asyncio.to_thread(cluster.clients, 1) == [] == await asyncio.to_thread(cluster.clients, 2)

            async def listed(tokens: torch.Tensor, instance_id: str) -> bool:
                response = await client.post("/lookup", json={"tokens": tokens.tolist()})
                assert response.status_code == 200, response.text
                entry = response.json()["layout_info"].get(instance_id)
                return bool(entry) and entry[1] == TOKENS

            before = random_tokens(TOKENS, seed=70)
            expected_before = await asyncio.to_thread(_store_on_disk, a, kv_a, before)
            assert await asyncio.to_thread(_loads, b, kv_b, before, expected_before)  # from the disk store
            await wait_until_async(lambda: listed(before, "cluster-a"), what="/lookup listing cluster-a")

            await asyncio.to_thread(cluster.kill, 0)

            def moved() -> bool:  # every client of node 0 reconnected to a surviving node
                return set(on_node0) <= set(cluster.clients(1) + cluster.clients(2))

            await asyncio.to_thread(wait_until, moved, WAIT_S, what="the clients on nodes 1 and 2", interval=0.1)
            for engine in engines:  # each engine reaches the disk store again (what A stored before the kill)
                await asyncio.to_thread(
                    wait_until, lambda: token_api.lookup(engine, before, search_range=[LOCAL_DISK]) == TOKENS, WAIT_S,
                    what="an engine's disk store lookup after the failover", interval=0.1)

            after = random_tokens(TOKENS, seed=71)
            expected_after = await asyncio.to_thread(_store_on_disk, b, kv_b, after)
            assert await asyncio.to_thread(_loads, a, kv_a, after, expected_after)  # B stored, A hits
            assert await asyncio.to_thread(_loads, a, kv_a, before, expected_before)
            also = random_tokens(TOKENS, seed=72)
            expected_also = await asyncio.to_thread(_store_on_disk, a, kv_a, also)
            # A stored, B hits from the remote store (its tickets issued over NATS after the failover): A takes
            # its chunks off the disk store first (a remove takes back only the caller's own claims)
            await asyncio.to_thread(wait_until, lambda: token_api.lookup(b, also, search_range=[REMOTE]) == TOKENS,
                                    WAIT_S, what="the remote store holding A's chunks", interval=0.1)
            disk_a = a.storage.lower(LOCAL_DISK)
            assert disk_a is not None
            assert a.nats_loop.call(disk_a.remove(a.hasher.keys(also)), WAIT_S, default=0) == TOKENS // CHUNK
            await asyncio.to_thread(wait_until, lambda: token_api.lookup(b, also, search_range=[LOCAL_DISK]) == 0,
                                    WAIT_S, what="the disk store without A's chunks", interval=0.1)
            fetched = b.storage.stats["fetched_RemoteBackend"]
            assert await asyncio.to_thread(_loads, b, kv_b, also, expected_also)
            assert b.storage.stats["fetched_RemoteBackend"] == fetched + TOKENS // CHUNK

            # the controller's index: what was stored before the kill and after it, by either engine
            await wait_until_async(lambda: listed(after, "cluster-b"), what="/lookup listing cluster-b's chunks")
            await wait_until_async(lambda: listed(also, "cluster-a"), what="/lookup listing cluster-a's new chunks")
            assert await listed(before, "cluster-a")
    finally:
        for engine in engines:
            await asyncio.to_thread(engine.close)
        await asyncio.to_thread(mesh.stop)
        cluster.stop()


async def test_an_engine_lends_its_pool_to_the_disk_store_on_another_server_of_the_cluster(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store on node 1, the engine on node 2: the pool socket is the cluster's, so the engine's chunk bytes
    reach the store through its pool, not inline on NATS (a socket named by the server would differ)."""
    disk = tmp_path / "disk"
    store_id = disk_store_id()
    auth = ClusterAuth(tmp_path / "credentials", False)
    cluster = auth.cluster()
    monkeypatch.setenv(*auth.environ())
    kv = PagedKV(num_blocks=128, seed=3)
    engine: CacheEngine | None = None
    try:
        await asyncio.to_thread(cluster.start)
        mesh = await asyncio.to_thread(_stores_mesh(cluster.nodes[1].url, auth, disk, store_id).start, WAIT_S)
        try:
            engine = await asyncio.to_thread(_engine, cluster.nodes[2].url, kv, disk, "cluster-pool", auth)
            assert any(name.startswith("disk_store:") for name in await asyncio.to_thread(cluster.clients, 1))
            assert any(name.startswith("cluster-pool@") for name in await asyncio.to_thread(cluster.clients, 2))
            await asyncio.to_thread(_store_on_disk, engine, kv, random_tokens(TOKENS, seed=73))
            client = engine.storage.lower(LOCAL_DISK)
            assert client is not None
            details = engine.nats_loop.call(client.stats(), WAIT_S, default=[])[0].details
            assert details["puts_inline"] == 0 and details["puts_pool"] == TOKENS // engine.config.chunk_size, \
                details
        finally:
            await asyncio.to_thread(mesh.stop)
    finally:
        if engine is not None:
            await asyncio.to_thread(engine.close)
        cluster.stop()


@pytest.mark.parametrize("url, problem", [
    ("nats://127.0.0.1:4222,,nats://127.0.0.1:4223", "an empty entry"),
    ("nats://127.0.0.1:4222,http://127.0.0.1:4223", "'http://127.0.0.1:4223': the scheme must be one of"),
    ("127.0.0.1:99999", "the port is not a number"),
])
@pytest.mark.parametrize("key", ["nats_url", "controller_url", "remote_url"])
def test_a_bad_nats_url_list_is_a_config_error_naming_the_entry(url: str, problem: str, key: str) -> None:
    if key == "remote_url" and "://" not in url.split(",")[0]:
        url = f"nats://{url}"  # a remote_url names its scheme
    with pytest.raises(ConfigError, match=key) as error:
        load_engine_config({key: url}, environ={})
    assert problem in str(error.value)


def test_a_cluster_s_urls_are_accepted_and_normalised() -> None:
    config = load_engine_config({"nats_url": "127.0.0.1:4222, nats://127.0.0.1:4223,tls://127.0.0.1:4224"},
                                environ={})
    assert bus.normalize_url(str(config.nats_url)) == \
        "nats://127.0.0.1:4222,nats://127.0.0.1:4223,tls://127.0.0.1:4224"
    assert load_engine_config({"remote_url": "nats://127.0.0.1:4222,nats://127.0.0.1:4223"}, environ={}).remote_url


def test_services_take_a_list_of_nats_urls(tmp_path: Path) -> None:
    from kvmesh.services.disk_store.options import build_parser

    parser = build_parser()
    args = parser.parse_args(["--nats-url", "127.0.0.1:4222, nats://127.0.0.1:4223", "--dir", str(tmp_path)])
    assert args.nats_url == "nats://127.0.0.1:4222,nats://127.0.0.1:4223"
    with pytest.raises(SystemExit):
        parser.parse_args(["--nats-url", "nats://127.0.0.1:4222,", "--dir", str(tmp_path)])


async def test_a_connection_without_reconnects_tries_every_server_of_the_list(nats_server: EmbeddedNats) -> None:
    """`kvmesh health`, `kvmesh wipe` and LocalMesh's health check connect once, without reconnects: a dead server
    in the list, wherever it stands, is skipped (nats-py alone would try one server only)."""
    dead = [f"nats://127.0.0.1:{free_port()}" for _ in range(2)]
    for servers in (dead + [nats_server.url], [dead[0], nats_server.url, dead[1]], [nats_server.url] + dead):
        nc = await bus.connect(",".join(servers), name="one-shot", allow_reconnect=False)
        try:
            assert nc.is_connected and nc.connected_url is not None
            assert nc.connected_url.port == nats_server.port
        finally:
            await nc.close()
    with pytest.raises(MeshUnavailable, match="cannot reach NATS at"):
        await bus.connect(",".join(dead), name="one-shot", allow_reconnect=False)


@pytest.mark.parametrize("allow_reconnect", [True, False])
async def test_a_first_connect_goes_past_a_server_that_rejects_the_credentials(allow_reconnect: bool) -> None:
    """One server of the list lacks the client's credentials (say, a cluster node not reloaded yet with a new
    user): the first connect reaches the other, whichever order the list or nats-py's shuffle gives; it fails,
    saying the credentials were rejected, only when every server rejects them."""
    with EmbeddedNats(token="old") as stale, EmbeddedNats(token="new") as current:
        for servers in ([stale.url, current.url], [current.url, stale.url]) * 3:
            nc = await bus.connect(",".join(servers), name="past-a-rejection", auth=NatsAuth(token="new"),
                                   allow_reconnect=allow_reconnect, first_connect_wait=WAIT_S)
            try:
                assert nc.connected_url is not None and nc.connected_url.port == current.port
            finally:
                await nc.close()
        with pytest.raises(MeshUnavailable, match="rejected past-a-rejection"):
            await bus.connect(f"{stale.url},{current.url}", name="past-a-rejection", auth=NatsAuth(token="wrong", auth_retry_secs=0),
                              allow_reconnect=allow_reconnect, first_connect_wait=WAIT_S)
