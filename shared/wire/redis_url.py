"""`remote_url` forms that put the remote tier on Redis or Valkey, and the async client each one needs.

The forms are LMCache's (docs/config.md):
  * ``redis://[[user]:[password]@]host[:port][/db]`` (``rediss://``: the same over TLS)
  * ``unix://[[user]:[password]@]/path/to/redis.sock[?db=N]``
  * ``redis-sentinel://[user:password@]h1:p1,h2:p2/service_name`` (the credentials are the master's; the
    sentinels are asked without them)
  * ``redis-cluster://[user:password@]h1:p1,h2:p2``
  * ``valkey://[user:password@]host[:port][/db]`` (``valkeys://``: TLS): standalone, or a cluster (hosts
    separated by commas) when ``extra_config: {valkey_mode: cluster}``.

Credentials in the URL win; otherwise ``KVMESH_REDIS_USERNAME`` / ``KVMESH_REDIS_PASSWORD`` from the
environment (so a password need not sit in a config file), and ``KVMESH_REDIS_TLS_CA`` names a CA bundle
for TLS. A URL that is none of these forms, or is malformed, is a ConfigError naming ``remote_url``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

from kvmesh.shared.errors import ConfigError

USERNAME_VAR = "KVMESH_REDIS_USERNAME"
PASSWORD_VAR = "KVMESH_REDIS_PASSWORD"
TLS_CA_VAR = "KVMESH_REDIS_TLS_CA"
VALKEY_MODE_KEY = "valkey_mode"  # extra_config key, as in LMCache
STANDALONE, CLUSTER, SENTINEL = "standalone", "cluster", "sentinel"
REDIS_PORT, SENTINEL_PORT = 6379, 26379
SCHEMES = frozenset({"redis", "rediss", "unix", "redis-sentinel", "redis-cluster", "valkey", "valkeys"})

if TYPE_CHECKING:  # redis is imported only where a client is made: the config (which uses this) stays light
    from redis.asyncio import Redis, RedisCluster


def is_redis_url(url: str | None) -> bool:
    """Whether `url` names one of the Redis / Valkey schemes (valid or not: `parse_redis_url` says)."""
    return bool(url) and "://" in url and url.split("://", 1)[0].lower() in SCHEMES


@dataclass(frozen=True)
class RedisTarget:
    """Where the Redis-backed remote tier is and how to reach it."""

    mode: str  # STANDALONE, CLUSTER or SENTINEL
    hosts: tuple[tuple[str, int], ...] = ()  # standalone: one; cluster: startup nodes; sentinel: the sentinels
    unix_path: str | None = None
    db: int = 0
    service_name: str | None = None  # sentinel: the monitored master's name
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never logged
    tls_ca: str | None = None

    def describe(self) -> str:
        """For logs: where, never the password."""
        where = self.unix_path or ",".join(f"{h}:{p}" for h, p in self.hosts)
        extra = f" service {self.service_name}" if self.service_name else f" db {self.db}" if self.db else ""
        return f"Redis {self.mode} {where}{extra}{' (TLS)' if self.tls else ''}"

    def client(self, timeout: float, retries: int = 1) -> "Redis | RedisCluster":
        """A new async client (connections open on first use). `timeout` bounds each connect and each socket
        read or write; a command that fails on its connection is retried `retries` times at once (default once:
        a pooled connection may predate a restart of the server)."""
        from redis.asyncio import Redis, RedisCluster, Sentinel
        from redis.asyncio.cluster import ClusterNode
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        common: dict[str, Any] = dict(username=self.username, password=self.password, socket_timeout=timeout,
                                      socket_connect_timeout=timeout, retry=Retry(NoBackoff(), retries))
        if self.tls:
            common.update(ssl=True, ssl_ca_certs=self.tls_ca)
        if self.mode == CLUSTER:
            nodes = [ClusterNode(host, port) for host, port in self.hosts]
            return RedisCluster(startup_nodes=nodes, **common)
        if self.mode == SENTINEL:
            sentinel = Sentinel(list(self.hosts), sentinel_kwargs={"socket_timeout": timeout,
                                                                   "socket_connect_timeout": timeout},
                                db=self.db, **common)
            return sentinel.master_for(self.service_name)
        if self.unix_path is not None:
            common.pop("ssl", None), common.pop("ssl_ca_certs", None)
            return Redis(unix_socket_path=self.unix_path, db=self.db, **common)
        (host, port), = self.hosts
        return Redis(host=host, port=port, db=self.db, **common)


def parse_redis_url(url: str, extra_config: Mapping[str, Any] | None = None,
                    environ: Mapping[str, str] | None = None) -> RedisTarget:
    """The target a Redis / Valkey `remote_url` names; ConfigError naming `remote_url` when it is malformed."""
    env = os.environ if environ is None else environ
    try:
        return _parse(url, extra_config or {}, env)
    except ConfigError as exc:
        raise ConfigError(f"remote_url {_redacted(url)!r}: {exc}") from None


def _parse(url: str, extra: Mapping[str, Any], env: Mapping[str, str]) -> RedisTarget:
    if not is_redis_url(url):
        raise ConfigError(f"not a Redis/Valkey URL (schemes: {', '.join(sorted(SCHEMES))})")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    rest, _, query = rest.partition("?")
    if "#" in rest:
        raise ConfigError("a URL fragment ('#...') has no meaning here")
    userinfo, at, location = rest.rpartition("@")
    username, password = _credentials(userinfo if at else None, env)
    tls = scheme in ("rediss", "valkeys")
    tls_ca = env.get(TLS_CA_VAR) or None
    params = parse_qs(query, keep_blank_values=True)
    unknown = set(params) - {"db"}
    if unknown:
        raise ConfigError(f"unknown query parameter(s) {', '.join(sorted(unknown))} (only ?db=N)")
    if scheme == "unix":
        path = unquote(location)
        if not path or not path.startswith("/"):
            raise ConfigError("unix:// needs an absolute socket path, e.g. unix:///run/redis/redis.sock")
        db = _db(params.get("db", ["0"])[-1])
        return RedisTarget(STANDALONE, unix_path=path, db=db, username=username, password=password)
    hosts_text, slash, tail = location.partition("/")
    if "db" in params and slash and tail:
        raise ConfigError("give the database either as /db or as ?db=N, not both")
    if scheme == "redis-sentinel":
        if not tail:
            raise ConfigError("redis-sentinel:// needs the master's service name: "
                              "redis-sentinel://h1:p1,h2:p2/service_name")
        return RedisTarget(SENTINEL, _hosts(hosts_text, SENTINEL_PORT, many=True), service_name=unquote(tail),
                           db=_db(params.get("db", ["0"])[-1]), tls=tls, username=username, password=password,
                           tls_ca=tls_ca)
    mode = CLUSTER if scheme == "redis-cluster" else STANDALONE
    if scheme in ("valkey", "valkeys"):
        mode = _valkey_mode(extra)
    db = _db(tail if tail else params.get("db", ["0"])[-1])
    if mode == CLUSTER and db != 0:
        raise ConfigError(f"a cluster has only database 0, got {db}")
    hosts = _hosts(hosts_text, REDIS_PORT, many=mode == CLUSTER)
    return RedisTarget(mode, hosts, db=db, tls=tls, username=username, password=password, tls_ca=tls_ca)


def _credentials(userinfo: str | None, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(username, password): the URL's when it has them, else the environment's."""
    user, password = None, None
    if userinfo is not None:
        name, colon, secret = userinfo.partition(":")
        user, password = unquote(name) or None, (unquote(secret) or None) if colon else None
        if not colon and name:  # "redis://secret@host": redis-py and LMCache read a lone word as the password
            user, password = None, unquote(name)
    return (user or env.get(USERNAME_VAR) or None, password or env.get(PASSWORD_VAR) or None)


