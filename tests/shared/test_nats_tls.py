"""NATS over TLS with a real nats-server: a store and its client that trust the mesh's CA work end to end (put and
get through a remote store), a client without the CA or trusting another CA is refused saying why, a plaintext
client is refused by the server, a client that requires TLS refuses a plaintext server, and a cluster's routes
run over TLS."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.services.engine.tiers.remote import RemoteStoreClient
from kvmesh.shared.errors import ConfigError, MeshUnavailable
from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.bus import NatsAuth
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.messaging.nats_auth import add_nats_auth_flags, nats_auth_from_args
from kvmesh.shared.tls import TlsMaterial

from support.nats_cluster import NatsCluster
from support.remote_store import ENGINE, MiB, chunk, start_stores
from support.waiting import WAIT_S

TOKEN = "tls-test-token"


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    material = TlsMaterial(tmp_path_factory.mktemp("tls") / "tls")
    material.ensure(["nats", "remote-store"], hosts=["127.0.0.1", "localhost"])
    return material


@pytest.fixture(scope="module")
def tls_nats(material: TlsMaterial) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(token=TOKEN, tls=material.files("nats")) as server:
        yield server


def other_ca(tmp_path: Path) -> Path:
    return TlsMaterial(tmp_path / "other").ensure(["nats"], hosts=["127.0.0.1"])["nats"].ca


async def test_a_store_and_its_client_trusting_the_ca_put_and_get(tls_nats: EmbeddedNats,
                                                                  material: TlsMaterial) -> None:
    assert tls_nats.url.startswith("tls://")
    auth = NatsAuth(token=TOKEN, tls_ca=str(material.ca))
    services, nc = await start_stores(tls_nats.url, f"tls{os.urandom(3).hex()}", capacity=8 * MiB, auth=auth)
    await nc.close()
    nc = await bus.connect(tls_nats.url, "test-tls-client", auth, allow_reconnect=False)
    client = RemoteStoreClient(nc, [s.options.store_id for s in services], ENGINE, request_timeout=WAIT_S)
    try:
        assert nc._transport._io_writer.get_extra_info("ssl_object") is not None  # the socket is TLS
        meta, data = chunk(1 * MiB + 7, 1)
        assert await client.put(meta, ChunkBuffer(memoryview(data)))
        out = np.zeros(meta.nbytes, dtype=np.uint8)
        got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
        assert got is not None and got.checksum == meta.checksum and np.array_equal(out, data)
        assert await client.contains([meta.key]) == 1
    finally:
        await client.close()
        await nc.close()
        for service in services:
            await service.stop()


async def test_a_client_without_the_ca_or_with_another_ca_is_refused(tls_nats: EmbeddedNats, tmp_path: Path) -> None:
    for auth in (NatsAuth(token=TOKEN), NatsAuth(token=TOKEN, tls_ca=str(other_ca(tmp_path)))):
        with pytest.raises(MeshUnavailable, match="not signed by the trusted CA.*--nats-tls-ca"):
            await bus.connect(tls_nats.url, "test-wrong-ca", auth, allow_reconnect=False, first_connect_wait=WAIT_S)


async def test_a_client_that_requires_tls_refuses_a_plaintext_server(material: TlsMaterial) -> None:
    with EmbeddedNats(token=TOKEN) as plaintext:
        url = plaintext.url.replace("nats://", "tls://")
        with pytest.raises(MeshUnavailable, match="does not offer TLS"):
            await bus.connect(url, "test-tls-only", NatsAuth(token=TOKEN, tls_ca=str(material.ca)),
                              allow_reconnect=False)


def test_a_plaintext_client_is_refused_by_the_server(tls_nats: EmbeddedNats) -> None:
    """A client speaking the NATS protocol in clear (its token would cross the network) is refused."""
    with socket.create_connection(("127.0.0.1", tls_nats.port), timeout=WAIT_S) as sock:
        reader = sock.makefile("rb")
        info = json.loads(reader.readline().split(b" ", 1)[1])
        assert info["tls_required"] is True
        sock.sendall(f'CONNECT {json.dumps({"auth_token": TOKEN, "verbose": False})}\r\nPING\r\n'.encode())
        answer = reader.readline()
    assert answer == b""  # the server took the CONNECT for a failed TLS handshake and hung up: no PONG


def test_tls_flags_that_cannot_work_are_config_errors_naming_the_flag(material: TlsMaterial, tmp_path: Path) -> None:
    import argparse
    parser = argparse.ArgumentParser()
    add_nats_auth_flags(parser)
    args = parser.parse_args(["--nats-tls-ca", str(tmp_path / "missing.pem")])
    with pytest.raises(ConfigError, match="--nats-tls-ca: TLS CA file .*missing.pem: no such file"):
        nats_auth_from_args(args, environ={})
    args = parser.parse_args(["--nats-tls-cert", str(material.files("nats").cert)])
    with pytest.raises(ConfigError, match="need --nats-tls-ca"):
        nats_auth_from_args(args, environ={})
    auth = nats_auth_from_args(parser.parse_args([]), environ={"KVMESH_NATS_TLS_CA": str(material.ca)})
    assert auth.tls_ca == str(material.ca)


async def test_a_cluster_routes_over_tls(material: TlsMaterial, tmp_path: Path) -> None:
    """Three nodes whose routes require TLS verified against the CA: a message crosses from one node to another."""
    cluster = NatsCluster(token=TOKEN, tls=material.files("nats")).start()
    try:
        auth = NatsAuth(token=TOKEN, tls_ca=str(material.ca))
        first = await bus.connect(cluster.nodes[0].url, "test-node0", auth, allow_reconnect=False)
        last = await bus.connect(cluster.nodes[2].url, "test-node2", auth, allow_reconnect=False)
        subscription = await last.subscribe("tls.route")
        await last.flush()
        await first.publish("tls.route", b"across")
        message = await subscription.next_msg(timeout=WAIT_S)
        assert message.data == b"across"
        await first.close()
        await last.close()
    finally:
        cluster.stop()


def test_engine_tls_keys_that_cannot_work_are_config_errors_naming_the_key(material: TlsMaterial,
                                                                           tmp_path: Path) -> None:
    from kvmesh.services.engine.config.engine_auth import engine_auth
    from kvmesh.services.engine.config.engine_config import EngineConfig
    with pytest.raises(ConfigError, match="nats_tls_ca: TLS CA file .*missing.pem: no such file"):
        engine_auth(EngineConfig(nats_token=TOKEN, nats_tls_ca=str(tmp_path / "missing.pem")))
    with pytest.raises(ConfigError, match="nats_tls_cert / nats_tls_key need nats_tls_ca"):
        engine_auth(EngineConfig(nats_token=TOKEN, nats_tls_cert=str(material.files("nats").cert)))
    assert engine_auth(EngineConfig(nats_tls_ca=str(material.ca))).tls_ca == str(material.ca)  # no credentials


async def test_kvmesh_credentials_tls_makes_a_nats_config_that_requires_tls(tmp_path: Path) -> None:
    """`kvmesh credentials --tls --listen`: the server it configures serves the principals over TLS only."""
    import subprocess
    import sys
    from kvmesh.shared.messaging.embedded_nats import find_nats_server, free_port
    port = free_port()
    made = subprocess.run([sys.executable, "-m", "kvmesh.cli", "credentials", "--dir", str(tmp_path / "mesh"), "--tls",
                           "--listen", f"127.0.0.1:{port}", "store.remote-0"],
                          capture_output=True, text=True, timeout=WAIT_S, check=True)
    files = json.loads(made.stdout)
    assert {"tls-ca", "tls-nats", "tls-remote-store", "tls-controller", "tls-pd-proxy", "tls-engine"} <= set(files)
    server = subprocess.Popen([find_nats_server(), "-c", files["nats-server"]], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        auth = dataclasses.replace(NatsAuth.from_file(files["store.remote-0"]), tls_ca=files["tls-ca"])
        nc = await bus.connect(f"tls://127.0.0.1:{port}", "test-made", auth, first_connect_wait=WAIT_S)
        assert nc._transport._io_writer.get_extra_info("ssl_object") is not None
        await nc.close()
        plain = dataclasses.replace(auth, tls_ca=None)
        with pytest.raises(MeshUnavailable, match="not signed by the trusted CA"):
            await bus.connect(f"nats://127.0.0.1:{port}", "test-plain", plain, first_connect_wait=WAIT_S)
        # a principal added later is loaded into the running server: the reload is confirmed over TLS
        added = subprocess.run([sys.executable, "-m", "kvmesh.cli", "credentials", "--dir", str(tmp_path / "mesh"),
                                "--tls", "engine.late"], capture_output=True, text=True, timeout=WAIT_S * 2)
        assert added.returncode == 0, added.stderr
        late = dataclasses.replace(NatsAuth.from_file(json.loads(added.stdout)["engine.late"]), tls_ca=files["tls-ca"],
                                   auth_retry_secs=0)
        nc = await bus.connect(f"tls://127.0.0.1:{port}", "test-late", late, allow_reconnect=False)
        await nc.close()
    finally:
        server.terminate()
        server.wait(WAIT_S)


async def test_a_tls_local_mesh_serves_its_stores_over_tls_only(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvmesh up --tls`'s mesh (LocalMesh(tls=True)): its NATS and a remote store's stream take TLS only; its disk
    and remote stores join over TLS; a client with the mesh's CA puts and gets through the remote store, one
    without it is refused."""
    from kvmesh.shared import protocol
    from kvmesh.shared.ops.local_mesh import LocalMesh
    from kvmesh.shared.ops.store_commands import disk_store, remote_stores
    from kvmesh.shared.tls import client_context
    monkeypatch.setenv("KVMESH_RUNTIME_DIR", str(tmp_path / "run"))
    # every service answers health over the TLS-only NATS before start() returns: a disk store and a remote store
    mesh = LocalMesh([disk_store(tmp_path / "disk", 8 * MiB, "disk-tls-test", "LRU"),
                      *remote_stores(8 * MiB, 1, "LRU")], tls=True)
    await asyncio.to_thread(mesh.start)
    try:
        assert mesh.nats_url is not None and mesh.nats_url.startswith("tls://")
        ca = mesh.tls_files["nats"].ca
        engine = protocol.Principal.engine("tls-test")
        auth = mesh.auth(engine)  # an engine's own user, added to the running NATS (its reload confirmed over TLS)
        assert auth is not None and auth.tls_ca == str(ca)
        nc = await bus.connect(mesh.nats_url, "test-mesh-tls", auth, allow_reconnect=False)
        client = RemoteStoreClient(nc, ["remote-0"], engine.producer("w0"), request_timeout=WAIT_S,
                                   tls=client_context(ca))
        try:
            meta, data = chunk(2 * MiB + 3, 5)
            assert await client.put(meta, ChunkBuffer(memoryview(data)))
            out = np.zeros(meta.nbytes, dtype=np.uint8)
            got = await client.get_into(meta.key, ChunkBuffer(memoryview(out)))
            assert got is not None and np.array_equal(out, data)
            async with client._replicas[0].pool.connection(WAIT_S) as connection:
                assert connection.sock.version() in ("TLSv1.2", "TLSv1.3")  # the stream is TLS
        finally:
            await client.close()
            await nc.close()
        without_ca = dataclasses.replace(auth, tls_ca=None)
        with pytest.raises(MeshUnavailable, match="not signed by the trusted CA"):
            await bus.connect(mesh.nats_url, "test-mesh-plain", without_ca, allow_reconnect=False)
    finally:
        await asyncio.to_thread(mesh.stop)


