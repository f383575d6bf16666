"""KVMeshConnector's scheduler half (vLLM's EngineCore process, its busy-loop thread; never blocks on NATS).

It keeps one `RequestTracker` per request (adapter/request_meta.py): hashes the request once into chain keys,
asks `SchedulerLookup` how many prefix tokens the workers hold (adapter/scheduler_lookup.py), and plans each
step's loads and saves into `KVMeshConnectorMetadata` for the workers (worker half: adapter/worker_side.py).
connector.py (the facade vLLM loads) says which vLLM call lands where.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from kvmesh.services.engine.adapter.async_loads import IDLE_WAIT_SECS, loads_asynchronously
from kvmesh.services.engine.adapter.block_prefix import BlockPrefixProbe
from kvmesh.services.engine.adapter.connector_stats import KVMeshStats
from kvmesh.services.engine.adapter.kv_events import KVEventLog, save_descriptions
from kvmesh.services.engine.adapter.kv_groups import KVGroups
from kvmesh.services.engine.adapter.pd import peer_hint, producer_params, wants_remote_decode
from kvmesh.services.engine.adapter.request_extras import lora_name_of, request_extras
from kvmesh.services.engine.adapter.request_retention import request_kv_params
from kvmesh.services.engine.adapter.request_meta import (
    KVMeshConnectorMetadata,
    ReqMeta,
    RequestTracker,
    SaveSpec,
)
from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents
from kvmesh.services.engine.adapter.in_step_loads import InStepLoads
from kvmesh.services.engine.adapter.scheduler_lookup import SchedulerLookup
from kvmesh.services.engine.adapter.vllm_blocks import VllmBlocks
from kvmesh.services.engine.config.engine_auth import engine_auth
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.shared.wire.keys import ChunkHasher, ChunkKey, ChunkSpan, state_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvmesh.connector")


class SchedulerSide:
    """The connector's scheduler-side state and calls: the requests' trackers, the lookup, the KV events."""

    def __init__(self, config: EngineConfig, block_size: int, lookup: SchedulerLookup | None, *,
                 can_load: bool = True, can_save: bool = True, saves_off_forward: bool = False,
                 kv_events: KVEventLog | None = None, unsupported: str | None = None,
                 groups: KVGroups | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.can_load = can_load
        self.can_save = can_save
        # on CUDA saves are gathered on a side stream and vLLM holds their blocks (async_saves.py)
        self.saves_off_forward = saves_off_forward
        # Why this model's KV is not cached at all (None: it is); see connector.unsupported_kv_cache.
        self.unsupported = unsupported
        self.lookup = lookup  # None when the model's KV is not cached
        self.kv_events = kv_events  # only when vLLM publishes KV events
        # vLLM's KV cache groups when copies need each group's block table (kv_groups.py), else None
        self.groups = groups if groups is not None and groups.grouped else None
        self._vllm_blocks: VllmBlocks | None = None  # vLLM's KV cache manager (bind_kv_cache_manager)
        self._trackers: dict[str, RequestTracker] = {}
        self._async_starting: list[str] = []  # requests whose async load the next step carries
        self._unrecomputed: set[int] = set()  # for the next step's metadata (KVMeshConnectorMetadata.unrecomputed)
        # with groups, which hits load in-step (leased, or promised from the mirror) until their step is planned
        self.in_step_loads = InStepLoads(config, self.groups, block_size)
        self._stats = KVMeshStats()  # what happened since vLLM last asked (get_kv_connector_stats)

    @classmethod
    def for_vllm(cls, vllm_config: "VllmConfig", config: EngineConfig, block_size: int, unsupported: str | None,
                 saves_off_forward: bool, groups: KVGroups | None = None) -> "SchedulerSide":
        """The scheduler half vLLM's EngineCore gets (its kv_transfer_config's role and load-failure policy, its
        KV events config)."""
        transfer = vllm_config.kv_transfer_config
        lookup = None
        kv_events = None
        if unsupported is not None:
            log.warning("KVMesh loads and stores nothing for model %s: %s", vllm_config.model_config.model,
                        unsupported)
        else:
            lookup = SchedulerLookup(vllm_config.parallel_config.world_size, config.lookup_timeout_secs,
                                     f"{config.lmcache_instance_id}-scheduler", engine_auth(config),
                                     config.pd_hint_wait_secs)
            if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
                # The scheduler reads the policy right after creating this connector.
                log.info("kv_load_failure_policy %r -> 'recompute': a chunk that cannot be loaded is recomputed, "
                         "never a failed request", transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"
            events_config = getattr(vllm_config, "kv_events_config", None)
            if getattr(events_config, "enable_kv_cache_events", False) and config.kv_event_chunks > 0:
                kv_events = KVEventLog(config.kv_event_chunks, config.chunk_size)
                log.info("KV events: the CPU tier's admissions and evictions are published as BlockStored / "
                         "BlockRemoved (medium CPU; %d chunks remembered)", config.kv_event_chunks)
        # LMCACHE_FORCE_SKIP_SAVE: the scheduler plans no saves (the engine would drop them anyway)
        can_save = transfer.kv_role in ("kv_both", "kv_producer") and not config.force_skip_save
        return cls(config, block_size, lookup, can_load=transfer.kv_role in ("kv_both", "kv_consumer"),
                   can_save=can_save, saves_off_forward=saves_off_forward, kv_events=kv_events,
                   unsupported=unsupported, groups=groups)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM's KV cache manager: the groups' block tables, and the prefix cache failed loads leave."""
        self._vllm_blocks = VllmBlocks(kv_cache_manager)

    def tracker(self, req_id: str) -> RequestTracker | None:
        """The tracker of a request in flight (looked up, not finished), or None."""
        return self._trackers.get(req_id)

    def _track(self, request: "Request", num_computed_tokens: int = 0) -> RequestTracker:
        """The tracker of `request` (new for a new or resumed request), with the extras its chunk keys need."""
        tracker = self._trackers.get(request.request_id)
        if tracker is not None and tracker.request is request:
            tracker.local = num_computed_tokens
            return tracker
        tracker = RequestTracker(request.request_id, request, prompt_len=request.num_prompt_tokens,
                                 local=num_computed_tokens, lora_name=lora_name_of(request),
                                 kv_params=request_kv_params(request.request_id,
                                                             getattr(request, "kv_transfer_params", None)))
        try:
            tracker.extras = request_extras(request, self.chunk_size)
        except Exception as exc:  # e.g. an unreadable LoRA adapter file: never a wrong key, never a crash
            log.warning("request %s: cannot read what its KV depends on besides the tokens (%s: %s); it is "
                        "neither loaded nor stored", request.request_id, type(exc).__name__, exc)
            tracker.cacheable = False
        self._trackers[request.request_id] = tracker
        return tracker

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.unsupported is not None or self.lookup is None:
            return 0, False
        total = request.num_tokens
        tracker = self._track(request, num_computed_tokens)
        hasher = self.lookup.hasher()
        if not self.can_load or hasher is None or total == 0 or not tracker.cacheable or tracker.load_failed:
            return 0, False
        started = time.perf_counter()
        if tracker.lookup_tokens != total:  # a new or longer chain (resumed after preemption): ask anew
            tracker.forget_lookup()
            tracker.lookup_tokens = total
        chain_keys = self._chain_keys(tracker, hasher, total)  # hashed once per request
        tiers = tracker.kv_params.load_tiers  # the request's kv_load_tiers: no other tier is counted
        if tracker.lower is None:  # not yet asked below: what the CPU tiers hold as the request arrives
            tracker.cpu_tokens = self.lookup.cpu_tokens(tracker.chain[:len(chain_keys)], tiers)
        hit, tracker.lower = self.lookup.held(tracker.chain[:len(chain_keys)], total, tracker.lower,
                                              peer_hint(getattr(request, "kv_transfer_params", None)),
                                              prefetch_from=num_computed_tokens, tiers=tiers)
        if hit is None:
            return None, False  # the lower tiers have not answered yet: vLLM asks again next step
        if self.groups is not None and self.groups.has_state:  # block prefixes and states: in its tiers too
            hit, tracker.state_key = self._state_hit(tracker, hit, total)
        else:
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
        tracker.num_to_load = to_load
        # Decided on the CPU tiers before the lower-tier lookup: its prefetch may have filled them since, but a
        # load behind it would still wait for that prefetch, stalling the batch.
        # with groups a load that can fail is asynchronous: vLLM takes a failed one only as a failed receive
        # (kv_groups.py); one leased or promised from the mirror cannot fail (in_step_loads.py)
        tracker.load_async = to_load > 0 and not self.in_step_loads.loads_in_step(
            tracker, hit, self.lookup, self._vllm_blocks) if self.groups is not None else \
            loads_asynchronously(self.config.enable_async_loading, to_load, need, tracker.cpu_tokens)
        if tracker.reported != (hit, to_load):  # vLLM asks again each step while the request waits
            tracker.reported = (hit, to_load)
            self._report_lookup(tracker, total, hit, to_load, num_computed_tokens, need, started)
        return to_load, tracker.load_async

    def _report_lookup(self, tracker: RequestTracker, total: int, hit: int, to_load: int, num_computed_tokens: int,
                       need: int, started: float) -> None:
        """A lookup's `lmcache:*` counters and its INFO lines, as LMCache logs them."""
        self._stats.count("lmcache:num_lookup_requests")
        self._stats.count("lmcache:num_requested_tokens", total)
        self._stats.count("lmcache:num_hit_tokens", hit)
        self._stats.count("lmcache:num_vllm_hit_tokens", num_computed_tokens)
        self._stats.observe("lmcache:time_to_lookup", time.perf_counter() - started)
        log.info("Reqid: %s, Total tokens %d, hit tokens %d, need to load %d", tracker.req_id, total, hit, to_load)
        if tracker.load_async:
            log.info("Reqid: %s loads asynchronously: %d of its %d tokens to load were in the CPU tier",
                     tracker.req_id, max(min(tracker.cpu_tokens, need) - num_computed_tokens, 0), to_load)

    def _block_prefix_hit(self, tracker: RequestTracker, hasher: ChunkHasher, hit: int, total: int
                          ) -> tuple[int | None, ChunkKey | None]:
        """`hit` extended by the longest held block prefix of the chunk after it (block_prefix.py), with that
        prefix's key; (None, None) while a lower tier is asked."""
        if hit % self.chunk_size or hit >= total or self.lookup is None:
            return hit, None
        probe = tracker.probe
        if probe is None or probe.after != hit:
            tokens = list(tracker.request.all_token_ids[:min(hit + self.chunk_size, total)])
            probe = tracker.probe = BlockPrefixProbe.of(hasher, tokens, tracker.chain, hit, self.block_size,
                                                        tracker.extras)
        tiers = tracker.kv_params.load_tiers
        answered, span = probe.held(self.lookup, tiers)
        if not answered:
            return None, None
        if span is None:
            return hit, None
        if tracker.cpu_tokens == hit and self.lookup.in_cpu(span, tiers):  # for the async decision, as the chain's
            tracker.cpu_tokens = span.end
        return span.end, span.key

    def _state_hit(self, tracker: RequestTracker, hit: int, total: int) -> tuple[int | None, ChunkKey | None]:
        """A model with recurrent state can resume only where a state was saved (kv_groups.py): the longest
        chunk end within the chain's `hit` (and before the request's last token) whose state every rank holds,
        with its chunk's chain key; (0, None) when there is none, (None, None) while a lower tier is asked.
        The candidates are looked up like block prefixes (block_prefix.py), longest first."""
        assert self.lookup is not None
        last = min(hit, total - 1) // self.chunk_size
        probe = tracker.probe
        if probe is None or probe.after != hit:
            spans = [ChunkSpan(k - 1, k * self.chunk_size - self.block_size, k * self.chunk_size,
                               state_key(tracker.chain[k - 1].key), state=True) for k in range(last, 0, -1)]
            probe = tracker.probe = BlockPrefixProbe(hit, spans, [None] * len(spans))
        answered, span = probe.held(self.lookup, tracker.kv_params.load_tiers)
        if not answered:
            return None, None
        if span is None:
            return 0, None
        return span.end, tracker.chain[span.end // self.chunk_size - 1].key

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

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVMeshConnectorMetadata:
        meta = KVMeshConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        if meta.idle and self.lookup is not None:
            self.lookup.wait_answer(IDLE_WAIT_SECS)  # nothing runs: do not spin through empty steps meanwhile
        num_scheduled = scheduler_output.num_scheduled_tokens
        # Preempted requests lost their blocks (this step may reuse them): the workers' handle_preemptions
        # orders the saves still reading them before the forward, and nothing is loaded into them any more.
        # A request preempted outside schedule() (vLLM's reset_prefix_cache with reset_running_requests) may be
        # resumed by this very step: what was planned for it since (its lookup, its load into its new blocks)
        # stays, as does an async load planned in this step (vLLM preempts no request it admitted after).
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        cached = scheduler_output.scheduled_cached_reqs
        resumed = ({new.req_id for new in scheduler_output.scheduled_new_reqs}
                   | set(getattr(cached, "resumed_req_ids", None) or ()) | set(self._async_starting))
        for req_id in meta.preempted:
            tracker = self._trackers.get(req_id)
            if tracker is not None:
                self._note_unrecomputed(tracker)  # its blocks are gone, recomputed or not
                tracker.recompute_from = None
                if req_id not in resumed:
                    tracker.preempted()
        # requests that verify draft tokens this step: vLLM counts the drafts as scheduled tokens
        drafting = set(getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or ())
        starting, self._async_starting = self._async_starting, []
        for req_id in starting:
            tracker = self._trackers.get(req_id)
            if tracker is not None:
                self._add_step(meta, tracker, None)
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers.get(new.req_id)
            if tracker is None:
                continue
            tracker.block_ids = list(new.block_ids[0]) if new.block_ids else []
            self._add_step(meta, tracker, (new.num_computed_tokens,
                                           new.num_computed_tokens + num_scheduled.get(new.req_id, 0)),
                           new.req_id in drafting)
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            if tracker is None:
                continue
            new_blocks = cached.new_block_ids[i]
            tracker.extend_blocks(new_blocks[0] if new_blocks else None, replace=req_id in cached.resumed_req_ids)
            start = cached.num_computed_tokens[i]
            self._add_step(meta, tracker, (start, start + num_scheduled.get(req_id, 0)), req_id in drafting)
        for req_id in scheduler_output.finished_req_ids:
            self._trackers.pop(req_id, None)
        # leases of requests vLLM did not schedule end; what the workers may stop holding (cpu_mirror.py)
        in_step = {req.req_id for req in meta.requests if req.load is not None and not req.load.asynchronous}
        meta.evictions_seen = self.in_step_loads.planned(in_step, self.lookup)
        meta.unrecomputed, self._unrecomputed = self._unrecomputed, set()
        return meta

    def _note_unrecomputed(self, tracker: RequestTracker) -> None:
        """The request leaves its blocks (it ended, or was preempted) before recomputing all a failed load left
        wrong: vLLM let other requests that took them from its prefix cache in the failing step count them
        computed, expecting this one to recompute them first (`_update_requests_with_invalid_blocks`). Those
        still held by another request go to the workers, which report them as load errors."""
        wrong = tracker.unrecomputed_blocks(self.block_size)
        if not wrong:
            return
        held = {block for other in self._trackers.values() if other is not tracker for block in other.block_ids}
        if wrong & held:
            self._unrecomputed |= wrong & held
            log.info("Reqid: %s left %d blocks a failed load left wrong to other requests before recomputing "
                     "them: they are reported as load errors, and vLLM recomputes them", tracker.req_id,
                     len(wrong & held))

    def _add_step(self, meta: KVMeshConnectorMetadata, tracker: RequestTracker, step: tuple[int, int] | None,
                  drafting: bool = False) -> None:
        """The request's load and save in this step, which computes its tokens [start, end) (`step`; None: an
        async load only), verifying draft tokens counted in `end` when `drafting`."""
        if step is not None:
            tracker.computed_upto = step[1]
        hasher = self.lookup.hasher() if self.lookup is not None else None
        if not tracker.cacheable or hasher is None:
            return
        load = tracker.take_load(self.chunk_size)
        if load is not None and load.state_key is not None and not load.asynchronous and step is not None:
            running = -(-step[1] // self.block_size) - 1  # vLLM's mamba_state_idx for the step
            if running != load.end // self.block_size - 1:
                load = dataclasses.replace(load, state_column=running)
        save = None
        if self.can_save and step is not None and tracker.kv_params.stores_anywhere:
            save = tracker.take_save(step[1], self.chunk_size, self.config.save_unfull_chunk,
                                     self.config.save_decode_cache, self.block_size)
            if save is not None and save.prefix_end:
                save = dataclasses.replace(save, prefix_key=self._block_prefix_key(tracker, hasher, save))
        tables = None
        if self.groups is not None and (load is not None or save is not None):
            # with drafts, what the state pages hold depends on how many vLLM accepts: none is stored
            tables, save = self._group_tables(tracker, save, None if drafting else step)
            if tables is None:
                return
        if load is None and save is None:
            return
        if save is not None and self.saves_off_forward:
            tracker.saves_held = True  # its copy may outlive the step: request_finished holds the blocks
        end = max(load.end if load else 0, save.end if save else 0)
        lora_id = tracker.extras.lora_id if tracker.extras is not None else None
        keys = self._chain_keys(tracker, hasher, end)
        if save is not None and self.config.describe_admissions:
            save = dataclasses.replace(save, described=save_descriptions(
                tracker.request.all_token_ids, keys[:-(-save.end // self.chunk_size)], save, self.chunk_size,
                tracker.extras, tracker.lora_name))
        meta.requests.append(ReqMeta(tracker.req_id, keys, list(tracker.block_ids), load, save, tracker.lora_name,
                                     lora_id, tracker.load_failed, tables, tracker.kv_params))

    def _group_tables(self, tracker: RequestTracker, save: SaveSpec | None, step: tuple[int, int] | None
                      ) -> tuple[list[list[int]] | None, SaveSpec | None]:
        """The request's block table per group for this step, and its save cut to the chunks whose blocks a hit
        would load are all still held, with the states the step's tokens [start, end) (`step`; None: no state is
        known) leave at chunk ends (kv_groups.py); (None, None) when vLLM has no table for it."""
        assert self.groups is not None
        try:
            tables = self._vllm_blocks.tables(tracker.req_id) if self._vllm_blocks is not None else None
        except Exception as exc:  # not known to vLLM's manager (never expected): neither loaded nor saved
            log.warning("Reqid: %s: no block tables (%s: %s); not loaded or saved this step", tracker.req_id,
                        type(exc).__name__, exc)
            tables = None
        if tables is None:
            return None, None
        if save is not None and self.groups.has_state and step is not None:
            # the states this step left at chunk ends, each from the page known to hold it (never a page taken
            # for the state at its block's end)
            pages = self.groups.state_pages(tables, *step)
            first = save.mask_start - save.mask_start % self.chunk_size + self.chunk_size
            states = tuple((end, pages[end]) for end in range(first, save.end + 1, self.chunk_size) if end in pages)
            save = dataclasses.replace(save, state_pages=states)
        if save is not None:
            start = self.groups.saveable_from(tables, save.mask_start, save.end, self.chunk_size, -1)
            prefix_end = save.prefix_end
            if prefix_end and not self.groups.held_for_hit(tables, prefix_end, -1):
                prefix_end = 0
            if start >= save.end:
                save = None
            elif start != save.mask_start or prefix_end != save.prefix_end:
                save = dataclasses.replace(save, mask_start=start - start % self.chunk_size, prefix_end=prefix_end,
                                           prefix_key=save.prefix_key if prefix_end else None)
        return tables, save

    def _chain_keys(self, tracker: RequestTracker, hasher: ChunkHasher, end: int) -> list[ChunkKey]:
        """The request's chain keys up to `end`; newly hashed chunks are noted for the KV events."""
        if self.kv_events is None:
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
        events, lookup = self.kv_events, self.lookup
        params = lookup.key_params(0) if lookup is not None else None
        if events is not None and params is not None:
            events.note(spans, tokens, params, tracker.extras, tracker.lora_name, parent)

    def update_connector_output(self, connector_output: Any) -> None:
        # A failed load sends an async-loading request back to waiting, and vLLM looks it up again: its lookup
        # would promise the same chunks (the tiers may still list what they cannot serve), fail again, and
        # again. A request whose load failed recomputes and is offered no more loads.
        # Its chunks from the first failed block on are saved again once vLLM has recomputed them.
        for req_id in getattr(connector_output, "failed_recving", None) or ():  # with groups (kv_groups.py)
            tracker = self._trackers.get(req_id)
            if tracker is not None and not tracker.load_failed:
                tracker.load_failed = True
                tracker.saved_upto = 0  # vLLM recomputes the whole request
                log.info("Reqid: %s: its load failed; vLLM recomputes it, which is saved again, and it is offered "
                         "no more loads", req_id)
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            if self._vllm_blocks is not None:
                self._vllm_blocks.uncache_failed(invalid, self._trackers)
            for tracker in self._trackers.values():  # a request may be rewound again (another's failed load)
                known = tracker.load_failed
                if tracker.load_failed_in(invalid, self.block_size, self.chunk_size) and not known:
                    log.info("Reqid: %s: its load failed; vLLM recomputes it from token %d, which is saved again, "
                             "and it is offered no more loads", tracker.req_id, tracker.saved_upto)
        events = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(events, CpuTierEvents) and self.lookup is not None:
            self.lookup.update(events)
            if self.kv_events is not None:
                self.kv_events.apply(events)

    def take_events(self) -> list[Any]:
        """KVMesh's CPU-tier admissions and evictions as vLLM KV events (adapter/kv_events.py)."""
        return self.kv_events.take() if self.kv_events is not None else []

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # On CPU saves are gathered synchronously in wait_for_save, so vLLM may free the blocks now. On CUDA a
        # request that had a save keeps its blocks until the workers report its copies done (finished_sending).
        # A PD producer's request (the proxy asked for do_remote_decode) names this instance's workers to the
        # consumer, which loads the chunks from their CPU tiers (adapter/pd.py).
        tracker = self._trackers.pop(request.request_id, None)
        if tracker is not None:
            self._note_unrecomputed(tracker)
        self.in_step_loads.forget(request.request_id)
        held = bool(tracker is not None and tracker.saves_held)
        if not wants_remote_decode(getattr(request, "kv_transfer_params", None)):
            return held, None
        workers = self.lookup.worker_ids() if self.lookup is not None else []
        if not (self.can_save and self.config.enable_p2p and workers and tracker is not None):
            log.warning("Reqid: %s asks for a remote decode, but this instance %s: the consumer will compute it",
                        request.request_id, "does not serve peers (enable_p2p / enable_pd)" if not
                        self.config.enable_p2p else "stores no KV for it (kv_role, an uncached model, or its "
                        "workers not known yet)")
            return held, None
        return held, producer_params(self.config.lmcache_instance_id, workers, tracker.saved_upto)

    def get_kv_connector_stats(self) -> KVMeshStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        if self.lookup is not None:
            self.lookup.close()
            self.lookup = None
