"""Every key of LMCache's configuration, and what KVMesh does with it.

A key KVMesh honours is a field of `EngineConfig` (services/engine/config/engine_config.py) that the engine acts on.
Every other LMCache key is accepted, so that an LMCache file or `LMCACHE_<KEY>` variable starts vLLM as it did, and logs
ONE warning per key per process naming the key and what KVMesh does instead. A key that LMCache does not know either
stays a `ConfigError` (services/engine/config/engine_config.py). docs/config.md lists this table ("Every LMCache key");
tests/test_docs.py checks that it does.

`remote_url` is honoured for the schemes in `REMOTE_SCHEMES`; `remote_url_problem` says why another is refused.
"""

import logging

from kvmesh.shared.messaging.nats_url import NATS_SCHEMES, problem as nats_url_problem
from kvmesh.shared.wire.redis_url import SCHEMES as REDIS_SCHEMES, VALKEY_MODE_KEY

log = logging.getLogger("kvmesh.config")

HONOURED = None  # the table's value for a key KVMesh acts on (docs/config.md, "Engine keys")

# What KVMesh does instead, for the groups of keys that share an answer.
_LAZY_POOL = "KVMesh maps its whole CPU pool (max_local_cpu_size, in /dev/shm when it fits) at start"
_GDS = "KVMesh has no GPUDirect Storage backend; local_disk (the host's disk store) is its disk tier"
_CONTROLLER_LINK = "engines and the controller talk over NATS (controller_url or nats_url); no port is opened"
_P2P = ("KVMesh finds peers through the controller over NATS and serves each worker's stream on p2p_host and "
        "p2p_init_ports; there is no lookup port or transfer channel to choose")
_PD = ("vLLM's kv_role (kv_producer / kv_consumer) gives the role; the consumer loads the producer's chunks over the "
       "P2P streams (p2p_host / p2p_init_ports), from the producer its request's kv_transfer_params name")
_BLEND = "KVMesh reuses exact prefixes only (no CacheBlend); the key is not used"
_API_SERVER = "KVMesh opens no API server inside vLLM; the controller's REST API serves the cache"

