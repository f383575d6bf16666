"""The engine configuration of KVMesh: LMCache's keys plus our own, from YAML, env vars and vLLM's extra config.

Sources, in the order the engine applies them (each later one overrides the earlier):
  1. the defaults below;
  2. the YAML file named by ``LMCACHE_CONFIG_FILE`` (LMCache's ``example.yaml``, docs/compatibility.md);
  3. ``LMCACHE_<KEY>`` environment variables, e.g. ``LMCACHE_CHUNK_SIZE=256``;
  4. ``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config`` (keys with or without ``lmcache.``).

Every key of LMCache's configuration starts: the ones KVMesh does not act on log one warning each
(services/engine/config/lmcache_keys.py). Unlike LMCache, a key LMCache does not know either, or a bad value, is never
ignored: it raises ``ConfigError`` naming the key and where it came from (file path, variable name or source label).
Sizes are in GB of 1024**3 bytes, as in LMCache.
"""

import difflib
import json
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from kvmesh.services.engine.config.lmcache_keys import IGNORED, LMCACHE_KEYS, remote_url_problem, warn_ignored
from kvmesh.shared.errors import ConfigError
from kvmesh.shared.eviction import POLICY_NAMES
from kvmesh.shared.messaging.nats_url import problem as nats_url_problem
from kvmesh.shared.options_cli import GB
from kvmesh.shared.wire.redis_keys import PREFIX_RULE, prefix_ok, secret_file_problem
from kvmesh.shared.wire.redis_url import RedisTarget, is_redis_url, parse_redis_url

ENV_PREFIX = "LMCACHE_"
CONFIG_FILE_VAR = "LMCACHE_CONFIG_FILE"
# LMCACHE_ variables that users set for other things than the config; anything else unknown is a typo.
IGNORED_ENV_VARS = frozenset({CONFIG_FILE_VAR, "LMCACHE_LOG_LEVEL", "LMCACHE_TRACK_USAGE"})
REMOTE_SERDES = frozenset({"naive", "kivi", "cachegen"})
CPU_LOAD_PIPELINE = frozenset({"auto", "always", "never"})
CACHE_POLICIES = frozenset(POLICY_NAMES)  # LRU, LFU, FIFO, MRU: one class each in shared/eviction/


