"""KVMeshConnector's worker half (each vLLM worker process, on the thread that runs the model).

It creates the rank's `CacheEngine` when vLLM registers its KV caches, loads each step's prefixes into the paged
cache before the forward (synchronously, layer by layer on CUDA, or between steps: adapter/async_loads.py),
gathers newly computed chunks after it (adapter/async_saves.py on CUDA), and reports load errors, finished
requests and the CPU tier's admissions and evictions back to vLLM. The scheduler half plans what it does
(adapter/scheduler_side.py); connector.py (the facade vLLM loads) says which vLLM call lands where.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvmesh.services.engine.adapter.async_loads import IDLE_WAIT_SECS, AsyncLoads, PendingLoad
from kvmesh.services.engine.adapter.async_saves import AsyncSaves
from kvmesh.services.engine.adapter.connector_stats import STORAGE_COUNTERS, GaugeClock, Increments, KVMeshStats
from kvmesh.services.engine.adapter.kv_groups import STATE, KVGroups, page_view
from kvmesh.services.engine.adapter.load_agreement import CollectiveAgreement, RankAgreement
from kvmesh.services.engine.adapter.request_meta import KVMeshConnectorMetadata, ReqMeta, SaveSpec
from kvmesh.services.engine.adapter.scheduler_lookup import CpuTierEvents, StepEventLog, engines
from kvmesh.services.engine.core.layerwise_load import ChunkCopy, LayerwiseLoader
from kvmesh.services.engine.mesh import side_cpus
from kvmesh.services.engine.agents.lookup_server import LookupServer, lookup_id_for
from kvmesh.services.engine.agents.rendezvous import PublishedWorker, publish_worker
from kvmesh.shared.config import EngineConfig
from kvmesh.shared.keys import ChunkSpan, KeyParams, state_key

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

LAYERWISE_NOTE = (
    "use_layerwise is set, but on a CPU vLLM loads are not pipelined layer by layer: the copy into the paged "
    "cache is a memcpy done by the same cores that run the forward, so there is nothing to overlap it with, "
    "and one scatter over all layers costs less than one per layer (see docs/connector.md). Loading all "
    "layers before the forward."
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
        self._failed_recving: set[str] = set()  # with groups: loads that failed since vLLM last asked
        self.engine: Any = None  # CacheEngine, created in register_kv_caches
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layerwise: LayerwiseLoader | None = None  # CUDA with use_layerwise: per-layer loads
        self.agreement: RankAgreement | None = None  # several ranks: how far every rank's loads got
        self._lookup_server: LookupServer | None = None
        self._rendezvous: Path | None = None
        self._load_errors: set[int] = set()
        # request -> its first token whose KV a failed load left wrong (and everything computed after it)
        self._failed_from: dict[str, int] = {}
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

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvmesh.services.engine.assembly import build_engine
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
            log.info("KV cache groups per %d-token chunk: %s", self.chunk_size,
                     self.groups.describe(layout.chunk_nbytes(self.chunk_size), layout.num_layers, self.chunk_size))
        params = KeyParams(self.model_name, layout.chunk_format(), self.world_size, rank)
        if first.device.type == "cpu":
            side_cpus.enable()  # the engine's threads keep off the cores vLLM bound its compute to
        self.engine = build_engine(self.config, params, layout=layout, device=first.device)
        self.engine.cpu.listen(self.cpu_events)  # reported to the scheduler's mirror with every step's output
        if self.config.use_layerwise:
            if self.groups is not None:  # every load runs between steps (kv_groups.py): no forward to overlap
                log.info("use_layerwise is set, but with KV cache groups every load runs between steps; loading "
                         "all layers at once")
            elif first.is_cuda:
                self.layerwise = LayerwiseLoader(layout, first.device)
                log.info("use_layerwise: loads are copied layer by layer on a side CUDA stream")
            else:
                log.info(LAYERWISE_NOTE)
        engines.add(rank, self.engine)
        lookup_id = lookup_id_for(self.engine.worker_id)
        if self.engine.nats_loop is not None:
            self._lookup_server = LookupServer(self.engine, self.engine.nats_loop, lookup_id)
        self._rendezvous = publish_worker(PublishedWorker.of(self.engine, lookup_id))

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
        if metadata is None:
            return
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
        if self.agreement is None or not loads:
            return
        mine = [self._failed_from.get(req.req_id, req.load.need) for req in loads]  # type: ignore[union-attr]
        try:
            agreed = self.agreement.min_over_ranks(mine)
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
        if self.groups is not None and self.groups.has_state and load.state_key is None:
            # a load that does not end where a state was saved (vLLM changed it): nothing to resume from
            self._fail_load(req, load.skip_prefix)
            self._finished_recving.add(req.req_id)
            return
        if load.asynchronous:
            self.async_saves.unhold(req.req_id)  # vLLM holds its blocks for the load (see unhold)
            if not self._start_async_load(req):  # no lower tier to fetch from now: load at once
                self._load(req)
                self._finished_recving.add(req.req_id)
        elif self.layerwise is not None:
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
            slots = slots.to(next(iter(self.kv_caches.values())).device)  # once, not once per layer
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
        assert self.layerwise is not None
        copies = [c for _, cs, _ in loads for c in cs]
        refs = [r for _, _, rs in loads for r in rs]
        try:
            self.layerwise.start(self.kv_caches, copies, refs)
        except Exception as exc:  # nothing is known to be in the blocks: every load of the step is recomputed
            log.warning("loading KV layer by layer failed (%s: %s); vLLM recomputes %d requests' loads",
                        type(exc).__name__, exc, len(loads))
            for req, _, _ in loads:
                assert req.load is not None
                self._fail_load(req, req.load.skip_prefix)

    def _slots(self, req: ReqMeta, num_tokens: int) -> torch.Tensor:
        """The slots of the request's first `num_tokens` tokens (with groups one row per group, none for the
        state groups: kv_groups.py)."""
        if self.groups is not None and req.group_block_ids is not None:
            return self.groups.chunk_slots(req.group_block_ids, num_tokens)
        return req.slot_mapping(num_tokens, self.block_size)

    def _state_span(self, req: ReqMeta, end: int, chain_key: Any, column: int | None = None
                    ) -> tuple[ChunkSpan, torch.Tensor]:
        """This worker's span of the recurrent state after `end` tokens (stored under `chain_key`'s state key),
        and the slots of the state groups' block `column` that holds it (default: where a load of `end` tokens
        writes it; kv_groups.py)."""
        assert self.groups is not None and req.group_block_ids is not None
        chain_span = ChunkSpan((end - 1) // self.chunk_size, end - self.block_size, end, state_key(chain_key))
        return (self.engine.hasher.shard([chain_span])[0],
                self.groups.state_slots(req.group_block_ids, end, column))

    def _load_state(self, req: ReqMeta, refs: list[Any] | None = None) -> bool:
        """Write the state at the load's end (fetched in `refs`, else from the tiers now); whether it was."""
        load = req.load
        assert load is not None and load.state_key is not None
        try:
            span, slots = self._state_span(req, load.end, load.state_key)
        except BaseException:  # no block for it (never expected): the fetched state is not written
            for ref in refs or ():
                ref.release()
            raise
        if refs is None:
            loaded = self.engine.retrieve_chunks([span], self.kv_caches, slots) == 1
        else:
            loaded = bool(refs) and self.engine.scatter_chunks([span], refs, self.kv_caches, slots) == 1
        self._stats.count("lmcache:num_retrieved_states", int(loaded))
        return loaded

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
            loaded = self.engine.retrieve_chunks(spans, self.kv_caches, self._slots(req, load.end), load.skip_prefix)
            if load.state_key is None or (loaded == len(spans) and self._load_state(req)):
                loaded_upto = spans[loaded - 1].end if loaded else load.mask_start
            # else KV without the state at its end is of no use
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
            if load.state_key is not None:  # fetched last, behind the chunks (kv_groups.py)
                spans = [*spans, self._state_span(req, load.end, load.state_key)[0]]
            future = self.engine.fetch_chunks(spans)
        except Exception as exc:
            log.warning("cannot start loading KV for request %s asynchronously (%s: %s); loading it now",
                        req.req_id, type(exc).__name__, exc)
            return False
        if future is None:
            return False
        self.async_loads.add(req, spans, future)
        log.info("Loading %d tokens for request %s asynchronously", load.need - load.skip_prefix, req.req_id)
        return True

    def _finish_async_load(self, pending: PendingLoad, refs: list[Any]) -> None:
        """Worker thread, between forwards: scatter what the fetch brought into the request's blocks."""
        req, load = pending.req, pending.req.load
        assert load is not None
        loaded_upto = load.mask_start
        spans = pending.spans
        state_refs: list[Any] = []
        if load.state_key is not None:  # the state was fetched last: the chunks before it, then the state
            spans = spans[:-1]
            refs, state_refs = refs[:len(spans)], refs[len(spans):]
        try:
            loaded = self.engine.scatter_chunks(spans, refs, self.kv_caches, self._slots(req, load.end),
                                                load.skip_prefix)
            state_loaded = True
            if load.state_key is not None:
                taken, state_refs = (state_refs, []) if loaded == len(spans) else ([], state_refs)
                state_loaded = self._load_state(req, taken)
            if state_loaded:  # KV without the state at its end is of no use
                loaded_upto = spans[loaded - 1].end if loaded else load.mask_start
        except Exception as exc:
            log.warning("loading KV for request %s failed (%s: %s); vLLM recomputes it", req.req_id,
                        type(exc).__name__, exc)
        finally:
            for ref in state_refs:  # a state behind chunks that were not all there
                ref.release()
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
        if req.group_block_ids is not None:  # vLLM takes no block errors with groups: the request is recomputed
            self._failed_recving.add(req.req_id)
        else:
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
        if self.layerwise is not None:  # CUDA with use_layerwise: this layer's copies, on the forward's stream
            self.layerwise.wait(layer_name)
        # otherwise all layers were loaded in start_load_kv (LAYERWISE_NOTE)

    def wait_for_save(self, metadata: "KVConnectorMetadata | None") -> None:
        """After the forward, with the step's metadata (None: vLLM bound none)."""
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
        for req in saves:
            save = req.save
            assert save is not None
            try:
                started = time.perf_counter()
                spans = self._save_spans(req, save)
                self._store_states(req, save, stream)
                end = max((span.end for span in spans), default=save.mask_start)
                if end < save.end:
                    log.warning("request %s: not storing tokens %d to %d: a load into its blocks failed and vLLM "
                                "recomputes them (stored once recomputed)", req.req_id, end, save.end)
                if not spans:
                    continue
                log.info("Storing KV cache for %d out of %d tokens for request %s", end - save.mask_start, end,
                         req.req_id)
                slots = self._slots(req, end)
                if stream is None:
                    self.engine.store_chunks(spans, self.kv_caches, slots)
                else:  # queued on the side stream; admitted by get_finished once copied
                    job = self.engine.gather_chunks(spans, self.kv_caches, slots, stream)
                    if job is not None:
                        self.async_saves.add(req.req_id, job)
                self._count_store(end - save.mask_start, time.perf_counter() - started)
            except Exception as exc:
                log.warning("storing KV for request %s failed (%s: %s); skipped", req.req_id, type(exc).__name__,
                            exc)

    def _store_states(self, req: ReqMeta, save: SaveSpec, stream: Any) -> None:
        """Store the recurrent states the step left at chunk ends (`SaveSpec.state_pages`: each from the page
        known to hold it, kv_groups.py), none past a failed load's first wrong token."""
        limit = self._save_limit(req)
        for end, column in save.state_pages:
            if limit is not None and end > limit:
                continue
            span, slots = self._state_span(req, end, req.chunk_keys[end // self.chunk_size - 1], column)
            if stream is None:
                self.engine.store_chunks([span], self.kv_caches, slots)
            else:
                job = self.engine.gather_chunks([span], self.kv_caches, slots, stream)
                if job is not None:
                    self.async_saves.add(req.req_id, job)
            self._stats.count("lmcache:num_stored_states")

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

    def get_kv_connector_stats(self) -> KVMeshStats | None:
        engine = self.engine
        if engine is not None and engine.storage is not None:
            self._storage_increments.add_to(self._stats, engine.storage.stats)
        if engine is not None and self._gauge_clock.due(self._stats):
            self._stats.set_gauge("lmcache:local_cache_usage", engine.cpu.used_bytes)
            self._stats.set_gauge("lmcache:pinned_memory_objs_count", len(engine.cpu))
            self._stats.set_gauge("lmcache:lmcache_is_healthy", float(engine.connected or engine.nats_loop is None))
        return self._stats.take()

    def get_finished(self, finished_req_ids: set[str], metadata: "KVConnectorMetadata | None"
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(the ended requests whose blocks vLLM held for their saves' copies, now done; the async loads done
        this step, scattered here between forwards). Called after start_load_kv and wait_for_save in every
        step, forward or not."""
        sending = self.async_saves.finished_sending(finished_req_ids, self.engine) or None
        if self.layerwise is not None:
            self.layerwise.release_done()
        if self.engine is None:
            return sending, None
        for pending in self.async_loads.discard(finished_req_ids):  # aborted while loading: no scatter
            self._finished_recving.add(pending.req.req_id)
        for req_id in finished_req_ids:
            self._failed_from.pop(req_id, None)
        if len(self.async_loads) and isinstance(metadata, KVMeshConnectorMetadata) and metadata.idle:
            self.async_loads.wait(IDLE_WAIT_SECS)  # nothing else to run: do not spin through empty steps
        for pending, refs in self.async_loads.take_ready():
            self._finish_async_load(pending, refs)
            self._finished_recving.add(pending.req.req_id)
        done, self._finished_recving = self._finished_recving, set()
        return sending, done or None

    def take_failed_recving(self) -> set[str]:
        """With groups: the requests whose load failed since the last call (vLLM recomputes them)."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> CpuTierEvents | None:
        if self.engine is None:
            return None
        events = self.cpu_events.take()
        evicted = sum(1 for admitted, _ in events if not admitted)
        if evicted:
            self._stats.count("lmcache:local_cpu_evict_count", evicted)
        return CpuTierEvents({self.engine.rank: events}) if events else None

    def shutdown(self) -> None:
        self._lookup_server = None  # its subscription closes with the engine's NATS connection
        if self._rendezvous is not None:
            self._rendezvous.unlink(missing_ok=True)
            self._rendezvous = None
        self.async_loads.abandon_all()
        self.async_saves.drain(self.engine)
        if self.layerwise is not None:
            self.layerwise.close()
        engine, self.engine = self.engine, None
        if engine is not None:
            engines.remove(engine)
            engine.cpu.unlisten(self.cpu_events)
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
