"""LMCache's controller surface on the KVMesh controller: its command line flags (`--monitor-ports`, `--config`,
`--health-check-interval`, `--lmcache-worker-timeout`), its endpoints' JSON (/query_worker_info with "all",
/query_instance, /health error codes, /move within an instance (between instances: tests/engine/tiers/test_p2p.py), /compress /decompress as a clear 501), and
instance identity: replicas that keep the same lmcache_instance_id are reported, never merged.

Real parts: a real nats-server, the controller's real uvicorn (in-process, or the `python -m
kvmesh.services.controller` process for the command line), httpx over loopback, and fake engine workers that
speak the real protocol (test_controller.FakeEngineWorker).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvmesh.services.controller.config import parse_args
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats, free_port
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK

from support.controller import FakeEngineWorker, FakeStore, running_controller, started, wait_layout
from support.waiting import WAIT_S, wait_until_async

LMCACHE_WORKER_INFO = {"instance_id", "worker_id", "ip", "port", "peer_init_url", "registration_time",
                       "last_heartbeat_time"}


# ---------------------------------------------------------------------------------------------------------
# Flags


def test_monitor_ports_pull_is_the_nats_port_and_other_ports_are_named_in_a_warning() -> None:
    config = parse_args(["--monitor-ports", '{"pull": 8300, "reply": 8400, "heartbeat": 8500}'])
    assert config.monitor_port == 8300
    assert len(config.notices) == 1 and "heartbeat, reply ignored" in config.notices[0]
    assert parse_args(["--monitor-port", "8301"]).monitor_port == 8301 and parse_args([]).monitor_port == 9001
    assert parse_args(["--monitor-ports", '{"pull": 8302}']).notices == ()


@pytest.mark.parametrize("bad", ['{"reply": 8400}', "[8300]", '{"pull": "x"}', "{pull: 1}"])
def test_bad_monitor_ports_are_a_clear_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--monitor-ports", bad])
    assert "--monitor-ports" in capsys.readouterr().err


def test_lmcache_worker_timeout_is_the_producer_expiry() -> None:
    assert parse_args(["--lmcache-worker-timeout", "30"]).producer_expiry_s == 30.0
    assert parse_args([]).producer_expiry_s == 600.0
    both = parse_args(["--lmcache-worker-timeout", "30", "--producer-expiry-secs", "40"])
    assert both.producer_expiry_s == 40.0 and "lmcache_worker_timeout 30 ignored" in both.notices[0]


def test_health_check_interval_is_accepted_with_a_warning_saying_what_kvmesh_does() -> None:
    config = parse_args(["--health-check-interval", "5"])
    assert len(config.notices) == 1 and "heartbeat" in config.notices[0] and "--liveness-timeout" in config.notices[0]
    assert parse_args(["--health-check-interval", "-1"]).notices  # LMCache's "disabled": still said once


def test_config_file_keys_apply_unless_a_flag_is_given_and_unknown_keys_are_named(tmp_path: Path) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text("controller_host: 127.0.0.2\ncontroller_port: 9100\n"
                    "controller_monitor_ports: {pull: 8310, reply: 8410}\nlmcache_worker_timeout: 120\n"
                    "health_check_interval: 10\nextra_config: {a: 1}\nmystery_key: 3\n")
    config = parse_args(["--config", str(path)])
    assert (config.host, config.port, config.monitor_port, config.producer_expiry_s) == ("127.0.0.2", 9100, 8310, 120.0)
    ignored = [n for n in config.notices if "mean nothing" in n]
    assert len(ignored) == 1 and "extra_config, mystery_key" in ignored[0]
    assert any("reply ignored" in n for n in config.notices)
    assert any("health_check_interval=10" in n for n in config.notices)
    flags_win = parse_args(["--config", str(path), "--port", "9200", "--monitor-port", "8320"])
    assert (flags_win.host, flags_win.port, flags_win.monitor_port) == ("127.0.0.2", 9200, 8320)


@pytest.mark.parametrize(("text", "named"), [("controller_port: abc\n", "controller_port"),
                                             ("- a list\n", "mapping"), ("a: [unclosed\n", "YAML"),
                                             ("lmcache_worker_timeout: 0\n", "lmcache_worker_timeout")])
def test_bad_config_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                          named: str) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path)])
    assert named in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    assert "missing.yaml" in capsys.readouterr().err


async def test_lmcache_command_line_serves_and_warns_once_per_setting(tmp_path: Path) -> None:
    """LMCache's full command line starts the controller: NATS on the pull port, REST on --port, a WARNING for
    each setting that means nothing here."""
    port, pull = free_port(), free_port()
    config = tmp_path / "controller.yaml"
    config.write_text("lmcache_worker_timeout: 60\nextra_config: {}\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.services.controller", "--host", "127.0.0.1", "--port", str(port),
         "--monitor-ports", f'{{"pull": {pull}, "reply": {free_port()}}}', "--config", str(config),
         "--health-check-interval", "5", "--lmcache-worker-timeout", "30", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as client:
            async def up() -> bool:
                assert process.poll() is None
                try:
                    return (await client.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False
            await wait_until_async(up, what="the controller process")
            worker = FakeEngineWorker(f"nats://127.0.0.1:{pull}", "inst-p", incarnation="1-aa")  # NATS: the pull port
            async with started(worker):
                async def registered() -> bool:
                    response = await client.post("/query_worker_info", json={"instance_id": "all"})
                    return [i["worker_name"] for i in response.json()["worker_infos"]] == [worker.worker_id]
                await wait_until_async(registered, what="the worker registered through the pull port")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0
        output = process.stdout.read().decode() if process.stdout else ""
        for said in ("extra_config mean nothing", "reply ignored", "health_check_interval=5: ignored"):
            assert output.count(said) == 1, output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        if process.stdout:
            process.stdout.close()


# ---------------------------------------------------------------------------------------------------------
# Endpoints


async def test_query_worker_info_all_and_lmcache_fields(nats_server: EmbeddedNats) -> None:
    started_before = time.time()
    a = FakeEngineWorker(nats_server.url, "inst-a", incarnation="1-aa", host="host-a", ip="10.0.0.1")
    b0 = FakeEngineWorker(nats_server.url, "inst-b", world_size=2, rank=0, incarnation="2-bb", host="host-b",
                          ip="10.0.0.2")
    b1 = FakeEngineWorker(nats_server.url, "inst-b", world_size=2, rank=1, incarnation="3-cc", host="host-b",
                          ip="10.0.0.2")
    async with running_controller(nats_server.url) as (_, client), started(a, b0, b1):
        async def all_workers() -> list[dict]:
            response = await client.post("/query_worker_info", json={"instance_id": "all"})
            assert response.status_code == 200, response.text
            infos = response.json()["worker_infos"]
            return infos if len(infos) == 3 else []
        infos = await wait_until_async(all_workers, what="three registered workers")
        assert [(i["instance_id"], i["worker_id"], i["worker_name"]) for i in infos] == [
            ("inst-a", 0, a.worker_id), ("inst-b", 0, b0.worker_id), ("inst-b", 1, b1.worker_id)]
        for info, worker in zip(infos, (a, b0, b1)):
            assert LMCACHE_WORKER_INFO <= info.keys()
            where = (info["ip"], info["host"], info["port"], info["peer_init_url"])
            assert where == (worker.ip, worker.host, None, None)
            assert started_before - 1 <= info["registration_time"] <= info["last_heartbeat_time"] + 0.01
        ranks_1 = await client.post("/query_worker_info", json={"instance_id": "all", "worker_ids": [1]})
        assert [i["worker_name"] for i in ranks_1.json()["worker_infos"]] == [b1.worker_id]
        empty_is_all = await client.post("/query_worker_info", json={"instance_id": "inst-b", "worker_ids": []})
        assert [i["worker_id"] for i in empty_is_all.json()["worker_infos"]] == [0, 1]
        unknown = await client.post("/query_worker_info", json={"instance_id": "inst-b", "worker_ids": [5]})
        assert unknown.status_code == 404 and "[5]" in unknown.json()["detail"]


async def test_query_instance_by_ip(nats_server: EmbeddedNats) -> None:
    a = FakeEngineWorker(nats_server.url, "inst-a", incarnation="1-aa", host="host-a", ip="10.0.0.1")
    b = FakeEngineWorker(nats_server.url, "inst-b", incarnation="2-bb", host="host-b", ip="10.0.0.2")
    async with running_controller(nats_server.url) as (_, client), started(a, b):
        async def answer() -> dict | None:
            response = await client.post("/query_instance", json={"ip": "10.0.0.2"})
            return response.json() if response.status_code == 200 else None
        body = await wait_until_async(answer, what="inst-b found by its ip")
        assert body["res"] == "inst-b" and len(body["event_id"]) == 32
        missing = await client.post("/query_instance", json={"ip": "10.9.9.9"})
        assert missing.status_code == 404 and "10.9.9.9" in missing.json()["detail"]
        assert "10.0.0.1" in missing.json()["detail"]  # the known ips are named
        assert (await client.post("/query_instance", json={})).status_code == 422


async def test_health_error_codes_per_rank(nats_server: EmbeddedNats) -> None:
    rank0 = FakeEngineWorker(nats_server.url, "tp", world_size=2, rank=0, incarnation="1-aa")
    async with running_controller(nats_server.url) as (_, client), started(rank0):
        async def health() -> dict | None:
            response = await client.post("/health", json={"instance_id": "tp"})
            return response.json() if response.status_code == 200 else None
        body = await wait_until_async(health, what="tp registered")
        # LMCache's shape: {event_id, error_codes: {worker_id: code}}, 0 = healthy; rank 1 never registered: 2
        assert body["error_codes"] == {"0": 0, "1": 2} and body["healthy"] is False and body["event_id"]
        rank1 = FakeEngineWorker(nats_server.url, "tp", world_size=2, rank=1, incarnation="2-bb")
        async with started(rank1):
            async def all_healthy() -> bool:
                return (await health() or {}).get("error_codes") == {"0": 0, "1": 0}
            await wait_until_async(all_healthy, what="both ranks healthy")
        unknown = await client.post("/health", json={"instance_id": "nope"})
        assert unknown.status_code == 404 and "nope" in unknown.json()["detail"]


async def test_health_code_1_for_a_silent_worker(nats_server: EmbeddedNats) -> None:
    worker = FakeEngineWorker(nats_server.url, "quiet", incarnation="1-aa")
    async with running_controller(nats_server.url, liveness_timeout_s=1.0) as (_, client):
        await worker.start()
        async def codes_are(expected: dict) -> bool:
            response = await client.post("/health", json={"instance_id": "quiet"})
            return response.status_code == 200 and response.json()["error_codes"] == expected
        await wait_until_async(lambda: codes_are({"0": 0}), what="the worker healthy")
        await worker.stop()  # silent from now on
        await wait_until_async(lambda: codes_are({"0": 1}), what="the silent worker reported with code 1")


async def test_move_and_copy_within_an_instance(nats_server: EmbeddedNats) -> None:
    disk = FakeStore(nats_server.url, "disk-h", LOCAL_DISK)
    worker = FakeEngineWorker(nats_server.url, "inst-m", chunk_size=4, disk=disk, incarnation="1-aa")
    other = FakeEngineWorker(nats_server.url, "inst-o", chunk_size=4, incarnation="2-bb")
    tokens = list(range(1, 11))  # chunks of 4, 4, 2
    async with running_controller(nats_server.url) as (_, client), started(disk, worker, other):
        worker.store(tokens, chunks=[0, 1])
        await wait_layout(client, tokens, {"inst-m": [LOCAL_CPU, 8]})

        def move(source: str, target: str, copy: bool, to: str = "inst-m") -> dict:
            return {"old_position": ["inst-m", source], "new_position": [to, target], "tokens": tokens,
                    "should_copy": copy}
        copied = await client.post("/move", json=move(LOCAL_CPU, LOCAL_DISK, copy=True))
        assert copied.status_code == 200 and copied.json()["num_tokens"] == 8, copied.text
        assert len(disk.chunks) == 2 and len(worker.chunks) == 2  # a copy: both hold the prefix
        finish = await client.post("/check_finish", json={"event_id": copied.json()["event_id"]})
        assert finish.json() == {"status": "finished"}
        command = worker.commands[-1]
        assert (command.op, command.location, command.target, command.keep_source) == ("move", LOCAL_CPU,
                                                                                       LOCAL_DISK, True)
        moved = await client.post("/move", json=move(LOCAL_CPU, LOCAL_DISK, copy=False))  # LMCache's default
        assert moved.status_code == 200 and moved.json()["num_tokens"] == 8 and not worker.chunks
        await wait_layout(client, tokens, {"inst-m": [LOCAL_DISK, 8]}, what="the chunks now on disk only")
        back = await client.post("/move", json=move(LOCAL_DISK, LOCAL_CPU, copy=True))
        assert back.status_code == 200 and back.json()["num_tokens"] == 8
        await wait_layout(client, tokens, {"inst-m": [LOCAL_CPU, 8]}, what="copied back to the CPU tier")

        out_of_store = await client.post("/move", json=move(LOCAL_DISK, LOCAL_CPU, copy=False))
        assert out_of_store.status_code == 409 and "shared" in out_of_store.json()["detail"]
        same = await client.post("/move", json=move(LOCAL_CPU, LOCAL_CPU, copy=True))
        assert same.status_code == 409 and "to itself" in same.json()["detail"]
        no_remote = await client.post("/move", json=move(LOCAL_CPU, "RemoteBackend", copy=True))
        assert no_remote.status_code == 404 and "RemoteBackend" in no_remote.json()["detail"]
        between = await client.post("/move", json=move(LOCAL_CPU, LOCAL_CPU, copy=True, to="inst-o"))
        assert between.status_code == 409 and "enable_p2p" in between.json()["detail"]  # neither serves peers
        unknown = await client.post("/move", json={"old_position": ["nope", LOCAL_CPU],
                                                   "new_position": ["inst-o", LOCAL_CPU]})
        assert unknown.status_code == 404 and "nope" in unknown.json()["detail"]
        assert (await client.post("/move", json={"old_position": ["inst-m"]})).status_code == 422


@pytest.mark.parametrize(("path", "body", "named"), [
    ("/compress", {"instance_id": "inst-a", "method": "cachegen", "location": LOCAL_CPU}, "no codec"),
    ("/decompress", {"instance_id": "inst-a", "method": "cachegen", "location": LOCAL_CPU, "tokens": [1]}, "no codec"),
])
async def test_compress_decompress_are_a_clear_501(nats_server: EmbeddedNats, path: str, body: dict,
                                                        named: str) -> None:
    async with running_controller(nats_server.url) as (_, client):
        response = await client.post(path, json=body)
        assert response.status_code == 501 and named in response.json()["detail"]
        assert (await client.post(path, json={"tokens": "x"})).status_code == 422  # a bad body is still named
        assert (await client.get("/healthz")).status_code == 200  # and it keeps serving


# ---------------------------------------------------------------------------------------------------------
# Instance identity


async def test_replicas_sharing_an_instance_id_are_reported_not_merged(nats_server: EmbeddedNats,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    first = FakeEngineWorker(nats_server.url, "lmcache_default_instance", chunk_size=4, incarnation="100-aa",
                             host="host-a", ip="10.0.0.1")
    second = FakeEngineWorker(nats_server.url, "lmcache_default_instance", chunk_size=4, incarnation="200-bb",
                              host="host-b", ip="10.0.0.2")
    first_prompt, second_prompt = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]
    async with running_controller(nats_server.url, liveness_timeout_s=1.0) as (service, client), started(first):
        first.store(first_prompt)
        await wait_layout(client, first_prompt, {"lmcache_default_instance": [LOCAL_CPU, 8]})
        async with started(second):
            second.store(second_prompt)
            # Both are live: the latest registered serves the instance id, the other is listed as a duplicate.
            async def duplicates() -> list[str]:
                instances = (await client.get("/instances")).json()["instances"]
                return [w["worker_name"] for i in instances for w in i["duplicate_workers"]]
            assert await wait_until_async(duplicates, what="the duplicate listed") == [first.worker_id]
            instance = (await client.get("/instances")).json()["instances"][0]
            assert [w["worker_name"] for w in instance["workers"]] == [second.worker_id]
            # Never merged: lookups see the serving worker's chunks only, not both workers' as one instance.
            await wait_layout(client, second_prompt, {"lmcache_default_instance": [LOCAL_CPU, 4]})
            assert (await client.post("/lookup", json={"tokens": first_prompt})).json()["layout_info"] == {}
            # Reported on both sides: a WARNING here, and a notice each claimant logs.
            for worker in (first, second):
                notice = await wait_until_async(lambda w=worker: w.conflicts, what="the conflict notice")
                assert notice[-1].serving == second.worker_id and notice[-1].rank == 0
                assert any(f"{first.worker_id} on host-a (10.0.0.1)" == o for o in notice[-1].others)
            assert any("claimed by 2 live workers" in r.getMessage() and r.levelno == logging.WARNING
                       for r in caplog.records)
            metrics = (await client.get("/metrics")).text
            assert f"kvmesh_controller_instance_conflicts_total {service.core.instance_conflicts()}" in metrics
            assert service.core.instance_conflicts() >= 1
        # The serving one goes silent (down): the other serves the instance id again.
        await wait_layout(client, first_prompt, {"lmcache_default_instance": [LOCAL_CPU, 8]}, what="first serves")
        assert (await client.get("/instances")).json()["instances"][0]["duplicate_workers"] == []


async def test_a_worker_id_of_another_instance_or_a_bad_tag_is_refused(nats_server: EmbeddedNats) -> None:
    """The per-process tag does not loosen who may register what: the id must be one of the sender's instance
    (`engine.<instance>` path) and end in one well-formed tag."""
    async with running_controller(nats_server.url) as (service, client):
        for bad_tag in ("x" * 65, "a@b"):
            worker = FakeEngineWorker(nats_server.url, "inst-t", incarnation=bad_tag)
            before = service.core.feed.forged_messages
            async with started(worker):
                await wait_until_async(lambda: service.core.feed.forged_messages > before, what="the refusal")
            assert service.core.table.producer(worker.worker_id) is None
        good = FakeEngineWorker(nats_server.url, "inst-t", incarnation="1-ok")
        async with started(good):
            await wait_until_async(lambda: service.core.table.producer(good.worker_id) is not None,
                                   what="the well-formed worker id registered")

