"""The controller's REST API over HTTPS (--tls-cert / --tls-key): a client trusting the CA is served; a plaintext
HTTP client and a client trusting another CA are refused; the flags that cannot work are errors naming them; a
certificate rotated on disk serves new connections while a client's open connection goes on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvmesh.shared.tls import TlsMaterial, client_context

from support.controller import running_controller
from support.tls import der, reissue, served_certificate
from support.waiting import WAIT_S


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    material = TlsMaterial(tmp_path_factory.mktemp("tls") / "tls")
    material.ensure(["controller"], hosts=["127.0.0.1"])
    return material


async def test_the_api_serves_https_to_a_client_trusting_the_ca_only(nats_server, material: TlsMaterial,
                                                                     tmp_path: Path) -> None:
    files = material.files("controller")
    async with running_controller(nats_server.url, tls_cert=files.cert, tls_key=files.key) as (service, _):
        assert service.url.startswith("https://")
        async with httpx.AsyncClient(base_url=service.url, timeout=WAIT_S,
                                     verify=client_context(material.ca)) as client:
            health = await client.get("/healthz")
            assert health.status_code == 200 and health.json()["nats_connected"]
        plain = service.url.replace("https://", "http://")
        async with httpx.AsyncClient(base_url=plain, timeout=WAIT_S) as client:
            with pytest.raises(httpx.HTTPError):  # the server takes the request for a failed handshake
                await client.get("/healthz")
        other = TlsMaterial(tmp_path / "other").ensure(["controller"], hosts=["127.0.0.1"])["controller"].ca
        async with httpx.AsyncClient(base_url=service.url, timeout=WAIT_S, verify=client_context(other)) as client:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get("/healthz")


async def test_a_rotated_certificate_serves_new_connections(nats_server, tmp_path: Path) -> None:
    material = TlsMaterial(tmp_path / "tls")
    files = material.ensure(["controller"], hosts=["127.0.0.1"])["controller"]
    assert files.cert is not None
    async with running_controller(nats_server.url, tls_cert=files.cert, tls_key=files.key) as (service, _):
        async with httpx.AsyncClient(base_url=service.url, timeout=WAIT_S,
                                     verify=client_context(material.ca)) as client:
            assert (await client.get("/healthz")).status_code == 200  # a kept-alive connection from here
            assert await served_certificate(service.port, material.ca) == der(files.cert)
            rotated = reissue(material, "controller", ["127.0.0.1"])
            assert await served_certificate(service.port, material.ca) == rotated
            assert (await client.get("/healthz")).status_code == 200


def test_tls_flags_that_cannot_work_are_errors_naming_them(material: TlsMaterial) -> None:
    files = material.files("controller")
    for flags, message in ((["--tls-cert", str(files.cert)], "--tls-cert and --tls-key go together"),
                           (["--tls-cert", "/nonexistent.pem", "--tls-key", str(files.key)],
                            "--tls-cert: TLS certificate /nonexistent.pem: no such file")):
        result = subprocess.run([sys.executable, "-m", "kvmesh.services.controller", *flags], capture_output=True,
                                text=True, timeout=WAIT_S)
        assert result.returncode == 2 and message in result.stderr, result.stderr
