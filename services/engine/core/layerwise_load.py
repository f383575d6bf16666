"""Layer-wise loading (LMCache's `use_layerwise`): a step's loads copied into vLLM's paged cache one layer at a
time on a side CUDA stream, each layer's copies marked by an event; `wait(layer)` (the connector's
`wait_for_layer_load`, called by layer i's attention) makes the forward's stream wait for that layer only, so
the copies of later layers overlap the forward of earlier ones.

The pool slots read by the copies are released only once the side stream has passed the last of them. Off
CUDA the copies run at once, layer by layer (the connector uses this only on CUDA; tests use it on CPU to check
the per-layer copies against the whole-chunk path).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from .kv_layout import KVLayout
from .paged_copy import PagedCopier

if TYPE_CHECKING:
    from kvmesh.services.engine.tiers.cpu import ChunkRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkCopy:
    """One chunk to scatter: its pool tensor (``layout.chunk_shape``, layers first), its tokens' slots, and how
    many leading tokens vLLM already holds."""

    chunk: torch.Tensor
    slots: torch.Tensor
    skip: int = 0


class LayerwiseLoader:
    """Per-layer scatters of one worker's loads (vLLM's worker thread only)."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        # a chunk's layer i is its [i:i+1] slice: copied by a copier for a one-layer layout
        self.copier = PagedCopier(dataclasses.replace(layout, num_layers=1), device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._events: dict[str, torch.cuda.Event] = {}
        self._held: list[tuple[torch.cuda.Event | None, list["ChunkRef"]]] = []  # released once the event fired

    def start(self, kv_caches: Mapping[str, torch.Tensor], copies: Sequence[ChunkCopy],
              refs: Sequence["ChunkRef"]) -> None:
        """Queue every layer's copies (layer by layer, in the caches' order); `refs` hold the chunks' slots."""
        if not copies:
            self._release(list(refs))
            return
        if self.stream is None:
            try:
                for i, cache in enumerate(kv_caches.values()):
                    for c in copies:
                        self.copier.scatter(c.chunk[i:i + 1], [cache], c.slots, c.skip)
            finally:
                self._release(list(refs))
            return
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)  # after what the previous forward still does with these blocks
        for c in copies:
            if c.slots.is_cuda:  # allocated on the forward's stream, read on ours: keep it until then
                c.slots.record_stream(self.stream)
        last: torch.cuda.Event | None = None
        try:
            with torch.cuda.stream(self.stream):
                for i, (name, cache) in enumerate(kv_caches.items()):
                    for c in copies:
                        self.copier.scatter(c.chunk[i:i + 1], [cache], c.slots, c.skip)
                    last = self._events[name] = torch.cuda.Event()
                    last.record(self.stream)
        finally:
            if last is None or len(self._events) < len(kv_caches):  # failed midway: wait before releasing
                self.stream.synchronize()
                last = None
            self._held.append((last, list(refs)))

    def wait(self, layer_name: str) -> None:
        """The forward's stream waits for `layer_name`'s copies (no host wait)."""
        event = self._events.pop(layer_name, None)
        if event is not None:
            torch.cuda.current_stream(self.stream.device if self.stream is not None else None).wait_event(event)

    def finish(self) -> None:
        """After the forward: every layer the forward did not wait for (none, normally) is ordered before the
        next work on the forward's stream; slots whose copies are done go back to the pool."""
        for name in list(self._events):
            self.wait(name)
        self.release_done()

    def release_done(self) -> None:
        keep: list[tuple[torch.cuda.Event | None, list[ChunkRef]]] = []
        for event, refs in self._held:
            if event is None or event.query():
                self._release(refs)
            else:
                keep.append((event, refs))
        self._held = keep

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._events.clear()
        for _, refs in self._held:
            self._release(refs)
        self._held = []

    @staticmethod
    def _release(refs: list["ChunkRef"]) -> None:
        for ref in refs:
            ref.release()