@dataclass(frozen=True)
class EngineConfig:
    """One flat, immutable engine configuration.

    Invariant: every field holds a value of its declared type that passed its check; ``__post_init__`` enforces
    it, so direct construction, ``replace()`` and every ``from_*`` path give the same guarantees.
    """

    # LMCache keys (YAML keys, LMCACHE_<KEY> env vars); sizes in GB
    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size: float = 5.0
    local_disk: str | None = None  # "file://local/disk_test/local_disk/" or a plain path
    max_local_disk_size: float = 0.0
    remote_url: str | None = None  # kept as-is; its scheme must be one of lmcache_keys.REMOTE_SCHEMES
    remote_serde: str | None = "naive"  # we store naive bytes; kivi/cachegen/NULL are accepted for compatibility
    save_unfull_chunk: bool = True  # True here: the pin quickstart pins a 12-token prompt and expects 12
    save_decode_cache: bool = False
    blocking_timeout_secs: float = 10.0
    use_experimental: bool = True
    enable_controller: bool = False
    lmcache_instance_id: str = "lmcache_default_instance"
    controller_url: str | None = None  # "localhost:9001": where NATS is (the controller's --monitor-port)
    lmcache_worker_port: int | None = None
    distributed_url: str | None = None
    # Eviction order of the CPU tier and of the disk and remote stores the engine embeds (LRU, LFU = least
    # frequently used, ties by recency; FIFO = arrival order, reads do not reorder; MRU = most recent first);
    # case-insensitive, anything else is a ConfigError naming the key. Stores run apart take `--cache-policy`.
    cache_policy: str = "LRU"
    error_handling: bool = False
    # P2P (docs/architecture.md "P2P hits"): serve this instance's CPU tier to peers of its sharing domain and load
    # from theirs when the own tiers miss; the stream listens on p2p_host (default: loopback, peers on this host
    # only) and port p2p_init_ports[rank] (default: any free port)
    enable_p2p: bool = False
    enable_pd: bool = False  # prefill/decode over the P2P streams (docs/connector.md): turns enable_p2p on
    p2p_host: str | None = None
    p2p_init_ports: list | None = None
    lookup_url: str | None = None
    extra_config: dict[str, Any] | None = None
    enable_blending: bool = False
    blend_recompute_ratio: float = 0.15
    blend_min_tokens: int = 256
    use_layerwise: bool = False  # CUDA: scatter loads layer by layer on a side stream (docs/connector.md)
    # CPU: in-step loads written layer by layer on a thread beside the forward ("auto": where a core is free
    # beside vLLM's compute cores; "always", "never"); core/layer_pipeline.py
    cpu_load_pipeline: str = "auto"
    enable_async_loading: bool = True  # True here: a disk hit measured 2x faster loaded between steps (docs/connector.md)
    internal_api_server_enabled: bool = False
    min_retrieve_tokens: int = 0
    priority_limit: int | None = None
    # KVMesh keys
    nats_url: str | None = None  # join an existing mesh; None -> use controller_url, else embed one
    nats_user: str | None = None
    nats_password: str | None = field(default=None, repr=False)  # secrets stay out of logged reprs
    nats_token: str | None = field(default=None, repr=False)
    nats_nkey_seed: str | None = None  # path to an nkey seed file
    nats_credentials: str | None = None  # path to a KVMesh credentials file (shared/messaging/credentials.py)
    nats_creds_file: str | None = None  # path to a NATS .creds file (JWT + nkey)
    nats_auth_retry_secs: float = 10.0  # a first connect retries credentials every server rejects this long
    nats_tls_ca: str | None = None  # CA file the NATS servers are verified against: TLS or no connection
    nats_tls_cert: str | None = None  # client certificate, for a NATS that asks for one (with nats_tls_key)
    nats_tls_key: str | None = None
    remote_size: float = 4.0  # GB, memory cap of the remote store when the engine embeds one
    remote_prefault_size: float = 1.0  # GB of each embedded remote store faulted in at start (<= remote_size)
    remote_partitions: int = 1  # remote-store replicas that keys are partitioned over
    store_queue_size: int = 256  # write-behind queue depth (chunks) to the disk/remote stores
    request_timeout_secs: float = 2.0  # NATS request timeout for control messages
    heartbeat_interval_secs: float = 2.0
    # engine tunables (docs/config.md says what each is for)
    lookup_timeout_secs: float = 2.0  # how long vLLM's scheduler is told "ask again" while the lower tiers answer
    pd_hint_wait_secs: float = 5.0  # a PD consumer's lookup waits this long more for its producer's admissions
    write_behind_workers: int = 2  # concurrent write-behind jobs to the lower tiers
    write_behind_defer_secs: float = 2.0  # how long a queued chunk may wait for vLLM to be idle
    write_behind_idle_secs: float = 0.1  # vLLM is idle once it has run no forward for this long
    fetch_concurrency: int = 4  # concurrent chunk reads from one store during a fetch
    prefetch_cpu_share: float = 0.5  # of the CPU tier, what lookups' prefetched chunks not yet loaded may fill
    # of the CPU tier, what requests' kv_priority / leases may keep over the rest (adapter/request_retention.py)
    retained_cpu_share: float = 0.5
    # of the CPU tier, what evicted chunks may hold until vLLM's scheduler saw the eviction (adapter/cpu_mirror.py)
    evicted_hold_share: float = 0.125
    known_held_keys: int = 200_000  # chunks remembered as in every lower tier (not sent again; ~40 B each)
    kv_event_chunks: int = 10_000  # chunks whose tokens the scheduler keeps for KV events (~8 B a token)
    # the CPU tier's admissions of saved chunks carry their parent, tokens and extras digests to the controller,
    # for its KV event stream (docs/config.md, "The controller's KV event stream"; ~4 B a token on NATS)
    describe_admissions: bool = False
    touch_interval_secs: float = 1.0  # how often hits refresh the chunks' recency in the lower tiers
    disk_data_timeout_secs: float = 10.0  # a put or get at the disk store (it may wait for the disk)
    remote_min_transfer_mb_per_s: float = 100.0  # a remote transfer slower than this is abandoned
    remote_retry_interval_secs: float = 1.0  # a remote partition that failed is not asked again for this long
    remote_stream_connections: int = 4  # open stream connections per remote partition
    remote_tls_ca: str | None = None  # CA the remote stores' TLS stream ports are verified against (TLS only)
    p2p_stream_connections: int = 4  # open stream connections to each peer this worker loads from
    p2p_tls_cert: str | None = None  # serve the P2P port over TLS only, with this certificate (and p2p_tls_key)
    p2p_tls_key: str | None = None
    p2p_tls_ca: str | None = None  # CA the peers' P2P ports are verified against (TLS only)
    # the P2P stream port's bounds (services/engine/agents/peer_server.py; docs/security.md): connections with a
    # valid ticket, in all and per peer instance (its unused tickets too)...
    p2p_max_connections: int = 16
    p2p_max_connections_per_peer: int = 8
    # ...connections that have not presented one yet, in all and per source address (a new one closes the oldest),
    # and how long they have to present it...
    p2p_max_pending_connections: int = 32
    p2p_max_pending_per_address: int = 8
    p2p_hello_timeout_secs: float = 5.0
    p2p_idle_timeout_secs: float = 300.0  # ...how long a greeted connection may go without a request...
    p2p_ticket_max_gb: float = 4.0  # ...and what one ticket's connection may receive (then it is closed)...
    p2p_ticket_max_mb_per_s: float = 4000.0  # ...and how fast (MB = 10**6 bytes)
    # LMCACHE_FORCE_SKIP_SAVE (LMCache reads it only as a variable): the engine stores nothing while it is true
    force_skip_save: bool = False
    # the remote tier on Redis / Valkey (remote_url redis://..., shared/wire/redis_url.py; docs/config.md)
    redis_key_prefix: str = "kvmesh"  # namespace of every key KVMesh writes, so deployments can share one Redis
    redis_timeout_secs: float = 2.0  # a Redis connect or command (plus nbytes / remote_min_transfer_mb_per_s)
    redis_chunk_ttl_secs: float = 604800.0  # TTL of unpinned chunks: makes them volatile (evictable), pins not
    # of Redis's maxmemory, what one engine principal's kv_priority / leased chunks may keep over the rest
    # (services/engine/tiers/redis_retention.py; honoured under maxmemory-policy volatile-ttl)
    retained_redis_share: float = 0.5
    # a file holding the secret that MACs the Redis tier's values, pins and owners (shared/wire/redis_keys.py); None:
    # the sharing domain's secret from the engine's NATS credentials file, else none (a WARNING at start)
    remote_auth_secret_file: str | None = None
    # seal the chunks put in the disk store and the remote store with the sharing domain's key (AES-256-GCM, on the
    # engine: services/engine/tiers/sealed.py); false: they go in clear
    encrypt_stores: bool = True

    def __post_init__(self) -> None:
        for key, (kind, optional) in _KINDS.items():
            where = f"EngineConfig: {key}"
            value = _check(key, _coerce(getattr(self, key), kind, optional, where), where)
            object.__setattr__(self, key, value)  # frozen: normalised values ("lru" -> "LRU") set once here
        if self.enable_pd:  # a PD producer serves its chunks to the consumer, which reads them as a peer
            object.__setattr__(self, "enable_p2p", True)

    # ---- constructors ----------------------------------------------------------------------------------------
    @classmethod
    def from_defaults(cls, **overrides: object) -> "EngineConfig":
        return cls().with_overrides(overrides, "from_defaults")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "EngineConfig":
        return cls()._with_file(path)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "EngineConfig":
        """``LMCACHE_CONFIG_FILE`` (if set) first, then every ``LMCACHE_<KEY>`` variable on top of it."""
        env = os.environ if environ is None else environ
        config = cls()
        file_name = _unquote(env.get(CONFIG_FILE_VAR, ""))
        if file_name:
            config = config._with_file(file_name)
        items: list[tuple[str, object, str]] = []
        for var in sorted(env):
            if not var.startswith(ENV_PREFIX) or var in IGNORED_ENV_VARS:
                continue
            key = var[len(ENV_PREFIX) :].lower()
            if key not in _KINDS and key not in IGNORED:
                close = _closest(key)
                hint = f" (did you mean {ENV_PREFIX}{close.upper()}?)" if close else ""
                raise ConfigError(f"{var}: unknown LMCache/KVMesh setting {key!r}{hint}")
            items.append((key, _unquote(env[var]), var))
        return config._merged(items)

    def with_overrides(self, overrides: Mapping[str, object], source: str) -> "EngineConfig":
        """A copy with ``overrides`` applied; keys may carry vLLM's ``lmcache.`` prefix (or ``kvmesh.``)."""
        items: list[tuple[str, object, str]] = []
        for name, value in overrides.items():
            key = name.removeprefix("lmcache.").removeprefix("kvmesh.") if isinstance(name, str) else name
            items.append((_known_key(key, name, source), value, f"{source}: {name}"))
        return self._merged(items)

    # ---- derived values ---------------------------------------------------------------------------------------
    @property
    def local_disk_path(self) -> Path | None:
        """``local_disk`` without ``file://``; a relative path stays relative to the working directory."""
        if self.local_disk is None:
            return None
        return Path(self.local_disk.removeprefix("file://"))

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GB)

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GB)

    @property
    def p2p_ticket_max_bytes(self) -> int:
        return int(self.p2p_ticket_max_gb * GB)

    @property
    def remote_size_bytes(self) -> int:
        return int(self.remote_size * GB)

    @property
    def remote_prefault_bytes(self) -> int:
        """What each embedded remote store faults in at start: `remote_prefault_size`, at most its memory cap."""
        return min(int(self.remote_prefault_size * GB), self.remote_size_bytes)

    @property
    def redis_target(self) -> RedisTarget | None:
        """The Redis / Valkey a `redis://`-family `remote_url` names (extra_config's `valkey_mode` says whether a
        `valkey://` one is a cluster); None for any other remote_url. ConfigError when it is malformed."""
        if self.remote_url is None or not is_redis_url(self.remote_url):
            return None
        return parse_redis_url(self.remote_url, self.extra_config)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_combination(self) -> None:
        """Checks between keys, once every source is applied (one source alone may set only one of them)."""
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ConfigError(f"max_local_disk_size: must be > 0 when local_disk is set ({self.local_disk!r}); "
                              f"got {self.max_local_disk_size!r}, a disk that could hold nothing")
        self.redis_target  # a malformed Redis URL raises; it needs extra_config too, so all sources must be in

    # ---- internals --------------------------------------------------------------------------------------------
    def _with_file(self, path: str | os.PathLike[str]) -> "EngineConfig":
        label = f"config file {path}"
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{label}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{label}: not valid YAML: {exc}") from exc
        if data is None:  # an empty file means all defaults
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{label}: the top level must be a mapping of keys to values, got {type(data).__name__}")
        return self._merged((_known_key(key, key, label), value, f"{label}: {key}") for key, value in data.items())

    def _merged(self, items: Iterable[tuple[str, object, str]]) -> "EngineConfig":
        """Apply (key, raw value, label) triples; errors are labelled here, before __post_init__ sees the values.

        An LMCache key KVMesh does not act on warns once; if it is no field, its value goes nowhere."""
        changes: dict[str, object] = {}
        for key, raw, where in items:
            value = raw
            if key in _KINDS:
                kind, optional = _KINDS[key]
                value = changes[key] = _check(key, _coerce(raw, kind, optional, where), where)
            if key in IGNORED:
                warn_ignored(key, value, where)
        return replace(self, **changes)


