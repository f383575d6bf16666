"""`kvmesh up`: every service starts and answers health over NATS; SIGTERM stops all of it within 5 s."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.shared import bus
from kvmesh.shared.embedded_nats import free_port
from kvmesh.shared.service import ping_all

from processes import wait_dead


async def health_of_all(url: str, expect: int, timeout: float = 30.0) -> list:
    nc = await bus.connect(url, name="test-health")
    try:
        deadline = time.monotonic() + timeout
        while True:
            replies = await ping_all(nc, wait=0.5)
            if len(replies) >= expect or time.monotonic() > deadline:
                return replies
    finally:
        await nc.close()


def test_up_health_and_clean_stop(tmp_path: Path) -> None:
    nats_port, http_port = free_port(), free_port()
    command = [sys.executable, "-m", "kvmesh.cli", "up", "--nats-port", str(nats_port),
               "--port", str(http_port), "--host", "127.0.0.1", "--disk-dir", str(tmp_path / "disk"),
               "--disk-size", "0.1", "--remote-size", "0.1", "--log-dir", str(tmp_path / "logs")]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = up.stdout.readline()
        assert line, f"kvmesh up printed nothing; logs: {list((tmp_path / 'logs').glob('*'))}"
        info = json.loads(line)
        replies = asyncio.run(health_of_all(info["nats_url"], expect=3))
        assert sorted(r.service for r in replies) == ["controller", "disk_store", "remote_store"], replies
        pids = [r.details["pid"] for r in replies]
        started = time.monotonic()
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=5) == 0
        assert time.monotonic() - started < 5
        for pid in pids:
            assert wait_dead(pid), f"service pid {pid} left running"
        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_up_passes_the_cache_policy_to_both_stores() -> None:
    from kvmesh.cli import build_parser, mesh_services

    def policies(*flags: str) -> dict[str, list[str]]:
        services = mesh_services(build_parser().parse_args(["up", *flags]))
        return {s.module.rsplit(".", 1)[1]: s.args[s.args.index("--cache-policy") + 1:][:1]
                for s in services if "--cache-policy" in s.args}

    assert policies() == {"disk_store": ["LRU"], "remote_store": ["LRU"]}
    assert policies("--cache-policy", "lfu") == {"disk_store": ["LFU"], "remote_store": ["LFU"]}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--cache-policy", "arc"])
