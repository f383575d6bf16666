"""Redis / Valkey `remote_url` forms (shared/wire/redis_url.py): every form LMCache accepts, credentials from the URL
or the environment, and a ConfigError naming `remote_url` for each malformed one."""

from __future__ import annotations

import pytest

from kvmesh.services.engine.config.engine_config import EngineConfig, load_engine_config
from kvmesh.services.engine.mesh.embedded import plan_mesh
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.wire.redis_url import (CLUSTER, PASSWORD_VAR, SENTINEL, STANDALONE, TLS_CA_VAR, USERNAME_VAR,
                                     RedisTarget, is_redis_url, parse_redis_url)

NO_ENV: dict[str, str] = {}


def parse(url: str, extra: dict[str, object] | None = None, env: dict[str, str] = NO_ENV) -> RedisTarget:
    return parse_redis_url(url, extra, env)


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://localhost", RedisTarget(STANDALONE, (("localhost", 6379),))),
    ("redis://10.0.0.5:6380/2", RedisTarget(STANDALONE, (("10.0.0.5", 6380),), db=2)),
    ("redis://h?db=3", RedisTarget(STANDALONE, (("h", 6379),), db=3)),
    ("redis://alice:s3cr%40t@h:1", RedisTarget(STANDALONE, (("h", 1),), username="alice", password="s3cr@t")),
    ("redis://:pw@h", RedisTarget(STANDALONE, (("h", 6379),), password="pw")),
    ("redis://pw@h", RedisTarget(STANDALONE, (("h", 6379),), password="pw")),  # a lone word is the password
    ("redis://[::1]:7000", RedisTarget(STANDALONE, (("::1", 7000),))),
    ("rediss://h:6380", RedisTarget(STANDALONE, (("h", 6380),), tls=True)),
    ("unix:///run/redis/redis.sock", RedisTarget(STANDALONE, unix_path="/run/redis/redis.sock")),
    ("unix://:pw@/tmp/r.sock?db=4", RedisTarget(STANDALONE, unix_path="/tmp/r.sock", db=4, password="pw")),
    ("redis-sentinel://s1:26379,s2:26380/mymaster",
     RedisTarget(SENTINEL, (("s1", 26379), ("s2", 26380)), service_name="mymaster")),
    ("redis-sentinel://u:p@s1,s2/m", RedisTarget(SENTINEL, (("s1", 26379), ("s2", 26379)), service_name="m",
                                                 username="u", password="p")),
    ("redis-cluster://a:7000,b:7001", RedisTarget(CLUSTER, (("a", 7000), ("b", 7001)))),
    ("valkey://v:6379/1", RedisTarget(STANDALONE, (("v", 6379),), db=1)),
    ("valkeys://v", RedisTarget(STANDALONE, (("v", 6379),), tls=True)),
])
def test_every_form(url: str, expected: RedisTarget) -> None:
    assert is_redis_url(url)
    assert parse(url) == expected


def test_valkey_cluster_mode_comes_from_extra_config() -> None:
    assert parse("valkey://a:1,b:2", {"valkey_mode": "cluster"}) == RedisTarget(CLUSTER, (("a", 1), ("b", 2)))
    assert parse("valkey://a:1", {"valkey_mode": "Standalone"}).mode == STANDALONE
    with pytest.raises(ConfigError, match="valkey_mode must be standalone or cluster"):
        parse("valkey://a:1", {"valkey_mode": "sentinel"})


def test_credentials_from_the_environment_unless_the_url_has_them() -> None:
    env = {USERNAME_VAR: "svc", PASSWORD_VAR: "from-env", TLS_CA_VAR: "/etc/ca.pem"}
    target = parse("rediss://h", env=env)
    assert (target.username, target.password, target.tls_ca) == ("svc", "from-env", "/etc/ca.pem")
    assert parse("redis://me:mine@h", env=env).password == "mine"
    assert "from-env" not in repr(target) and "from-env" not in target.describe()


@pytest.mark.parametrize(("url", "problem"), [
    ("redis://", "missing host"),
    ("redis://h:0", "bad port"),
    ("redis://h:99999", "bad port"),
    ("redis://h:port", "bad port"),
    ("redis://a,b", "several hosts"),
    ("redis://h/db1", "database must be a number"),
    ("redis://h/1?db=2", "either as /db or as"),
    ("redis://h?timeout=3", "unknown query parameter"),
    ("redis://[::1", "bad IPv6 host"),
    ("unix://relative/path", "absolute socket path"),
    ("redis-sentinel://s1,s2", "service name"),
    ("redis-sentinel://s1,s2/", "service name"),
    ("redis-cluster://a:1/2", "only database 0"),
    ("redis://h#frag", "fragment"),
])
def test_bad_urls_name_remote_url(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        parse(url)
    assert str(info.value).startswith("remote_url ")


def test_a_password_never_reaches_the_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse("redis://u:hunter2@h:0")
    assert "hunter2" not in str(info.value) and "u:***@h:0" in str(info.value)


def test_the_config_checks_the_url_and_the_plan_uses_redis() -> None:
    with pytest.raises(ConfigError, match="remote_url 'redis-cluster://a:1/3'"):
        load_engine_config({"remote_url": "redis-cluster://a:1/3"}, environ={})
    with pytest.raises(ConfigError, match="valkey_mode"):
        load_engine_config({"remote_url": "valkey://a", "extra_config": {"valkey_mode": "x"}}, environ={})
    config = load_engine_config({"remote_url": "redis://h:1", "local_disk": "/tmp/kvmesh-plan-test",
                                 "max_local_disk_size": 1}, environ={})
    plan = plan_mesh(config)
    assert plan.redis and plan.remote_stores == ["redis-kvmesh"]  # named for the controller's RemoteBackend
    assert [s.service_id for s in plan.services] == [plan.disk_store]  # no remote-store process
    assert not plan_mesh(EngineConfig(remote_url="lm://localhost:65432")).redis


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("redis_key_prefix", "a{b}", "without braces"),
    ("redis_key_prefix", "", "non-empty"),
    ("redis_timeout_secs", 0, "must be > 0"),
    ("redis_chunk_ttl_secs", 0.5, "must be >= 1"),
])
def test_redis_options_are_checked(key: str, value: object, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_engine_config({key: value}, environ={})
