"""Every LMCache key starts (services/engine/config/lmcache_keys.py): honoured, or accepted with one warning per key per process.

The YAML files in tests/data/lmcache/ were written for these tests; together they set every key of
`LMCACHE_KEYS`, and each loads through `load_engine_config`, the function the connector calls.
"""

import logging
from pathlib import Path

import pytest
import yaml

from kvmesh.services.engine.config import lmcache_keys
from kvmesh.services.engine.config.engine_config import EngineConfig, load_engine_config
from kvmesh.services.engine.config.lmcache_keys import IGNORED, LMCACHE_KEYS
from kvmesh.services.engine.mesh.embedded import EMBED, JOIN, plan_mesh
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.wire.redis_url import SCHEMES as REDIS_SCHEMES

from support.lmcache_yaml import expected_warnings

DATA = Path(__file__).resolve().parents[1] / "data" / "lmcache"
FILES = sorted(DATA.glob("*.yaml"))


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """The config's warnings, as a fresh process would log them (no key warned about yet)."""
    monkeypatch.setattr(lmcache_keys, "_warned", set())
    monkeypatch.setattr(logging.getLogger("kvmesh"), "propagate", True)  # the connector's logging turns it off
    caplog.set_level(logging.WARNING, logger="kvmesh.config")
    return caplog


