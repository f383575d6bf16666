"""One request's load in one step, and what failed loads leave behind.

The worker half makes a `RequestLoad` for each request whose step metadata carries a load (worker_side.py
`start_load_kv`): its spans on this worker, the slots it writes, the recurrent state at its end (kv_groups.py)
and how far it got. It runs one of three ways: at once, before the forward (`run`; on a CPU with a core beside the
forward's, planned there and written layer by layer during the forward: core/layer_pipeline.py); fetched on the
NATS loop and scattered between steps (`fetch`, then `finish`: async_loads.py); or copied layer by layer on CUDA
(`for_layers`: core/layerwise_load.py). What it did not bring is a failure (`fail`): vLLM recomputes those
blocks, and until the scheduler has heard of it no save of the request reaches past the first wrong token
(`LoadFailures.save_limit`, saves.py). With several ranks, a step's in-step loads first agree on that token
(`agree_on_loads`, load_agreement.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

import torch

from kvmesh.services.engine.adapter.connector_stats import KVMeshStats
from kvmesh.services.engine.adapter.load_agreement import RankAgreement
from kvmesh.services.engine.adapter.request_meta import LoadSpec, ReqMeta
from kvmesh.services.engine.adapter.request_slots import RequestSlots
from kvmesh.services.engine.core.layerwise_load import ChunkCopy
from kvmesh.shared.wire.keys import ChunkSpan

if TYPE_CHECKING:
    from kvmesh.services.engine.adapter.cpu_leases import Lease
    from kvmesh.services.engine.core.cache_engine import CacheEngine
    from kvmesh.services.engine.core.chunk_load import ChunkLoad
    from kvmesh.services.engine.core.layer_pipeline import LayerPipeline
    from kvmesh.services.engine.tiers.cpu import ChunkRef

log = logging.getLogger("kvmesh.connector")


class LoadFailures:
    """What failed loads left, until vLLM and the scheduler have heard of it (vLLM's worker thread only): the
    blocks vLLM recomputes and, with KV cache groups, the requests it recomputes (both taken after every step),
    and per request the first token whose KV a failed load left wrong (and everything computed after it)."""

    def __init__(self) -> None:
        self._block_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        self._failed_from: dict[str, int] = {}
        self._cut_now: dict[str, int] = {}  # this step's cuts (cut_sharers): they hold whatever the scheduler knew

    def record(self, req: ReqMeta, first_bad: int, block_size: int) -> set[int]:
        """Tokens [first_bad, need) of the request's load are not its KV: their blocks are load errors (vLLM
        recomputes them), and until the scheduler has heard of it no save of the request reaches past
        `first_bad` (what this step's forward computes after it is computed over the wrong KV). The blocks."""
        load = req.load
        assert load is not None
        bad = req.block_ids_for(first_bad, load.need, block_size)
        if req.group_block_ids is not None:  # vLLM takes no block errors with groups: the request is recomputed
            self._failed_recving.add(req.req_id)
        else:
            self._block_errors |= bad
        self._failed_from[req.req_id] = min(first_bad, self._failed_from.get(req.req_id, first_bad))
        return bad

    def still_wrong(self, block_ids: set[int]) -> None:
        """Blocks an earlier failed load left wrong that the scheduler found still held, unrecomputed, by other
        requests (KVMeshConnectorMetadata.unrecomputed): load errors of this step."""
        self._block_errors |= block_ids

    def first_bad(self, req_id: str, default: int) -> int:
        return self._failed_from.get(req_id, default)

    def cut_sharers(self, requests: Sequence[ReqMeta], block_size: int) -> None:
        """What this step's forward computes over a failed load is wrong too, and vLLM's prefix cache may have
        given any of it to another request of the step: a block whose load failed, or a later block of a request
        holding one (allocated this step, cached at once, filled by the forward over the wrong KV). Every such
        block becomes a block error, so vLLM rewinds each request holding one in its computed prefix (it checks
        only those), and saves of every request holding one stop at it. To a fixpoint: a sharer's own later
        blocks are computed over the wrong KV as well. (The block errors are only this step's here: vLLM takes
        them after every step.)"""
        if not self._block_errors:
            return
        changed = True
        while changed:
            changed = False
            for req in requests:
                first = next((i for i, block in enumerate(req.block_ids) if block in self._block_errors), None)
                if first is None:
                    continue
                start = first * block_size
                self._failed_from[req.req_id] = min(start, self._failed_from.get(req.req_id, start))
                self._cut_now[req.req_id] = min(start, self._cut_now.get(req.req_id, start))
                later = set(req.block_ids[first:]) - self._block_errors
                if later:
                    self._block_errors |= later
                    changed = True

    def save_limit(self, req: ReqMeta) -> int | None:
        """How far the request's saves may reach: None for no bound, else the first token a failed load of this
        or an earlier step left wrong, until the step metadata says the scheduler knows (it then plans saves
        from vLLM's recompute); a block of this step's errors in its table bounds them whatever the scheduler
        knew (it planned them before this step's errors)."""
        if req.load_failed:
            self._failed_from.pop(req.req_id, None)
            return self._cut_now.get(req.req_id)
        return self._failed_from.get(req.req_id)

    def forget(self, req_ids: set[str]) -> None:
        """Requests that ended."""
        for req_id in req_ids:
            self._failed_from.pop(req_id, None)

    def take_block_errors(self) -> set[int]:
        """This step's load errors (vLLM takes them after the step's saves): the step's cuts end with them."""
        errors, self._block_errors = self._block_errors, set()
        self._cut_now = {}
        return errors

    def take_failed_recving(self) -> set[str]:
        failed, self._failed_recving = self._failed_recving, set()
        return failed


class RequestLoad:
    """One request's load in one step (module docstring), into `kv_caches` (the layers in chunk order). `engine`
    None: the worker has nothing to load from, and the load only fails."""

    def __init__(self, req: ReqMeta, engine: "CacheEngine | None", kv_caches: dict[str, torch.Tensor],
                 where: RequestSlots, failures: LoadFailures, stats: KVMeshStats) -> None:
        assert req.load is not None
        self.req: ReqMeta = req
        self.spec: LoadSpec = req.load
        self._engine, self._kv_caches = engine, kv_caches
        self._where, self._failures, self._stats = where, failures, stats
        self.started = time.perf_counter()
        self.leased: "Lease | None" = None  # the chunks the scheduler leased for it (cpu_leases.py)
        # CPU, in-step: what writes its chunks layer by layer during the forward (core/layer_pipeline.py)
        self.pipeline: "LayerPipeline | None" = None

    @property
    def engine(self) -> "CacheEngine":
        assert self._engine is not None
        return self._engine

    @property
    def tiers(self) -> frozenset[str] | None:
        """The only tiers the load reads (the request's kv_load_tiers; None: all)."""
        return self.req.kv_params.load_tiers

    def lacks_state(self) -> bool:
        """A load that does not end where a state was saved (vLLM changed it): nothing to resume from."""
        groups = self._where.groups
        return groups is not None and groups.has_state and self.spec.state_key is None

    def spans(self) -> list[ChunkSpan]:
        """This worker's spans of the load (the last one a block prefix's when `last_key` is set)."""
        chunk_size = self._where.chunk_size
        keys = self.req.keys_upto(self.spec.end, chunk_size, self.spec.last_key)
        return self.engine.chunk_spans(keys, self.spec.end, self.spec.mask_start // chunk_size)

    def run(self) -> None:
        """Load now: the chunks, then the state at their end (KV without it is of no use)."""
        spec = self.spec
        self.started = time.perf_counter()
        loaded_upto = spec.mask_start
        try:
            spans = self.spans()
            slots = self._where.tokens(self.req, spec.end)
            pipeline = self.pipeline if spec.state_key is None else None  # a state is written after its chunks
            loaded = self.engine.load(spans, slots, tiers=self.tiers, leased=self.leased).scatter(
                self._kv_caches, slots, spec.skip_prefix, pipeline=pipeline)
            if spec.state_key is None or (loaded == len(spans) and self._load_state()):
                loaded_upto = spans[loaded - 1].end if loaded else spec.mask_start
        except Exception as exc:
            log.warning("loading KV for request %s failed (%s: %s); vLLM recomputes it", self.req.req_id,
                        type(exc).__name__, exc)
        self.account(loaded_upto)

    def fetch(self) -> "ChunkLoad | None":
        """Start fetching the load's chunks on the NATS loop (the state at their end last, behind them); None
        when it cannot start (no lower tier connected now): the caller runs it at once."""
        spec = self.spec
        try:
            spans = self.spans()
            if spec.state_key is not None:
                spans = [*spans, self._where.state(self.engine, self.req, spec.end, spec.state_key)[0]]
            chunks = self.engine.load(spans, fetch=True, tiers=self.tiers)
        except Exception as exc:
            log.warning("cannot start loading KV for request %s asynchronously (%s: %s); loading it now",
                        self.req.req_id, type(exc).__name__, exc)
            return None
        if chunks is not None:
            self.started = time.perf_counter()
            log.info("Loading %d tokens for request %s asynchronously", spec.need - spec.skip_prefix,
                     self.req.req_id)
        return chunks

    def finish(self, fetched: "ChunkLoad") -> None:
        """Between forwards: scatter what the fetch brought into the request's blocks (the state behind the
        chunks only when they all came)."""
        spec = self.spec
        loaded_upto = spec.mask_start
        count = len(fetched.spans) - (spec.state_key is not None)
        try:
            loaded = fetched.scatter(self._kv_caches, self._where.tokens(self.req, spec.end), spec.skip_prefix,
                                     count=count)
            state_loaded = True
            if spec.state_key is not None:
                if loaded < count:  # a state behind chunks that were not all there is not written
                    fetched.release()
                state_loaded = self._load_state(fetched, first=count)
            if state_loaded:  # KV without the state at its end is of no use
                loaded_upto = fetched.spans[loaded - 1].end if loaded else spec.mask_start
        except Exception as exc:
            log.warning("loading KV for request %s failed (%s: %s); vLLM recomputes it", self.req.req_id,
                        type(exc).__name__, exc)
        finally:
            fetched.release()
        self.account(loaded_upto)

    def for_layers(self, device: torch.device) -> tuple[list[ChunkCopy], list["ChunkRef"]]:
        """The load's chunks for the layer-wise loader: its copies and the references they read (none when the
        load failed)."""
        spec = self.spec
        self.started = time.perf_counter()
        try:
            spans = self.spans()
            slots = self.req.slot_mapping(spec.end, self._where.block_size)
            chunks = self.engine.load(spans, slots, tiers=self.tiers, leased=self.leased)
        except Exception as exc:
            log.warning("loading KV for request %s failed (%s: %s); vLLM recomputes it", self.req.req_id,
                        type(exc).__name__, exc)
            self.account(spec.mask_start)
            return [], []
        try:
            on_device = slots.to(device)  # once, not once per layer
        except BaseException:
            chunks.release()
            raise
        copies, refs = chunks.layer_copies(on_device, spec.skip_prefix)
        self.account(spans[len(refs) - 1].end if refs else spec.mask_start)
        return copies, refs

    def _load_state(self, fetched: "ChunkLoad | None" = None, first: int = 0) -> bool:
        """Write the state at the load's end (fetched as `fetched`'s span `first`, else from the tiers now);
        whether it was."""
        spec = self.spec
        assert spec.state_key is not None
        span, slots = self._where.state(self.engine, self.req, spec.end, spec.state_key)
        if fetched is None:
            loaded = self._scatter_state(span, slots, keep=spec.state_column is not None)
            if loaded and spec.state_column is not None:  # where the step's forward reads it (LoadSpec)
                running = self._where.state(self.engine, self.req, spec.end, spec.state_key, spec.state_column)[1]
                loaded = self._scatter_state(span, running, keep=False)
        else:
            loaded = fetched.scatter(self._kv_caches, slots, first=first) == 1
        self._stats.count("lmcache:num_retrieved_states", int(loaded))
        return loaded

    def _scatter_state(self, span: ChunkSpan, slots: torch.Tensor, keep: bool) -> bool:
        """Write the state `span` names into `slots` (from the lease when it holds it; `keep`: its reference stays
        there for one more write); whether it was."""
        lease = self.leased
        if keep and lease and span.key in lease:
            ref = lease[span.key]
            lease = {span.key: type(ref)(ref.meta, ref.slot.ref())}
        return self.engine.load([span], slots, tiers=self.tiers, leased=lease).scatter(self._kv_caches, slots) == 1

    def account(self, loaded_upto: int) -> None:
        """Metrics, the log line, and load errors for what the load did not bring (vLLM recomputes those)."""
        spec, req = self.spec, self.req
        seconds = time.perf_counter() - self.started
        retrieved = max(min(loaded_upto, spec.need) - spec.skip_prefix, 0)
        self._stats.count("lmcache:num_retrieve_requests")
        self._stats.count("lmcache:num_retrieved_tokens", retrieved)
        self._stats.observe("lmcache:time_to_retrieve", seconds)
        if retrieved and seconds > 0:
            self._stats.observe("lmcache:retrieve_speed", retrieved / seconds)
        if loaded_upto < spec.need:
            bad = self.fail(max(loaded_upto, spec.skip_prefix))
            self._stats.count("lmcache:num_failed_retrieve_blocks", len(bad))
            log.warning("request %s: loaded %d of %d tokens; %d blocks from token %d are recomputed", req.req_id,
                        max(loaded_upto - spec.skip_prefix, 0), spec.need - spec.skip_prefix, len(bad),
                        loaded_upto)
        else:
            log.info("Retrieved %d tokens for request %s in %.1f ms", spec.need - spec.skip_prefix, req.req_id,
                     (time.perf_counter() - self.started) * 1e3)

    def fail(self, first_bad: int) -> set[int]:
        """Tokens [first_bad, need) of the load are not the request's KV (`LoadFailures.record`); the blocks."""
        return self._failures.record(self.req, first_bad, self._where.block_size)

    def reached(self) -> int:
        """The first token this rank's load left wrong (`need` when none)."""
        return self._failures.first_bad(self.req.req_id, self.spec.need)


def agree_on_loads(loads: Sequence[RequestLoad], agreement: RankAgreement | None) -> None:
    """With several ranks, every rank cuts its saves (and reports load errors) at the first wrong token any
    rank's load of this step left: the forward computes over it on every rank (load_agreement.py). Loads
    between steps (asynchronous) run no forward in their step: vLLM hears of their failures first."""
    if agreement is None or not loads:
        return
    mine = [load.reached() for load in loads]
    try:
        agreed = agreement.min_over_ranks(mine)
    except Exception as exc:  # unknown: as if every rank's load had failed
        log.warning("the ranks could not agree on this step's %d loads (%s: %s); vLLM recomputes them",
                    len(loads), type(exc).__name__, exc)
        agreed = [load.spec.skip_prefix for load in loads]
    for load, own, first_bad in zip(loads, mine, agreed):
        if first_bad < own:
            log.warning("request %s: another rank's load stopped at token %d; recomputed from there",
                        load.req.req_id, first_bad)
            load.fail(first_bad)