def _hosts(text: str, default_port: int, many: bool) -> tuple[tuple[str, int], ...]:
    parts = text.split(",")
    if not many and len(parts) > 1:
        raise ConfigError("several hosts need redis-cluster://, redis-sentinel:// or valkey_mode: cluster")
    return tuple(_host_port(part, default_port) for part in parts)


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, bracket, port_text = text[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise ConfigError(f"bad IPv6 host {text!r} (write [::1]:6379)")
        port_text = port_text[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError(f"missing host in {text!r}")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"bad port {port_text!r} in {text!r} (1-65535)")
    return host, int(port_text)


def _db(text: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"the database must be a number >= 0, got {text!r}")
    return int(text)


def _valkey_mode(extra: Mapping[str, Any]) -> str:
    mode = str(extra.get(VALKEY_MODE_KEY, STANDALONE)).lower()
    if mode not in (STANDALONE, CLUSTER):
        raise ConfigError(f"extra_config.{VALKEY_MODE_KEY} must be standalone or cluster, got {mode!r}")
    return mode


def _redacted(url: str) -> str:
    """`url` with any password replaced by '***' (error messages are logged)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, location = rest.rpartition("@")
    if not at:
        return url
    name, colon, _ = userinfo.partition(":")
    return f"{scheme}{sep}{name + ':***' if colon else '***'}@{location}"
