"""compose.yaml's "cluster" profile runs over TLS, checked without Docker.

The credentials-cluster service's own command runs with its volumes mapped into a temporary directory; three
real nats-server processes then run the config it wrote with the nodes' own command lines. Where compose gives
each node a host of its own (nats-1:4222, nats-1:6222, ...), here each gets loopback ports of its own: its copy of
the config has the host:port pairs replaced, nothing else. The routes form over TLS, both ends verified; the
services' clients, configured by their compose environment and the engine's docker/lmcache-cluster.yaml, reach
each other across the routes over TLS; a plaintext client and a client trusting another CA are refused. The
`redis` service's command (the remote tier) serves TLS only, to the clients the profile configures."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import redis
import yaml

from kvmesh.services.engine.config.engine_auth import engine_auth
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.shared.errors import MeshUnavailable
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import find_nats_server, free_port
from kvmesh.shared.messaging.nats_auth import add_nats_auth_flags, nats_auth_from_args
from kvmesh.shared.protocol import Subjects
from kvmesh.shared.tls import TlsMaterial, client_context
from kvmesh.shared.wire.redis_url import parse_redis_url

from support.redis_server import REDIS_SERVER
from support.waiting import WAIT_S, wait_until, wait_until_async

ROOT = Path(__file__).parents[2]
SERVICES: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
NODES = ("nats-1", "nats-2", "nats-3")


def mounts(service: str, volumes: Path) -> dict[str, Path]:
    """Each named volume `service` mounts: its path in the container -> where this test keeps the volume."""
    found = {}
    for entry in SERVICES[service].get("volumes", []):
        volume, container_path = entry.split(":")[:2]
        if not volume.startswith("."):  # a named volume, not the source tree
            found[container_path] = volumes / volume
            found[container_path].mkdir(exist_ok=True)
    return found


def mapped(text: str, paths: dict[str, Path]) -> str:
    """`text` with each container path of `paths` (as a whole path or a path's start) replaced by the test's."""
    for container_path in sorted(paths, key=len, reverse=True):
        text = re.sub(rf"(?<![\w/.-]){re.escape(container_path)}(?=/|\s|\"|$)", str(paths[container_path]), text)
    return text


def credentials_command() -> list[str]:
    """The arguments of credentials-cluster's `kvmesh credentials` (the first command of its script)."""
    script = SERVICES["credentials-cluster"]["command"][0]
    return shlex.split(script.split("&&")[0])


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


@dataclasses.dataclass
class Node:
    name: str
    client_port: int
    route_port: int
    monitor_port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.client_port}"


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The profile's volumes after credentials-cluster ran its command (in sh, as compose runs it)."""
    volumes = tmp_path_factory.mktemp("volumes")
    script = mapped(SERVICES["credentials-cluster"]["command"][0], mounts("credentials-cluster", volumes))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["sh", "-c", script], env=env, check=True, timeout=WAIT_S, capture_output=True)
    return volumes


