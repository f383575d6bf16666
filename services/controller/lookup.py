"""Answering `/lookup {tokens}`: which instance holds the longest prefix of these tokens, and where.

Runs on the controller's event loop, called by the REST handler; pure CPU work over the ProducerTable.

Each instance names chunks with its own KeyParams (model, kv_format, world_size, rank) and chunk size, so
the tokens are hashed once per distinct (KeyParams, chunk_size, save_unfull_chunk) — one ChunkHasher each,
cached — and every (instance, rank) that shares those parameters reads the same key list. A lookup may
name a `cache_salt` and a `lora_name` (`KeyRequest`): the keys then mix in the salt and the adapter's
identity as that worker registered it (`worker_extras`); an instance that never served the adapter holds
nothing for it. An instance is
credited, per location, with its own *contiguous* prefix from token 0: the end token of the last chunk
before its first miss (a partial last chunk counts with its own length); for a model with recurrent state (a
chunk format naming a state group), the end of the last of those chunks whose state is held there too, as only
there can a load resume (engine adapter/kv_groups.py). With several ranks, a chunk counts
only if every rank holds its shard. The answer per instance is its best location: longest prefix, ties to
the faster tier (LocalCPUBackend > LocalDiskBackend > RemoteBackend); instances matching nothing are left out.

The plan (hasher groups, consumers, location masks filtered by liveness) is rebuilt only when the table's
`version` changes, so a lookup is: hash once per group, one dict probe per chunk, short integer loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvmesh.services.controller.producer_records import KeySpec as HasherSpec, key_spec
from kvmesh.services.controller.producers import ProducerTable
from kvmesh.shared.protocol import LOCATIONS, RegisterEngine
from kvmesh.shared.wire.keys import ChunkHasher, KeyExtras, has_state_groups, state_key, tokens_as_array


@dataclass(frozen=True)
class KeyRequest:
    """What a REST caller says besides the tokens about how the chunks were keyed (LMCache's JSON has neither)."""

    cache_salt: str | None = None
    lora_name: str | None = None


class UnknownAdapter(KeyError):
    """The worker never served the LoRA adapter a request names, so it holds nothing keyed with it."""


def worker_extras(reg: RegisterEngine, request: KeyRequest) -> KeyExtras | None:
    """The KeyExtras this worker's chunks for `request` carry; UnknownAdapter for an adapter it never served."""
    lora_id = None
    if request.lora_name is not None:
        lora_id = reg.lora_adapters.get(request.lora_name)
        if lora_id is None:
            raise UnknownAdapter(request.lora_name)
    if lora_id is None and request.cache_salt is None:
        return None
    return KeyExtras(lora_id=lora_id, cache_salt=request.cache_salt)


@dataclass
class _Consumer:
    """One rank of one instance reading a group's keys: its location masks, fastest tier first."""

    instance_id: str
    registration: RegisterEngine
    location_masks: list[tuple[int, int]]  # (index into LOCATIONS, mask of alive holders)


@dataclass
class _Group:
    hasher: ChunkHasher
    consumers: list[_Consumer] = field(default_factory=list)


@dataclass
class _Plan:
    version: int
    groups: list[_Group]
    ranks: dict[str, int]  # instance_id -> number of ranks whose prefixes must be combined


class LookupEngine:
    """Computes `layout_info` for a token list from the current index and registrations."""

    def __init__(self, table: ProducerTable) -> None:
        self.table = table
        self._hashers: dict[HasherSpec, ChunkHasher] = {}
        self._plan: _Plan | None = None

    def _hasher(self, spec: HasherSpec) -> ChunkHasher:
        hasher = self._hashers.get(spec)
        if hasher is None:
            hasher = self._hashers[spec] = ChunkHasher(spec[0], spec[1], spec[2])
        return hasher

    def _build_plan(self) -> _Plan:
        table = self.table
        alive = table.alive_mask
        groups: dict[HasherSpec, _Group] = {}
        ranks: dict[str, int] = {}
        for instance_id in table.instances:
            workers = table.workers_of(instance_id)
            if not workers:
                continue
            world_size = workers[0].engine.world_size if workers[0].engine else 1
            # An instance missing a rank, or with a rank down, cannot serve a full chunk: leave it out.
            if len(workers) != world_size or not all(w.alive for w in workers):
                continue
            ranks[instance_id] = world_size
            for worker in workers:
                reg = worker.engine
                assert reg is not None
                spec = key_spec(reg)
                group = groups.get(spec)
                if group is None:
                    group = groups[spec] = _Group(self._hasher(spec))
                masks = [(i, table.location_mask(worker, location) & alive) for i, location in enumerate(LOCATIONS)]
                group.consumers.append(_Consumer(instance_id, reg, [(i, m) for i, m in masks if m]))
        # Keep only the hashers in use: specs come and go with registrations.
        self._hashers = {spec: self._hashers[spec] for spec in groups}
        return _Plan(table.version, list(groups.values()), ranks)

    def plan(self) -> _Plan:
        if self._plan is None or self._plan.version != self.table.version:
            self._plan = self._build_plan()
        return self._plan

    def lookup(self, tokens: Sequence[int] | np.ndarray,
               key_request: KeyRequest = KeyRequest()) -> dict[str, tuple[str, int]]:
        """`{instance_id: (location, matched_prefix_len)}` for every instance matching at least one chunk."""
        plan = self.plan()
        if not plan.groups or len(tokens) == 0:
            return {}
        token_array = tokens_as_array(tokens)
        get = self.table.index.table.get
        num_locations = len(LOCATIONS)
        # per instance: [min prefix over ranks per location..., ranks seen per location...]
        best: dict[str, list[int]] = {}
        for group in plan.groups:
            hasher = group.hasher
            with_states = has_state_groups(hasher.params.kv_format)
            # (holder masks, end token, holder masks of the state after it) per chunk, by the adapter the keys
            # were made with
            chunks_by_adapter: dict[str | None, tuple[list[int], list[int], list[int] | None]] = {}
            for consumer in group.consumers:
                try:
                    extras = worker_extras(consumer.registration, key_request)
                except UnknownAdapter:
                    continue  # never served the adapter: no rank count, so the instance is not listed
                lora_id = extras.lora_id if extras is not None else None
                chunks = chunks_by_adapter.get(lora_id)
                if chunks is None:
                    chain = hasher.chain(token_array, extras=extras)
                    states = [get(hasher.params.shard_key(state_key(s.key)), 0) if s.num_tokens == hasher.chunk_size
                              else 0 for s in chain] if with_states else None
                    chunks = chunks_by_adapter[lora_id] = ([get(s.key, 0) for s in hasher.shard(chain)],
                                                           [s.end for s in chain], states)
                masks, ends, states = chunks
                if not masks:
                    continue
                matched = best.get(consumer.instance_id)
                if matched is None:
                    matched = best[consumer.instance_id] = [0] * (2 * num_locations)
                for location_index, location_mask in consumer.location_masks:
                    n = 0
                    for mask in masks:
                        if not mask & location_mask:
                            break
                        n += 1
                    if states is not None:  # a prefix is of use only up to a chunk whose state is held there too
                        while n and not states[n - 1] & location_mask:
                            n -= 1
                    prefix = ends[n - 1] if n else 0
                    seen = matched[num_locations + location_index]
                    matched[location_index] = prefix if not seen else min(matched[location_index], prefix)
                    matched[num_locations + location_index] = seen + 1
        layout: dict[str, tuple[str, int]] = {}
        for instance_id, matched in best.items():
            num_ranks = plan.ranks[instance_id]
            top, top_index = 0, -1
            for location_index in range(num_locations):  # LOCATIONS is fastest first: '>' keeps ties fast
                prefix = matched[location_index]
                # Every rank must hold its shard at this location (a rank without it, or with its store
                # down, has no mask there and is not counted).
                if prefix > top and matched[num_locations + location_index] == num_ranks:
                    top, top_index = prefix, location_index
            if top_index >= 0:
                layout[instance_id] = (LOCATIONS[top_index], top)
        return layout
