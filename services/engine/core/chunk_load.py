"""A load's chunks on their way from the tiers into vLLM's paged cache (`CacheEngine.load`), and the rules every
copy between the paged cache and pool slots keeps: one slot per token, slots handed back only after the copies
that read or write them.

A `ChunkLoad` holds the references to the held prefix of a load's spans: acquired at once (the CPU tier, then the
lower tiers within `blocking_timeout_secs`), or fetched on the NATS loop (its `future` answers them). Its holder
gives each reference back once: `scatter` copies chunks into vLLM's blocks and releases them, `layer_copies`
hands them to the layer-wise loader (core/layerwise_load.py), `release` drops what was not copied.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvmesh.services.engine.core.kv_layout import KVLayout
from kvmesh.services.engine.core.layerwise_load import ChunkCopy
from kvmesh.services.engine.core.paged_copy import PagedCopier
from kvmesh.services.engine.tiers.cpu import ChunkRef
from kvmesh.shared.wire.keys import ChunkKey, ChunkSpan

if TYPE_CHECKING:
    from kvmesh.services.engine.core.layer_pipeline import LayerPipeline

log = logging.getLogger(__name__)

KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


class ChunkLoad:
    """The held prefix of `spans` (module docstring). `note_hits`: called with the keys of fetched chunks as they
    are scattered (chunks acquired at once were counted as hits by the acquire)."""

    def __init__(self, spans: Sequence[ChunkSpan], future: "concurrent.futures.Future[list[ChunkRef]]",
                 layout: KVLayout, copier: PagedCopier,
                 note_hits: Callable[[list[ChunkKey]], None] | None = None) -> None:
        self.spans = list(spans)
        self.future = future
        self._layout, self._copier, self._note_hits = layout, copier, note_hits
        self._refs: list[ChunkRef | None] | None = None  # from the future; None where given back already
        self._given_up = False  # released before the fetch ended: what it brings is released then

    @classmethod
    def acquired(cls, spans: Sequence[ChunkSpan], refs: list[ChunkRef], layout: KVLayout,
                 copier: PagedCopier) -> "ChunkLoad":
        future: concurrent.futures.Future[list[ChunkRef]] = concurrent.futures.Future()
        future.set_result(refs)
        return cls(spans, future, layout, copier)

    def done(self) -> bool:
        """Whether the chunks are here (a fetch has ended, well or not)."""
        return self.future.done()

    def scatter(self, kv_caches: KVCaches, slot_mapping: torch.Tensor, skip_prefix: int = 0, *, first: int = 0,
                count: int | None = None, pipeline: "LayerPipeline | None" = None) -> int:
        """Copy the held chunks of spans[first:first + count] (to the end by default) into vLLM's paged cache,
        writing none of the first `skip_prefix` tokens, and give them back; how many were copied. Raises what a
        broken fetch raised. With `pipeline` (CPU, core/layer_pipeline.py), chunks whose writes can be planned
        together are checked here and handed to it with their references, to be written during the forward."""
        refs = self._take(first, count)
        spans = self.spans[first:first + len(refs)]
        if self._note_hits is not None and refs:
            self._note_hits([ref.meta.key for ref in refs])
        caches = layer_list(kv_caches)
        handed = False
        try:
            if refs:
                check_slot_count(slot_mapping, spans[-1].end)
            chunks = [(self._view(span, ref), span.start, span.end, min(max(skip_prefix - span.start, 0),
                                                                       span.num_tokens))
                      for span, ref in zip(spans, refs)]
            states = [span.state for span in spans]
            plan = self._copier.plan_chunks(chunks, caches, slot_mapping, states) if pipeline is not None else None
            if plan is not None:
                assert pipeline is not None
                pipeline.add(plan, refs)
                handed = True
            else:
                self._copier.scatter_chunks(chunks, caches, slot_mapping, states)
        finally:  # the slots must not be reused before the copies queued so far have read them
            if not handed:
                release_after_copies(caches, refs)
        return len(refs)

    def layer_copies(self, slot_mapping: torch.Tensor, skip_prefix: int = 0
                     ) -> tuple[list[ChunkCopy], list[ChunkRef]]:
        """The held chunks as the layer-wise loader's copies (`slot_mapping` on the caches' device), and their
        references, which the loader gives back once the copies have read them."""
        refs = self._take(0, None)
        try:
            copies = [ChunkCopy(self._view(span, ref), slot_mapping[span.start:span.end],
                                min(max(skip_prefix - span.start, 0), span.num_tokens))
                      for span, ref in zip(self.spans, refs)]
        except BaseException:
            for ref in refs:
                ref.release()
            raise
        return copies, refs

    def release(self) -> None:
        """Give back what was not copied; a fetch still running gives back what it brings once it ends."""
        if self._given_up:
            return
        if self._refs is None:
            self._given_up = True
            self.future.add_done_callback(_release_late)
            return
        held = [ref for ref in self._refs if ref is not None]
        self._refs = [None] * len(self._refs)
        for ref in held:
            ref.release()

    def _take(self, first: int, count: int | None) -> list[ChunkRef]:
        if self._given_up:
            return []
        if self._refs is None:
            self._refs = list(self.future.result())
        end = len(self._refs) if count is None else min(first + count, len(self._refs))
        taken = [ref for ref in self._refs[first:end] if ref is not None]
        self._refs[first:end] = [None] * max(end - first, 0)
        return taken

    def _view(self, span: ChunkSpan, ref: ChunkRef) -> torch.Tensor:
        return ref.slot.view(self._layout.dtype, self._layout.chunk_shape(span.num_tokens, span.state))


def _release_late(future: "concurrent.futures.Future[Any]") -> None:
    """A fetch whose load was given up: its chunks stay in the CPU tier (which holds its own references)."""
    if future.cancelled() or future.exception() is not None:
        return
    for ref in future.result():
        ref.release()


def layer_list(kv_caches: KVCaches) -> list[torch.Tensor]:
    """vLLM's per-layer caches, a list or a dict of them, as a list in their order."""
    return list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)


def check_slot_count(slot_mapping: torch.Tensor, needed: int) -> None:
    if slot_mapping.shape[-1] < needed:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[-1]} slots, the chunks need {needed} "
                         f"(one slot per token)")


def synchronize(kv_caches: list[torch.Tensor]) -> None:
    if kv_caches and kv_caches[0].is_cuda:
        torch.cuda.current_stream(kv_caches[0].device).synchronize()


class _Releasable(Protocol):
    def release(self) -> None: ...


def release_after_copies(kv_caches: list[torch.Tensor], held: Sequence[_Releasable],
                         stream: "torch.cuda.Stream | None" = None) -> None:
    """Hand pool slots back only once the copies queued on them (on `stream`, else on the current stream) are
    done, on success and on error alike: a gather still queued behind the forward would otherwise write into a
    slot the mesh has since refilled (a prefetched chunk, later served as valid). If even the wait fails (a
    broken CUDA context), the slots are leaked, never released under a copy that may still run."""
    try:
        if stream is not None:
            stream.synchronize()
        else:
            synchronize(kv_caches)
    except BaseException as exc:
        log.error("cannot wait for the KV copies of %d pool slots (%s: %s): leaving them allocated", len(held),
                  type(exc).__name__, exc)
        return
    for item in held:
        item.release()


__all__ = ["ChunkLoad", "KVCaches", "check_slot_count", "layer_list", "release_after_copies"]
