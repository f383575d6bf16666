"""vLLM's KV cache groups (its hybrid KV cache manager) as KVMesh caches them.

With the hybrid manager on (the connector implements vLLM's `SupportsHMA`), vLLM splits a model's layers into
KV cache groups, one per kind of layer, each with its own block table: full attention, sliding window,
Mamba / linear-attention state... A chunk holds the KV of its tokens for every layer of every cached attention
group, layers in group order (`KVGroups.layer_order`), each group copied through its own block table
(`ReqMeta.slot_mapping` gives one row of slots per group); state groups' layers are stored apart, as states.

What each kind needs:
  * full attention (`FullAttentionSpec`, `MLAAttentionSpec`): every token's KV, as without groups.
  * sliding window (`SlidingWindowSpec`): vLLM frees the blocks that fell out of the window (their table
    entries become its null block). A load writes only the blocks vLLM allocated for the group: a null
    entry's slots are -1, which the copies skip. A chunk is stored only when its group blocks that a hit at
    the chunk's end would load are still held (`KVGroups.saveable_from`); the rest of a stored chunk may be
    stale for that group, and no load ever writes it (vLLM allocates at most that window before a hit, and
    less for a later hit: the skipped count only grows with the hit).
  * recurrent state (`MambaSpec`: Mamba, Gated DeltaNet / linear attention): no KV per token, one state per
    request, which vLLM's "align" mode (prefix caching on) keeps in the request's block table: after a step
    that computed tokens [start, end), the state after `end` tokens is in the running block (column
    cdiv(end, B) - 1), and a prefill step may also leave vLLM's internal checkpoint in column cdiv(end, B) - 2:
    the state after the position vLLM's own `compute_mamba_prefill_checkpoints` gives (a hash-block boundary,
    which is that block's end only when the hash block is the Mamba block and EAGLE drops no block). Any other
    page holds an older state or nothing. `KVGroups.state_pages` names exactly those two pages, with the
    position each holds, computed from the inputs vLLM's backends use (the KV cache config's hash block size
    and cache-hit alignment, the spec's checkpoint alignment, EAGLE's block drop). A state is stored beside
    the chunk ending at that position, under the chunk's state key (`shared.wire.keys.state_key`), only when one of
    those pages holds it; a page is never taken for the state at its block's end. It is stored as one page per
    state layer, nothing else (`page_view`: a state page copies like an attention page of the same size), and a
    hit ends only at a chunk whose state every rank holds (the scheduler looks the candidates up longest first).
    The load writes it into the block vLLM allocates for it (block hit / B - 1, where vLLM's forward reads a
    resumed request's state). Chunks hold the attention groups' layers only, states the state groups' layers
    only (core/kv_layout.py: `KVLayout.object_layers`; the meta's fmt names which an object is). Without
    "align" mode there is no state to resume from: the model is served without the cache.
  * anything else (chunked-local attention, cross attention, ...) is not cached: the model is served without
    KVMesh, with one WARNING naming the group (`KVGroups.of`).

vLLM refuses block-level load errors from a connector when there are several groups, so with groups a load
runs in-step only when it cannot fail: its every chunk and state leased at lookup in the CPU tiers of this
process's engines (adapter/cpu_leases.py). Any other load runs asynchronously, and a failed one is reported as
a failed receive (vLLM recomputes the request).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvmesh.shared.wire.keys import STATE_GROUP_TAG

FULL = "full"
SLIDING = "sliding"
STATE = "state"  # Mamba / linear attention (GDN): a recurrent state per request, not KV per token
# KV cache specs whose blocks hold every token's KV, the same way in every layer of the group.
FULL_ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
SLIDING_WINDOW_SPECS = ("SlidingWindowSpec",)
STATE_SPECS = ("MambaSpec",)


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: its kind, its layers, and for sliding windows what vLLM keeps."""

    kind: str  # FULL, SLIDING or STATE
    layer_names: tuple[str, ...]
    sliding_window: int = 0
    extra_retained_tokens: int = 0
    # STATE: vLLM's prefill checkpoint alignment (MambaSpec.prefill_checkpoint_alignment), None when the group
    # has no checkpoint block (its spec's num_prefill_checkpoint_blocks is 0)
    checkpoint_alignment: int | None = None

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens before the window of the token after `num_computed` (whose blocks vLLM frees); vLLM's
        SlidingWindowManager.get_num_skipped_tokens."""
        if self.kind != SLIDING:
            return 0
        return max(0, num_computed - self.sliding_window + 1 - self.extra_retained_tokens)

    @property
    def tag(self) -> str:
        if self.kind == STATE:
            return f"{STATE_GROUP_TAG}{len(self.layer_names)}"
        return f"F{len(self.layer_names)}" if self.kind == FULL else \
            f"S{len(self.layer_names)}w{self.sliding_window}+{self.extra_retained_tokens}"


@dataclass(frozen=True)
class StateCheckpoints:
    """What vLLM's backends compute a Mamba prefill checkpoint from besides the step (the engine core resolves
    the first two into every KVCacheConfig; `compute_mamba_prefill_checkpoints` takes all three)."""

    hash_block_size: int  # KVCacheConfig.hash_block_size: tokens per prefix-cache block hash
    alignment_tokens: int  # KVCacheConfig.cache_hit_alignment_tokens: where prefix-cache hits land
    drop_eagle_block: bool  # speculative_config.use_eagle_block_drop(): EAGLE replays the last hash block

    @classmethod
    def of(cls, kv_cache_config: Any, drop_eagle_block: bool) -> "StateCheckpoints | None":
        """From vLLM's KVCacheConfig; None where it does not carry them (no checkpoint page is then stored)."""
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
        alignment_tokens = getattr(kv_cache_config, "cache_hit_alignment_tokens", None)
        if not hash_block_size or not alignment_tokens:
            return None
        return cls(int(hash_block_size), int(alignment_tokens), bool(drop_eagle_block))


