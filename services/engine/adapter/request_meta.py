"""What the scheduler-side connector tells the worker-side connector each step, and how it decides it.

Runs in the scheduler (vLLM's EngineCore process, its busy loop thread): `RequestTracker` follows one request
from its first lookup to its end and turns each scheduled step into a `ReqMeta`: which prefix to load before the
forward (`LoadSpec`) and which newly computed chunks to store after it (`SaveSpec`), named by the request's
chain keys (hashed here once per request, extended as it grows; each worker derives its shard's keys). The
worker (vLLM's worker process) receives `KVMeshConnectorMetadata` pickled with the scheduler output and only
executes it.

Token arithmetic, with C = chunk_size and B = vLLM's block size (C is a multiple of B on CPU):
  * `hit` is what the cache holds: a multiple of C, the whole sequence when its partial last chunk is held, or
    a block boundary inside a chunk when only that chunk's block prefix is held (block_prefix.py: the load
    reads the last span under `LoadSpec.last_key`).
  * vLLM must compute at least the last token, so a full hit loads `len - 1` tokens (`num_to_load`), yet the
    retrieve asks for all `hit` tokens: the last chunk is named by all its tokens, and the extra token's slot
    is overwritten by the forward with the same values.
  * `local` tokens vLLM already holds (its own prefix cache, block-aligned) are not written again: the
    retrieve's mask starts at floor(local / C) * C and `skip_prefix = local` leaves the rest untouched.
  * Saves move only finished chunks: during a chunked prefill, up to floor(computed / C) * C; once the prompt
    is complete, the prompt's end (with its partial last chunk, if `save_unfull_chunk`, and that chunk's block
    prefix, `SaveSpec.prefix_end`); during decode only with `save_decode_cache`, whole chunks. `saved_upto`
    moves back only when a load failed: vLLM recomputes from the first failed block, and that KV is then
    saved (the worker never stored the failed load's blocks nor what the same step computed after them).
  * Every key list is cut at the span it is for (`ReqMeta.keys_upto`): a load never names chunks past its hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from kvmesh.services.engine.adapter.block_prefix import saved_prefix_end
from kvmesh.services.engine.adapter.kv_groups import slot_rows
from kvmesh.services.engine.adapter.request_retention import DEFAULT as DEFAULT_KV_PARAMS
from kvmesh.services.engine.adapter.request_retention import KVRequestParams
from kvmesh.shared.wire.keys import ChunkHasher, ChunkKey, ChunkSpan, KeyExtras

if TYPE_CHECKING:
    from kvmesh.services.engine.adapter.block_prefix import BlockPrefixProbe
    from kvmesh.shared.wire.kv_events import ChunkDescription
    from kvmesh.services.engine.adapter.scheduler_lookup import LowerLookup

try:  # the base class exists wherever vLLM does; the module stays importable (and testable) without it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except Exception:  # pragma: no cover - only without vLLM
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens [mask_start, end) of the request's sequence into its blocks, leaving [0, skip_prefix) alone.

    `need` is how many tokens vLLM counts as computed after the load (<= end); a retrieve that stops short of
    `need` makes the blocks from the first missing token up to `need` load errors (recomputed by vLLM).
    """

    end: int
    need: int
    mask_start: int
    skip_prefix: int
    asynchronous: bool = False  # between steps (async_loads.py): vLLM waits for it in finished_recving
    last_key: ChunkKey | None = None  # the last span's key when it is a block prefix of its chunk (ends at `end`)
    # models with recurrent state (kv_groups.py): the chain key of the chunk ending at `end`, whose state is loaded
    state_key: ChunkKey | None = None
    # in-step with a state: the block column the step's forward reads the state from, when not end / B - 1 (vLLM's
    # preprocess_mamba moved the old page's content there before the load ran: the state is written to both)
    state_column: int | None = None


@dataclass(frozen=True)
class SaveSpec:
    """Store the chunks covering tokens [mask_start, end) (mask_start is a multiple of chunk_size), and, when
    `prefix_end` is set, the block prefix of the last chunk up to it under `prefix_key` (block_prefix.py)."""

    end: int
    mask_start: int
    prefix_end: int = 0
    prefix_key: ChunkKey | None = None
    # models with recurrent state (kv_groups.py): (chunk end, the state groups' block column whose page holds the
    # state after exactly that many tokens) for each state this step left at a chunk end, stored beside the chunk
    state_pages: tuple[tuple[int, int], ...] = ()
    # with describe_admissions: (chain key, its description) of each chunk stored, for the admissions' batches
    described: tuple[tuple[ChunkKey, "ChunkDescription"], ...] = ()


