"""The cache engine: one worker's chunks between vLLM's paged cache and the tiers, built for the mesh.

Who runs what:
  * vLLM's worker thread (through the connector) calls every public method synchronously. The connector names
    chunks by the chain keys its scheduler computed once per request (`chunk_spans`) and has one entry for loads,
    `load` (a `ChunkLoad`: acquired now or fetched on the NATS loop, then scattered or copied layer by layer,
    core/chunk_load.py), and one for saves, `save` (admitted now, or a `StoreJob` admitted once its copies end);
    LMCache's API by tokens (core/token_api.py) uses the same two. Bytes move between vLLM's paged cache and
    pool slots with the paged copier (`PagedCopier.gather` / `scatter`); a CPU hit never touches NATS.
  * The NATS loop thread (`NatsLoop`) does all NATS work: write-behind to the disk / remote stores, fetches
    from them, the worker agent (registration, admission events, controller commands). vLLM's calls wait for
    it only with bounded timeouts and fall back to a miss, so a dead NATS never blocks vLLM.
  * The engine's parts, its NATS connection (`mesh.embedded`) included, are built by services/engine/assembly.py.

A chunk's way: vLLM paged cache --gather--> pool slot --> CPU tier --write-behind--> disk store / remote store;
back: store --get_into--> pool slot --> CPU tier --scatter--> vLLM paged cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol, overload

import torch

from kvmesh.services.engine.core.chunk_load import (ChunkLoad, KVCaches, check_slot_count, layer_list,
                                                    release_after_copies, synchronize)
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core.kv_layout import KVLayout
from kvmesh.services.engine.core.paged_copy import PagedCopier
from kvmesh.services.engine.core.storage_manager import ALL_LOCATIONS, StorageManager
from kvmesh.services.engine.mesh.nats_loop import NatsLoop
from kvmesh.services.engine.tiers.base import NO_RETENTION, Retention
from kvmesh.services.engine.tiers.cpu import ChunkRef, LocalCPUBackend
from kvmesh.services.engine.tiers.memory_pool import MemoryPool, Slot
from kvmesh.services.engine.tiers.peer import PeerTier, PeerWorker
from kvmesh.shared import protocol
from kvmesh.shared.protocol import PEER, ChunkMeta, worker_id_for
from kvmesh.shared.rate_limited_log import RateLimitedLog
from kvmesh.shared.wire.keys import ChunkHasher, ChunkKey, ChunkSpan, KeyParams, chunk_spans, state_key
from kvmesh.shared.wire.kv_events import ChunkDescription

log = logging.getLogger(__name__)


class MeshPresence(Protocol):
    """What the engine asks of its place on the mesh (`assembly.WorkerMesh`)."""

    nats_url: str

    def registered(self) -> bool: ...

    def announce(self) -> None: ...

    def describe(self, key: ChunkKey, description: ChunkDescription) -> None: ...

    def close(self) -> None: ...


class CacheEngine:
    """Store, retrieve, look up and prefetch KV chunks across the CPU tier, the disk store and the remote store.

    Built from its parts by `assembly.build_engine` (the pool, the CPU tier, the copier, the storage manager and,
    with the mesh, the NATS loop and `mesh`); the engine never builds them itself.
    """

    def __init__(self, config: EngineConfig, key_params: KeyParams, layout: KVLayout, *, worker_id: str,
                 world_size: int, rank: int, writes_lower_tiers: bool, hasher: ChunkHasher, pool: MemoryPool,
                 cpu: LocalCPUBackend, copier: PagedCopier, storage: StorageManager,
                 nats_loop: NatsLoop | None = None) -> None:
        self.config = config
        self.key_params = key_params  # as the layout and the sharing domain fixed them
        self.layout = layout
        # The worker's place in its instance; key_params may name another shard (MLA: one for all ranks).
        self.world_size, self.rank = world_size, rank
        self.worker_id = worker_id
        self.writes_lower_tiers = writes_lower_tiers  # False on ranks > 0 of a replicated (MLA) cache
        self.hasher = hasher
        self.pool = pool
        self.cpu = cpu
        self.copier = copier
        self.storage = storage
        self.nats_loop = nats_loop  # the engine's NATS thread (None without the mesh)
        self.mesh: MeshPresence | None = None  # set by the assembly once the engine is on the mesh
        self.lora_adapters: dict[str, str] = {}  # LoRA name -> identity, as seen in requests (registration)
        self._dtype_name = str(layout.dtype).removeprefix("torch.")
        # (num_tokens, state) -> (field, value)
        self._expected: dict[tuple[int, bool], tuple[tuple[str, object], ...]] = {}
        self._rlog = RateLimitedLog(log)
        self._closed = False

    @property
    def store_caller(self) -> str:
        """This rank's path towards the stores, `engine.<instance_id>.<instance_id>[.r<rank>]`: its puts are claimed
        under it, and the controller's `/clear` (through this rank's `clear`) takes back only those claims. It
        leaves out the process tag of `worker_id`, so a restarted vLLM still clears what it put before."""
        rank_id = worker_id_for(self.config.lmcache_instance_id, self.world_size, self.rank)
        return protocol.Principal.engine(self.config.lmcache_instance_id).producer(rank_id)

    def note_lora(self, lora_name: str, lora_id: str) -> None:
        """A request used this LoRA adapter: register it, so /lookup, /pin and /unpin can name it."""
        if self.lora_adapters.get(lora_name) == lora_id:
            return
        self.lora_adapters = {**self.lora_adapters, lora_name: lora_id}  # rebound: the loop thread reads it
        if self.mesh is not None:
            self.mesh.announce()

    def describe(self, described: Sequence[tuple[ChunkKey, ChunkDescription]]) -> None:
        """What the CPU tier's admissions of these chunks (by chain key) tell the controller besides their keys
        (describe_admissions): keys and parents as this shard names them."""
        mesh = self.mesh
        if mesh is None:
            return
        shard = self.hasher.params.shard_key
        for key, description in described:
            parent = description.parent
            mesh.describe(shard(key), ChunkDescription(shard(parent) if parent is not None else None,
                                                       description.token_ids, description.extra_keys,
                                                       description.lora_name))

    def ready(self) -> tuple[KVLayout, ChunkHasher, LocalCPUBackend, StorageManager, PagedCopier]:
        """The engine's parts, once more; RuntimeError after `close`."""
        if self._closed:
            raise RuntimeError(f"cache engine {self.worker_id} is closed")
        return self.layout, self.hasher, self.cpu, self.storage, self.copier

    # ---- the connector's path: chunks named by the chain keys the scheduler computed -------------------------
    def chunk_spans(self, chain_keys: Sequence[ChunkKey], num_tokens: int, first_chunk: int = 0,
                    state: bool = False) -> list[ChunkSpan]:
        """This worker's spans of chunks [first_chunk, len(chain_keys)) of a `num_tokens`-token sequence (`state`:
        the keys name recurrent states, looked up alone as one-chunk sequences: scheduler_lookup.py)."""
        _, hasher, _, _, _ = self.ready()
        spans = chunk_spans(chain_keys, num_tokens, self.config.chunk_size, first_chunk)
        if state:
            spans = [dataclasses.replace(span, state=True) for span in spans]
        return hasher.shard(spans)

    @overload
    def load(self, spans: Sequence[ChunkSpan], slot_mapping: torch.Tensor | None = None, *,
             fetch: Literal[False] = False, tiers: frozenset[str] | None = None,
             leased: dict[ChunkKey, ChunkRef] | None = None) -> ChunkLoad: ...

    @overload
    def load(self, spans: Sequence[ChunkSpan], slot_mapping: torch.Tensor | None = None, *,
             fetch: bool, tiers: frozenset[str] | None = None,
             leased: dict[ChunkKey, ChunkRef] | None = None) -> ChunkLoad | None: ...

    def load(self, spans: Sequence[ChunkSpan], slot_mapping: torch.Tensor | None = None, *,
             fetch: bool = False, tiers: frozenset[str] | None = None,
             leased: dict[ChunkKey, ChunkRef] | None = None) -> ChunkLoad | None:
        """The held prefix of `spans` on its way into vLLM's paged cache (core/chunk_load.py): acquired at once
        from the CPU tier, then the lower tiers (`slot_mapping`, when given, must have a slot for every span's
        token); with `fetch`, fetched on the NATS loop (the CPU tier, then the lower tiers; chunks a lookup is
        prefetching are waited for, not read twice), and None without a connected lower tier: the caller loads
        at once. `tiers`: the only locations read (a request's kv_load_tiers; None: all); without the CPU tier
        its copy is never read, the chunks come from the named lower tiers (StorageManager.fetch). `leased`: chunks
        the scheduler leased for this load (adapter/cpu_leases.py), taken from it by key before any tier is read."""
        layout, _, _, storage, copier = self.ready()
        wanted = ALL_LOCATIONS if tiers is None else tiers
        if fetch:
            if not spans or not storage.lower_ready():
                return None
            assert storage.loop is not None
            return ChunkLoad(spans, storage.loop.submit(storage.fetch(spans, self.meta_mismatch, wanted=wanted)),
                             layout, copier, storage.recency.note_hits)
        if not spans:
            return ChunkLoad.acquired(spans, [], layout, copier)
        if slot_mapping is not None:
            check_slot_count(slot_mapping, spans[-1].end)
        refs: list[ChunkRef] = []
        for span in spans if leased else ():
            ref = leased.pop(span.key, None)
            if ref is None:
                break
            refs.append(ref)
        if len(refs) < len(spans):
            refs += storage.acquire_prefix(spans[len(refs):], self.meta_mismatch, wanted)
        return ChunkLoad.acquired(spans, refs, layout, copier)

    def lease_cpu(self, spans: Sequence[ChunkSpan]) -> list[ChunkRef] | None:
        """References to the CPU tier's chunk of every span, each checked against its span (`meta_mismatch`),
        for a load that must not fail (adapter/cpu_leases.py); None, holding nothing, unless all are there."""
        _, _, cpu, storage, _ = self.ready()
        if cpu.prefix(span.key for span in spans) < len(spans):
            return None
        refs: list[ChunkRef] = []
        for span in spans:
            ref = storage.checked_cpu(span, cpu.acquire(span.key), self.meta_mismatch)
            if ref is None:
                for held in refs:
                    held.release()
                return None
            refs.append(ref)
        return refs

    def save(self, spans: Sequence[ChunkSpan], kv_caches: KVCaches, slot_mapping: torch.Tensor,
             stream: "torch.cuda.Stream | None" = None, retention: Retention = NO_RETENTION,
             store_to: frozenset[str] | None = None, first_token: int = 0) -> "StoreJob | None":
        """Copy the chunks of `spans` out of vLLM's paged cache into the CPU tier and queue them for the lower
        tiers (write-behind). Chunks already held (CPU tier, or known to be in every lower tier) are not copied
        again; from a token without a slot (negative) or when the pool is full, the rest is skipped.
        `slot_mapping` starts at token `first_token` (at most the first span's start).

        With `stream` the copies are only started, and the job returned (None: nothing to copy) is admitted by
        `StoreJob.admit` once `job.done()`: on CUDA the gather runs on `stream` after everything already queued
        on the current stream (the forward that wrote the KV), and `job.event` marks its end, until which vLLM's
        blocks must stay untouched. Elsewhere the copy is done when this returns.

        The storing request's `retention` goes with every chunk (CPU tier, disk store); `store_to` names the only
        locations written (its kv_store_tiers; None: all): without LOCAL_CPU the CPU tier only stages the chunks
        for the lower tiers and keeps none."""
        job = self._gather_spans(spans, layer_list(kv_caches), slot_mapping, first_token, stream, retention,
                                 store_to)
        if job is None or stream is not None:
            return job
        job.admit()
        return None

    def retain(self, chain_keys: Sequence[ChunkKey], num_tokens: int, retention: Retention) -> None:
        """Give this worker's resident chunks of a `num_tokens`-token sequence a request's retention (a request
        that loads them: its save stores only what it computed)."""
        if retention.asked:
            self.ready()[2].retain_keys([span.key for span in self.chunk_spans(chain_keys, num_tokens)], retention)

    def state_span(self, chain_key: ChunkKey, end: int, num_tokens: int) -> ChunkSpan:
        """This worker's span of the recurrent state after `end` tokens (adapter/kv_groups.py): its last
        `num_tokens` tokens, stored under `chain_key`'s state key."""
        hasher = self.ready()[1]
        chain_span = ChunkSpan((end - 1) // self.config.chunk_size, end - num_tokens, end, state_key(chain_key),
                               state=True)
        return hasher.shard([chain_span])[0]

    async def lookup_and_prefetch(self, spans: Sequence[ChunkSpan], peer_instance: str = "",
                                  peer_worker: str = "", prefetch_from: int = 0,
                                  tiers: frozenset[str] | None = None) -> int:
        """NATS loop: the held prefix of `spans` over every tier, in tokens; what a lower tier holds past token
        `prefetch_from` (vLLM's computed tokens) starts moving into the CPU tier at once (the scheduler's lower-tier
        lookup, then the load one step later).
        `peer_worker` of `peer_instance`: the PD producer a request's hint names (adapter/pd.py, client input):
        the peer lookup waits a little for its admissions of the spans, never takes its word for them.
        `tiers`: the only locations looked in (a request's kv_load_tiers; None: all)."""
        _, _, _, storage, _ = self.ready()
        peers = storage.lower(PEER)
        if peer_worker and isinstance(peers, PeerTier):
            # every span, the partial last chunk too: the producer saves the same prompt (save_unfull_chunk)
            peers.expect([span.key for span in spans], PeerWorker(peer_instance, peer_worker))
        held = await storage.lookup_and_prefetch(spans, self.meta_mismatch, prefetch_from, for_request=True,
                                                 wanted=ALL_LOCATIONS if tiers is None else tiers)
        return spans[held - 1].end if held else 0

    def _gather_spans(self, spans: Sequence[ChunkSpan], kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                      first_token: int, stream: "torch.cuda.Stream | None", retention: Retention = NO_RETENTION,
                      store_to: frozenset[str] | None = None) -> "StoreJob | None":
        layout, _, cpu, storage, copier = self.ready()
        lower_to = None if store_to is None else store_to - {protocol.LOCAL_CPU}
        write_lower = storage.has_stores and self.writes_lower_tiers and (lower_to is None or bool(lower_to))
        keep_cpu = cpu.keep and (store_to is None or protocol.LOCAL_CPU in store_to)
        if not spans or (not keep_cpu and not write_lower) or self.config.force_skip_save:
            return None
        if first_token > min(span.start for span in spans):
            raise ValueError(f"slot_mapping starts at token {first_token}, after the first chunk's")
        check_slot_count(slot_mapping, spans[-1].end - first_token)
        first_bad = first_token + _first_negative(slot_mapping, spans[-1].end - first_token)
        on_side = stream is not None and bool(kv_caches) and kv_caches[0].is_cuda
        if on_side:
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(kv_caches[0].device))  # after the forward's writes
        filled: list[tuple[ChunkSpan, Slot]] = []
        try:
            with torch.cuda.stream(stream) if on_side else contextlib.nullcontext():
                for span in spans:
                    held_below = storage.write_behind.known_held(span.key)
                    if span.key in cpu or held_below:
                        cpu.retain_keys([span.key], retention)  # held already: kept as the request asks
                        if write_lower and not held_below:  # e.g. stored before to the CPU tier only
                            self._send_on(span.key, retention, lower_to)
                        continue
                    if span.end > first_bad:  # tokens without a cache slot: nothing valid to copy from here on
                        break
                    slot = cpu.allocate(span.state)
                    if slot is None:
                        self._rlog.warning("store_pool_full", "CPU pool full (%d chunks, all pinned or in use): "
                                           "skipped storing %d tokens from token %d", cpu.pool.num_slots,
                                           spans[-1].end - span.start, span.start)
                        break
                    filled.append((span, slot))
                    out = slot.view(layout.dtype, layout.chunk_shape(span.num_tokens, span.state))
                    copier.gather(kv_caches, slot_mapping[..., span.start - first_token:span.end - first_token],
                                  out, span.state)
                event = torch.cuda.Event() if on_side else None
                if event is not None:
                    event.record()
            if not on_side:
                synchronize(kv_caches)  # GPU copies into pinned memory are asynchronous
        except BaseException:
            release_after_copies(kv_caches, [slot for _, slot in filled], stream if on_side else None)
            raise
        return StoreJob(filled, write_lower, self._admit, event, retention, keep_cpu, lower_to) if filled else None

    def _send_on(self, key: ChunkKey, retention: Retention, lower_to: frozenset[str] | None) -> None:
        """A chunk the CPU tier holds that the stores are not known to hold and no write-behind is sending: sent
        from the CPU tier (no copy out of vLLM's cache), to the save's stores."""
        cpu, write_behind = self.cpu, self.storage.write_behind
        if write_behind.pending(key):
            return
        ref = cpu.copy_for_stores(key)
        if ref is not None:
            write_behind.enqueue(ref.meta, ref.slot, retention, lower_to)

    def _admit(self, job: "StoreJob") -> None:
        """Put a finished gather's chunks into the CPU tier and queue them for the lower tiers (write-behind).
        Waits for the copies if they are still running."""
        _, _, cpu, storage, _ = self.ready()
        job.wait()
        for span, slot in job.filled:
            meta = self._chunk_meta(span)
            if not job.keep_cpu:  # the request stores below only: the write-behind takes over the slot's reference
                if job.write_lower:
                    storage.write_behind.enqueue(meta, slot, job.retention, job.lower_to)
                else:
                    slot.release()
                continue
            behind = slot.ref() if job.write_lower else None
            if not cpu.put(meta, slot, retention=job.retention):  # resident already (a concurrent store) or no room
                if behind is not None:
                    behind.release()
                continue
            if behind is not None:
                storage.write_behind.enqueue(meta, behind, job.retention, job.lower_to)
        job.filled = []

    # ---- helpers for tests and the connector ----------------------------------------------------------------
    def _chunk_meta(self, span: ChunkSpan) -> ChunkMeta:
        """The meta of `span`'s chunk (or state) in this engine's layout (checksum unset: computed at write-behind)."""
        layout = self.layout
        assert layout is not None
        return ChunkMeta(key=span.key, num_tokens=span.num_tokens,
                         shape=list(layout.chunk_shape(span.num_tokens, span.state)), dtype=self._dtype_name,
                         fmt=layout.object_format(span.state), nbytes=layout.chunk_nbytes(span.num_tokens, span.state))

    def meta_mismatch(self, span: ChunkSpan, meta: ChunkMeta) -> str | None:
        """How a chunk about to be loaded (from any tier, the CPU tier included) differs from what `span`'s key
        must hold here (None: it matches). A chunk of another key, token count, KV format or kind (a chunk where a
        state is expected, or the reverse), dtype, byte size or shape is never scattered into vLLM's blocks. On
        every loaded chunk: the per-token-count part of the expectation is built once (`_expected_meta`)."""
        if meta.key != span.key:
            return f"key {meta.key.hex()!r} where this engine expects {span.key.hex()!r}"
        if meta.num_tokens != span.num_tokens:
            return f"num_tokens {meta.num_tokens!r} where this engine expects {span.num_tokens!r}"
        expected = self._expected_meta(span.num_tokens, span.state)
        for name, want in expected:
            got = getattr(meta, name)
            if name == "shape":
                got = tuple(got)
            if got != want:
                return f"{name} {got!r} where this engine expects {want!r}"
        return None

    def _expected_meta(self, num_tokens: int, state: bool) -> tuple[tuple[str, object], ...]:
        """(field, value) of what a chunk (or with `state` a state) of `num_tokens` tokens holds in this engine's
        layout, besides its key."""
        expected = self._expected.get((num_tokens, state))
        if expected is None:
            meta = self._chunk_meta(ChunkSpan(0, 0, num_tokens, b"", state))
            expected = self._expected[num_tokens, state] = (("fmt", meta.fmt), ("dtype", meta.dtype),
                                                            ("nbytes", meta.nbytes), ("shape", tuple(meta.shape)))
        return expected

    def usage(self) -> "EngineUsage":
        """What the connector's metrics report of this engine (adapter/connector_stats.py)."""
        layout = self.layout
        state_bytes = layout.chunk_nbytes(layout.state_block, state=True) if layout.has_state else 0
        return EngineUsage(self.storage.stats, self.cpu.used_bytes, len(self.cpu),
                           self.connected or self.nats_loop is None, {"retains_refused": self.cpu.retain_refused},
                           layout.chunk_nbytes(self.config.chunk_size), state_bytes)

    @property
    def nats_url(self) -> str | None:
        """The NATS this engine uses (joined or embedded); None without the mesh."""
        return self.mesh.nats_url if self.mesh is not None else None

    @property
    def connected(self) -> bool:
        return self.nats_loop is not None and self.nats_loop.connected

    def wait_connected(self, timeout: float) -> bool:
        """Block until NATS is connected and the worker agent registered (False on timeout or without mesh)."""
        if self.nats_loop is None:
            return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.nats_loop.connected and self.mesh is not None and self.mesh.registered():
                return True
            time.sleep(0.01)
        return False

    def forward_started(self) -> None:
        """vLLM's model thread: a forward runs; the write-behind holds its jobs back (core/write_behind.py)."""
        self.storage.write_behind.forward_started()

    def forward_ended(self) -> None:
        """vLLM's model thread: the forward has ended; the write-behind may start its jobs."""
        self.storage.write_behind.forward_ended()

    def wait_write_behind(self, timeout: float = 10.0) -> bool:
        """Block until every queued write-behind finished (tests, benchmarks)."""
        if self.nats_loop is None:
            return True
        return self.nats_loop.call(self.storage.write_behind.wait_idle(timeout), timeout + 1.0, default=False)

    def close(self) -> None:
        """Stop the worker agent and write-behind, close NATS, join the loop thread, free the pool."""
        if self._closed:
            return
        self._closed = True
        if self.nats_loop is not None:
            self.nats_loop.close()
        if self.mesh is not None:
            self.mesh.close()
        self.cpu.close()
        self.pool.close()
        log.info("cache engine %s closed", self.worker_id)

    def __enter__(self) -> "CacheEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class EngineUsage:
    """The storage manager's counters so far, the CPU tier's bytes and chunks, whether the engine is healthy
    (its mesh reachable, or it has none), and the CPU tier's own counters so far (`retains_refused`)."""

    counters: Mapping[str, int]
    cpu_bytes: int
    cpu_chunks: int
    healthy: bool
    cpu_counters: Mapping[str, int] = dataclasses.field(default_factory=dict)
    chunk_bytes: int = 0  # what one full chunk stores (kv_layout.py: its layers' pages only)
    state_bytes: int = 0  # what one recurrent state stores (0: the model has no state layers)


