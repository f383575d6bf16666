"""`kvmesh pd-proxy` holds its bounds (issue 36, finding 4): a real proxy process (`python -m kvmesh.cli pd-proxy`),
real HTTP. Its producer and consumer are ports where no vLLM listens (so every request that gets through ends in
a 502 naming the consumer), or, for a producer that answers what no vLLM would, a plain HTTP server here that
answers a JSON list. Peak memory is the proxy's own VmHWM from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import pytest

from kvmesh.shared.messaging.embedded_nats import free_port

from support.processes import peak_rss_mib
from support.waiting import WAIT_S, wait_until_async

PEAK_RSS_MIB = 512  # docs/config.md, --max-large-bodies: 24 concurrent 11 MiB bodies stay under this


@contextlib.asynccontextmanager
async def proxy(producer: str, consumer: str, *flags: str, env: dict[str, str] | None = None,
                scheme: str = "http", verify: ssl.SSLContext | bool = True
                ) -> AsyncIterator[tuple[subprocess.Popen[bytes], httpx.AsyncClient]]:
    """A `kvmesh pd-proxy` process in front of `producer` and `consumer`, and a client of it (`scheme`, verifying
    with `verify`); stopped after."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "pd-proxy", "--prefill", producer, "--decode", consumer,
         "--port", str(port), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "KVMESH_PD_PROXY_TOKEN": "", "KVMESH_PD_PROXY_TOKEN_FILE": "", **(env or {})})
    try:
        async with httpx.AsyncClient(base_url=f"{scheme}://127.0.0.1:{port}", timeout=WAIT_S * 4,
                                     verify=verify) as client:
            async def up() -> bool:
                assert process.poll() is None, f"the proxy exited: {process.stdout.read().decode()}"  # type: ignore
                try:
                    return (await client.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False
            await wait_until_async(up, what="the pd-proxy serving")
            yield process, client
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.stdout is not None
        process.stdout.close()


def nowhere() -> str:
    """A loopback URL where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc")
async def test_24_concurrent_large_bodies_keep_the_proxy_under_its_memory_bound() -> None:
    """24 clients each send an 11 MiB completion request (a prompt of 1.2M token ids) at once, at the default
    bounds. Every body used to be read and parsed at once (82 -> 1,080 MiB); now two at a time, the rest wait
    unread, and each is answered (502: no consumer listens)."""
    body = json.dumps({"model": "m", "prompt": list(range(10_000_000, 11_200_000)), "max_tokens": 4}).encode()
    assert len(body) > 11 * 2**20
    async with proxy(nowhere(), nowhere()) as (process, client):
        before = peak_rss_mib(process.pid)
        responses = await asyncio.gather(*(client.post("/v1/completions", content=body,
                                                       headers={"content-type": "application/json"})
                                           for _ in range(24)))
        peak = peak_rss_mib(process.pid)
        assert peak < PEAK_RSS_MIB, f"peak RSS {peak:.0f} MiB (before the flood {before:.0f} MiB)"
        assert [r.status_code for r in responses] == [502] * 24, [r.text[:200] for r in responses]
        assert all("decode at" in r.json()["detail"] for r in responses)
        assert (await client.get("/healthz")).json()["requests"] == 24


class ListProducer(http.server.BaseHTTPRequestHandler):
    """A producer whose answer is a JSON list (no vLLM answers that; a broken or hostile one might)."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        payload = b"[1, 2, 3]"
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def list_producer() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ListProducer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_bad_json_is_a_400_or_422_naming_it_and_a_producer_answer_that_is_no_object_falls_back() -> None:
    with list_producer() as producer:
        async with proxy(producer, nowhere()) as (_, client):
            deep = b'{"model": "m", "prompt": ' + b"[" * 1000 + b"1" + b"]" * 1000 + b"}"
            nested = await client.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
            assert nested.status_code == 422, nested.text
            (problem,) = nested.json()["detail"]
            assert problem["loc"] == ["body", "prompt"] and "nested deeper than 128 levels" in problem["msg"]
            broken = await client.post("/v1/completions", content=b'{"prompt": "hi",',
                                       headers={"content-type": "application/json"})
            assert broken.status_code == 400 and "not JSON" in broken.json()["detail"], broken.text

            # the producer's answer is a list: no kv_transfer_params, so the consumer computes the prompt (it is
            # not there: a 502 naming it, never a 500)
            answered = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert answered.status_code == 502 and "decode at" in answered.json()["detail"], answered.text
            health = (await client.get("/healthz")).json()
            assert health["prefill_failures"] == 1 and health["decode_failures"] == 1


async def test_a_token_is_required_when_set(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o600)
    async with proxy(nowhere(), nowhere(), "--auth-token-file", str(token_file)) as (_, client):
        body = {"model": "m", "prompt": "hi"}
        refused = await client.post("/v1/completions", json=body)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        wrong = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert (await client.get("/v1/models")).status_code == 401
        let_in = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret-token"})
        assert let_in.status_code == 502, let_in.text  # through the gate; no vLLM behind it
        assert (await client.get("/healthz")).status_code == 200  # open, for liveness probes
