"""Where a chunk's tokens are in vLLM's paged KV cache, for both copy paths (paged_torch.py, paged_kernels.py):
the checks of a slot mapping and of a chunk against its layout (kv_layout.py), and the layers' views grouped so
that one copy op covers every layer (vLLM allocates one buffer for all of them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .kv_layout import KVLayout

KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def as_list(kv_caches: KVCaches) -> list[torch.Tensor]:
    if isinstance(kv_caches, Mapping):
        return list(kv_caches.values())
    return list(kv_caches)


def check_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.to(torch.int64)
    return slot_mapping


def group_rows(slot_mapping: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The per-group rows of slots of a grouped layout."""
    if slot_mapping.dim() != 2 or slot_mapping.shape[0] != len(layout.group_layers):
        raise ValueError(f"slot_mapping must have one row per KV cache group ({len(layout.group_layers)}), got "
                         f"shape {tuple(slot_mapping.shape)}")
    return slot_mapping


def check_chunk(chunk: torch.Tensor, layout: KVLayout, num_tokens: int, what: str, state: bool = False) -> None:
    expected = layout.chunk_shape(num_tokens, state)
    if tuple(chunk.shape) != expected or chunk.dtype != layout.dtype:
        raise ValueError(
            f"{what} must be {layout.dtype} of shape {expected} for {num_tokens} tokens "
            f"({layout.object_format(state)}), got {chunk.dtype} {tuple(chunk.shape)}"
        )
    if not chunk.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


def _stack_layers(views: list[torch.Tensor]) -> torch.Tensor | None:
    """All layers as one strided view ``[L, *view.shape]``, if they are equally spaced views of one storage.

    vLLM allocates one buffer for all layers, so this is the usual case: one copy op for all layers.
    """
    v0 = views[0]
    if len(views) == 1:
        return v0.unsqueeze(0)
    ptr = v0.untyped_storage().data_ptr()
    step = views[1].storage_offset() - v0.storage_offset()
    if step <= 0:
        return None
    for i, v in enumerate(views):
        if (
            v.storage_offset() != v0.storage_offset() + i * step
            or v.stride() != v0.stride()
            or v.untyped_storage().data_ptr() != ptr
        ):
            return None
    return torch.as_strided(v0, (len(views), *v0.shape), (step, *v0.stride()), v0.storage_offset())


class _Groups:
    """Layer views grouped for copying: one stacked ``[L, ...]`` view, or one ``[1, ...]`` view per layer."""

    __slots__ = ("views", "slices")

    def __init__(self, per_layer: list[torch.Tensor]) -> None:
        stacked = _stack_layers(per_layer)
        if stacked is not None:
            self.views = [stacked]
            self.slices = [slice(0, len(per_layer))]
        else:
            self.views = [v.unsqueeze(0) for v in per_layer]
            self.slices = [slice(i, i + 1) for i in range(len(per_layer))]


# Building the grouped views costs a few microseconds per layer; vLLM's caches never move, so keep them.
_GROUPS_CACHE: OrderedDict[tuple[Any, ...], _Groups] = OrderedDict()
_GROUPS_CACHE_SIZE = 8
_GROUPS_LOCK = threading.Lock()


def _groups(caches: list[torch.Tensor], layout: KVLayout) -> _Groups:
    c0 = caches[0]
    key = (layout, c0.device, c0.stride(), tuple(c.data_ptr() for c in caches))
    with _GROUPS_LOCK:
        groups = _GROUPS_CACHE.get(key)
        if groups is not None:
            _GROUPS_CACHE.move_to_end(key)
            return groups
    if len(caches) != layout.num_layers:
        raise ValueError(f"expected {layout.num_layers} layer caches, got {len(caches)}")
    if layout.per_block:
        per_layer = list(caches)  # [nb, H, N, 2D], contiguous per block
    else:
        per_layer = [layout.kv_view(c) for c in caches]  # [P, nb, bs, H, D]
    groups = _Groups(per_layer)
    with _GROUPS_LOCK:
        _GROUPS_CACHE[key] = groups
        while len(_GROUPS_CACHE) > _GROUPS_CACHE_SIZE:
            _GROUPS_CACHE.popitem(last=False)
    return groups


def layer_groups(caches: list[torch.Tensor], layout: KVLayout) -> tuple[list[torch.Tensor], list[slice]]:
    """The layers' views for copying, and the layers each covers."""
    g = _groups(caches, layout)
    return g.views, g.slices
