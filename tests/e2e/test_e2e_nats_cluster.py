"""End to end: two vLLM instances (the CPU build, the demo model) on a three-node NATS cluster whose server they
are connected to dies while they serve.

The cluster (tests/support/nats_cluster.py) runs with a user per principal on every node, made as `kvmesh credentials`
makes them: each process connects with its own file, so each authenticates to whichever server of the URL list
it lands on, first and after the failover. Node 0 starts alone, so the controller, the disk store and both
vLLMs ("a", "b": every connection of each, the worker's at start, the scheduler's on its first request) connect
to it; nodes 1 and 2 join once the first prompt was shared. vLLM's own prefix cache is off and the instances
have no remote tier, so the disk store is the only path between them: a prompt that "a" served cold is a hit on
"b" (`assert_loaded`: the worker retrieved what the scheduler promised, no load error), with the output of a
vLLM without the connector ("ref").

Node 0 is then SIGKILLed while both instances serve a stream of requests: none fails and every output is the
reference's. Every client reconnects to node 1 or 2 (the cluster's monitoring shows them there); the
controller's /lookup lists the chunks stored before the kill again; and both instances keep hitting: a prompt
served by "b" after the failover is a hit on "a", and the other way round.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from support.e2e import ManagedProcess, VLLMServer, clean_env, free_port, kv_transfer_config, start_vllm
from support.nats_cluster import NatsCluster
from kvmesh.shared import protocol
from kvmesh.shared.errors import MeshUnavailable
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.bus import NatsAuth
from kvmesh.shared.messaging.credentials import MeshCredentials
from kvmesh.shared.messaging.nats_auth import CREDENTIALS_ENV
from support.waiting import WAIT_S, wait_until

pytestmark = pytest.mark.vllm

CHUNK = 256
INSTANCES = {"a": "cluster-a", "b": "cluster-b"}


def engine_yaml(path: Path, nats_url: str, credentials: Path, disk: Path, instance_id: str) -> Path:
    config = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": 0.25,
        "local_disk": str(disk),  # the host's disk store on the mesh (the store's own --dir applies)
        "max_local_disk_size": 1.0,
        "lmcache_instance_id": instance_id,
        "nats_url": nats_url,
        "nats_credentials": str(credentials),
    }
    path.write_text(yaml.safe_dump(config))
    return path


def output_text(completion: dict[str, Any]) -> str:
    return completion["choices"][0]["text"]


def store_healthy(url: str, operator: NatsAuth, store_id: str) -> bool:
    """The disk store answers health on the cluster (asked as the operator, as `kvmesh health` does)."""
    async def ask() -> bool:
        nc = await bus.connect(url, name="e2e-health", auth=operator, allow_reconnect=False)
        try:
            await bus.request(nc, protocol.Subjects.health(protocol.store_path(store_id)), protocol.HealthRequest(),
                              protocol.HealthReply, timeout=2.0)
            return True
        except MeshUnavailable:
            return False
        finally:
            await nc.close()

    return asyncio.run(ask())


@pytest.fixture(scope="module")
def cluster_vllms(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("e2e-nats-cluster")
    store_id = protocol.disk_store_id()
    credentials = MeshCredentials(work / "nats-credentials")
    engines = {name: protocol.Principal.engine(instance) for name, instance in INSTANCES.items()}
    credentials.ensure(protocol.CONTROLLER.path, protocol.OPERATOR.path, protocol.Principal.store(store_id).path,
                       *(principal.path for principal in engines.values()))
    cluster = NatsCluster(credentials=credentials)
    cluster.start(0)
    port = free_port()
    controller = ManagedProcess(
        "controller", [sys.executable, "-m", "kvmesh.services.controller", "--host", "127.0.0.1", "--port",
                       str(port), "--nats-url", cluster.url], work / "controller.log",
        env=clean_env(**{CREDENTIALS_ENV: str(credentials.file(protocol.CONTROLLER.path))}))
    disk_store = ManagedProcess(
        "disk-store", [sys.executable, "-m", "kvmesh.services.disk_store", "--nats-url", cluster.url, "--dir",
                       str(work / "disk"), "--max-size-gb", "1", "--store-id", store_id], work / "disk-store.log",
        env=clean_env(**{CREDENTIALS_ENV: str(credentials.file(protocol.Principal.store(store_id).path))}))
    servers = {name: VLLMServer(
        f"vllm-cluster-{name}", demo_model, free_port(), work / f"vllm-{name}.log", kv_config=kv_transfer_config(),
        env=clean_env(LMCACHE_CONFIG_FILE=str(engine_yaml(
            work / f"{name}.yaml", cluster.url, credentials.file(principal.path), work / "disk", INSTANCES[name]))))
        for name, principal in engines.items()}
    ref = VLLMServer("vllm-cluster-ref", demo_model, free_port(), work / "vllm-ref.log")
    try:
        controller.start()
        disk_store.start()
        operator = NatsAuth.from_file(credentials.file(protocol.OPERATOR.path))
        wait_until(lambda: store_healthy(cluster.url, operator, store_id), WAIT_S, interval=0.5,
                   what="the disk store on the cluster")
        start_vllm(*servers.values(), ref)
        yield {"cluster": cluster, "controller": f"http://127.0.0.1:{port}", "ref": ref, **servers,
               "processes": [controller, disk_store]}
    finally:
        for server in (ref, *servers.values(), disk_store, controller):
            server.stop()
        cluster.stop()


class Traffic:
    """Requests sent to both instances in turn from a thread until stopped, cycling through `prompts` (so the
    first round misses everywhere: lookups, loads and stores on the disk store while NATS fails over): each
    reply's text with the reference's, or the error that failed it."""

    def __init__(self, servers: list[VLLMServer], prompts: dict[str, str], expected: dict[str, str]) -> None:
        self.servers = servers
        self.prompts = prompts
        self.expected = expected
        self.outputs: list[tuple[str, str]] = []  # (output, expected output)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        turn = 0
        while not self._stop.is_set():
            name = list(self.prompts)[turn % len(self.prompts)]
            server = self.servers[turn % len(self.servers)]
            turn += 1
            try:
                completion = server.complete(self.prompts[name], max_tokens=8)
                self.outputs.append((output_text(completion), self.expected[name]))
            except httpx.HTTPError as exc:
                self.errors.append(f"{server.name}: {type(exc).__name__}: {exc}")

    @property
    def done(self) -> int:
        """Requests answered or failed so far."""
        return len(self.outputs) + len(self.errors)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S * 4)
        assert not self._thread.is_alive(), "a request did not finish"


def test_two_vllms_keep_serving_and_hitting_when_their_nats_server_dies(cluster_vllms: dict[str, Any],
                                                                         long_text: str) -> None:
    cluster: NatsCluster = cluster_vllms["cluster"]
    a: VLLMServer = cluster_vllms["a"]
    b: VLLMServer = cluster_vllms["b"]
    ref: VLLMServer = cluster_vllms["ref"]
    servers = {"a": a, "b": b}
    prompts = {name: f"[cluster {name}]\n{long_text[start:start + 7_000]}"
               for name, start in (("before", 10_000), ("after-b", 20_000), ("after-a", 30_000))}
    expected = {name: output_text(ref.complete(prompt, max_tokens=16)) for name, prompt in prompts.items()}
    traffic_prompts = {f"traffic-{i}": f"[traffic {i}]\n{long_text[40_000 + 2_000 * i:44_000 + 2_000 * i]}"
                       for i in range(5)}  # odd: each prompt goes to a and b in turn
    traffic_expected = {name: output_text(ref.complete(prompt, max_tokens=8))
                        for name, prompt in traffic_prompts.items()}
    ref.stop()  # its outputs are all it was for; it would only slow the others down
    tokens = {name: a.tokenize(prompt) for name, prompt in prompts.items()}
    assert all(len(ids) > 4 * CHUNK for ids in tokens.values()), {name: len(ids) for name, ids in tokens.items()}

    def listed(name: str, instance: str) -> bool:
        """The controller's /lookup finds every token of the prompt `name` held for `instance`."""
        response = httpx.post(f"{cluster_vllms['controller']}/lookup", json={"tokens": tokens[name]}, timeout=30)
        response.raise_for_status()
        entry = response.json()["layout_info"].get(instance)
        return bool(entry) and entry[1] == len(tokens[name])

    def shared(name: str, first_name: str, second_name: str) -> None:
        """The instance `first_name` serves the prompt cold, its chunks reach the disk store, `second_name` loads
        them."""
        first, second = servers[first_name], servers[second_name]
        cold = first.complete(prompts[name], max_tokens=16)
        assert first.hit_for(cold).hit == 0
        assert output_text(cold) == expected[name]
        # `second` never saw the prompt: it is listed for it once the disk store's writes are all admitted (they
        # land after `first`'s CPU tier admits the chunks, later still while NATS fails over)
        for instance in (INSTANCES[first_name], INSTANCES[second_name]):
            wait_until(lambda: listed(name, instance), WAIT_S, interval=0.3,
                       what=f"/lookup listing the prompt {name!r} for {instance}")
        warm = second.complete(prompts[name], max_tokens=16)  # never seen by `second`: only the disk store has it
        hit = second.assert_loaded(warm)
        assert hit.hit >= len(tokens[name]) - CHUNK, hit
        assert output_text(warm) == expected[name]

    shared("before", "a", "b")  # every connection is made now: the schedulers' on a first request
    cluster.start(1, 2)

    on_node0 = cluster.clients(0)
    for prefix in ("disk_store:", "kvmesh-controller", *(f"{instance}{part}" for instance in INSTANCES.values()
                                                         for part in ("@", "-scheduler"))):
        assert any(client.startswith(prefix) for client in on_node0), (prefix, on_node0)
    assert cluster.clients(1) == [] == cluster.clients(2)

    with Traffic([a, b], traffic_prompts, traffic_expected) as traffic:
        wait_until(lambda: traffic.done >= 2, WAIT_S, interval=0.1, what="requests before the kill")
        cluster.kill(0)
        wait_until(lambda: set(on_node0) <= set(cluster.clients(1) + cluster.clients(2)), WAIT_S, interval=0.2,
                   what="every client of node 0 on node 1 or 2")
        served = traffic.done
        wait_until(lambda: traffic.done >= served + 2, WAIT_S, interval=0.1, what="requests after the failover")
    assert traffic.errors == []
    assert all(output == reference for output, reference in traffic.outputs), traffic.outputs

    # the controller's index holds what was stored before the kill (the disk store's and a's chunks)
    wait_until(lambda: listed("before", INSTANCES["a"]), WAIT_S, interval=0.3, what="/lookup after the failover")
    # both keep storing to and loading from the disk store, each what the other stored
    shared("after-b", "b", "a")
    shared("after-a", "a", "b")
    for process in cluster_vllms["processes"]:
        assert process.alive(), process.log_tail()
