"""The seeded simulation's invariants, checked after every step against the oracle (sim_oracle.py):

  1. every page vLLM's next forward reads holds the oracle's values: for each request that holds blocks (its load,
     if any, done), the KV of its computed tokens in every attention layer (a sliding window's layers: the tokens
     still in its window) and the state its next step starts from, in every rank's caches; except blocks the
     connector reported failed that vLLM has not recomputed yet (it rewinds the first request holding one to it,
     which recomputes it; a request sharing the block counts it computed meanwhile), and the blocks a request
     vLLM rewound for such a failure computed over it in that step (the request recomputes them; another request
     that took them from vLLM's prefix cache in that same step counts them computed meanwhile, as vLLM's
     `_update_requests_with_invalid_blocks` does);
  2. every chunk in every CPU tier (and every evicted one a worker still holds: cpu_mirror.py), and every chunk file of the disk store (opened with the engine's key when it
     seals them), holds the oracle's KV for the tokens and extras its key was made from, in every layer a hit on
     it would load (a sliding window's layers: the tokens a hit at the chunk's end keeps in its window; state
     layers: none, states are stored on their own), and has a key some request's tokens make;
  3. no exception escapes a connector method (or vLLM's scheduler, whose calls into the connector it runs);
  4. every state stored under a chunk's state key is the oracle's state after exactly that chunk's tokens, in
     every state layer.

Keys: `KeyBook` records, as requests arrive and grow, what every key KVMesh can store for them names: the chain's
chunks and the partial last chunk of every prefix length (prompt ends, block prefixes) per rank, and the state
key of every chunk end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvmesh.services.engine.adapter.request_extras import request_extras
from kvmesh.services.engine.tiers.sealed import SEAL_OVERHEAD, SealRejected
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import ChunkHasher, ChunkKey, is_state_object, state_key

from support.engine import BLOCK, CHUNK
from support.sim_kinds import SLIDING, STATE_ROLES, GroupKind
from support.sim_oracle import Oracle
from support.sim_pages import LayerPages, chunk_state, chunk_tokens


class Violation(AssertionError):
    """An invariant broke: `invariant` (1-4) and what broke it."""

    def __init__(self, invariant: int, detail: str) -> None:
        self.invariant, self.detail = invariant, detail
        super().__init__(f"invariant {invariant}: {detail}")


@dataclass
class KeyBook:
    """What each key names: chunks (rank, tag, tokens, start, end) and states (rank, tag, tokens)."""

    hasher: ChunkHasher  # rank 0's, for the chain keys
    shard_params: list[Any]  # each rank's KeyParams (its shard of a chain key)
    chunks: dict[ChunkKey, tuple[int, str, tuple[int, ...], int, int]] = field(default_factory=dict)
    states: dict[ChunkKey, tuple[int, str, tuple[int, ...]]] = field(default_factory=dict)
    sequences: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # request -> (tag, tokens)
    _registered: dict[str, int] = field(default_factory=dict)

    def register(self, request: Any, tag: str) -> None:
        """The keys of `request`'s tokens not recorded yet (it may have grown since)."""
        tokens = list(request.all_token_ids)
        done = self._registered.get(request.request_id, 0)
        if done >= len(tokens):
            return
        extras = request_extras(request, CHUNK)
        chain = self.hasher.chain(tokens, extras=extras)
        for end in range(done + 1, len(tokens) + 1):
            span = self.hasher.prefix_span(tokens, chain, end, extras)
            for rank, params in enumerate(self.shard_params):
                self.chunks.setdefault(params.shard_key(span.key), (rank, tag, tuple(tokens[:end]), span.start, end))
            if end % CHUNK == 0:
                for rank, params in enumerate(self.shard_params):
                    self.states.setdefault(params.shard_key(state_key(chain[end // CHUNK - 1].key)),
                                           (rank, tag, tuple(tokens[:end])))
        self._registered[request.request_id] = len(tokens)
        self.sequences[request.request_id] = (tag, tuple(tokens))


class Checks:
    """The invariants over one schedule's vLLM scheduler, ranks and engines."""

    def __init__(self, kind: GroupKind, oracle: Oracle, scheduler: Any, runners: Sequence[Any], keys: KeyBook,
                 tags: Callable[[str], str]) -> None:
        self.kind = kind
        self.oracle = oracle
        self.scheduler = scheduler
        self.runners = runners
        self.keys = keys
        self.tags = tags  # request id -> its tag
        self.checked_chunks = 0
        self.checked_states = 0
        manager = scheduler.kv_cache_manager
        self.null_block = manager.block_pool.null_block.block_id
        self.group_managers = manager.coordinator.single_type_managers
        self.disk_seen: dict[str, tuple[int, int, int]] = {}
        self.reported_failed: set[int] = set()  # blocks the connector reported failed, until vLLM recomputed them

    # ---- 1: what the next forward reads ---------------------------------------------------------------------------
    def report_failed(self, block_ids: set[int]) -> None:
        """The connector reported these blocks failed (vLLM's invalid_block_ids of a step)."""
        self.reported_failed |= block_ids

    def report_rewound(self, computed_before: dict[str, int]) -> None:
        """vLLM's recovery from a failed load rewound some of these requests (`computed_before`: each one's computed
        tokens before update_from_output, this step's included): each rewound request's blocks past its new count
        may hold KV it computed this step over a failed block, and it recomputes them, so they wait like the
        failed blocks themselves."""
        manager = self.scheduler.kv_cache_manager
        for req_id, before in computed_before.items():
            request = self.scheduler.requests.get(req_id)
            if request is None or request.num_computed_tokens >= before:
                continue
            first = -(-request.num_computed_tokens // BLOCK)  # a block it keeps in part holds none of this step's
            for table in manager.get_block_ids(req_id):
                self.reported_failed.update(block for block in table[first:] if block != self.null_block)

    def _not_recomputed(self) -> set[int]:
        """The reported blocks some request still has to compute (a block past its computed tokens); the others
        are forgotten: vLLM has recomputed them, or no request will (then they are checked like any other)."""
        manager = self.scheduler.kv_cache_manager
        pending: set[int] = set()
        for req_id, request in self.scheduler.requests.items():
            for table in manager.get_block_ids(req_id):
                pending.update(block for i, block in enumerate(table)
                               if block in self.reported_failed and (i + 1) * BLOCK > request.num_computed_tokens)
        self.reported_failed &= pending
        return pending

    def blocks(self) -> None:
        from vllm.v1.request import RequestStatus

        manager = self.scheduler.kv_cache_manager
        reported_failed = self._not_recomputed()
        for req_id, request in list(self.scheduler.requests.items()):
            n = request.num_computed_tokens
            if not n or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS or request.is_finished():
                continue
            tables = manager.get_block_ids(req_id)
            if not any(tables):
                continue
            expected = self.oracle.expected(self.tags(req_id), list(request.all_token_ids)[:n])
            for runner in self.runners:
                for index, layer in enumerate(self.kind.layers):
                    group = runner.group_of[layer.name]
                    where = f"request {req_id} ({request.status.name}, rank {runner.rank}, {layer.name})"
                    if layer.has_state:
                        self._state_read(where, runner.pages[layer.name], tables[group], n,
                                         expected.state_after(index, runner.rank, n))
                        continue
                    first = self.group_managers[group].get_num_skipped_tokens(n) if layer.role == SLIDING else 0
                    self._tokens_read(where, runner.pages[layer.name], tables[group], first, n,
                                      expected.layers[index][runner.rank], reported_failed)

    def _tokens_read(self, where: str, pages: LayerPages, table: Sequence[int], first: int, n: int,
                     want: Sequence[np.ndarray], reported_failed: set[int]) -> None:
        positions = [p for p in range(max(first, 0), n) if table[p // BLOCK] not in reported_failed]
        if not positions:
            return
        blocks = [table[p // BLOCK] for p in positions]
        if self.null_block in blocks:
            p = positions[blocks.index(self.null_block)]
            raise Violation(1, f"{where}: token {p} of its {n} computed tokens is in vLLM's null block")
        got = pages.read_tokens([b * BLOCK + p % BLOCK for b, p in zip(blocks, positions)])
        wrong = [p for p, value in zip(positions, got) if not np.array_equal(value, want[p])]
        if wrong:
            p = wrong[0]
            raise Violation(1, f"{where}: token {p} (block {table[p // BLOCK]}, logical block {p // BLOCK}) of its "
                               f"{n} computed tokens is not the oracle's KV ({len(wrong)} tokens wrong)")

    def _state_read(self, where: str, pages: LayerPages, table: Sequence[int], n: int, want: bytes) -> None:
        index = (n - 1) // BLOCK
        block = table[index] if index < len(table) else self.null_block
        if block == self.null_block:
            raise Violation(1, f"{where}: the block its next step reads its state from (logical block {index}) "
                               "is vLLM's null block")
        got = pages.read_state(block)
        if got != want:
            raise Violation(1, f"{where}: block {block} (logical block {index}) does not hold the state after its "
                               f"{n} computed tokens ({self._name_state(got)})")

    def _name_state(self, seed: bytes) -> str:
        return "garbage" if seed.startswith(b"?") else f"state {seed.hex()}"

    # ---- 2 and 4: what the tiers hold -----------------------------------------------------------------------------
    def cpu_tiers(self) -> None:
        for runner in self.runners:
            engine = runner.connector.worker_side.engine
            cpu, layout = engine.cpu, engine.layout
            events = runner.connector.worker_side.cpu_events
            with cpu._lock:  # a peek that does not count as a hit (the eviction order stays the schedule's)
                entries = [(key, ref, "") for key, ref in cpu._entries.items()]
                with events._lock:  # and the evicted chunks held for loads planned before the scheduler saw them
                    entries += [(key, ref, " (held after its eviction)") for _, key, ref in events._held]
                for _, ref, _ in entries:
                    ref.slot.ref()
            try:
                for key, ref, held in entries:
                    chunk = ref.slot.view(layout.dtype, layout.chunk_shape(ref.meta.num_tokens,
                                                                            is_state_object(ref.meta.fmt)))
                    self.chunk(f"rank {runner.rank}'s CPU tier{held}", key, chunk, layout)
            finally:
                for _, ref, _ in entries:
                    ref.slot.release()

    def disk(self, directory: Path) -> None:
        """Every chunk file, opened with the engine's key when it seals the stores' chunks (encrypt_stores)."""
        engine = self.runners[0].connector.worker_side.engine
        layout = engine.layout
        sealer = getattr(engine.mesh, "sealer", None)  # the WorkerMesh's
        for path in sorted(directory.rglob("*" + chunk_file.SUFFIX)):
            try:
                st = path.stat()
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                if self.disk_seen.get(str(path)) == stamp:
                    continue
                meta, _ = chunk_file.read_chunk_meta(path)
                out = bytearray(meta.nbytes)
                meta = chunk_file.read_chunk_into(path, memoryview(out))
            except FileNotFoundError:  # evicted or deleted meanwhile
                continue
            except chunk_file.CorruptChunkFile as exc:
                raise Violation(2, f"disk store: {path.name} is corrupt ({exc})") from exc
            if sealer is not None:
                sealed, out = out, bytearray(meta.nbytes - SEAL_OVERHEAD)
                try:
                    meta = sealer.open_into(meta.key, meta, memoryview(sealed), memoryview(out))
                except SealRejected as exc:
                    raise Violation(2, f"disk store: {path.name} does not open ({exc})") from exc
            self.disk_seen[str(path)] = stamp
            chunk = torch.frombuffer(out, dtype=torch.uint8).view(layout.dtype).reshape(list(meta.shape))
            self.chunk(f"disk store file {path.name}", meta.key, chunk, layout)

    def _object_layers(self, state: bool) -> list[str]:
        """The layers a stored chunk (or state) holds, in its order: the caches' (group order), of its kind only."""
        kinds = {layer.name: layer.has_state for layer in self.kind.layers}
        return [name for name in self.runners[0].connector.worker_side.kv_caches if kinds[name] == state]

    def chunk(self, where: str, key: ChunkKey, chunk: torch.Tensor, layout: Any) -> None:
        self.checked_chunks += 1
        state = self.keys.states.get(key)
        if state is not None:
            self._state_entry(where, key, chunk, layout, *state)
            return
        info = self.keys.chunks.get(key)
        if info is None:
            raise Violation(2, f"{where}: chunk {key.hex()} has a key no request's tokens make")
        rank, tag, tokens, start, end = info
        expected = self.oracle.expected(tag, tokens)
        order = self._object_layers(False)  # the layers as chunks hold them
        for index, layer in enumerate(self.kind.layers):
            if layer.role in STATE_ROLES:
                continue  # chunks carry no state (kv_groups.py): states are stored under their own keys
            first = start
            if layer.role == SLIDING:  # what a hit at the chunk's end keeps in its window
                group = self.runners[0].group_of[layer.name]
                first = max(start, self.group_managers[group].get_num_skipped_tokens(end))
            if first >= end:
                continue
            got = chunk_tokens(layout, chunk, order.index(layer.name), layer.role, first - start, end - start)
            want = expected.layers[index][rank][first:end]
            wrong = [first + i for i, (a, b) in enumerate(zip(got, want)) if not np.array_equal(a, b)]
            if wrong:
                raise Violation(2, f"{where}: chunk {key.hex()} (rank {rank}, {tag}, tokens [{start}, {end}) of a "
                                   f"{len(tokens)}-token sequence) is not the oracle's KV in {layer.name} (tokens "
                                   f"wrong: {wrong[:8]})")

    def _state_entry(self, where: str, key: ChunkKey, chunk: torch.Tensor, layout: Any, rank: int, tag: str,
                     tokens: tuple[int, ...]) -> None:
        self.checked_states += 1
        expected = self.oracle.expected(tag, tokens)
        order = self._object_layers(True)  # the layers as states hold them
        for index, layer in enumerate(self.kind.layers):
            if not layer.has_state:
                continue
            pages = self.runners[0].pages[layer.name]
            got = chunk_state(layout, chunk, order.index(layer.name), layer.role, pages.state_bytes)
            want = expected.state_after(index, rank, len(tokens))
            if got != want:
                for seq_tag, seq in self.keys.sequences.values():  # every request's, to name the state
                    self.oracle.expected(seq_tag, seq)
                found = self.oracle.find_state(index, rank, got)
                held = self._name_state(got) if found is None else \
                    f"the state after {found[2]} tokens of a {found[1]}-token sequence ({found[0]})"
                raise Violation(4, f"{where}: state {key.hex()} (rank {rank}, {tag}, stored as the state after "
                                   f"{len(tokens)} tokens) holds {held} in {layer.name}")


__all__ = ["Checks", "KeyBook", "Violation"]
