"""Certificate rotation in tests: a new certificate from the same CA moved over a service's files as an operator's
rotation does (`reissue`), and the certificate a TLS server serves a new connection (`served_certificate`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
from pathlib import Path

from kvmesh.shared.tls import TlsMaterial, client_context


def der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def reissue(material: TlsMaterial, service: str, hosts: list[str]) -> bytes:
    """A new key and certificate for `service`, signed by `material`'s CA, each moved over the old file in one
    rename (key first); the new certificate (DER)."""
    fresh = TlsMaterial(material.root.parent / f"reissued-{os.urandom(4).hex()}")
    fresh.root.mkdir(mode=0o700)
    shutil.copy2(material.ca, fresh.ca)
    shutil.copy2(material.root / "ca.key", fresh.root / "ca.key")
    made = fresh.ensure([service], hosts)[service]
    live = material.files(service)
    assert made.cert and made.key and live.cert and live.key
    os.replace(made.key, live.key)
    os.replace(made.cert, live.cert)
    return der(live.cert)


async def served_certificate(port: int, ca: Path, host: str = "127.0.0.1") -> bytes:
    """The certificate (DER) a TLS server on `port` presents to a new connection that trusts `ca`."""
    _, writer = await asyncio.open_connection(host, port, ssl=client_context(ca))
    try:
        served = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        assert served is not None
        return served
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