def load_engine_config(
    extra: Mapping[str, object] | None = None, *, environ: Mapping[str, str] | None = None
) -> EngineConfig:
    """What the connector uses: file and env (``from_env``), then vLLM's ``kv_connector_extra_config``."""
    config = EngineConfig.from_env(environ)
    if extra:
        config = config.with_overrides(extra, "kv_connector_extra_config")
    config.check_combination()
    return config


# ---- parsing and checks ---------------------------------------------------------------------------------------
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE_TEXT = frozenset({"none", "null", ""})  # LMCache's docs write "None if disabled"
_EXPECTED = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "a JSON/YAML mapping",
             list: "a list of TCP ports (YAML list, JSON list or comma-separated)"}

_POSITIVE = (lambda v: v > 0, "must be > 0")
_NON_NEGATIVE = (lambda v: v >= 0, "must be >= 0")
_AT_LEAST_ONE = (lambda v: v >= 1, "must be >= 1")
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "chunk_size": _POSITIVE,
    "max_local_cpu_size": _NON_NEGATIVE,
    "max_local_disk_size": _NON_NEGATIVE,
    "remote_size": _POSITIVE,
    "remote_prefault_size": _NON_NEGATIVE,
    "blocking_timeout_secs": _POSITIVE,
    "request_timeout_secs": _POSITIVE,
    "heartbeat_interval_secs": _POSITIVE,
    "nats_auth_retry_secs": _NON_NEGATIVE,
    "remote_partitions": _AT_LEAST_ONE,
    "p2p_max_connections": _AT_LEAST_ONE,
    "p2p_max_connections_per_peer": _AT_LEAST_ONE,
    "p2p_max_pending_connections": _AT_LEAST_ONE,
    "p2p_max_pending_per_address": _AT_LEAST_ONE,
    "p2p_hello_timeout_secs": _POSITIVE,
    "p2p_idle_timeout_secs": _POSITIVE,
    "p2p_ticket_max_gb": _POSITIVE,
    "p2p_ticket_max_mb_per_s": _POSITIVE,
    "p2p_stream_connections": _AT_LEAST_ONE,
    "p2p_init_ports": (lambda v: all(0 < port < 65536 for port in v), "every port must be 1-65535"),
    "store_queue_size": _AT_LEAST_ONE,
    "lookup_timeout_secs": _POSITIVE,
    "pd_hint_wait_secs": _POSITIVE,
    "write_behind_workers": _AT_LEAST_ONE,
    "write_behind_defer_secs": _NON_NEGATIVE,
    "write_behind_idle_secs": _POSITIVE,
    "fetch_concurrency": _AT_LEAST_ONE,
    "prefetch_cpu_share": (lambda v: 0 <= v <= 1, "must be between 0 and 1"),
    "retained_cpu_share": (lambda v: 0 <= v <= 1, "must be between 0 and 1"),
    "evicted_hold_share": (lambda v: 0 <= v <= 0.5, "must be between 0 and 0.5"),
    "retained_redis_share": (lambda v: 0 <= v <= 1, "must be between 0 and 1"),
    "known_held_keys": _NON_NEGATIVE,
    "kv_event_chunks": _NON_NEGATIVE,
    "touch_interval_secs": _POSITIVE,
    "disk_data_timeout_secs": _POSITIVE,
    "remote_min_transfer_mb_per_s": _POSITIVE,
    "remote_retry_interval_secs": _NON_NEGATIVE,
    "remote_stream_connections": _AT_LEAST_ONE,
    "redis_timeout_secs": _POSITIVE,
    "redis_chunk_ttl_secs": (lambda v: v >= 1, "must be >= 1 (Redis expiries are in whole milliseconds)"),
    "redis_key_prefix": (prefix_ok, PREFIX_RULE),
    "blend_min_tokens": _NON_NEGATIVE,
    "min_retrieve_tokens": _NON_NEGATIVE,
    "blend_recompute_ratio": (lambda v: 0 <= v <= 1, "must be between 0 and 1"),
    "lmcache_worker_port": (lambda v: 0 < v < 65536, "must be a TCP port (1-65535)"),
    "lmcache_instance_id": (lambda v: v != "", "must not be empty"),
    # another scheme ("s3://...") here is a mistake, not a local path
    "local_disk": (lambda v: "://" not in v or v.startswith("file://"), "must be a path or a file:// URL"),
}
# key -> why a value is refused (None: it is fine), for checks with more to say than one rule
_EXPLAINED: dict[str, Callable[[Any], str | None]] = {
    "remote_url": remote_url_problem, "nats_url": nats_url_problem, "controller_url": nats_url_problem,
    "remote_auth_secret_file": secret_file_problem}
