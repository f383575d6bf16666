"""The worker's saves after each forward (worker_side.py `wait_for_save`).

Each request the step metadata gives a save stores its chunks (the last chunk's block prefix too, before the last
one: block_prefix.py) and the recurrent states the step left at chunk ends (kv_groups.py), none reaching past the
first token a failed load left wrong (`LoadFailures.save_limit`, request_load.py). On CPU the copies are done
when `save_step` returns; on CUDA they are only started on a stream and admitted once done (async_saves.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from kvmesh.services.engine.adapter.async_saves import AsyncSaves
from kvmesh.services.engine.adapter.connector_stats import KVMeshStats
from kvmesh.services.engine.adapter.request_load import LoadFailures
from kvmesh.services.engine.adapter.request_meta import ReqMeta, SaveSpec
from kvmesh.services.engine.adapter.request_slots import RequestSlots
from kvmesh.shared.wire.keys import ChunkSpan

if TYPE_CHECKING:
    from kvmesh.services.engine.core.cache_engine import CacheEngine

log = logging.getLogger("kvmesh.connector")


class Saves:
    """Stores each step's saves through the engine's one save entry (`CacheEngine.save`)."""

    def __init__(self, where: RequestSlots, failures: LoadFailures, stats: KVMeshStats) -> None:
        self._where, self._failures, self._stats = where, failures, stats

    def save_step(self, engine: "CacheEngine", kv_caches: dict[str, torch.Tensor], requests: Sequence[ReqMeta],
                  stream: Any, jobs: AsyncSaves) -> None:
        """Store the saves of `requests` from `kv_caches`: at once, or (with `stream`) started there and added to
        `jobs`. A save that fails is logged and skipped; vLLM's request is unaffected."""
        for req in requests:
            save = req.save
            assert save is not None
            try:
                started = time.perf_counter()
                spans = self._spans(engine, req, save)
                self._store_states(engine, kv_caches, req, save, stream, jobs)
                end = max((span.end for span in spans), default=save.mask_start)
                if end < save.end:
                    log.warning("request %s: not storing tokens %d to %d: a load into its blocks failed and vLLM "
                                "recomputes them (stored once recomputed)", req.req_id, end, save.end)
                if not spans:
                    continue
                log.info("Storing KV cache for %d out of %d tokens for request %s", end - save.mask_start, end,
                         req.req_id)
                if save.described:  # before the admissions, which carry them (describe_admissions)
                    engine.describe(save.described)
                start = min(span.start for span in spans)  # the step's own chunks: earlier slots are not read
                self._store(engine, kv_caches, req, spans, self._where.tokens(req, end, start), start, stream,
                            jobs)
                self._count_store(end - save.mask_start, time.perf_counter() - started)
            except Exception as exc:
                log.warning("storing KV for request %s failed (%s: %s); skipped", req.req_id, type(exc).__name__,
                            exc)

    def _store(self, engine: "CacheEngine", kv_caches: dict[str, torch.Tensor], req: ReqMeta,
               spans: list[ChunkSpan], slots: torch.Tensor, first_token: int, stream: Any, jobs: AsyncSaves
               ) -> None:
        """With the request's retention, to its store tiers (its kv_transfer_params: request_retention.py);
        `slots` from token `first_token` on."""
        # with a stream: admitted by get_finished once copied
        job = engine.save(spans, kv_caches, slots, stream, req.kv_params.retention, req.kv_params.store_tiers,
                          first_token)
        if job is not None:
            jobs.add(req.req_id, job)

    def _store_states(self, engine: "CacheEngine", kv_caches: dict[str, torch.Tensor], req: ReqMeta,
                      save: SaveSpec, stream: Any, jobs: AsyncSaves) -> None:
        """Store the recurrent states the step left at chunk ends (`SaveSpec.state_pages`: each from the page
        known to hold it, kv_groups.py), none past a failed load's first wrong token."""
        limit = self._failures.save_limit(req)
        chunk_size = self._where.chunk_size
        for end, column in save.state_pages:
            if limit is not None and end > limit:
                continue
            span, slots = self._where.state(engine, req, end, req.chunk_keys[end // chunk_size - 1], column,
                                             window=True)
            self._store(engine, kv_caches, req, [span], slots, span.start, stream, jobs)
            self._stats.count("lmcache:num_stored_states")

    def _spans(self, engine: "CacheEngine", req: ReqMeta, save: SaveSpec) -> list[ChunkSpan]:
        """This worker's spans of the request's save: its chunks, the last chunk's block prefix before the last
        one (block_prefix.py), none reaching past a failed load's first wrong token."""
        chunk_size = self._where.chunk_size
        spans = engine.chunk_spans(req.keys_upto(save.end, chunk_size), save.end, save.mask_start // chunk_size)
        if save.prefix_end and save.prefix_key is not None:
            prefix_keys = req.keys_upto(save.prefix_end, chunk_size, save.prefix_key)
            spans[-1:-1] = engine.chunk_spans(prefix_keys, save.prefix_end, len(prefix_keys) - 1)
        limit = self._failures.save_limit(req)
        return spans if limit is None else [span for span in spans if span.end <= limit]

    def _count_store(self, num_tokens: int, seconds: float) -> None:
        self._stats.count("lmcache:num_store_requests")
        self._stats.count("lmcache:num_stored_tokens", num_tokens)
        self._stats.observe("lmcache:time_to_store", seconds)
        if num_tokens and seconds > 0:
            self._stats.observe("lmcache:store_speed", num_tokens / seconds)
