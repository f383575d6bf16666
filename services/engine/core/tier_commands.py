"""The controller's commands on one worker's tiers: pin / unpin / clear / lookup at a location, `move` (a copy
from one tier to another, or from a peer's CPU tier), `evict` (chunks leave the CPU tier) and `prefetch` (the held
prefix starts moving from the lower tiers into the CPU tier).

Run on the NATS loop thread, for the worker agent (services/engine/agents/worker_agent.py) and the engine's own
`pin` / `unpin` / `clear`. Each command goes to whichever tier its location names (`Tier` in
services/engine/tiers/base.py); a move reads a chunk at a time through a pool slot, with the walk's checked read
(`Tiers.read_into`: a chunk of the wrong meta, or a slot a store may still write into, is never used).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable, Protocol, Sequence

from kvmesh.services.engine.tiers.base import StoreTier, Tier
from kvmesh.services.engine.tiers.cpu import ChunkRef, LocalCPUBackend
from kvmesh.services.engine.tiers.memory_pool import Slot
from kvmesh.shared.protocol import LOCAL_CPU, LOCATIONS, PEER, TIER_OPS, ChunkMeta
from kvmesh.shared.wire.chunk_file import checksum
from kvmesh.shared.wire.keys import ChunkSpan

# what a loaded chunk's meta says differently from what its span's key must hold; None when it matches
CheckMeta = Callable[[ChunkSpan, ChunkMeta], "str | None"]


class Tiers(Protocol):
    """What the commands need of the tier walk (`StorageManager`)."""

    cpu: LocalCPUBackend

    def tier(self, location: str) -> Tier | None: ...

    def lower(self, location: str) -> StoreTier | None: ...

    async def read_into(self, client: StoreTier, span: ChunkSpan, slot: Slot,
                        check: CheckMeta) -> ChunkMeta | None: ...

    def count_reads(self, location: str, refs: Sequence[ChunkRef]) -> None: ...

    async def lookup_and_prefetch(self, spans: Sequence[ChunkSpan], check: CheckMeta,
                                  prefetch_from: int = 0) -> int: ...


class TierCommands:
    """pin / unpin / clear / lookup, move, evict and prefetch over `tiers` (each a count of tokens)."""

    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self.cpu = tiers.cpu

    def lower(self, location: str) -> StoreTier | None:
        """The client of a tier below the CPU tier (a store, or the peers)."""
        return self.tiers.lower(location)

    async def run(self, op: str, location: str, spans: Sequence[ChunkSpan], ttl_secs: float | None = None,
                  states: Sequence[ChunkSpan] = ()) -> int:
        """pin / unpin / clear / lookup at `location`, for whichever tier it names; tokens affected (or held).
        A pin or unpin covers the recurrent `states` after the chunks too (a model with Mamba / linear-attention
        layers resumes only from one); the count is the chunks'.

        Raises ValueError for an unknown op or location and LookupError for a location this engine does not
        have (or whose client is not connected yet).
        """
        if op not in TIER_OPS:
            raise ValueError(f"unknown op {op!r} (known: {', '.join(TIER_OPS)})")
        if location not in LOCATIONS:
            raise ValueError(f"unknown location {location!r} (known: {', '.join(LOCATIONS)})")
        tier = self.tiers.tier(location)
        if tier is None:
            raise LookupError(f"no {location} configured here (or its store client is not connected)")
        keys = [span.key for span in spans]
        num_tokens = [span.num_tokens for span in spans]
        state_keys = [span.key for span in states]
        state_tokens = [span.num_tokens for span in states]
        if op == "pin":
            pinned = await tier.pin(keys, num_tokens, ttl_secs)
            if states:  # the held prefix of them, as for chunks: with align mode a state at every chunk end held
                await tier.pin(state_keys, state_tokens, ttl_secs)
            return pinned
        if op == "unpin":
            unpinned = await tier.unpin(keys, num_tokens)
            if states:
                await tier.unpin(state_keys, state_tokens)
            return unpinned
        if op == "clear":
            return await tier.clear()
        return sum(span.num_tokens for span in spans[:await tier.contains(keys)])

    async def move(self, spans: Sequence[ChunkSpan], source: str, target: str, keep_source: bool,
                   check: CheckMeta) -> int:
        """Copy the contiguous prefix of `spans` held at `source` to `target` (both this worker's tiers, or
        `source` PEER: the peer's CPU tier the peer tier names for these keys, `PeerTier.assume_holder`), one
        chunk at a time through a pool slot; unless `keep_source`, the copied chunks then leave `source`. The
        tokens copied. Only the CPU tier may be left: a store is shared, and removing a chunk there would take
        it from every instance (ValueError)."""
        for location in (source, target):
            if location not in LOCATIONS and not (location == source == PEER):
                raise ValueError(f"unknown location {location!r} (known: {', '.join(LOCATIONS)})")
            if self.tiers.tier(location) is None:
                raise LookupError(f"no {location} configured here (or its store client is not connected)"
                                  + (": P2P is off (enable_p2p)" if location == PEER else ""))
        if source == target:
            raise ValueError(f"source and target are both {source}")
        if not keep_source and source != LOCAL_CPU:
            raise ValueError(f"{source} is shared with other instances: moving out of it would remove their "
                             "chunks too; copy instead (should_copy)")
        moved: list[ChunkSpan] = []
        for span in spans:
            ref = await self._read(source, span, check)
            if ref is None or not await self._write_to(target, ref):
                break
            moved.append(span)
        if not keep_source:
            for span in moved:
                self.cpu.remove(span.key)
        return sum(span.num_tokens for span in moved)

    def evict(self, spans: Sequence[ChunkSpan]) -> int:
        """Drop these chunks from the CPU tier (pinned or not; the lower tiers keep theirs); the tokens dropped."""
        return sum(span.num_tokens for span in spans if self.cpu.remove(span.key))

    async def prefetch(self, spans: Sequence[ChunkSpan], check: CheckMeta) -> int:
        """Start moving the held prefix of `spans` from the lower tiers into the CPU tier (the stores' reads run on
        after this returns; a retrieve that comes first waits for them); the tokens of that prefix, those already
        in the CPU tier included. Refused (ValueError) when the CPU tier keeps no chunks (`local_cpu: false`):
        nothing would stay there."""
        if not self.cpu.keep:
            raise ValueError("the CPU tier keeps no chunks here (local_cpu: false): nothing to prefetch into")
        held = await self.tiers.lookup_and_prefetch(spans, check)
        return spans[held - 1].end if held else 0

    async def _read(self, location: str, span: ChunkSpan, check: CheckMeta) -> ChunkRef | None:
        """One chunk of `location` in a slot the caller owns a reference of; None on a miss."""
        if location == LOCAL_CPU:
            return self.cpu.acquire(span.key)
        slot = self.cpu.allocate(span.state)
        if slot is None:
            return None
        store = self.tiers.lower(location)
        assert store is not None  # move checked it
        meta = await self.tiers.read_into(store, span, slot, check)
        if meta is None:
            slot.release()
            return None
        ref = ChunkRef(meta, slot)
        self.tiers.count_reads(location, [ref])
        return ref

    async def _write_to(self, location: str, ref: ChunkRef) -> bool:
        """Hand `ref` (and its slot reference) to `location`: True once it holds the chunk."""
        if location == LOCAL_CPU:
            return self.cpu.put(ref.meta, ref.slot) or ref.meta.key in self.cpu
        try:
            buffer = ref.slot.chunk_buffer(ref.meta.nbytes)
            digest = await asyncio.to_thread(checksum, buffer.view[:ref.meta.nbytes])
            store = self.tiers.lower(location)
            assert store is not None  # move checked it
            return await store.put(dataclasses.replace(ref.meta, checksum=digest), buffer) is True
        finally:
            ref.release()
