"""Hits that end inside a chunk, at a vLLM block boundary ("block prefixes").

Chunk keys are prefix hashes over whole chunks of C tokens (shared/wire/keys.py), so a prompt that extends an
earlier one by a few tokens misses the chunk the earlier prompt ended in: in a multi-turn chat, each turn's
prompt ends mid-chunk and the next turn recomputes up to C - 1 tokens that were computed before. vLLM's own
prefix cache reuses at block granularity (B tokens, B divides C), so at C = 256 and B = 128 it beat KVMesh by
a block per turn (benchmarks/serving.py, round 3).

Two halves, both keyed the way the chain already keys a sequence's partial last chunk (`ChunkHasher.prefix_span`):
  * Save: when a prompt ends inside chunk i with n = len % C tokens there, the chunk is stored as today
    (all n tokens, `save_unfull_chunk`) and, when n is not a whole number of blocks, also its first
    floor(n / B) * B tokens: the part a longer prompt can share, since vLLM loads and computes whole blocks.
  * Lookup: when the chain's hit stops at a chunk boundary i * C, the scheduler asks for the block prefixes of
    chunk i, longest first: the CPU-tier mirror answers at once; the lower tiers get one single-key lookup
    per candidate (in parallel, the same "ask again" as the chain's lookup). The longest held one extends the
    hit, and the load reads that span under its own key (`LoadSpec.last_key`).

The cost: at most C - B more tokens stored per prompt, and at most C / B - 1 extra keys hashed per lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from kvmesh.shared.wire.keys import ChunkHasher, ChunkSpan, KeyExtras

if TYPE_CHECKING:
    from kvmesh.services.engine.adapter.scheduler_lookup import LowerLookup, SchedulerLookup


def probe_ends(hit: int, num_tokens: int, chunk_size: int, block_size: int) -> list[int]:
    """Where a block-prefix hit after `hit` (a multiple of chunk_size) may end, longest first: every block
    boundary strictly inside the sequence's next chunk (its end is the chain's own key, already looked up)."""
    if hit % chunk_size or block_size <= 0 or block_size >= chunk_size:
        return []
    chunk_end = min(hit + chunk_size, num_tokens)
    return list(range(hit + (chunk_end - hit - 1) // block_size * block_size, hit, -block_size))


def saved_prefix_end(prompt_len: int, chunk_size: int, block_size: int) -> int:
    """The end of the block prefix stored beside a prompt's partial last chunk; 0 when there is none (the
    prompt ends on a chunk boundary, or inside the chunk's first block, or on a block boundary: then the
    partial chunk itself is that prefix)."""
    if block_size <= 0 or block_size >= chunk_size:
        return 0
    start = prompt_len - prompt_len % chunk_size
    in_chunk = prompt_len - start
    whole_blocks = in_chunk - in_chunk % block_size
    return start + whole_blocks if 0 < whole_blocks < in_chunk else 0


@dataclass
class BlockPrefixProbe:
    """One request's lookup of the block prefixes of the chunk where its chain hit stopped."""

    after: int  # the chain's hit it extends (a multiple of chunk_size)
    spans: list[ChunkSpan]  # longest first
    lowers: list["LowerLookup | None"] = field(default_factory=list)

    @classmethod
    def of(cls, hasher: ChunkHasher, tokens: Sequence[int], chain: Sequence[ChunkSpan], hit: int, block_size: int,
           extras: KeyExtras | None) -> "BlockPrefixProbe":
        ends = probe_ends(hit, len(tokens), hasher.chunk_size, block_size)
        spans = [hasher.prefix_span(tokens, chain, end, extras) for end in ends]
        return cls(hit, spans, [None] * len(spans))

    def held(self, lookup: "SchedulerLookup", tiers: frozenset[str] | None = None) -> tuple[bool, ChunkSpan | None]:
        """(answered, the longest span every rank holds or None); (False, None) while a lower tier is asked.
        `tiers`: the only locations looked in (the request's kv_load_tiers; None: all)."""
        answered = True
        for i, span in enumerate(self.spans):
            is_held, self.lowers[i] = lookup.held_one(span, self.lowers[i], tiers)
            if is_held is None:
                answered = False
            elif is_held and answered:  # every longer candidate said no: this is the longest held
                return True, span
        return answered, None
