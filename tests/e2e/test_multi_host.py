"""A mesh over three hosts (network namespaces joined by a bridge: tests/support/netns.py), with a sniffer on the
wire between them.

Host 0 runs a NATS node, the remote store and the controller; hosts 1 and 2 a NATS node each (the three routed
as a cluster) and an engine each (tests/support/host_engine.py, a process in its host). Every client proves
itself with the cluster's token. Engine A (host 1) connects to host 0's node, so its token crosses the wire;
it stores a prompt to its CPU tier and the remote store on host 0. Engine B (host 2, no P2P) loads it from the
remote store across hosts; engine C (host 2, P2P, no remote tier) loads it from A's CPU tier over a P2P stream
across hosts. Each load is a proven hit: every token loaded, no load error, every block as the KV oracle
computes it, fetched from the tier named.

The module runs twice. In clear, the sniffer sees the token and the KV bytes cross the wire: what
docs/security.md says an operator spanning hosts must not run, and the proof that the sniffer sees what crosses.
Over TLS (a CA and certificates naming the hosts' addresses, shared/tls.py): the NATS clients and the cluster's
routes, the remote store's stream port and the P2P ports all TLS only, every client verifying its server; the
same hits, and the sniffer sees neither the token nor any of the KV bytes.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvmesh.shared.messaging.embedded_nats import find_nats_server, nats_tls_settings, server_settings
from kvmesh.shared.protocol import PEER, REMOTE
from kvmesh.shared.tls import TlsMaterial

from support.engine import CHUNK
from support.netns import Hosts, Sniffer
from support.waiting import WAIT_S, wait_until

TESTS = Path(__file__).resolve().parents[1]
TOKENS = 4 * CHUNK + 5
NATS_PORT, ROUTE_PORT = 4222, 6222


def nats_config(hosts: Hosts, host: int, token: str, tls: TlsMaterial | None) -> str:
    routes = ", ".join(f"nats-route://{hosts.address(i)}:{ROUTE_PORT}" for i in range(len(hosts.names)) if i != host)
    clients = nats_tls_settings(tls.files("nats")) if tls is not None else ""
    between = nats_tls_settings(tls.files("nats"), routes=True) if tls is not None else ""
    return (f"listen: \"{hosts.address(host)}:{NATS_PORT}\"\nserver_name: host{host}\n{server_settings()}"
            f"authorization {{ token: \"{token}\" }}\n{clients}"
            f"cluster {{\n  name: kvmesh-hosts\n  listen: \"{hosts.address(host)}:{ROUTE_PORT}\"\n"
            f"  routes: [{routes}]\n{between}}}\n")


class Mesh:
    def __init__(self, hosts: Hosts, work: Path, token: str, tls: TlsMaterial | None) -> None:
        self.hosts, self.work, self.token, self.tls = hosts, work, token, tls
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}

    def url(self, host: int) -> str:
        return f"nats://{self.hosts.address(host)}:{NATS_PORT}"

    def log(self, name: str) -> Path:
        return self.work / f"{name}.log"

    def logged(self, name: str, text: str) -> bool:
        path = self.log(name)
        return path.exists() and text in path.read_text(errors="replace")

    def service_tls(self, cert: str = "", key: str = "", service: str = "") -> list[str]:
        """A service's flags: NATS verified against the CA, and its own port (`cert`/`key` flags) TLS only."""
        if self.tls is None:
            return []
        files = self.tls.files(service) if service else None
        return ["--nats-tls-ca", str(self.tls.ca),
                *([cert, str(files.cert), key, str(files.key)] if files is not None else [])]

    def engine(self, host: int, mode: str, tiers: list[str], **config: Any) -> subprocess.Popen[str]:
        if self.tls is not None:  # every connection verified against the CA; its own P2P port TLS only
            engine = self.tls.files("engine")
            config.update(nats_tls_ca=str(self.tls.ca), remote_tls_ca=str(self.tls.ca), p2p_tls_ca=str(self.tls.ca),
                          p2p_tls_cert=str(engine.cert), p2p_tls_key=str(engine.key))
        settings = {"tokens": TOKENS, "tiers": tiers, "config": {"nats_token": self.token, **config}}
        return subprocess.Popen(["ip", "netns", "exec", self.hosts.names[host], sys.executable,
                                 str(TESTS / "support" / "host_engine.py"), mode, json.dumps(settings)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env,
                                stderr=self.log(f"engine-{mode}-{config['lmcache_instance_id']}").open("a"),
                                start_new_session=True)


@pytest.fixture(scope="module", params=["clear", "tls"])
def mesh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, Sniffer]]:
    reason = Hosts.skip_reason()
    if reason is not None:
        pytest.skip(f"no hosts to span: {reason}")
    work = tmp_path_factory.mktemp(f"hosts-{request.param}")
    with Hosts(3) as hosts:
        tls = None
        if request.param == "tls":
            tls = TlsMaterial(work / "tls")
            tls.ensure(("nats", "remote-store", "engine"), hosts=[hosts.address(i) for i in range(3)])
        sniffer = Sniffer(hosts.bridge)
        mesh = Mesh(hosts, work, secrets.token_hex(16), tls)
        try:
            nats = find_nats_server()
            for host in range(3):
                config = work / f"nats{host}.conf"
                config.write_text(nats_config(hosts, host, mesh.token, tls))
                hosts.popen(host, [nats, "-c", str(config), "-l", str(mesh.log(f"nats{host}"))],
                            mesh.log(f"nats{host}-out"))
            wait_until(lambda: all(mesh.logged(f"nats{h}", "Server is ready") for h in range(3)),
                       what="three NATS nodes")
            auth = ["--nats-token", mesh.token]
            hosts.popen(0, [sys.executable, "-m", "kvmesh.services.remote_store", "--nats-url", mesh.url(0), *auth,
                            "--stream-host", hosts.address(0), "--advertise-host", hosts.address(0),
                            "--max-size-gb", "0.1", "--fault-ahead-gb", "0",
                            *mesh.service_tls("--stream-tls-cert", "--stream-tls-key", "remote-store")],
                        mesh.log("remote"), mesh.env)
            hosts.popen(0, [sys.executable, "-m", "kvmesh.services.controller", "--nats-url", mesh.url(0), *auth,
                            "--host", "127.0.0.1", "--port", "0", "--insecure-no-auth", *mesh.service_tls()],
                        mesh.log("controller"), mesh.env)
            wait_until(lambda: mesh.logged("remote", "serving on NATS") and mesh.logged("controller", "REST on"),
                       what="the remote store and the controller on host 0")
            yield mesh, sniffer
        finally:
            sniffer.close()


