"""The controller's REST API closed beyond loopback, and request bodies bounded before parsing (issue 24, finding 3).

Real controller processes (`python -m kvmesh.services.controller`) with their embedded NATS, bound to this
machine's non-loopback address (0.0.0.0 where it has none), httpx over real HTTP; the flood's worker is a real
NATS client registered as an engine worker that never answers, so each /pin holds its token list until the
command times out, as behind a stalled engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import pytest

from kvmesh.shared import protocol

from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.embedded_nats import free_port
from kvmesh.shared.protocol import LOCAL_CPU, Subjects

from support.controller import RawProducer
from support.processes import peak_rss_mib
from support.waiting import WAIT_S, wait_until_async

# The documented bound (docs/config.md, --max-large-bodies): 24 concurrent 1,000,000-token /pin bodies keep the
# controller's peak RSS under this at the default settings (about 80 MiB of its own, 80 MiB per large body).
FLOOD_PEAK_RSS_MIB = 512


def stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM a process we started, SIGKILL it if it outlives WAIT_S, and close its output."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    if process.stdout:
        process.stdout.close()


def _outside_address() -> str:
    """An address of this machine that is not loopback (the one a default route leaves from), else 0.0.0.0."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = probe.getsockname()[0]
        except OSError:
            return "0.0.0.0"
    return "0.0.0.0" if address.startswith("127.") or address == "0.0.0.0" else address


HOST = _outside_address()
CLIENT_HOST = "127.0.0.1" if HOST == "0.0.0.0" else HOST