@dataclass(frozen=True)
class KVGroups:
    """The groups of one model, in vLLM's order (the order of its block tables)."""

    groups: tuple[KVGroup, ...]
    block_size: int
    # with state groups: how vLLM places its prefill checkpoints (None: never taken as a state, `state_pages`)
    checkpoints: StateCheckpoints | None = None

    @classmethod
    def of(cls, kv_cache_config: Any, drop_eagle_block: bool = False) -> "tuple[KVGroups | None, str | None]":
        """(the groups, None) when KVMesh caches every group of this model; (None, why not) otherwise; (None,
        None) without a kv_cache_config (tests, old vLLM: one full-attention group is assumed).
        `drop_eagle_block`: vLLM's speculative_config.use_eagle_block_drop() (it moves Mamba checkpoints)."""
        if kv_cache_config is None:
            return None, None
        specs = [(group, group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups]
        if not specs:
            return None, "no KV cache groups"
        groups = []
        for group, spec in specs:
            kind = type(spec).__name__
            if getattr(spec, "non_causal", False):
                return None, ("its attention is bidirectional (non_causal): a prefix's KV depends on the tokens "
                              "after it")
            if kind in FULL_ATTENTION_SPECS:  # with the hybrid manager off, windowed layers keep every block too
                groups.append(KVGroup(FULL, tuple(group.layer_names)))
            elif kind in SLIDING_WINDOW_SPECS:
                groups.append(KVGroup(SLIDING, tuple(group.layer_names), int(spec.sliding_window),
                                      int(getattr(spec, "extra_retained_tokens", 0) or 0)))
            elif kind in STATE_SPECS:
                why = _uncached_state(spec)
                if why is not None:
                    return None, f"its KV cache group of {kind} ({_names(group.layer_names)}) {why}"
                alignment = getattr(spec, "prefill_checkpoint_alignment", None)
                has_checkpoint = getattr(spec, "num_prefill_checkpoint_blocks", 0) > 0 and alignment is not None
                groups.append(KVGroup(STATE, tuple(group.layer_names),
                                      checkpoint_alignment=int(alignment) if has_checkpoint else None))
            else:
                return None, (f"its KV cache group of {kind} ({_names(group.layer_names)}) is not cached by KVMesh: "
                              "full attention, sliding-window and Mamba state groups are")
        sizes = {int(spec.block_size) for _, spec in specs}
        if len(sizes) != 1:
            return None, f"its KV cache groups have different block sizes {sorted(sizes)}"
        if all(group.kind == STATE for group in groups):
            return None, "it has no attention layer (only recurrent state): KVMesh stores states beside KV"
        return cls(tuple(groups), sizes.pop(), StateCheckpoints.of(kv_cache_config, drop_eagle_block)), None

    @property
    def has_state(self) -> bool:
        """Whether a hit needs a recurrent state saved at its end (a Mamba / GDN group)."""
        return any(group.kind == STATE for group in self.groups)

    def state_pages(self, tables: Sequence[Sequence[int]], start: int, end: int) -> dict[int, int]:
        """The state pages a step that computes tokens [start, end) leaves, as {how many tokens the state a page
        holds is after: the page's column in the state groups' tables (`tables`, this step's)}. Only two pages
        are known: the running state after `end` (column cdiv(end, B) - 1) and the prefill checkpoint vLLM's
        forward writes in this step, if any (`prefill_checkpoint`). Every other page holds an older state (the
        one the step started from, a prefix-cache hit's, which may sit inside its block) or nothing, and is never
        named. Only columns where every state group has a block count."""
        if end <= start:
            return {}
        pages = {end: -(-end // self.block_size) - 1}
        checkpoint = self.prefill_checkpoint(start, end)
        if checkpoint is not None:
            position, column = checkpoint
            pages[position] = column
        return {position: column for position, column in pages.items()
                if all(0 <= column < len(table) and table[column] != -1
                       for group, table in zip(self.groups, tables) if group.kind == STATE)}

    def prefill_checkpoint(self, start: int, end: int) -> tuple[int, int] | None:
        """(position, column) of the prefill checkpoint vLLM's forward writes in a step that computes tokens
        [start, end): the state after `position` tokens into the state groups' column (vLLM's
        `compute_mamba_prefill_checkpoints`, which its Mamba backends call with the same inputs, so this
        declines exactly where they do); None when it writes none, or not the same one in every state group."""
        compute = _vllm_prefill_checkpoints()
        if self.checkpoints is None or compute is None:
            return None
        found = set()
        for group in self.groups:
            if group.kind != STATE:
                continue
            if group.checkpoint_alignment is None:
                return None
            offsets, columns = compute([end], [end - start], hash_block_size=self.checkpoints.hash_block_size,
                                       mamba_block_size=self.block_size,
                                       checkpoint_alignment=group.checkpoint_alignment,
                                       drop_eagle_block=self.checkpoints.drop_eagle_block,
                                       cache_hit_alignment_tokens=self.checkpoints.alignment_tokens)
            if offsets[0] <= 0:
                return None
            found.add((start + offsets[0], columns[0]))
        return found.pop() if len(found) == 1 else None

    def chunk_slots(self, tables: Sequence[Sequence[int]], num_tokens: int, start: int = 0) -> torch.Tensor:
        """The slots of tokens [start, num_tokens) as chunks hold them, one row per group (`slot_rows`); state
        groups get none (-1): their pages travel as the state beside the chunk (`state_slots`)."""
        rows = slot_rows(tables, num_tokens, self.block_size, -1, start)
        for i, group in enumerate(self.groups):
            if group.kind == STATE:
                rows[i] = -1
        return rows

    def state_slots(self, tables: Sequence[Sequence[int]], end: int, column: int | None = None,
                    start: int = 0) -> torch.Tensor:
        """The slots of the state after `end` tokens, which the state groups' block `column` holds (default
        end / B - 1, where vLLM reads the state a request resumes from after a hit of `end` tokens): for tokens
        [end - B, end), that block's page (one whole page per layer), nothing (-1) for the other groups; the
        rows cover tokens [start, end) (`start` at most end - B)."""
        if column is None:
            column = end // self.block_size - 1
        if not 0 <= start <= end - self.block_size:
            raise ValueError(f"state slots from token {start}: the state after {end} tokens sits in tokens "
                             f"[{end - self.block_size}, {end})")
        rows = np.full((len(self.groups), end - start), -1, dtype=np.int64)  # numpy, as slot_rows says why
        for i, (group, table) in enumerate(zip(self.groups, tables)):
            if group.kind == STATE:
                if not 0 <= column < len(table) or table[column] == -1:
                    raise ValueError(f"no state block in column {column} of a state group's table")
                rows[i, end - self.block_size - start:] = table[column] * self.block_size + _offsets(self.block_size)
        return torch.from_numpy(rows)

    @property
    def grouped(self) -> bool:
        """Whether copies need per-group block tables (anything but one full-attention group)."""
        return len(self.groups) > 1 or self.groups[0].kind != FULL

    def layer_order(self) -> list[str]:
        """Every cached layer, in the order chunks hold them (group by group)."""
        return [name for group in self.groups for name in group.layer_names]

    def describe(self, chunk_bytes: int, state_bytes: int) -> str:
        """Each group with the bytes it stores (all layers' pages are the same size): its share of a chunk's
        `chunk_bytes` (attention groups) or of a state's `state_bytes` (state groups), for the log."""
        attention = sum(len(group.layer_names) for group in self.groups if group.kind != STATE)
        states = sum(len(group.layer_names) for group in self.groups if group.kind == STATE)

        def one(group: KVGroup) -> str:
            layers = len(group.layer_names)
            if group.kind == STATE:
                return f"{group.kind} x{layers} {state_bytes * layers / states / 2**20:.2f} MiB per state"
            window = f" (window {group.sliding_window})" if group.kind == SLIDING else ""
            return f"{group.kind} x{layers}{window} {chunk_bytes * layers / attention / 2**20:.2f} MiB per chunk"

        total = f"chunk {chunk_bytes / 2**20:.2f} MiB"
        if states:
            total += f", state after each chunk {state_bytes / 2**20:.2f} MiB"
        return f"{total}: " + ", ".join(one(group) for group in self.groups)

    def layers_per_group(self) -> tuple[int, ...]:
        return tuple(len(group.layer_names) for group in self.groups)

    @property
    def tag(self) -> str:
        """What a chunk's bytes mean beyond the layout (part of the chunk format): the groups in order."""
        return "g" + ",".join(group.tag for group in self.groups)

    def saveable_from(self, tables: Sequence[Sequence[int]], start: int, end: int, chunk_size: int,
                      null_block: int) -> int:
        """The first chunk boundary in [start, end] from which every chunk (ending at min(its end, `end`)) has
        every block a hit at its end would load still in every group's table (`tables`, vLLM's block ids per
        group, `null_block` where freed). Chunks before it are not stored."""
        first = start
        boundary = start
        while boundary < end:
            chunk_end = min(boundary - boundary % chunk_size + chunk_size, end)
            if not self.held_for_hit(tables, chunk_end, null_block):
                first = chunk_end
            boundary = chunk_end
        return first

    def held_for_hit(self, tables: Sequence[Sequence[int]], hit: int, null_block: int) -> bool:
        """Whether every attention group holds the blocks vLLM would allocate for a hit of `hit` tokens (states
        are stored beside the chunks where a step left them: `state_pages`)."""
        last = -(-hit // self.block_size)
        for group, table in zip(self.groups, tables):
            if group.kind == STATE:
                continue
            first = group.skipped_tokens(hit) // self.block_size
            if len(table) < last or any(block == null_block for block in table[first:last]):
                return False
        return True


def page_view(state: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """A state layer's cache (vLLM's view of its state inside each page) as `template`'s shape, dtype and strides
    over the same memory: with the hybrid manager every layer's page has one size, so a page of state copies
    like a page of KV. ValueError when the pages differ."""
    page_bytes = template.stride(0) * template.element_size()
    if state.stride(0) * state.element_size() != page_bytes or state.shape[0] != template.shape[0]:
        raise ValueError(f"a state layer's pages ({state.shape[0]} of {state.stride(0) * state.element_size()} "
                         f"bytes) differ from the attention layers' ({template.shape[0]} of {page_bytes} bytes)")
    offset = state.storage_offset() * state.element_size()
    if offset % template.element_size():
        raise ValueError(f"a state layer starts at byte {offset}, not a multiple of {template.element_size()}")
    storage = torch.empty(0, dtype=template.dtype, device=state.device).set_(state.untyped_storage())
    return storage.as_strided(template.shape, template.stride(), offset // template.element_size())


def _uncached_state(spec: Any) -> str | None:
    """Why KVMesh cannot cache this Mamba group's state, or None."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (f"keeps its state in mamba_cache_mode {mode!r}: vLLM keeps states at block boundaries only in "
                "'align' mode (--enable-prefix-caching, or --mamba-cache-mode align)")
    if getattr(spec, "num_speculative_blocks", 0):
        return "has speculative-decoding state blocks, which KVMesh does not follow"
    return None


@functools.cache
def _vllm_prefill_checkpoints() -> Callable[..., tuple[list[int], list[int]]] | None:
    """vLLM's `compute_mamba_prefill_checkpoints` (None in a vLLM without one: no checkpoint is ever taken)."""
    try:
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints
    except ImportError:
        return None
    return compute_mamba_prefill_checkpoints


def _names(layer_names: Sequence[str]) -> str:
    return ", ".join(layer_names[:3]) + (", ..." if len(layer_names) > 3 else "")


def slot_rows(tables: Sequence[Sequence[int]], num_tokens: int, block_size: int, null_block: int,
              start: int = 0) -> torch.Tensor:
    """Slots of tokens [start, num_tokens) in each group, ``[groups, num_tokens - start]`` (int64), -1 for tokens
    in a freed block (the copies skip them). A step's save asks for its own chunks only: its cost then does not
    grow with the tokens before them. Built in numpy and handed to torch once: called on vLLM's model thread every
    step, where each small torch op would release the GIL and wait to take it back from KVMesh's other threads."""
    first = start // block_size  # the block of token `start`
    num_blocks = -(-num_tokens // block_size)
    window = slice(start - first * block_size, num_tokens - first * block_size)
    rows = np.empty((len(tables), num_tokens - start), dtype=np.int64)
    for row, table in zip(rows, tables):
        if len(table) < num_blocks:
            raise ValueError(f"a block table of {len(table)} blocks for {num_tokens} tokens")
        blocks = np.asarray(table[first:num_blocks], dtype=np.int64)
        slots = blocks[:, None] * block_size + _offsets(block_size)
        slots[blocks == null_block] = -1
        row[:] = slots.reshape(-1)[window]
    return torch.from_numpy(rows)


@functools.cache
def _offsets(block_size: int) -> np.ndarray:
    """0 .. block_size - 1 (int64, read-only: shared by every call)."""
    offsets = np.arange(block_size, dtype=np.int64)
    offsets.flags.writeable = False
    return offsets