# key -> (allowed values, normalisation); matching is case-insensitive
_CHOICES: dict[str, tuple[frozenset[str], Callable[[str], str]]] = {
    "remote_serde": (REMOTE_SERDES, str.lower),
    "cache_policy": (CACHE_POLICIES, str.upper),
    "cpu_load_pipeline": (CPU_LOAD_PIPELINE, str.lower),
}


def _field_kinds() -> dict[str, tuple[type, bool]]:
    """Field name -> (base type, whether None is allowed), read from the dataclass annotations."""
    kinds: dict[str, tuple[type, bool]] = {}
    for f in fields(EngineConfig):
        tp, optional = f.type, False
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp, optional = next(a for a in typing.get_args(tp) if a is not type(None)), True
        kinds[f.name] = (typing.get_origin(tp) or tp, optional)
    return kinds


_KINDS = _field_kinds()


def _coerce(value: object, kind: type, optional: bool, where: str) -> object:
    """Convert ``value`` to ``kind``: lenient on text ("5" -> 5.0, "yes" -> True), strict on anything else."""
    text = value.strip() if isinstance(value, str) else None
    if value is None or (optional and text is not None and text.lower() in _NONE_TEXT):
        if optional:
            return None  # a required key given None/null falls through to the error below
    elif kind is str:
        if text is not None:
            return value
    elif kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if text is not None and text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
    elif kind is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if text is not None:
            try:
                return int(text)
            except ValueError:
                pass
        number = _to_float(value)
        if number is not None and number.is_integer():  # "5.0" and 5.0 are fine; 5.5 is not an integer
            return int(number)
    elif kind is float and not isinstance(value, bool):
        number = _to_float(value)
        if number is not None:
            return number
    elif kind is dict:
        if text is not None:  # env vars carry a JSON object
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: expected a JSON object, got {value!r} ({exc.msg})") from exc
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
    elif kind is list:  # of ports: "8200,8201", "[8200, 8201]" (env vars) or a YAML list
        if text is not None:
            try:
                value = json.loads(text) if text.startswith("[") else [part for part in text.split(",") if part.strip()]
            except json.JSONDecodeError:
                pass
        if isinstance(value, (list, tuple)):
            ports = [_coerce(item, int, False, where) for item in value]
            return ports
    shown = repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"
    raise ConfigError(f"{where}: expected {_EXPECTED[kind]}, got {shown}")