# key -> HONOURED, or what KVMesh does instead (the text of the key's one warning).
LMCACHE_KEYS: dict[str, str | None] = {
    # core
    "chunk_size": HONOURED,
    "local_cpu": HONOURED,
    "max_local_cpu_size": HONOURED,
    "local_disk": HONOURED,
    "max_local_disk_size": HONOURED,
    "remote_url": HONOURED,
    "remote_serde": "KVMesh always stores chunks as raw bytes, as 'naive' does; the value is not used",
    "save_decode_cache": HONOURED,
    "save_unfull_chunk": HONOURED,
    "blocking_timeout_secs": HONOURED,
    "min_retrieve_tokens": HONOURED,
    "cache_policy": HONOURED,
    "use_layerwise": HONOURED,
    "pre_caching_hash_algorithm": "KVMesh's chunk keys use its own hash (shared/wire/keys.py), the same in every "
                                  "process",
    "py_enable_gc": "KVMesh leaves Python's garbage collector as vLLM set it",
    "numa_mode": "KVMesh does not bind its CPU pool to NUMA nodes",
    "external_lookup_client": "vLLM's scheduler asks KVMesh's workers itself (docs/connector.md); no external "
                              "lookup client is used",
    "priority_limit": "KVMesh stores the chunks of every request, whatever its priority",
    "retrieve_buffer_size": "KVMesh copies chunks from its CPU pool straight into vLLM's paged cache; there is "
                            "no retrieve buffer",
    "extra_config": "KVMesh reads no extra_config sub-key but valkey_mode",
    "plugin_locations": "KVMesh loads no plugins",
    "audit_actual_remote_url": "KVMesh has no audit backend",
    "error_handling": "KVMesh always turns a failure into a miss or a recompute, never a failed request",
    "use_experimental": "KVMesh has one engine; there is nothing to choose",
    # CPU memory
    "local_cpu_use_hugepages": "KVMesh maps its CPU pool with the system's default pages",
    "reserve_local_cpu_size": "KVMesh reserves no CPU memory beyond max_local_cpu_size",
    "enable_lazy_memory_allocator": _LAZY_POOL,
    "lazy_memory_initial_ratio": _LAZY_POOL,
    "lazy_memory_expand_trigger_ratio": _LAZY_POOL,
    "lazy_memory_step_ratio": _LAZY_POOL,
    "lazy_memory_safe_size": _LAZY_POOL,
    # disk and GPUDirect Storage
    "local_disk_path_sharding": "a host's disk store keeps one directory (local_disk or its --dir) for every "
                                "GPU and rank",
    "gds_path": _GDS,
    "gds_buffer_size": _GDS,
    "gds_path_sharding": _GDS,
    "gds_backend": _GDS,
    "use_gds": _GDS,
    "cufile_buffer_size": _GDS,
    # controller
    "enable_controller": "an engine on a mesh always registers with the controller",
    "lmcache_instance_id": HONOURED,
    "controller_url": HONOURED,
    "controller_pull_url": _CONTROLLER_LINK,
    "controller_reply_url": _CONTROLLER_LINK,
    "lmcache_worker_port": _CONTROLLER_LINK,
    "lmcache_worker_ports": _CONTROLLER_LINK,
    "lmcache_worker_url": _CONTROLLER_LINK,
    "distributed_url": _CONTROLLER_LINK,
    # peer to peer
    "enable_p2p": HONOURED,
    "lookup_url": _P2P,
    "p2p_host": HONOURED,
    "p2p_init_ports": HONOURED,
    "p2p_lookup_ports": _P2P,
    "peer_init_ports": _P2P,
    "peer_lookup_ports": _P2P,
    "transfer_channel": _P2P,
    # prefill/decode disaggregation (and its older nixl_* names)
    "enable_pd": HONOURED,
    "pd_role": _PD,
    "pd_buffer_size": _PD,
    "pd_buffer_device": _PD,
    "pd_peer_host": _PD,
    "pd_peer_init_port": _PD,
    "pd_peer_alloc_port": _PD,
    "pd_proxy_host": _PD,
    "pd_proxy_port": _PD,
    "nixl_backends": _PD,
    "enable_nixl": _PD,
    "nixl_role": _PD,
    "nixl_receiver_host": _PD,
    "nixl_receiver_port": _PD,
    "nixl_buffer_size": _PD,
    "nixl_buffer_device": _PD,
    "nixl_enable_gc": _PD,
    # blending
    "enable_blending": _BLEND,
    "blend_recompute_ratio": _BLEND,
    "blend_recompute_ratios": _BLEND,
    "blend_min_tokens": _BLEND,
    "blend_check_layers": _BLEND,
    "blend_special_str": _BLEND,
    # asynchronous loading and events
    "enable_async_loading": HONOURED,
    "enable_kv_events": "KVMesh publishes no vLLM KV events; the controller's index follows the engines over NATS",
    # internal API server
    "internal_api_server_enabled": _API_SERVER,
    "internal_api_server_host": _API_SERVER,
    "internal_api_server_port_start": _API_SERVER,
    "internal_api_server_include_index_list": _API_SERVER,
    "internal_api_server_socket_path_prefix": _API_SERVER,
}
IGNORED: dict[str, str] = {key: note for key, note in LMCACHE_KEYS.items() if note is not None}

# remote_url: scheme -> what KVMesh makes of it. The NATS schemes name the NATS whose remote stores to use;
# "lm" (LMCache's own server) and "kvmesh" mean KVMesh's remote store, embedded when no NATS is configured.
# NATS (the mesh's remote stores), KVMesh's own remote store, and Redis / Valkey (shared/wire/redis_url.py)
REMOTE_SCHEMES = NATS_SCHEMES | {"lm", "kvmesh"} | REDIS_SCHEMES

_warned: set[str] = set()  # keys warned about in this process


def url_scheme(url: str) -> str | None:
    """The lower-cased scheme of `url`, or None when it has none."""
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else None


def remote_url_problem(url: str) -> str | None:
    """Why KVMesh cannot serve `url` as `remote_url`, or None when it can."""
    scheme = url_scheme(url)
    if scheme in NATS_SCHEMES:  # the NATS to join, maybe a cluster's servers
        return nats_url_problem(url)
    if scheme in REMOTE_SCHEMES:
        return None
    supported = ", ".join(f"{s}://" for s in sorted(REMOTE_SCHEMES))
    shown = f"scheme {scheme}://" if scheme else "no scheme"
    return f"{url!r} has {shown}, which KVMesh does not serve (supported: {supported})"


def warn_ignored(key: str, value: object, where: str) -> None:
    """The one warning of an LMCache key KVMesh does not act on; extra_config warns once per sub-key."""
    if key == "extra_config" and isinstance(value, dict):
        for sub in value:
            if sub != VALKEY_MODE_KEY:  # read with a valkey:// remote_url (shared/wire/redis_url.py)
                _warn_once(f"extra_config.{sub}", where, IGNORED[key])
    elif key != "extra_config":
        _warn_once(key, where, IGNORED[key])


def _warn_once(name: str, where: str, note: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    log.warning("LMCache key %s (%s) is accepted and not used: %s", name, where, note)