@dataclasses.dataclass
class StoreJob:
    """A save whose gather was started (`CacheEngine.save` with a stream): the pool slots it fills, one per span,
    what admits them (the engine's CPU tier and write-behind) and, on CUDA, the event that marks the end of its
    copies (None: already done)."""

    filled: list[tuple[ChunkSpan, Slot]]
    write_lower: bool
    admit_into: "Callable[[StoreJob], None]"
    event: "torch.cuda.Event | None" = None
    retention: Retention = NO_RETENTION  # the storing request's (tiers/base.py)
    keep_cpu: bool = True  # False: the CPU tier only stages the chunks for the lower tiers
    lower_to: frozenset[str] | None = None  # the lower locations written (None: all)

    def admit(self) -> None:
        """Put the chunks into the CPU tier and queue them for the lower tiers; waits for the copies if they
        still run."""
        self.admit_into(self)

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def order_before(self, stream: "torch.cuda.Stream") -> None:
        """Make work queued on `stream` from now on wait for this job's copies, without blocking the host
        (a preempted request's blocks may be rewritten by the next forward)."""
        if self.event is not None:
            stream.wait_event(self.event)

    def abandon(self) -> None:
        """Give the slots back without admitting them (after the copies, which may still write them)."""
        self.wait()
        for _, slot in self.filled:
            slot.release()
        self.filled = []


def _first_negative(slot_mapping: torch.Tensor, limit: int) -> int:
    """Index of the first token without a cache slot (negative), or `limit` if there is none before it. With KV
    cache groups (one row each) a freed sliding-window block is negative and the scheduler chose what to save."""
    if slot_mapping.dim() == 2:
        return limit
    negative = (slot_mapping[:limit] < 0).nonzero()
    return int(negative[0, 0]) if negative.numel() else limit


__all__ = ["CacheEngine", "EngineUsage", "KVCaches", "StoreJob"]