def warned_keys(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The key each config warning names, in order (one entry per warning)."""
    return [record.args[0] for record in caplog.records if record.name == "kvmesh.config"]  # type: ignore[index]


def file_keys(path: Path) -> dict[str, object]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def test_the_data_files_set_every_lmcache_key() -> None:
    assert len(FILES) >= 4
    covered = set().union(*(file_keys(path) for path in FILES))
    assert sorted(LMCACHE_KEYS.keys() - covered) == []
    assert sorted(covered - LMCACHE_KEYS.keys()) == []  # they exercise LMCache's keys, not KVMesh's


@pytest.mark.parametrize("path", FILES, ids=[path.stem for path in FILES])
def test_each_data_file_starts_and_each_ignored_key_warns_once(path: Path, warnings: pytest.LogCaptureFixture
                                                               ) -> None:
    data = file_keys(path)
    environ = {"LMCACHE_CONFIG_FILE": str(path)}
    config = load_engine_config(environ=environ)
    expected = expected_warnings(data)
    assert sorted(warned_keys(warnings)) == sorted(expected)
    for record in warnings.records:
        assert str(path) in record.getMessage() and record.args[2] in record.getMessage()  # type: ignore[index]
    # honoured keys took their values
    for key, value in data.items():
        if LMCACHE_KEYS[key] is None and key not in ("cache_policy", "local_disk"):
            assert getattr(config, key) == value, key
    # the same file again (the scheduler and worker connectors of one process): no second warning
    assert load_engine_config(environ=environ) == config
    assert sorted(warned_keys(warnings)) == sorted(expected)


def test_core_file_values(warnings: pytest.LogCaptureFixture) -> None:
    config = load_engine_config(environ={"LMCACHE_CONFIG_FILE": str(DATA / "core.yaml")})
    assert (config.chunk_size, config.cache_policy, config.remote_serde) == (128, "LFU", "cachegen")
    assert config.local_disk_path == Path("/var/tmp/kvmesh-test-disk")
    assert config.save_unfull_chunk is False and config.save_decode_cache is True
    assert config.extra_config == {"use_odirect": True, "save_only_first_rank": True, "tag_keys": ["tenant"],
                                   "s3_bucket": "kv-bucket", "valkey_mode": "cluster"}
    assert config.use_layerwise is True
    message = next(r.getMessage() for r in warnings.records if r.args[0] == "numa_mode")  # type: ignore[index]
    assert message == (f"LMCache key numa_mode (config file {DATA / 'core.yaml'}: numa_mode) is accepted "
                       f"and not used: {IGNORED['numa_mode']}")


@pytest.mark.parametrize("key", sorted(IGNORED))
def test_every_ignored_key_starts_as_a_variable_and_warns_once(key: str, warnings: pytest.LogCaptureFixture) -> None:
    value = {"extra_config": '{"use_odirect": true}', "remote_serde": "NULL"}.get(key, "1")
    var = f"LMCACHE_{key.upper()}"
    load_engine_config(environ={var: value})
    load_engine_config(environ={var: value})
    assert warned_keys(warnings) == ["extra_config.use_odirect" if key == "extra_config" else key]
    assert var in warnings.records[0].getMessage()


def test_ignored_keys_with_the_lmcache_prefix_in_vllm_extra_config(warnings: pytest.LogCaptureFixture) -> None:
    config = load_engine_config({"lmcache.numa_mode": "auto", "lmcache.pd_buffer_size": 1024, "chunk_size": 64},
                                environ={})
    assert config.chunk_size == 64
    assert warned_keys(warnings) == ["numa_mode", "pd_buffer_size"]
    assert "kv_connector_extra_config: lmcache.numa_mode" in warnings.records[0].getMessage()


def test_honoured_keys_do_not_warn(warnings: pytest.LogCaptureFixture) -> None:
    values = {"local_disk": "/var/tmp/kv", "remote_url": "nats://host:4222", "cache_policy": "FIFO",
              "lmcache_instance_id": "inst", "controller_url": "localhost:9001", "p2p_host": "127.0.0.1",
              "p2p_init_ports": [8200, 8201]}
    load_engine_config({key: values.get(key, 1) for key, note in LMCACHE_KEYS.items() if note is None}, environ={})
    assert warned_keys(warnings) == []


# ---- keys LMCache does not know either -----------------------------------------------------------------------------
def test_unknown_keys_still_fail_with_the_hint(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("use_layerwse: true\n")
    with pytest.raises(ConfigError, match=r"unknown key 'use_layerwse' \(did you mean 'use_layerwise'\?\)"):
        load_engine_config(environ={"LMCACHE_CONFIG_FILE": str(path)})
    with pytest.raises(ConfigError, match=r"LMCACHE_PD_ROLL: .* \(did you mean LMCACHE_PD_ROLE\?\)"):
        load_engine_config(environ={"LMCACHE_PD_ROLL": "sender"})
    with pytest.raises(ConfigError, match="'lmcache.nixl_rolle'.*did you mean 'nixl_role'"):
        load_engine_config({"lmcache.nixl_rolle": "sender"}, environ={})
    with pytest.raises(ConfigError) as exc:
        load_engine_config({"frobnicate_everything": 1}, environ={})
    assert "did you mean" not in str(exc.value)


# ---- values ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [("naive", "naive"), ("CacheGen", "cachegen"), ("kivi", "kivi"),
                                                ("NULL", None), ("null", None)])
def test_remote_serde_takes_lmcache_values(text: str, expected: str | None) -> None:
    assert load_engine_config(environ={"LMCACHE_REMOTE_SERDE": text}).remote_serde == expected


def test_remote_serde_null_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "serde.yaml"
    path.write_text("remote_serde: NULL\n")
    assert load_engine_config(environ={"LMCACHE_CONFIG_FILE": str(path)}).remote_serde is None


def test_a_bad_remote_serde_is_still_an_error() -> None:
    with pytest.raises(ConfigError, match="LMCACHE_REMOTE_SERDE: must be one of cachegen, kivi, naive"):
        load_engine_config(environ={"LMCACHE_REMOTE_SERDE": "pickle"})


@pytest.mark.parametrize(("text", "expected"), [("1", True), ("true", True), ("yes", True), ("0", False),
                                                ("false", False)])
def test_force_skip_save_variable(text: str, expected: bool) -> None:
    assert load_engine_config(environ={"LMCACHE_FORCE_SKIP_SAVE": text}).force_skip_save is expected


def test_force_skip_save_garbage_is_an_error() -> None:
    with pytest.raises(ConfigError, match="LMCACHE_FORCE_SKIP_SAVE: expected a boolean, got 'sometimes'"):
        load_engine_config(environ={"LMCACHE_FORCE_SKIP_SAVE": "sometimes"})


# ---- remote_url schemes ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["nats://remote-host:4222", "tls://remote-host:4222", "ws://remote-host:8080",
                                 "wss://remote-host:443", "lm://localhost:65432", "kvmesh://mesh/remote",
                                 "NATS://remote-host:4222"])
def test_supported_remote_url_schemes_work(url: str) -> None:
    config = load_engine_config({"remote_url": url, "remote_partitions": 2}, environ={})
    plan = plan_mesh(config)
    assert plan.remote_stores == ["remote-0", "remote-1"]
    if url.split("://")[0].lower() in ("lm", "kvmesh"):  # KVMesh's own remote store, embedded
        assert plan.mode == EMBED and [s.service_id for s in plan.services] == ["remote-0", "remote-1"]
    else:  # the NATS the remote stores are on
        assert plan.mode == JOIN and plan.nats_url == url


@pytest.mark.parametrize("scheme", sorted(REDIS_SCHEMES))
def test_redis_family_is_the_engines_own_tier(scheme: str) -> None:
    url = {"unix": "unix:///run/redis.sock", "redis-sentinel": "redis-sentinel://cache-host:26379/mymaster"}.get(
        scheme, f"{scheme}://cache-host:6379")
    config = load_engine_config(environ={"LMCACHE_REMOTE_URL": url})
    plan = plan_mesh(config)
    assert plan.redis and plan.remote_stores == ["redis-kvmesh"] and not plan.services


@pytest.mark.parametrize("url", ["mooncakestore://host:50051/", "infinistore://host:12345", "s3://bucket/kv",
                                 "fs:///mnt/kv", "localhost:65432", "whatever"])
def test_other_remote_urls_are_refused_naming_the_supported_schemes(url: str, tmp_path: Path) -> None:
    path = tmp_path / "remote.yaml"
    path.write_text(f'remote_url: "{url}"\n')
    with pytest.raises(ConfigError) as exc:
        load_engine_config(environ={"LMCACHE_CONFIG_FILE": str(path)})
    message = str(exc.value)
    assert f"config file {path}: remote_url: {url!r}" in message
    assert ("does not serve (supported: kvmesh://, lm://, nats://, redis://, redis-cluster://, redis-sentinel://, "
            "rediss://, tls://, unix://, valkey://, valkeys://, ws://, wss://)") in message


def test_direct_construction_checks_the_scheme_too() -> None:
    with pytest.raises(ConfigError, match="does not serve"):
        EngineConfig(remote_url="s3://bucket/kv")