@contextlib.contextmanager
def controller_process(*flags: str, env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    """A controller process on HOST (REST port, embedded NATS port), output collected; killed at the end."""
    port, nats_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.services.controller", "--port", str(port), "--monitor-port", str(nats_port),
         *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        yield process, port, nats_port
    finally:
        stop(process)


def _output(process: subprocess.Popen[bytes]) -> str:
    assert process.stdout is not None
    return process.stdout.read().decode(errors="replace")


async def _wait_serving(process: subprocess.Popen[bytes], client: httpx.AsyncClient) -> None:
    async def up() -> bool:
        assert process.poll() is None, f"the controller exited: {_output(process)}"
        try:
            return (await client.get("/healthz")).status_code == 200
        except httpx.TransportError:
            return False
    await wait_until_async(up, what="the controller serving")


async def _wait_exit(process: subprocess.Popen[bytes]) -> int:
    await wait_until_async(lambda: process.poll() is not None, what="the controller to exit")
    return process.returncode


@contextlib.asynccontextmanager
async def serving(host: str, *flags: str, env: dict[str, str] | None = None
                  ) -> AsyncIterator[tuple[subprocess.Popen[bytes], httpx.AsyncClient, int]]:
    """A controller process serving on `host` (with `flags`), and a client of its REST API."""
    with controller_process("--host", host, *flags, env=env) as (process, port, nats_port):
        client_host = CLIENT_HOST if host == HOST else host
        async with httpx.AsyncClient(base_url=f"http://{client_host}:{port}", timeout=WAIT_S * 4) as client:
            await _wait_serving(process, client)
            yield process, client, nats_port


# ---- no token beyond loopback: no start ----------------------------------------------------------------------------
async def test_a_controller_beyond_loopback_without_a_token_does_not_start_and_says_why(tmp_path: Path) -> None:
    env = {"KVMESH_CONTROLLER_TOKEN": "", "KVMESH_CONTROLLER_TOKEN_FILE": ""}
    with controller_process("--host", HOST, env=env) as (process, port, _):
        assert await _wait_exit(process) != 0
        said = _output(process)
    assert "--auth-token-file" in said and "$KVMESH_CONTROLLER_TOKEN" in said and "--insecure-no-auth" in said, said
    assert HOST in said and "beyond loopback" in said, said
    with pytest.raises(httpx.TransportError):  # nothing ever listened
        httpx.get(f"http://{CLIENT_HOST}:{port}/healthz", timeout=5)

    # LMCache's controller YAML names the host: the same rule.
    config = tmp_path / "controller.yaml"
    config.write_text(f"controller_host: {HOST}\n")
    with controller_process("--config", str(config), env=env) as (process, _, _):
        assert await _wait_exit(process) != 0
        said = _output(process)
    assert "controller_host" in said and "--auth-token-file" in said, said


async def test_insecure_no_auth_starts_open_with_a_warning() -> None:
    async with serving(HOST, "--insecure-no-auth", "--log-level", "info",
                       env={"KVMESH_CONTROLLER_TOKEN": ""}) as (process, client, _):
        assert (await client.post("/lookup", json={"tokens": [1, 2, 3]})).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert await _wait_exit(process) == 0
        said = _output(process)
    warnings = [line for line in said.splitlines() if "--insecure-no-auth" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "no token" in warnings[0], said


# ---- with a token: every read endpoint needs it -----------------------------------------------------------------
READS = [("POST", "/lookup", {"tokens": [1, 2, 3]}), ("GET", "/metrics", None), ("GET", "/instances", None),
         ("POST", "/health", {"instance_id": "inst"}), ("POST", "/query_worker_info", {"instance_id": "all"}),
         ("POST", "/query_instance", {"ip": "127.0.0.1"}), ("POST", "/check_finish", {"event_id": "x"})]


async def test_a_token_file_closes_every_read_endpoint(tmp_path: Path) -> None:
    token_file = tmp_path / "controller-token"
    token_file.write_text("t0k3n-from-a-file\n")
    token_file.chmod(0o600)
    async with serving(HOST, "--auth-token-file", str(token_file),
                       env={"KVMESH_CONTROLLER_TOKEN": ""}) as (_, client, _):
        for method, path, body in READS:
            refused = await client.request(method, path, json=body)
            assert refused.status_code == 401, (path, refused.text)
            wrong = await client.request(method, path, json=body, headers={"Authorization": "Bearer t0k3n"})
            assert wrong.status_code == 401, (path, wrong.text)
        bearer = {"Authorization": "Bearer t0k3n-from-a-file"}
        assert (await client.post("/lookup", json={"tokens": [1, 2, 3]}, headers=bearer)).status_code == 200
        assert (await client.get("/metrics", headers=bearer)).status_code == 200
        assert (await client.get("/instances", headers=bearer)).status_code == 200
        assert (await client.get("/healthz")).status_code == 200  # the liveness probe's, open by design


async def test_an_empty_token_file_is_an_error_naming_it(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    with controller_process("--host", HOST, "--auth-token-file", str(token_file)) as (process, _, _):
        assert await _wait_exit(process) != 0
        said = _output(process)
    assert f"--auth-token-file {token_file}" in said and "got an empty file" in said, said


# ---- nested or wrongly typed tokens: 422 naming the field -------------------------------------------------------
DEEP = "[" * 50_000 + "]" * 50_000
TOKEN_ENDPOINTS = [("/lookup", {}), ("/pin", {"instance_id": "inst", "location": LOCAL_CPU}),
                   ("/unpin", {"instance_id": "inst", "location": LOCAL_CPU}),
                   ("/move", {"old_position": ["inst", LOCAL_CPU], "new_position": ["inst", "LocalDiskBackend"]}),
                   ("/compress", {"instance_id": "inst", "method": "cachegen", "location": LOCAL_CPU})]


async def test_nested_or_wrongly_typed_tokens_are_a_422_naming_the_field() -> None:
    async with serving("127.0.0.1") as (process, client, _):
        for path, fields in TOKEN_ENDPOINTS:
            prefix = json.dumps(fields)[:-1] + (", " if fields else "")
            for tokens in (DEEP, "[[[[1]]]]", '"1 2 3"', '{"a": 1}', "[1, [2]]", '["1"]'):
                body = prefix + '"tokens": ' + tokens + "}"
                response = await client.post(path, content=body, headers={"content-type": "application/json"})
                assert response.status_code == 422, (path, tokens[:20], response.status_code, response.text[:300])
                assert any(error["loc"][:2] == ["body", "tokens"] for error in response.json()["detail"]), \
                    (path, tokens[:20], response.text[:300])
        # a deep value in another field is named as that field
        response = await client.post("/lookup", content='{"tokens": [1], "extra": ' + DEEP + "}",
                                     headers={"content-type": "application/json"})
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "extra"], response.text
        assert (await client.post("/lookup", json={"tokens": [1, 2, 3]})).status_code == 200  # still serving
        assert process.poll() is None


# ---- 24 concurrent 1M-token /pin bodies: a bounded peak RSS -----------------------------------------------------
class SilentWorker(RawProducer):
    """An engine worker that registers and takes its pin commands but never answers (a stalled engine)."""

    def __init__(self, nats_url: str, instance_id: str) -> None:
        super().__init__(nats_url, instance_id, chunk_size=256)
        self.commands = 0

    async def start(self, register: bool = True) -> "SilentWorker":
        await super().start(register=False)

        async def on_command(_msg: object) -> None:
            self.commands += 1

        await self.nc.subscribe(Subjects.worker(self.instance_id, self.worker_id, "pin"), cb=on_command)
        await self.nc.flush()
        await bus.publish(self.nc, Subjects.register(self.path), protocol.RegisterEngine(
            worker_id=self.worker_id, instance_id=self.instance_id, model="test-model", kv_format="bfloat16/test",
            world_size=1, rank=0, chunk_size=self.chunk_size, save_unfull_chunk=True, started_at=1.0))
        await self.publish_sync()
        return self


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc")
async def test_24_concurrent_million_token_pins_keep_the_controller_under_its_memory_bound() -> None:
    """At the default settings: --max-large-bodies (2) are read and served at once, the other 22 wait unread in
    --large-body-queue (32), and each admitted one holds its token list until the silent worker's command times
    out (--command-timeout, 5 s). A timed-out command used to leave its token list in a reference cycle (its
    exception, raised again from the frame holding it), freed only by a late cyclic GC: 843-1,176 MiB."""
    async with serving("127.0.0.1") as (process, client, nats_port):
        worker = await SilentWorker(f"nats://127.0.0.1:{nats_port}", "inst-flood").start()
        try:
            async def registered() -> bool:
                response = await client.post("/query_worker_info", json={"instance_id": "all"})
                return [info["instance_id"] for info in response.json()["worker_infos"]] == ["inst-flood"]
            await wait_until_async(registered, what="the silent worker registered")
            before = peak_rss_mib(process.pid)
            body = json.dumps({"instance_id": "inst-flood", "location": LOCAL_CPU,
                               "tokens": list(range(100_000, 1_100_000))}).encode()
            responses = await asyncio.gather(*(client.post("/pin", content=body,
                                                           headers={"content-type": "application/json"})
                                               for _ in range(24)))
            peak = peak_rss_mib(process.pid)
            assert peak < FLOOD_PEAK_RSS_MIB, f"peak RSS {peak:.0f} MiB (before the flood {before:.0f} MiB)"
            assert [r.status_code for r in responses] == [504] * 24, [r.text[:200] for r in responses]
            assert worker.commands == 24  # every body reached the worker in its turn, holding its list meanwhile
            assert (await client.post("/lookup", json={"tokens": [1, 2, 3]})).status_code == 200
        finally:
            await worker.nc.close()


async def test_past_the_queue_a_large_body_gets_503_with_retry_after() -> None:
    """With no queue, the bodies past --max-large-bodies (default 2) are refused at once, unread."""
    async with serving("127.0.0.1", "--command-timeout", "10", "--large-body-queue", "0") \
            as (process, client, nats_port):
        worker = await SilentWorker(f"nats://127.0.0.1:{nats_port}", "inst-flood").start()
        try:
            async def registered() -> bool:
                response = await client.post("/query_worker_info", json={"instance_id": "all"})
                return bool(response.json()["worker_infos"])
            await wait_until_async(registered, what="the silent worker registered")
            body = json.dumps({"instance_id": "inst-flood", "location": LOCAL_CPU,
                               "tokens": list(range(100_000, 1_100_000))}).encode()
            responses = await asyncio.gather(*(client.post("/pin", content=body,
                                                           headers={"content-type": "application/json"})
                                               for _ in range(8)))
            statuses = sorted(r.status_code for r in responses)
            assert set(statuses) <= {503, 504}, [r.text[:200] for r in responses]
            busy = [r for r in responses if r.status_code == 503]
            assert busy and all(r.headers.get("retry-after") == "1" for r in busy), statuses
            assert "--max-large-bodies" in busy[0].json()["detail"]
        finally:
            await worker.nc.close()


# ---- kvmesh up: a token beyond loopback, none on loopback -------------------------------------------------------
@contextlib.contextmanager
def kvmesh_up(tmp_path: Path, host: str) -> Iterator[tuple[dict, int]]:
    """`kvmesh up` with only its controller, its runtime directory in tmp_path; (the line it printed, REST port)."""
    port = free_port()
    env = {**os.environ, "KVMESH_RUNTIME_DIR": str(tmp_path / "run"), "KVMESH_CONTROLLER_TOKEN": "",
           "KVMESH_CONTROLLER_TOKEN_FILE": ""}
    up = subprocess.Popen([sys.executable, "-m", "kvmesh.cli", "up", "--host", host, "--port", str(port),
                           "--nats-port", str(free_port()), "--no-disk", "--no-remote"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path, env=env)
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        assert line, "kvmesh up printed nothing"
        yield json.loads(line), port
    finally:
        stop(up)


def test_kvmesh_up_beyond_loopback_makes_a_token_and_on_loopback_none(tmp_path: Path) -> None:
    with kvmesh_up(tmp_path, HOST) as (info, port):
        token_file = Path(info["controller_token_file"])
        assert token_file.parent.parent == tmp_path / "run" and token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        url = f"http://{CLIENT_HOST}:{port}/lookup"
        assert httpx.post(url, json={"tokens": [1, 2]}, timeout=WAIT_S).status_code == 401
        answer = httpx.post(url, json={"tokens": [1, 2]}, headers={"Authorization": f"Bearer {token}"}, timeout=WAIT_S)
        assert answer.status_code == 200, answer.text
    with kvmesh_up(tmp_path, "localhost") as (info, port):  # the quickstarts' curl: no token on loopback
        assert info["controller_token_file"] is None
        answer = httpx.post(f"http://localhost:{port}/lookup", json={"tokens": [1, 2]}, timeout=WAIT_S)
        assert answer.status_code == 200, answer.text
