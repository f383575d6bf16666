"""`kvmesh pd-proxy` over TLS: served over HTTPS (--tls-cert / --tls-key) to a client trusting the CA, refused in
clear; its requests to https:// producers and consumers verified against --tls-ca, so an upstream whose certificate
another CA signed is refused (502 naming the reason) without its answer being used."""

from __future__ import annotations

import contextlib
import http.server
import json
import ssl
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from kvmesh.shared.tls import TlsMaterial, client_context, server_context

from support.waiting import WAIT_S
from test_pd_proxy_bounds import proxy


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    material = TlsMaterial(tmp_path_factory.mktemp("tls") / "tls")
    material.ensure(["pd-proxy", "engine"], hosts=["127.0.0.1"])
    return material


@contextlib.contextmanager
def https_vllm(name: str, context: ssl.SSLContext) -> Iterator[str]:
    """An HTTPS server answering every completion with `name` (a stand-in for a vLLM's OpenAI API)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = json.dumps({"choices": [{"text": name}], "kv_transfer_params": {"from": name}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(WAIT_S)


async def test_the_proxy_serves_https_and_verifies_its_vllms(material: TlsMaterial, tmp_path: Path) -> None:
    served = material.files("pd-proxy")
    upstream = material.files("engine")
    other = TlsMaterial(tmp_path / "other").ensure(["engine"], hosts=["127.0.0.1"])["engine"]
    with https_vllm("producer", server_context(upstream.cert, upstream.key)) as producer, \
            https_vllm("consumer", server_context(upstream.cert, upstream.key)) as consumer, \
            https_vllm("impostor", server_context(other.cert, other.key)) as impostor:
        flags = ("--tls-cert", str(served.cert), "--tls-key", str(served.key), "--tls-ca", str(material.ca))
        async with proxy(producer, consumer, *flags, scheme="https", verify=client_context(material.ca)) as (_, client):
            answer = await client.post("/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 4})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "consumer"
            assert (await client.get("/healthz")).json()["prefill_failures"] == 0
            plain = str(client.base_url).replace("https://", "http://")
            async with httpx.AsyncClient(base_url=plain, timeout=WAIT_S) as clear:
                with pytest.raises(httpx.HTTPError):
                    await clear.get("/healthz")
        async with proxy(producer, impostor, *flags, scheme="https", verify=client_context(material.ca)) as (_, client):
            answer = await client.post("/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 4})
            assert answer.status_code == 502 and "CERTIFICATE_VERIFY_FAILED" in answer.json()["detail"]


def test_tls_flags_that_cannot_work_are_errors_naming_them(material: TlsMaterial,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from kvmesh.services.pd_proxy.__main__ import parse_args
    base = ["--prefill", "https://p:1", "--decode", "https://d:2"]
    for flags, message in ((["--tls-key", str(material.files("pd-proxy").key)], "--tls-cert and --tls-key go together"),
                           (["--tls-ca", "/nonexistent-ca.pem"], "--tls-ca: TLS CA file /nonexistent-ca.pem: no such")):
        with pytest.raises(SystemExit):
            parse_args(base + flags)
        assert message in capsys.readouterr().err