async def test_a_client_reconnecting_to_a_server_of_another_ca_refuses_it_and_still_closes(
        material: TlsMaterial, tmp_path: Path) -> None:
    """The server comes back on its port with a certificate another CA signed: every reconnect fails its handshake
    (nothing is sent to it), and closing the client then returns (a failed TLS upgrade leaves nats-py a stream
    whose close would otherwise never finish)."""
    from kvmesh.shared.tls import is_tls_error
    from support.waiting import wait_until_async
    impostor_files = TlsMaterial(tmp_path / "other").ensure(["nats"], hosts=["127.0.0.1"])["nats"]
    server = EmbeddedNats(token=TOKEN, tls=material.files("nats")).start()
    nc = await bus.connect(server.url, "test-reconnect", NatsAuth(token=TOKEN, tls_ca=str(material.ca)))
    impostor = None
    try:
        port = server.port
        server.stop()
        impostor = EmbeddedNats(port=port, token=TOKEN, tls=impostor_files).start()
        await wait_until_async(lambda: nc.last_error is not None and is_tls_error(nc.last_error),
                               what="a reconnect refusing the impostor's certificate")
        assert not nc.is_connected
    finally:
        await asyncio.wait_for(nc.close(), WAIT_S)
        if impostor is not None:
            impostor.stop()
