"""shared/tls.py: the CA and certificates it makes verify with the contexts it builds, over real loopback sockets;
another CA, a plaintext peer and a key open to others are refused, each saying why; a server's certificate rotated
on disk serves its new connections, and a rotated pair that cannot serve keeps the last good one."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path

import pytest

from kvmesh.shared.errors import ConfigError
from kvmesh.shared.tls import TlsMaterial, client_context, describe_tls_error, server_context

from support.tls import der, reissue, served_certificate


async def echo_server(context: ssl.SSLContext | None) -> tuple[asyncio.AbstractServer, int, list[BaseException]]:
    """A loopback server that echoes one line (in clear, it greets first); the errors its handshakes met."""
    errors: list[BaseException] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if context is None:  # a plaintext server that speaks first, as NATS does
                writer.write(b"INFO {}\r\n")
            writer.write(await reader.readline())
            await writer.drain()
        except (ssl.SSLError, ConnectionError) as exc:
            errors.append(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1], errors


def test_material_is_private_and_kept(tmp_path: Path) -> None:
    material = TlsMaterial(tmp_path / "tls")
    made = material.ensure(["remote-store"], hosts=["127.0.0.1"])
    files = made["remote-store"]
    assert (tmp_path / "tls").stat().st_mode & 0o777 == 0o700
    assert files.key is not None and files.key.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "tls" / "ca.key").stat().st_mode & 0o777 == 0o600
    ca_before = material.ca.read_bytes()
    material.ensure(["remote-store", "nats"], hosts=["127.0.0.1"])
    assert material.ca.read_bytes() == ca_before  # clients keep trusting it
    assert files.cert is not None and files.cert.read_bytes() == made["remote-store"].cert.read_bytes()


async def test_a_client_trusting_the_ca_talks_tls_1_2_or_later(tmp_path: Path) -> None:
    files = TlsMaterial(tmp_path / "tls").ensure(["remote-store"], hosts=["127.0.0.1"])["remote-store"]
    server, port, _ = await echo_server(server_context(files.cert, files.key))
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context(files.ca))
        writer.write(b"hello\n")
        assert await reader.readline() == b"hello\n"
        assert writer.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
        writer.close()


async def test_a_certificate_from_another_ca_is_refused(tmp_path: Path) -> None:
    files = TlsMaterial(tmp_path / "ours").ensure(["remote-store"], hosts=["127.0.0.1"])["remote-store"]
    other_ca = TlsMaterial(tmp_path / "theirs").ensure(["remote-store"], hosts=["127.0.0.1"])["remote-store"].ca
    server, port, _ = await echo_server(server_context(files.cert, files.key))
    async with server:
        with pytest.raises(ssl.SSLCertVerificationError) as refused:
            await asyncio.open_connection("127.0.0.1", port, ssl=client_context(other_ca))
    assert "not signed by the trusted CA" in describe_tls_error(refused.value)


async def test_a_host_the_certificate_does_not_name_is_refused(tmp_path: Path) -> None:
    files = TlsMaterial(tmp_path / "tls").ensure(["remote-store"], hosts=["example.invalid"])["remote-store"]
    server, port, _ = await echo_server(server_context(files.cert, files.key))
    async with server:
        with pytest.raises(ssl.SSLCertVerificationError) as refused:
            await asyncio.open_connection("127.0.0.1", port, ssl=client_context(files.ca))
    assert "does not name the host" in describe_tls_error(refused.value)


async def test_plaintext_on_either_side_is_refused(tmp_path: Path) -> None:
    files = TlsMaterial(tmp_path / "tls").ensure(["remote-store"], hosts=["127.0.0.1"])["remote-store"]
    # a TLS client on a plaintext port
    server, port, _ = await echo_server(None)
    async with server:
        with pytest.raises(ssl.SSLError) as refused:
            await asyncio.open_connection("127.0.0.1", port, ssl=client_context(files.ca))
    assert "does not speak TLS" in describe_tls_error(refused.value)
    # a plaintext client on a TLS port: the server drops it without serving it
    server, port, errors = await echo_server(server_context(files.cert, files.key))
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello\n")
        assert await reader.read() == b""  # closed, nothing echoed
        writer.close()
    assert errors == []  # the handler never ran: the handshake failed before it


def test_files_that_cannot_work_are_config_errors_naming_them(tmp_path: Path) -> None:
    files = TlsMaterial(tmp_path / "tls").ensure(["nats"], hosts=["127.0.0.1"])["nats"]
    assert files.key is not None
    os.chmod(files.key, 0o644)
    with pytest.raises(ConfigError, match=f"{files.key} is readable by other users"):
        server_context(files.cert, files.key)
    with pytest.raises(ConfigError, match="no-such.pem: no such file"):
        client_context(tmp_path / "no-such.pem")
    with pytest.raises(ConfigError, match="not a PEM certificate"):
        client_context(files.key)


@pytest.fixture
def tls_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(logging.getLogger("kvmesh"), "propagate", True)  # the connector's logging turns it off
    caplog.set_level(logging.INFO, logger="kvmesh.shared.tls")
    return caplog


async def test_a_rotated_certificate_serves_new_connections_and_those_up_carry_on(
        tmp_path: Path, tls_log: pytest.LogCaptureFixture) -> None:
    material = TlsMaterial(tmp_path / "tls")
    files = material.ensure(["remote-store"], hosts=["127.0.0.1"])["remote-store"]
    assert files.cert is not None
    first = der(files.cert)
    server, port, errors = await echo_server(server_context(files.cert, files.key))
    async with server:
        assert await served_certificate(port, material.ca) == first
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context(material.ca))
        second = reissue(material, "remote-store", ["127.0.0.1"])  # a new key and certificate, the same CA
        assert second != first
        assert await served_certificate(port, material.ca) == second
        assert await served_certificate(port, material.ca) == second
        # the connection made before goes on with the certificate it was served
        assert writer.get_extra_info("ssl_object").getpeercert(binary_form=True) == first
        writer.write(b"still here\n")
        assert await reader.readline() == b"still here\n"
        writer.close()
    assert errors == []
    reloads = [r for r in tls_log.records if "changed: new connections get it" in r.getMessage()]
    assert len(reloads) == 1  # read once per change, not at every connection


async def test_a_rotated_pair_that_cannot_serve_keeps_the_last_good_one_and_says_why(
        tmp_path: Path, tls_log: pytest.LogCaptureFixture) -> None:
    material = TlsMaterial(tmp_path / "tls")
    files = material.ensure(["remote-store", "engine"], hosts=["127.0.0.1"])["remote-store"]
    assert files.cert is not None and files.key is not None
    good = der(files.cert)
    server, port, _ = await echo_server(server_context(files.cert, files.key))
    good_key = files.key.read_bytes()
    other_key = material.files("engine").key
    assert other_key is not None

    def write(path: Path, data: bytes, mode: int = 0o600) -> None:
        temporary = path.with_name(path.name + ".new")
        temporary.write_bytes(data)
        os.chmod(temporary, mode)
        os.replace(temporary, path)

    async with server:
        bad_pairs = ((lambda: write(files.key, other_key.read_bytes()), "KEY_VALUES_MISMATCH"),  # another cert's key
                     (lambda: write(files.key, good_key, mode=0o644), "readable by other users"),
                     (lambda: write(files.cert, b"not a certificate\n", mode=0o644), "PEM lib"))
        for change, why in bad_pairs:
            tls_log.clear()
            change()
            assert await served_certificate(port, material.ca) == good
            refused = [r for r in tls_log.records if r.levelno == logging.WARNING]
            assert len(refused) == 1 and why in refused[0].getMessage(), [r.getMessage() for r in refused]
            assert "keep getting the certificate loaded before" in refused[0].getMessage()
            assert await served_certificate(port, material.ca) == good
            assert len([r for r in tls_log.records if r.levelno == logging.WARNING]) == 1  # once per change
            write(files.key, good_key)
        # a good pair again is taken at the next connection
        reissued = reissue(material, "remote-store", ["127.0.0.1"])
        assert await served_certificate(port, material.ca) == reissued
