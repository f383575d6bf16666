"""`kvmesh up`: every service starts and answers health over NATS; SIGTERM stops all of it, each service on its
own SIGTERM (none needed the SIGKILL that follows a service's grace period). A service that dies is restarted
while the rest keep running (`--no-restart`: the mesh stops instead)."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from kvmesh.shared.messaging import bus
from kvmesh.shared.messaging.credentials import credentials_for
from kvmesh.shared.messaging.embedded_nats import free_port
from kvmesh.shared.ops.service import ping_all
from kvmesh.shared.ops.store_commands import disk_store, remote_stores
from kvmesh.shared.protocol import OPERATOR

from support.processes import pid_alive, wait_dead
from support.waiting import WAIT_S, wait_until_async


async def health_of_all(url: str, expect: int) -> list:
    nc = await bus.connect(url, name="test-health", auth=credentials_for(url, OPERATOR, None))

    async def replies() -> list | None:
        answered = await ping_all(nc, wait=0.5)
        return answered if len(answered) >= expect else None

    try:
        return await wait_until_async(replies, what=f"{expect} services answering health")
    finally:
        await nc.close()


@contextlib.contextmanager
def kvmesh_up(tmp_path: Path, nats_port: int, http_port: int, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """`kvmesh up` on these ports (a small disk and remote store unless `flags` say otherwise), its own log in
    tmp_path/up.stderr; killed at the end if the test left it running."""
    command = [sys.executable, "-m", "kvmesh.cli", "up", "--nats-port", str(nats_port),
               "--port", str(http_port), "--host", "127.0.0.1", "--disk-dir", str(tmp_path / "disk"),
               "--disk-size", "0.1", "--remote-size", "0.1", "--log-dir", str(tmp_path / "logs"), *flags]
    with open(tmp_path / "up.stderr", "w+") as stderr:
        up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=tmp_path)
        try:
            yield up
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()


def test_up_health_and_clean_stop(tmp_path: Path) -> None:
    nats_port, http_port = free_port(), free_port()
    with kvmesh_up(tmp_path, nats_port, http_port) as up:
        line = up.stdout.readline()
        assert line, f"kvmesh up printed nothing; logs: {list((tmp_path / 'logs').glob('*'))}"
        info = json.loads(line)
        replies = asyncio.run(health_of_all(info["nats_url"], expect=3))
        assert sorted(r.service for r in replies) == ["controller", "disk_store", "remote_store"], replies
        pids = [r.details["pid"] for r in replies]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=WAIT_S) == 0
        log = (tmp_path / "up.stderr").read_text()
        assert "mesh stopped" in log and "did not stop on SIGTERM" not in log, log
        for pid in pids:
            assert wait_dead(pid), f"service pid {pid} left running"
        with pytest.raises(OSError):  # the embedded NATS is gone too
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()


def test_up_restarts_a_killed_store_and_keeps_the_rest_running(tmp_path: Path) -> None:
    """SIGKILL the disk store: `kvmesh up` logs it and starts a new one (a new pid answers health) while the
    controller's REST API keeps answering; SIGTERM then stops everything, the restarted store included."""
    nats_port, http_port = free_port(), free_port()
    healthz = f"http://127.0.0.1:{http_port}/healthz"
    with kvmesh_up(tmp_path, nats_port, http_port) as up:
        url = json.loads(up.stdout.readline())["nats_url"]
        pids = {r.service: r.details["pid"] for r in asyncio.run(health_of_all(url, expect=3))}
        killed = pids["disk_store"]
        os.kill(killed, signal.SIGKILL)

        async def wait_for_restart() -> int:
            nc = await bus.connect(url, name="test-restart", auth=credentials_for(url, OPERATOR, None))

            async def restarted_store() -> int | None:
                with urllib.request.urlopen(healthz, timeout=5) as response:  # the controller stays up throughout
                    assert response.status == 200
                replies = await ping_all(nc, wait=0.5)
                return next((r.details["pid"] for r in replies
                             if r.service == "disk_store" and r.details["pid"] != killed), None)

            try:
                return await wait_until_async(restarted_store, what="the disk store answering with a new pid")
            finally:
                await nc.close()

        new_pid = asyncio.run(wait_for_restart())
        assert not pid_alive(killed) and up.poll() is None
        assert pid_alive(pids["controller"]) and pid_alive(pids["remote_store"])  # the others kept running
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=WAIT_S) == 0
        log = (tmp_path / "up.stderr").read_text()
        assert f"(pid {killed}) was killed by SIGKILL; restarting it in" in log, log
        assert f"(pid {new_pid})" in log and "mesh stopped" in log, log
        for pid in [new_pid, pids["controller"], pids["remote_store"]]:
            assert wait_dead(pid), f"service pid {pid} left running"