@dataclass
class ReqMeta:
    """One request's work in one step. `chunk_keys` (chain keys) and `block_ids` cover at least
    max(load.end, save.end). `lora_name` / `lora_id` name the adapter its keys were made with, for the
    worker's registration (so the controller can look them up by name)."""

    req_id: str
    chunk_keys: list[ChunkKey]
    block_ids: list[int]
    load: LoadSpec | None = None
    save: SaveSpec | None = None
    lora_name: str | None = None
    lora_id: str | None = None
    # the scheduler has learned that a load into this request's blocks failed (it has rewound `saved_upto` to
    # what vLLM recomputes): the worker's saves of it no longer need to stop at the failed position
    load_failed: bool = False
    # with vLLM's KV cache groups (kv_groups.py): the request's block ids per group this step, -1 where freed
    group_block_ids: list[list[int]] | None = None
    # its kv_transfer_params' retention and tiers (request_retention.py): how the worker's saves keep its chunks
    kv_params: KVRequestParams = DEFAULT_KV_PARAMS

    def slot_mapping(self, num_tokens: int, block_size: int, start: int = 0) -> torch.Tensor:
        """Slot of each of tokens [start, num_tokens): block_ids[i // B] * B + i % B (int64, CPU), -1 past the
        blocks vLLM allocated; with groups one row per group, ``[groups, num_tokens - start]``, -1 in freed
        blocks. Past the allocated blocks: an asynchronous load of a whole prompt's hit reads its last chunk, whose
        last token vLLM computes itself and allocated no block for yet (a prompt one token past a block
        boundary)."""
        if self.group_block_ids is not None:
            return slot_rows(self.group_block_ids, num_tokens, block_size, -1, start)
        first = start // block_size  # the block of token `start`
        blocks = torch.as_tensor(self.block_ids[first: -(-num_tokens // block_size)], dtype=torch.int64)
        offsets = torch.arange(block_size, dtype=torch.int64)
        slots = (blocks.unsqueeze(1) * block_size + offsets).flatten()[start - first * block_size:
                                                                       num_tokens - first * block_size]
        if len(slots) < num_tokens - start:
            slots = torch.cat((slots, torch.full((num_tokens - start - len(slots),), -1, dtype=torch.int64)))
        return slots

    def keys_upto(self, end: int, chunk_size: int, last_key: ChunkKey | None = None) -> list[ChunkKey]:
        """The chain keys of tokens [0, end), never of chunks past it (`chunk_keys` may cover more: the same
        step's save, or a longer hit on this rank than every rank agrees on), with the last one replaced by
        `last_key` when set (a block prefix's own key)."""
        count = -(-end // chunk_size)
        if last_key is None:
            return self.chunk_keys[:count]
        return [*self.chunk_keys[:count - 1], last_key]

    def block_ids_for(self, start: int, end: int, block_size: int) -> set[int]:
        """The block ids holding tokens [start, end)."""
        if end <= start:
            return set()
        return set(self.block_ids[start // block_size : -(-end // block_size)])


@dataclass
class KVMeshConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)
    idle: bool = False  # the step runs no forward (every request waits for its load, or none is left)
    # vLLM preempted these since the last step and freed their blocks, which this step may reuse
    preempted: set[str] = field(default_factory=set)
    # per rank, the last CPU-tier event the scheduler had applied when it planned this step's loads: the worker
    # may release the chunks it holds for evictions up to it once the loads took theirs (cpu_mirror.py); None:
    # no load is planned from the mirror, nothing need be held (a rank's None: nothing of that rank)
    evictions_seen: dict[int, int | None] | None = None
    # blocks a failed load left wrong whose request ended (or was preempted) before recomputing them, while other
    # requests still hold them: vLLM let those count them computed (it expects the failed request to recompute
    # them), so the workers report them as load errors and vLLM rewinds those requests (one KV cache group)
    unrecomputed: set[int] = field(default_factory=set)

    def __repr__(self) -> str:  # vLLM may log it: never dump token lists
        return (f"KVMeshConnectorMetadata(loads={sum(r.load is not None for r in self.requests)}, "
                f"saves={sum(r.save is not None for r in self.requests)})")


def floor_to(value: int, multiple: int) -> int:
    return value - value % multiple


@dataclass
class RequestTracker:
    """Scheduler-side state of one request, from lookup to finish.

    Invariant: `saved_upto` is a multiple of chunk_size, the end of a sequence whose partial last chunk is
    stored, or the end of a block-prefix hit; every token below it is in the cache (or was handed to the worker
    to store), so it goes down only to a failed load's first block (`load_failed_in`), whose KV vLLM
    recomputes.
    """

    req_id: str
    request: Any  # vLLM's Request (live: all_token_ids grows as tokens are generated)
    prompt_len: int
    extras: KeyExtras | None = None  # what besides the tokens its keys mix in (LoRA, cache_salt, images...)
    lora_name: str | None = None
    cacheable: bool = True  # False: its key inputs could not be read, so it is neither loaded nor stored
    kv_params: KVRequestParams = DEFAULT_KV_PARAMS  # its retention and tiers (request_retention.py)
    chain: list[ChunkSpan] = field(default_factory=list)  # chain keys of its tokens so far (hashed once)
    lower: "LowerLookup | None" = None  # its lookup in the workers' lower tiers, once asked
    hit: int = 0  # tokens the cache held at lookup
    hit_key: ChunkKey | None = None  # the key of the hit's last span when it is a block prefix (block_prefix.py)
    state_key: ChunkKey | None = None  # models with recurrent state: the chain key of the chunk the hit ends with
    probe: "BlockPrefixProbe | None" = None  # its lookup of block prefixes, once asked
    cpu_tokens: int = 0  # of those, in the CPU tiers before the lower tiers were asked (the async decision)
    local: int = 0  # tokens vLLM had computed itself (its prefix cache) when we looked up
    num_to_load: int = 0  # what get_num_new_matched_tokens answered (tokens beyond `local`)
    load_pending: bool = False  # update_state_after_alloc confirmed the load; the next step carries it
    load_async: bool = False  # the load runs between steps (get_num_new_matched_tokens said load_kv_async)
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0
    saves_held: bool = False  # a save ran off the forward's path: vLLM keeps its blocks after it ends
    load_failed: bool = False  # a load into its blocks failed (vLLM recomputes): it is offered no more loads
    # its first block a failed load left wrong (with what the step computed over it): vLLM rewound it there
    recompute_from: int | None = None
    computed_upto: int = 0  # the end of the tokens its last step computed (back to the rewind after a failed load)

    lookup_tokens: int = 0  # the request's length when `lower`, `probe` and `cpu_tokens` were asked for
    reported: tuple[int, int] | None = None  # (hit, to load) whose counters and INFO line are out: vLLM asks
    # a waiting request again every step, and only a changed answer is reported again

    def preempted(self) -> None:
        """vLLM freed the request's blocks (it resumes later with new ones): forget them and any load planned
        into them; what was saved stays saved."""
        self.block_ids = []
        self.load_pending = self.load_async = False
        self.forget_lookup()

    def forget_lookup(self) -> None:
        """Drop the lookup answers: they belong to the chain they were asked for (a resumed request's chain is
        longer, and its last chunks' keys differ)."""
        self.lower = None
        self.probe = None
        self.state_key = None
        self.cpu_tokens = 0
        self.lookup_tokens = 0
        self.reported = None

    def load_failed_in(self, invalid_block_ids: set[int], block_size: int, chunk_size: int) -> bool:
        """Note a failed load if any of `invalid_block_ids` is this request's: vLLM recomputes from the first
        of them, and the chunks from there on are saved again once recomputed (`saved_upto` goes back to that
        chunk's start; the worker never stored what the failed load left behind). Whether it was ours."""
        first = next((i for i, block in enumerate(self.block_ids) if block in invalid_block_ids), None)
        if first is None:
            return False
        self.load_failed = True
        self.saved_upto = min(self.saved_upto, floor_to(first * block_size, chunk_size))
        self.recompute_from = first if self.recompute_from is None else min(first, self.recompute_from)
        self.computed_upto = min(self.computed_upto, first * block_size)
        return True

    def unrecomputed_blocks(self, block_size: int) -> set[int]:
        """Its blocks a failed load left wrong that it has not recomputed yet (none when no load failed)."""
        if self.recompute_from is None:
            return set()
        return {block for i, block in enumerate(self.block_ids)
                if i >= self.recompute_from and (i + 1) * block_size > self.computed_upto}

    def chain_keys(self, hasher: ChunkHasher, end: int,
                   on_hashed: "Callable[[list[ChunkSpan], list[int], ChunkKey | None], None] | None" = None
                   ) -> list[ChunkKey]:
        """Chain keys of a sequence of tokens [0, end), hashing only chunks not hashed before (the last one is the
        key of a partial chunk ending at `end` when the chain covers more of it).

        `on_hashed(spans, tokens, parent)` is told of the spans hashed now (with the tokens from 0 and the chain
        key before the first of them, None at the start): the KV events' chunk metadata."""
        if not self.chain or self.chain[-1].end < end:
            tokens = list(self.request.all_token_ids[:end])
            known = self.chain
            self.chain = hasher.chain(tokens, extras=self.extras, known=known)
            if on_hashed is not None:
                reused = 0  # the known spans hasher.chain kept (the same objects)
                while reused < min(len(known), len(self.chain)) and self.chain[reused] is known[reused]:
                    reused += 1
                if reused < len(self.chain):
                    on_hashed(self.chain[reused:], tokens, self.chain[reused - 1].key if reused else None)
        keys = [span.key for span in self.chain if span.start < end]
        if keys and self.chain[len(keys) - 1].end > end:
            # `end` falls inside a chunk hashed for the longer sequence (a resumed or rewound request that had
            # grown past its prompt saves up to the prompt's end): that chunk's key for a sequence ending at `end`
            tokens = list(self.request.all_token_ids[:end])
            keys[-1] = hasher.prefix_span(tokens, self.chain, end, self.extras).key
        return keys

    def take_load(self, chunk_size: int) -> LoadSpec | None:
        """The load for the step that schedules this request after allocation (once)."""
        if not self.load_pending or self.num_to_load <= 0:
            self.load_pending = False
            return None
        self.load_pending = False
        need = self.local + self.num_to_load
        end = self.hit if self.hit > need else need
        return LoadSpec(end=end, need=need, mask_start=floor_to(self.local, chunk_size), skip_prefix=self.local,
                        asynchronous=self.load_async, last_key=self.hit_key if end == self.hit else None,
                        state_key=self.state_key if end == self.hit else None)

    def take_save(self, num_computed_after: int, chunk_size: int, save_unfull_chunk: bool,
                  save_decode_cache: bool, block_size: int = 0) -> SaveSpec | None:
        """The chunks completed by a step after which `num_computed_after` tokens have KV in vLLM's cache.
        At the prompt's end, `prefix_end` marks its last chunk's block prefix to store too (vLLM's block size
        `block_size`; 0: none); the caller names it (`prefix_key`)."""
        if num_computed_after >= self.prompt_len:
            in_decode = num_computed_after > self.prompt_len
            if in_decode and not save_decode_cache:
                return None
            if in_decode:
                end = floor_to(num_computed_after, chunk_size)
            else:
                end = self.prompt_len if save_unfull_chunk else floor_to(self.prompt_len, chunk_size)
        else:
            end = floor_to(num_computed_after, chunk_size)
        start = floor_to(self.saved_upto, chunk_size)
        if end <= self.saved_upto or end <= start:
            return None
        prefix_end = 0
        if end == self.prompt_len and save_unfull_chunk:
            prefix_end = saved_prefix_end(self.prompt_len, chunk_size, block_size)
            if prefix_end <= self.hit:  # loaded from the cache: held already
                prefix_end = 0
        self.saved_upto = end
        return SaveSpec(end=end, mask_start=start, prefix_end=prefix_end)

    def extend_blocks(self, new_block_ids: Sequence[int] | None, replace: bool) -> None:
        if new_block_ids is None:
            return
        if replace:
            self.block_ids = list(new_block_ids)
        else:
            self.block_ids.extend(new_block_ids)