@pytest.fixture(scope="module")
def nodes(volumes: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    """nats-1..3, each with the generated config and its compose command line, on loopback ports of its own."""
    made = credentials_command()
    client_listen = flag_values(made, "--listen")[0]
    route_listen = flag_values(made, "--cluster-listen")[0]
    routes = flag_values(made, "--route")
    assert sorted(route.split(":")[0] for route in routes) == list(NODES), "every node routes to all three"
    logs = tmp_path_factory.mktemp("nats-logs")
    started = {name: Node(name, free_port(), free_port(), free_port()) for name in NODES}
    try:
        for node in started.values():
            paths = mounts(node.name, volumes)
            argv = [mapped(arg, paths) for arg in SERVICES[node.name]["command"]]
            config = Path(argv[argv.index("-c") + 1])
            text = config.read_text().replace(client_listen, f"127.0.0.1:{node.client_port}")
            text = text.replace(route_listen, f"127.0.0.1:{node.route_port}")
            for route in routes:
                text = text.replace(route, f"127.0.0.1:{started[route.split(':')[0]].route_port}")
            own = config.with_name(f"{node.name}.conf")  # beside it: the config includes ./authorization.conf
            own.write_text(text + f'http: "127.0.0.1:{node.monitor_port}"\n')  # for /routez only
            argv[argv.index("-c") + 1] = str(own)
            argv[argv.index("--pid") + 1] = str(logs / f"{node.name}.pid")
            with open(logs / f"{node.name}.log", "wb") as log:
                node.process = subprocess.Popen([find_nats_server(), *argv], stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: all(routed(node, started, logs) for node in started.values()), WAIT_S,
                   interval=0.1, what="the routes between nats-1..3")
        yield started
    finally:
        for node in started.values():
            if node.process is not None:
                node.process.terminate()
                node.process.wait(WAIT_S)


def routed(node: Node, nodes: dict[str, Node], logs: Path) -> bool:
    assert node.process is not None
    if node.process.poll() is not None:
        raise AssertionError(f"{node.name} exited: {(logs / f'{node.name}.log').read_text()[-3000:]}")
    try:
        routes = httpx.get(f"http://127.0.0.1:{node.monitor_port}/routez", timeout=2).json().get("routes") or []
    except httpx.HTTPError:
        return False
    return {route.get("remote_name") for route in routes} >= set(nodes) - {node.name}


def route_greeting(node: Node, context: ssl.SSLContext | None) -> bytes:
    """What a node's route port says first to a dialer (b"" when it hangs up): over TLS with `context`, else in
    clear after a route's CONNECT."""
    with socket.create_connection(("127.0.0.1", node.route_port), timeout=WAIT_S) as raw:
        try:
            if context is None:
                raw.sendall(b'CONNECT {"verbose":false}\r\n')
                return raw.makefile("rb").readline()
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                return sock.makefile("rb").readline()
        except (ssl.SSLError, ConnectionResetError):
            return b""


def service_auth(service: str, volumes: Path, **overrides: str) -> Any:
    """The NATS credentials `service` connects with: its compose environment, its volume paths mapped."""
    paths = mounts(service, volumes)
    environ = {name: mapped(str(value), paths) for name, value in SERVICES[service]["environment"].items()}
    parser = argparse.ArgumentParser()
    add_nats_auth_flags(parser)
    return nats_auth_from_args(parser.parse_args([]), environ={**environ, **overrides})


def test_every_cluster_client_is_given_tls_urls() -> None:
    urls = [SERVICES[name]["command"][SERVICES[name]["command"].index("--nats-url") + 1]
            for name in ("controller-cluster", "disk-store-cluster", "remote-store-redis")]
    engine = EngineConfig.from_env({"LMCACHE_CONFIG_FILE": str(ROOT / "docker" / "lmcache-cluster.yaml")})
    assert set(urls) == {engine.nats_url} == {",".join(f"tls://{node}:4222" for node in NODES)}


def test_the_certificates_name_the_servers_hosts(volumes: Path) -> None:
    from cryptography import x509
    tls = volumes / "kvmesh-cluster-nats" / "tls"
    for service in ("nats", "redis"):
        cert = x509.load_pem_x509_certificate((tls / f"{service}.pem").read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {*NODES, "redis"} <= set(names.get_values_for_type(x509.DNSName))


async def test_the_nodes_route_over_tls_and_carry_a_message_from_nats_1_to_nats_3(
        volumes: Path, nodes: dict[str, Node], tmp_path: Path) -> None:
    """The controller (on nats-1) pings all; the disk store (on nats-3) hears it across the routes."""
    nats_tls = TlsMaterial(volumes / "kvmesh-cluster-nats" / "tls").files("nats")
    impostor = TlsMaterial(tmp_path / "other").ensure(["nats"], hosts=["127.0.0.1"])["nats"]
    for node in nodes.values():  # a route port speaks TLS first, and only to a node the CA vouches for
        assert route_greeting(node, None) == b"", "a plaintext route"
        assert route_greeting(node, client_context(nats_tls.ca)) == b"", "a route from a dialer without a certificate"
        assert route_greeting(node, client_context(nats_tls.ca, impostor.cert, impostor.key)) == b"", \
            "a route from a dialer whose certificate another CA signed"
        greeting = route_greeting(node, client_context(nats_tls.ca, nats_tls.cert, nats_tls.key))
        assert json.loads(greeting.split(b" ", 1)[1])["cluster"] == "kvmesh"
    controller = await bus.connect(nodes["nats-1"].url, "test-controller", service_auth("controller-cluster", volumes),
                                   allow_reconnect=False)
    store = await bus.connect(nodes["nats-3"].url, "test-disk-store", service_auth("disk-store-cluster", volumes),
                              allow_reconnect=False)
    try:
        for client in (controller, store):
            assert client._transport._io_writer.get_extra_info("ssl_object") is not None  # the socket is TLS
        heard: list[bytes] = []

        async def hear(message: Any) -> None:
            heard.append(message.data)

        await store.subscribe(Subjects.PING_ALL, cb=hear)
        await store.flush()

        async def crossed() -> bool:  # the subscription's interest reaches nats-1 over a route
            await controller.publish(Subjects.PING_ALL, b"across")
            await controller.flush()
            await store.flush()
            return bool(heard)

        await wait_until_async(crossed, what="a ping from nats-1 heard on nats-3")
        assert set(heard) == {b"across"}
    finally:
        await controller.close()
        await store.close()


async def test_the_engine_connects_with_its_cluster_config(volumes: Path, nodes: dict[str, Node],
                                                           tmp_path: Path) -> None:
    """docker/lmcache-cluster.yaml and vllm-cluster's environment, the container's paths mapped: the engine
    verifies nats-2 against the CA and logs in as its principal."""
    paths = mounts("vllm-cluster", volumes)
    config_file = tmp_path / "lmcache-cluster.yaml"
    config_file.write_text(mapped((ROOT / "docker" / "lmcache-cluster.yaml").read_text(), paths))
    environ = {name: mapped(str(value), paths) for name, value in SERVICES["vllm-cluster"]["environment"].items()
               if name.startswith("LMCACHE_")}
    config = EngineConfig.from_env({**environ, "LMCACHE_CONFIG_FILE": str(config_file)})
    assert config.nats_tls_ca == str(paths["/creds"] / "ca.pem")
    engine = await bus.connect(nodes["nats-2"].url, "test-engine", engine_auth(config), allow_reconnect=False)
    try:
        assert engine._transport._io_writer.get_extra_info("ssl_object") is not None
    finally:
        await engine.close()


def test_a_plaintext_client_is_refused(volumes: Path, nodes: dict[str, Node]) -> None:
    """The controller's password in clear on a node's client port: the node hangs up, no PONG."""
    auth = service_auth("controller-cluster", volumes)
    with socket.create_connection(("127.0.0.1", nodes["nats-1"].client_port), timeout=WAIT_S) as sock:
        reader = sock.makefile("rb")
        assert json.loads(reader.readline().split(b" ", 1)[1])["tls_required"] is True
        connect = {"user": auth.user, "pass": auth.password, "verbose": False}
        sock.sendall(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        assert reader.readline() == b""


async def test_a_client_trusting_another_ca_is_refused(volumes: Path, nodes: dict[str, Node],
                                                        tmp_path: Path) -> None:
    other = TlsMaterial(tmp_path / "other").ensure(["nats"], hosts=["127.0.0.1"])["nats"].ca
    auth = service_auth("controller-cluster", volumes, KVMESH_NATS_TLS_CA=str(other))
    with pytest.raises(MeshUnavailable, match="not signed by the trusted CA"):
        await bus.connect(nodes["nats-3"].url, "test-other-ca", auth, allow_reconnect=False,
                          first_connect_wait=WAIT_S)


@pytest.fixture(scope="module")
def redis_port(volumes: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The redis service's own command (compose's `$$` is `$`), its TLS port mapped to a free loopback one."""
    script = mapped(SERVICES["redis"]["command"][0].replace("$$", "$"), mounts("redis", volumes))
    assert "--port 0 --tls-port 6379" in script, "Redis has no plaintext port"
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    script = script.replace("redis-server", REDIS_SERVER, 1).replace("--tls-port 6379", f"--tls-port {port}")
    script += f" --bind 127.0.0.1 --dir {workdir} --logfile {workdir / 'redis.log'}"
    process = subprocess.Popen(["sh", "-c", script], env={**os.environ, "KVMESH_REDIS_PASSWORD": ""})
    try:
        wait_until(lambda: process.poll() is None and listening(port), WAIT_S, interval=0.05,
                   what="the redis service's TLS port")
        yield port
    finally:
        process.terminate()
        process.wait(WAIT_S)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


async def test_redis_serves_the_profiles_clients_over_tls_only(volumes: Path, redis_port: int,
                                                               tmp_path: Path) -> None:
    """remote-store-redis's --redis-url and environment (and the engine's remote_url, the same) reach Redis
    over TLS; a plaintext client and one trusting another CA get nothing."""
    command = SERVICES["remote-store-redis"]["command"]
    url = command[command.index("--redis-url") + 1]
    engine = EngineConfig.from_env({"LMCACHE_CONFIG_FILE": str(ROOT / "docker" / "lmcache-cluster.yaml")})
    assert url == engine.remote_url and url.startswith("rediss://redis:")
    paths = mounts("remote-store-redis", volumes)
    environ = {name: mapped(str(value), paths) for name, value in SERVICES["remote-store-redis"]["environment"].items()}
    ca = (volumes / "kvmesh-cluster-nats" / "tls" / "ca.pem").read_bytes()
    engine_ca = mapped(SERVICES["vllm-cluster"]["environment"]["KVMESH_REDIS_TLS_CA"], mounts("vllm-cluster", volumes))
    assert Path(environ["KVMESH_REDIS_TLS_CA"]).read_bytes() == Path(engine_ca).read_bytes() == ca
    local = url.replace("redis:6379", f"127.0.0.1:{redis_port}")
    client = parse_redis_url(local, environ=environ).client(timeout=WAIT_S)
    try:
        assert await client.ping()
    finally:
        await client.aclose()
    other = TlsMaterial(tmp_path / "other").ensure(["redis"], hosts=["127.0.0.1"])["redis"].ca
    for refused in (parse_redis_url(local.replace("rediss://", "redis://"), environ={}),
                    parse_redis_url(local, environ={**environ, "KVMESH_REDIS_TLS_CA": str(other)})):
        client = refused.client(timeout=WAIT_S, retries=0)
        try:
            with pytest.raises(redis.ConnectionError):
                await client.ping()
        finally:
            await client.aclose()


def test_routes_without_a_server_config_are_refused(tmp_path: Path) -> None:
    """--route writes into nats-server.conf: without --listen there is none, and saying nothing would lose it."""
    made = subprocess.run([sys.executable, "-m", "kvmesh.cli", "credentials", "--dir", str(tmp_path / "mesh"),
                           "--route", "nats-1:6222"], capture_output=True, text=True, timeout=WAIT_S)
    assert made.returncode != 0 and "give --listen too" in made.stderr
    assert not (tmp_path / "mesh").exists()