def test_up_no_restart_stops_the_mesh_when_a_service_dies(tmp_path: Path) -> None:
    nats_port, http_port = free_port(), free_port()
    with kvmesh_up(tmp_path, nats_port, http_port, "--no-disk", "--no-remote", "--no-restart") as up:
        url = json.loads(up.stdout.readline())["nats_url"]
        [controller] = asyncio.run(health_of_all(url, expect=1))
        os.kill(controller.details["pid"], signal.SIGKILL)
        assert up.wait(timeout=WAIT_S) == 0
        log = (tmp_path / "up.stderr").read_text()
        assert "was killed by SIGKILL" in log and "stopping the mesh (--no-restart)" in log, log
        assert "restarted" not in log, log
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", nats_port), timeout=1).close()


def test_up_rejects_a_zero_restart_backoff() -> None:
    from kvmesh.cli import build_parser, cmd_up

    for flags in (["--restart-backoff", "0"], ["--restart-backoff", "5", "--restart-backoff-max", "2"]):
        with pytest.raises(SystemExit, match="--restart-backoff"):
            cmd_up(build_parser().parse_args(["up", *flags]))


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


def test_up_passes_the_liveness_timeout_to_the_controller() -> None:
    from kvmesh.cli import build_parser, mesh_services
    from kvmesh.services.controller.config import parse_args

    def liveness(*flags: str) -> float:
        (controller,) = [s for s in mesh_services(build_parser().parse_args(["up", *flags])) if s.role == "controller"]
        return parse_args(controller.args).liveness_timeout_s

    assert liveness() == 6.0
    assert liveness("--liveness-timeout", "120") == 120.0


def test_up_passes_the_kv_event_stream_options_to_the_controller() -> None:
    from kvmesh.cli import build_parser, mesh_services
    from kvmesh.services.controller.config import parse_args

    def ports(*flags: str) -> tuple[int | None, int | None, int]:
        (controller,) = [s for s in mesh_services(build_parser().parse_args(["up", *flags])) if s.role == "controller"]
        config = parse_args(controller.args)
        return config.kv_events_port, config.kv_events_replay_port, config.kv_events_chunks

    assert ports() == (None, None, 20_000)
    assert ports("--kv-events-port", "5557", "--kv-events-replay-port", "5558") == (5557, 5558, 20_000)
    assert ports("--kv-events-port", "5557", "--kv-events-chunks", "123") == (5557, None, 123)
    assert ports("--kv-events-port", "5557", "--kv-events-chunks", "0") == (5557, None, 0)


def test_store_options_round_trip_through_their_flags(tmp_path: Path) -> None:
    """One definition of each store's flags: what `to_args` writes, `options_from_args` reads back unchanged."""
    from kvmesh.services.disk_store import options as disk
    from kvmesh.services.remote_store import options as remote

    written = disk.DiskStoreOptions(root=Path(tmp_path / "d"), capacity_bytes=123_456_789, store_id="disk-x",
                                    cache_policy="LFU", fsync=False, writer_threads=2, reader_threads=3,
                                    staging_bytes=7 * 2**20)
    read = disk.options_from_args(disk.build_parser().parse_args(written.to_args()), environ={})
    assert read == written
    for options in (remote.RemoteStoreOptions(store_id=f"remote-{i}", capacity_bytes=987_654_321, partition=i,
                                              num_partitions=3, cache_policy="MRU") for i in range(3)):
        assert remote.options_from_args(remote.build_parser().parse_args(options.to_args())) == options
    # and what `kvmesh up` / the embedded mesh pass (shared/ops/store_commands.py) reads as the store's own options
    for i, spec in enumerate(remote_stores(987_654_321, 3, "MRU", prefault_bytes=2**20)):
        assert remote.options_from_args(remote.build_parser().parse_args(spec.args)) == remote.RemoteStoreOptions(
            store_id=spec.service_id, capacity_bytes=987_654_321, partition=i, num_partitions=3,
            cache_policy="MRU", prefault_bytes=2**20)
    spec = disk_store(tmp_path / "d", 123_456_789, "disk-x", "LFU")
    assert disk.options_from_args(disk.build_parser().parse_args(spec.args), environ={}) == disk.DiskStoreOptions(
        root=tmp_path / "d", capacity_bytes=123_456_789, store_id="disk-x", cache_policy="LFU")