@pytest.fixture(scope="module")
def stored(mesh: tuple[Mesh, Sniffer]) -> Iterator[list[bytes]]:
    """Engine A on host 1 has stored the prompt (CPU tier, remote store on host 0) and serves it to peers; the
    KV byte slices it stored."""
    m, _ = mesh
    a = m.engine(1, "store", [REMOTE, PEER], nats_url=m.url(0), remote_url="lm://remote", enable_p2p=True,
                 p2p_host=m.hosts.address(1), lmcache_instance_id="host-a")
    try:
        assert a.stdout is not None
        line = a.stdout.readline()
        assert line, f"engine A ended without storing: see {m.log('engine-store-host-a')}"
        yield [bytes.fromhex(n) for n in json.loads(line)["needles"]]
    finally:
        if a.stdin is not None:
            a.stdin.close()
        a.wait(WAIT_S)


def load(m: Mesh, host: int, tier: str, **config: Any) -> dict[str, Any]:
    process = m.engine(host, "load", [tier], nats_url=m.url(host), **config)
    out, _ = process.communicate(timeout=3 * WAIT_S)
    assert process.returncode == 0, f"the load failed: see {m.log('engine-load-' + config['lmcache_instance_id'])}"
    return json.loads(out.strip().splitlines()[-1])


def assert_hit(result: dict[str, Any], tier: str) -> None:
    chunks = -(-TOKENS // CHUNK)
    assert result["loaded"] == TOKENS and result["oracle"], result
    assert result["fetched"].get(f"fetched_{tier}") == chunks, result
    assert not any(result["errors"].values()), result


def test_a_remote_store_hit_across_hosts(mesh: tuple[Mesh, Sniffer], stored: list[bytes]) -> None:
    m, _ = mesh
    assert_hit(load(m, 2, REMOTE, remote_url="lm://remote", lmcache_instance_id="host-b"), REMOTE)


def test_a_p2p_hit_across_hosts(mesh: tuple[Mesh, Sniffer], stored: list[bytes]) -> None:
    m, _ = mesh
    assert_hit(load(m, 2, PEER, enable_p2p=True, p2p_host=m.hosts.address(2), lmcache_instance_id="host-c"), PEER)


def test_what_the_wire_between_hosts_carries(mesh: tuple[Mesh, Sniffer], stored: list[bytes]) -> None:
    """Run after the hits (module order): in clear the token (engine A's CONNECT to host 0's node) and the KV
    bytes (the chunks to the remote store and over P2P) cross the wire; over TLS neither does."""
    m, sniffer = mesh
    assert sniffer.captured_bytes() > 100_000  # the chunks crossed, one way or the other
    if m.tls is None:
        assert sniffer.seen(m.token.encode())
        assert any(sniffer.seen(needle) for needle in stored)
    else:
        assert not sniffer.seen(m.token.encode())
        assert not any(sniffer.seen(needle) for needle in stored)

