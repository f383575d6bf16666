"""KVMeshConnector's worker half (each vLLM worker process, on the thread that runs the model).

It holds vLLM's calls and nothing else: it creates the rank's `CacheEngine` when vLLM registers its KV caches,
makes one load per request of each step (adapter/request_load.py: before the forward, layer by layer on CUDA,
or between steps: adapter/async_loads.py), hands the step's saves to adapter/saves.py after it
(adapter/async_saves.py on CUDA), and reports load errors, finished requests and the CPU tier's admissions and
evictions back to vLLM. The scheduler half plans what it does
(adapter/scheduler_side.py); connector.py (the facade vLLM loads) says which vLLM call lands where.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from kvmesh.services.engine.adapter.async_loads import IDLE_WAIT_SECS, AsyncLoads
from kvmesh.services.engine.adapter.async_saves import AsyncSaves
from kvmesh.services.engine.adapter.connector_stats import (CPU_COUNTERS, STORAGE_COUNTERS, GaugeClock, Increments,
                                                            KVMeshStats)
from kvmesh.services.engine.adapter.cpu_leases import leases, release_lease
from kvmesh.services.engine.adapter.kv_groups import STATE, KVGroups, page_view
from kvmesh.services.engine.adapter.load_agreement import CollectiveAgreement, RankAgreement
from kvmesh.services.engine.adapter.request_load import LoadFailures, RequestLoad, agree_on_loads
from kvmesh.services.engine.adapter.request_meta import KVMeshConnectorMetadata, ReqMeta
from kvmesh.services.engine.adapter.request_slots import RequestSlots
from kvmesh.services.engine.adapter.saves import Saves
from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents, StepEventLog, evicted_hold_slots
from kvmesh.services.engine.adapter.scheduler_lookup import engines
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core.layer_pipeline import LayerPipeline
from kvmesh.services.engine.core.layerwise_load import ChunkCopy, LayerwiseLoader
from kvmesh.services.engine.mesh import side_cpus
from kvmesh.shared.wire.keys import KeyParams

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    from kvmesh.services.engine.assembly import SchedulerLink
    from kvmesh.services.engine.core.kv_layout import KVLayout

LAYERWISE_NOTE = (
    "use_layerwise is set, but on a CPU vLLM it does not apply: in-step loads are written layer by layer beside "
    "the forward where a core is free beside vLLM's compute cores (cpu_load_pipeline, see docs/connector.md)."
)

log = logging.getLogger("kvmesh.connector")


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


class WorkerSide:
    """The connector's worker-side state and calls: the rank's cache engine, its loads, saves and load errors.

    `engine` and `kv_caches` are set by register_kv_caches; `layerwise` (CUDA with use_layerwise) and
    `agreement` (several ranks) too. A test that brings its own engine sets them itself."""

    def __init__(self, config: EngineConfig, block_size: int, *, vllm_config: Any = None, model_name: str = "",
                 cache_dtype: str = "auto", world_size: int = 1, unsupported: str | None = None,
                 saves_off_forward: bool = False, groups: KVGroups | None = None, latent_kv: bool = False) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.model_name = model_name  # the model the cache keys name (adapter/model_identity.py)
        self.cache_dtype = cache_dtype
        self.world_size = world_size
        # Why this model's KV is not cached at all (None: it is); see connector.unsupported_kv_cache.
        self.unsupported = unsupported
        # vLLM's KV cache groups when copies need each group's block table (kv_groups.py), else None
        self.groups = groups if groups is not None and groups.grouped else None
        # MLA: one latent vector per token, which vLLM's CPU MLA backends store token by token (kv_layout.py)
        self.latent_kv = latent_kv
        self.engine: Any = None  # CacheEngine, created in register_kv_caches
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layerwise: LayerwiseLoader | None = None  # CUDA with use_layerwise: per-layer loads
        self.pipeline: LayerPipeline | None = None  # CPU: in-step loads written beside the forward
        self._piped: list[RequestLoad] = []  # this step's in-step loads given the pipeline
        self._step_requests: list[ReqMeta] = []  # this step's requests (for load errors found after the forward)
        self.agreement: RankAgreement | None = None  # several ranks: how far every rank's loads got
        self._link: SchedulerLink | None = None  # what the engine offers the scheduler (assembly.py)
        self._where = RequestSlots(block_size, self.chunk_size, self.groups)
        self._failures = LoadFailures()  # load errors, and how far saves may reach after a failed load
        self.async_loads = AsyncLoads(config.blocking_timeout_secs)  # loads between steps
        self._finished_recving: set[str] = set()  # async loads done this step, reported to vLLM
        # on CUDA saves are gathered after the forward without a host wait and vLLM holds their blocks; with
        # groups on the forward's stream, else on a side stream (async_saves.py)
        self.saves_off_forward = saves_off_forward
        # those saves in flight, the requests whose blocks are held
        self.async_saves = AsyncSaves(on_forward_stream=self.groups is not None)
        self.cpu_events = StepEventLog()  # the CPU tier's admissions and evictions, for the scheduler's mirror
        # metrics: what happened since vLLM last asked (get_kv_connector_stats)
        self._stats = KVMeshStats()
        self._gauge_clock = GaugeClock()
        self._storage_increments = Increments(STORAGE_COUNTERS)
        self._cpu_increments = Increments(CPU_COUNTERS)
        self._saves = Saves(self._where, self._failures, self._stats)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvmesh.services.engine.assembly import SchedulerLink, build_engine
        from kvmesh.services.engine.core.kv_layout import detect_layout

        if self.unsupported is not None:
            log.info("KVMesh is off for this model (%s)", self.unsupported)
            return
        if self.world_size > 1 and self.agreement is None:  # before anything that may fail: every rank takes
            self.agreement = CollectiveAgreement.of_replica()  # part (load_agreement.py); kept if already set
        backend = self._attention_backend_name()
        try:
            self.kv_caches = self._in_chunk_order(kv_caches)
            layout = dataclasses.replace(detect_layout(self.kv_caches, self.block_size, backend),
                                         cache_dtype=self.cache_dtype)
            if self.groups is not None:
                layout = dataclasses.replace(layout, group_layers=self.groups.layers_per_group(),
                                             groups_tag=self.groups.tag)
            layout.check_chunk_size(self.chunk_size)  # e.g. a hybrid model's block size unified past it
        except ValueError as exc:  # layers that differ, a shape or chunk size we cannot copy: serve uncached
            log.warning("KVMesh loads and stores nothing for model %s: its KV caches cannot be copied (%s)",
                        self.vllm_config.model_config.model, exc)
            self.kv_caches = {}
            return
        first = next(iter(self.kv_caches.values()))
        rank = replica_rank(self.vllm_config)
        log.info("registered %d KV cache layers: shape %s, dtype %s, backend %s -> layout %s (chunk format %s)",
                 len(kv_caches), tuple(first.shape), first.dtype, backend, layout.name, layout.chunk_format())
        if self.groups is not None:
            state_bytes = layout.chunk_nbytes(layout.state_block, state=True) if layout.has_state else 0
            log.info("KV cache groups per %d-token chunk: %s", self.chunk_size,
                     self.groups.describe(layout.chunk_nbytes(self.chunk_size), state_bytes))
        params = KeyParams(self.model_name, layout.chunk_format(), self.world_size, rank)
        if first.device.type == "cpu":
            side_cpus.enable()  # the engine's threads keep off the cores vLLM bound its compute to
        self.engine = build_engine(self.config, params, layout=layout, device=first.device)
        if self.groups is not None:  # the scheduler may plan in-step loads from its mirror (cpu_mirror.py)
            self.cpu_events.hold_slots = evicted_hold_slots(self.config, self.engine.cpu.pool.num_slots)
        self._link = SchedulerLink(self.engine, self.cpu_events,  # events sent with every step's output
                                   self.cpu_events if self.cpu_events.hold_slots > 0 else None)
        if self.config.use_layerwise:
            if self.groups is not None:  # every load runs between steps (kv_groups.py): no forward to overlap
                log.info("use_layerwise is set, but with KV cache groups every load runs between steps; loading "
                         "all layers at once")
            elif first.is_cuda:
                self.layerwise = LayerwiseLoader(layout, first.device)
                log.info("use_layerwise: loads are copied layer by layer on a side CUDA stream")
            else:
                log.info(LAYERWISE_NOTE)
        self.pipeline = self._cpu_pipeline(layout, first)
        engines.add(rank, self.engine)

    def _cpu_pipeline(self, layout: "KVLayout", first: torch.Tensor) -> LayerPipeline | None:
        """The CPU's layer pipeline (core/layer_pipeline.py), where `cpu_load_pipeline` and the model allow it:
        no recurrent state group (a state is written after its chunks), one rank (ranks agree on their loads
        before the forward), a known token arrangement in a block (else a partial block is written whole, over the
        tokens vLLM writes into it before the attention waits), and for "auto" a core beside vLLM's compute
        cores."""
        mode = self.config.cpu_load_pipeline
        if mode == "never" or first.device.type != "cpu" or not layout.per_block:
            return None
        groups = self.groups
        why_not = ("a recurrent state is written after its chunks" if groups is not None and groups.has_state
                   else "several ranks" if self.world_size > 1
                   else f"CPU ISA {layout.cpu_isa!r} arranges a block's tokens in a way KVMesh does not know"
                   if not layout.knows_token_arrangement else None)
        if why_not is not None:
            log.info("cpu_load_pipeline: in-step loads are written before the forward (%s)", why_not)
            return None
        cpus = side_cpus.free_cpus()
        if mode == "auto" and cpus is None:
            log.info("cpu_load_pipeline: no core is free beside vLLM's compute cores; in-step loads are written "
                     "before the forward")
            return None
        log.info("cpu_load_pipeline: in-step loads are written layer by layer during the forward, on CPUs %s",
                 sorted(cpus) if cpus is not None else "shared with the forward")
        return LayerPipeline(list(self.kv_caches))

    def _in_chunk_order(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layers as chunks hold them: vLLM's order, or group by group (kv_groups.py)."""
        if self.groups is None:
            return dict(kv_caches)
        order = self.groups.layer_order()
        missing = [name for name in order if name not in kv_caches]
        if missing or len(order) != len(kv_caches):
            raise ValueError(f"the KV cache groups name layers {missing or order} that vLLM did not register as "
                             f"{sorted(kv_caches)}")
        states = {name for group in self.groups.groups if group.kind == STATE for name in group.layer_names}
        template = next(kv_caches[name] for name in order if name not in states)
        # a state layer's pages, seen as an attention layer's: one layout copies whole pages of both
        return {name: page_view(kv_caches[name], template) if name in states else kv_caches[name]
                for name in order}

    def handle_preemptions(self, kv_connector_metadata: "KVConnectorMetadata") -> None:
        """Worker, before the step's forward: vLLM freed the preempted requests' blocks, and this step may
        write other requests' KV into them. Their saves still copying are ordered before that write (the
        forward's stream waits for their events); a load for them never scatters into those blocks."""
        if not isinstance(kv_connector_metadata, KVMeshConnectorMetadata) or not kv_connector_metadata.preempted:
            return
        preempted = kv_connector_metadata.preempted
        device = next(iter(self.kv_caches.values())).device if self.kv_caches else None
        waited = self.async_saves.order_before_reuse(preempted, device)
        dropped = self.async_loads.discard(preempted)
        if waited or dropped:
            log.info("preempted %d requests: %d saves ordered before their blocks' reuse, %d loads dropped",
                     len(preempted), waited, len(dropped))

    def start_load_kv(self, metadata: "KVConnectorMetadata | None") -> None:
        """Before the forward, with the step's metadata (None: vLLM bound none)."""
        if self.engine is not None:  # the write-behind waits for the forward's end (core/write_behind.py)
            self.engine.forward_started()
        if metadata is None:
            return
        assert isinstance(metadata, KVMeshConnectorMetadata)
        self._failures.still_wrong(metadata.unrecomputed)
        if self.engine is not None:
            for req in metadata.requests:
                if req.lora_name and req.lora_id:
                    self.engine.note_lora(req.lora_name, req.lora_id)
                if req.load is not None and req.kv_params.retention.asked:  # what it loads is kept as it asks
                    self.engine.retain(req.keys_upto(req.load.end, self.engine.config.chunk_size, req.load.last_key),
                                       req.load.end, req.kv_params.retention)
        loads = [self.request_load(req) for req in metadata.requests if req.load is not None]
        in_step = [load for load in loads if not load.spec.asynchronous]
        if self.engine is None:  # nothing to load from: recomputed (still agreed on with the other ranks)
            for load in in_step:
                load.fail(load.spec.skip_prefix)
            agree_on_loads(in_step, self.agreement)
            return
        for load in in_step:  # what the scheduler leased for it in this process (cpu_leases.py), if it did
            load.leased = leases.take(load.req.req_id, self.engine.rank)
            load.pipeline = self.pipeline
        self._step_requests = list(metadata.requests)
        self._piped = in_step if self.pipeline is not None else []
        layerwise: list[tuple[RequestLoad, list[ChunkCopy], list[Any]]] = []
        for load in loads:
            try:
                self._start_load(load, layerwise)
            except Exception as exc:  # never into vLLM's model runner: the whole load is recomputed
                log.warning("loading KV for request %s failed (%s: %s); vLLM recomputes it", load.req.req_id,
                            type(exc).__name__, exc)
                load.fail(load.spec.skip_prefix)
            finally:  # what the load did not read (chunks before its mask, a load not run)
                release_lease(load.leased)
        if layerwise:
            self._start_layerwise(layerwise)
        if self.pipeline is not None:
            self.pipeline.launch(list(self.kv_caches.values()))
        # the step's loads took their references: evictions the scheduler saw before planning them may go
        seen = metadata.evictions_seen
        self.cpu_events.seen(seen.get(self.engine.rank) if seen is not None else None)
        agree_on_loads(in_step, self.agreement)
        self._failures.cut_sharers(metadata.requests, self.block_size)

    def request_load(self, req: ReqMeta) -> RequestLoad:
        """The request's load of this step (request_load.py), into this worker's caches."""
        return RequestLoad(req, self.engine, self.kv_caches, self._where, self._failures, self._stats)

    def _start_load(self, load: RequestLoad, layerwise: list[tuple[RequestLoad, list[ChunkCopy], list[Any]]]
                    ) -> None:
        req_id = load.req.req_id
        if load.lacks_state():  # nothing to resume from
            load.fail(load.spec.skip_prefix)
            self._finished_recving.add(req_id)
            return
        if load.spec.asynchronous:
            self.async_saves.unhold(req_id)  # vLLM holds its blocks for the load (see unhold)
            fetched = load.fetch()
            if fetched is not None:
                self.async_loads.add(load, fetched)
            else:  # no lower tier to fetch from now: load at once
                load.run()
                self._finished_recving.add(req_id)
        elif self.layerwise is not None:
            layerwise.append((load, *load.for_layers(next(iter(self.kv_caches.values())).device)))
        else:
            load.run()

    def _start_layerwise(self, loads: list[tuple[RequestLoad, list[ChunkCopy], list[Any]]]) -> None:
        """Queue every layer's copies of this step's loads; wait_for_layer_load(layer) waits for its own."""
        assert self.layerwise is not None
        copies = [c for _, cs, _ in loads for c in cs]
        refs = [r for _, _, rs in loads for r in rs]
        try:
            self.layerwise.start(self.kv_caches, copies, refs)
        except Exception as exc:  # nothing is known to be in the blocks: every load of the step is recomputed
            log.warning("loading KV layer by layer failed (%s: %s); vLLM recomputes %d requests' loads",
                        type(exc).__name__, exc, len(loads))
            for load, _, _ in loads:
                load.fail(load.spec.skip_prefix)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.layerwise is not None:  # CUDA with use_layerwise: this layer's copies, on the forward's stream
            self.layerwise.wait(layer_name)
        elif self.pipeline is not None:  # CPU: this layer's writes, on the pipeline's thread
            self.pipeline.wait(layer_name)
        # otherwise all layers were loaded in start_load_kv

    def _end_pipeline(self) -> None:
        """After the forward: the pipeline's writes done; if they failed, the step's pipelined loads are load
        errors (and what other requests of the step computed over them: `LoadFailures.cut_sharers`)."""
        if self.pipeline is None:
            return
        error = self.pipeline.finish()
        piped, self._piped = self._piped, []
        if error is None or not piped:
            return
        for load in piped:
            bad = load.fail(load.spec.skip_prefix)
            self._stats.count("lmcache:num_failed_retrieve_blocks", len(bad))
        log.warning("%d requests' loads are recomputed: writing them during the forward failed (%s: %s)",
                    len(piped), type(error).__name__, error)
        self._failures.cut_sharers(self._step_requests, self.block_size)

    def wait_for_save(self, metadata: "KVConnectorMetadata | None") -> None:
        """After the forward, with the step's metadata (None: vLLM bound none)."""
        self._end_pipeline()
        if not isinstance(metadata, KVMeshConnectorMetadata):
            return
        if self.layerwise is not None:
            self.layerwise.finish()
        saves = [req for req in metadata.requests if req.save is not None]
        if self.saves_off_forward:
            for req in saves:  # the scheduler holds their blocks: report them whatever becomes of the save
                self.async_saves.hold(req.req_id)
        if self.engine is None:
            return
        stream = None
        if self.saves_off_forward and self.kv_caches:
            stream = self.async_saves.stream(next(iter(self.kv_caches.values())).device)
        self._saves.save_step(self.engine, self.kv_caches, saves, stream, self.async_saves)

    def get_kv_connector_stats(self) -> KVMeshStats | None:
        if self.engine is not None:
            usage = self.engine.usage()
            self._storage_increments.add_to(self._stats, usage.counters)
            self._cpu_increments.add_to(self._stats, usage.cpu_counters)
            if self._gauge_clock.due(self._stats):
                self._stats.set_gauge("lmcache:local_cache_usage", usage.cpu_bytes)
                self._stats.set_gauge("lmcache:pinned_memory_objs_count", usage.cpu_chunks)
                self._stats.set_gauge("lmcache:lmcache_is_healthy", float(usage.healthy))
                self._stats.set_gauge("lmcache:chunk_bytes", usage.chunk_bytes)
                self._stats.set_gauge("lmcache:state_bytes", usage.state_bytes)
        return self._stats.take()

    def get_finished(self, finished_req_ids: set[str], metadata: "KVConnectorMetadata | None"
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(the ended requests whose blocks vLLM held for their saves' copies, now done; the async loads done
        this step, scattered here between forwards). Called after start_load_kv and wait_for_save in every
        step, forward or not."""
        self._end_pipeline()  # also where vLLM defers wait_for_save past this call (a drafter's forward)
        if self.engine is not None:
            self.engine.forward_ended()
        sending = self.async_saves.finished_sending(finished_req_ids) or None
        if self.layerwise is not None:
            self.layerwise.release_done()
        if self.engine is None:
            return sending, None
        for pending in self.async_loads.discard(finished_req_ids):  # aborted while loading: no scatter
            self._finished_recving.add(pending.load.req.req_id)
        self._failures.forget(finished_req_ids)
        if len(self.async_loads) and isinstance(metadata, KVMeshConnectorMetadata) and metadata.idle:
            self.async_loads.wait(IDLE_WAIT_SECS)  # nothing else to run: do not spin through empty steps
        for pending in self.async_loads.take_ready():
            pending.load.finish(pending.fetched)
            self._finished_recving.add(pending.load.req.req_id)
        done, self._finished_recving = self._finished_recving, set()
        return sending, done or None

    def take_failed_recving(self) -> set[str]:
        """With groups: the requests whose load failed since the last call (vLLM recomputes them)."""
        return self._failures.take_failed_recving()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._failures.take_block_errors()

    def build_connector_worker_meta(self) -> CpuTierEvents | None:
        if self.engine is None:
            return None
        first, events = self.cpu_events.take_numbered()
        evicted = sum(1 for admitted, _ in events if not admitted)
        if evicted:
            self._stats.count("lmcache:local_cpu_evict_count", evicted)
        return CpuTierEvents({self.engine.rank: events}, {self.engine.rank: first}) if events else None

    def shutdown(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None
        self.async_loads.abandon_all()
        self.async_saves.drain()
        if self.layerwise is not None:
            self.layerwise.close()
        if self.pipeline is not None:
            self.pipeline.close()
        engine, self.engine = self.engine, None
        if engine is not None:
            engines.remove(engine)
            engine.close()

    def _attention_backend_name(self) -> str | None:
        try:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():  # CPU_MLA / AMX_MLA pages are token-major, CPU_ATTN's per head
                return "CPU_MLA" if self.latent_kv else "CPU_ATTN"
        except Exception:
            pass
        try:
            context = self.vllm_config.compilation_config.static_forward_context
            for layer in context.values():
                backend = getattr(layer, "attn_backend", None) or getattr(layer, "get_attn_backend", lambda: None)()
                if backend is not None:
                    return str(backend.get_name())
        except Exception:
            pass
        return None