def _to_float(value: object) -> float | None:
    """A finite float from a number or numeric text, else None (inf/nan would slip past range checks)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _check(key: str, value: Any, where: str) -> Any:
    """Range and choice checks of one already-typed value; returns it normalised."""
    if value is None:
        return None
    if key in _CHOICES:
        allowed, normalise = _CHOICES[key]
        if normalise(value) not in allowed:
            raise ConfigError(f"{where}: must be one of {', '.join(sorted(allowed))}, got {value!r}")
        return normalise(value)
    rule = _RULES.get(key)
    if rule is not None and not rule[0](value):
        raise ConfigError(f"{where}: {rule[1]}, got {value!r}")
    problem = _EXPLAINED[key](value) if key in _EXPLAINED else None
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    return value


def _closest(name: str) -> str | None:
    matches = difflib.get_close_matches(name.lower(), sorted(_KINDS.keys() | LMCACHE_KEYS.keys()), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _known_key(key: object, shown: object, where: str) -> str:
    if isinstance(key, str) and (key in _KINDS or key in IGNORED):
        return key
    close = _closest(key) if isinstance(key, str) else None
    hint = f" (did you mean {close!r}?)" if close else ""
    raise ConfigError(f"{where}: unknown key {shown!r}{hint}")


def _unquote(text: str) -> str:
    """Env values: surrounding whitespace and one pair of matching quotes go (shells and .env files leave them)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
