"""A block vLLM frees while its request still runs is read by the request's save before the next forward can
write it (adapter/async_saves.py).

vLLM's own KV cache manager (support.vllm_kv_cache) runs two requests through two steps: request P's first step
saves a chunk (or a Mamba state), and at the next schedule vLLM frees blocks that save read (blocks that left the
sliding window; the retired prefill checkpoint page) and hands them to request Q, whose forward writes them. As
in vLLM's hybrid allocator, a layer of each group shares one paged buffer, so a block id is one page whichever
group holds it.

On CUDA a gather queued on a side stream may run after the next step's forward (nothing orders the two streams);
the CPU copy is synchronous, so the test runs each save where CUDA may run it: a worker whose gathers go to a
side stream (`AsyncSaves.on_forward_stream` False) has its step's `wait_for_save` run after the next step's
forward; a gather on the forward's stream runs in order, before it. The torch copy path is the oracle; every
page holds a pattern naming its request, group and tokens, so a stored chunk or state shows whose it is.
tests/gpu/test_stream_ordering_gpu.py races the same gathers on real CUDA streams.
"""

from __future__ import annotations

import dataclasses
import zlib
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from kvmesh.services.engine.adapter.kv_groups import STATE, KVGroups, slot_rows
from kvmesh.services.engine.core.kv_layout import detect_layout
from kvmesh.shared.wire.keys import ChunkSpan, state_key

from support.engine import random_tokens

pytest.importorskip("kvmesh.services.engine.connector")
from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvmesh.services.engine.adapter.async_saves import AsyncSaves  # noqa: E402

from support.connector_driver import Step, rank0_engine  # noqa: E402
from support.vllm_kv_cache import (  # noqa: E402
    VLLMCache, full_attention, hybrid_cache, mamba2, request, sliding_window, tables)

B = 16
HEADS, HEAD_SIZE = 2, 32
SCRATCH = 4  # blocks past vLLM's pool: where the test loads what was stored


@dataclasses.dataclass
class Scenario:
    cache: VLLMCache
    groups: KVGroups
    layer_names: tuple[str, ...]
    p_tokens: list[int]
    q_tokens: list[int]
    steps: list[list[tuple[str, int]]]  # per step: (request id, tokens it computes), in vLLM's schedule order


def sliding_window_scenario() -> Scenario:
    """P (96 tokens) prefills 64 then 32; at the second schedule vLLM frees P's window blocks 0 and 1 (tokens
    before 64 - 32 + 1), which the first step's save of chunk 0 read, and gives them to Q (16 tokens): 13 blocks
    leave vLLM nothing else to give."""
    names = ("model.layers.0.self_attn", "model.layers.1.self_attn")
    cache = hybrid_cache([(names[0], sliding_window(B, 2 * B)), (names[1], full_attention(B))], num_blocks=13,
                         block_size=B, hash_block_size=B)
    return Scenario(cache, KVGroups.of(cache.config)[0], names, random_tokens(96, seed=1).tolist(),
                    random_tokens(16, seed=2).tolist(), [[("p", 64)], [("p", 32), ("q", 16)]])


def mamba_scenario() -> Scenario:
    """P (44 tokens) prefills in one step, whose save stores the state after 32 from vLLM's prefill checkpoint
    page (block 1); P's next step (a decode) retires that page, and vLLM gives the block to Q (10 tokens) for its
    attention: 7 blocks leave it nothing else."""
    names = ("model.layers.0.mixer", "model.layers.1.self_attn")
    cache = hybrid_cache([(names[0], mamba2(B)), (names[1], full_attention(B))], num_blocks=7, block_size=B,
                         hash_block_size=B)
    return Scenario(cache, KVGroups.of(cache.config)[0], names, random_tokens(44, seed=3).tolist(),
                    random_tokens(10, seed=4).tolist(), [[("p", 44)], [("p", 1), ("q", 10)]])


SCENARIOS = {"sliding-window": sliding_window_scenario, "mamba-checkpoint": mamba_scenario}


def pattern(req_id: str, layer: str, tokens: list[int], like: torch.Tensor) -> torch.Tensor:
    """The oracle's page for `req_id`'s layer after `tokens` (a state, or the KV of the block ending there)."""
    seed = zlib.crc32(f"{req_id}/{layer}/{tokens}".encode())
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed)).to(like.dtype)


class Forward:
    """Stands for the model's forward over the step's requests: each attention layer writes the blocks of the
    step's tokens, each state layer the running state after the step and the prefill checkpoint where vLLM's
    Mamba2 backend exports one (the call its metadata builder makes)."""

    def __init__(self, scenario: Scenario, caches: dict[str, torch.Tensor]) -> None:
        self.scenario, self.caches = scenario, caches
        self.scheduled: list[tuple[str, list[int], list[list[int]], int, int]] = []

    def __call__(self, layer: int, name: str) -> None:
        group = self.scenario.groups.groups[layer]
        pages = self.caches[name]
        for req_id, tokens, block_ids, start, end in self.scheduled:
            table = block_ids[layer]
            if group.kind != STATE:
                for column in range(start // B, -(-end // B)):
                    pages[table[column]] = pattern(req_id, name, tokens[:min((column + 1) * B, end)], pages[0])
                continue
            pages[table[-(-end // B) - 1]] = pattern(req_id, name, tokens[:end], pages[0])
            cache = self.scenario.cache
            offsets, columns = compute_mamba_prefill_checkpoints(
                [end], [end - start], hash_block_size=cache.hash_block_size, mamba_block_size=B,
                checkpoint_alignment=1, drop_eagle_block=cache.drop_eagle_block,
                cache_hit_alignment_tokens=int(cache.config.cache_hit_alignment_tokens))
            if offsets[0] and table[columns[0]] != -1:
                pages[table[columns[0]]] = pattern(req_id, name, tokens[:start + offsets[0]], pages[0])


@pytest.fixture
def halves(request: pytest.FixtureRequest) -> Iterator[tuple[Scenario, Any, Any, Any, dict[str, torch.Tensor]]]:
    """The scenario's two connector halves over one paged buffer (a layer of each group shares it, as in vLLM's
    hybrid allocator), saves off the forward as on CUDA."""
    from kvmesh.services.engine.adapter.async_loads import AsyncLoads
    from kvmesh.services.engine.adapter.scheduler_lookup import SchedulerLookup
    from kvmesh.services.engine.adapter.scheduler_side import SchedulerSide
    from kvmesh.services.engine.adapter.worker_side import WorkerSide
    from kvmesh.services.engine.connector import KVMeshConnector

    from support.waiting import WAIT_S

    scenario: Scenario = SCENARIOS[request.param]()
    num_blocks = scenario.cache.config.num_blocks + SCRATCH
    buffer = torch.randn(num_blocks, HEADS, B, 2 * HEAD_SIZE, generator=torch.Generator().manual_seed(0)).to(
        torch.bfloat16)
    caches = {name: buffer for name in scenario.layer_names}
    layout = dataclasses.replace(detect_layout(caches, B, "CPU_ATTN", cpu_isa="vec"),
                                 group_layers=scenario.groups.layers_per_group(), groups_tag=scenario.groups.tag)
    with rank0_engine(layout) as engine:
        side = SchedulerSide(engine.config, B, SchedulerLookup(1, WAIT_S, "test-scheduler"), saves_off_forward=True,
                             groups=scenario.groups)
        side.bind_kv_cache_manager(scenario.cache.manager)
        worker_side = WorkerSide(engine.config, B, saves_off_forward=True, groups=scenario.groups)
        worker_side.engine, worker_side.kv_caches, worker_side.async_loads = engine, caches, AsyncLoads(WAIT_S)
        try:
            yield (scenario, engine, KVMeshConnector.from_sides(scheduler_side=side),
                   KVMeshConnector.from_sides(worker_side=worker_side), caches)
        finally:
            side.shutdown()


def run(scenario: Scenario, sched: Any, work: Any, caches: dict[str, torch.Tensor]) -> None:
    """vLLM's schedules and the worker's steps; a step's saves run where the worker's stream lets CUDA run them
    (module docstring)."""
    cache = scenario.cache
    requests: dict[str, Request] = {}
    forward = Forward(scenario, caches)
    late = not work.worker_side.async_saves.on_forward_stream  # a side stream: after the next step's forward
    pending = None  # the previous step's metadata, whose gathers a side stream has not run yet
    for scheduled in scenario.steps:
        cache.manager.new_step_starts()
        step = Step()
        forward.scheduled = []
        for req_id, count in scheduled:
            req = requests.get(req_id)
            if req is None:
                req = requests[req_id] = request(cache, req_id, scenario.p_tokens if req_id == "p"
                                                 else scenario.q_tokens)
                computed, local, _ = cache.manager.get_computed_blocks(req)
                assert sched.get_num_new_matched_tokens(req, local) == (0, False)
                blocks = cache.manager.allocate_slots(req, count, local, computed)
                assert blocks is not None, f"vLLM's manager could not schedule {req_id}"
                sched.update_state_after_alloc(req, blocks, 0)
                step.new.append((req_id, tables(cache, req_id)[0], local, count))
            else:
                if req.num_computed_tokens >= req.num_tokens:  # a decode: the token sampled last step
                    req.append_output_token_ids(7)
                blocks = cache.manager.allocate_slots(req, count)
                assert blocks is not None, f"vLLM's manager could not schedule {req_id}"
                step.cached.append((req_id, list(blocks.get_block_ids()[0]), req.num_computed_tokens, count, False))
            start = req.num_computed_tokens
            forward.scheduled.append((req_id, list(req.all_token_ids), tables(cache, req_id), start, start + count))
        metadata = sched.build_connector_meta(step.output())
        work.handle_preemptions(metadata)
        work.bind_connector_metadata(metadata)
        work.start_load_kv(None)
        for i, name in enumerate(caches):
            work.wait_for_layer_load(name)
            forward(i, name)
            work.save_kv_layer(name, caches[name], None)
        if pending is not None:  # the side stream runs the previous step's gathers only now
            work.worker_side.wait_for_save(pending)
        if late:
            pending = metadata
        else:
            work.wait_for_save()
        work.get_finished(set())
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=work.build_connector_worker_meta(),
                                                      invalid_block_ids=work.get_block_ids_with_load_errors()))
        work.clear_connector_metadata()
        for req_id, count in scheduled:
            requests[req_id].num_computed_tokens += count
    if pending is not None:
        work.worker_side.wait_for_save(pending)


def stored_page(scenario: Scenario, engine: Any, caches: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """(layer, page) of what P's first step saved that vLLM then freed and gave to Q, loaded back into a scratch
    block: the sliding-window layer's block 0 of P's chunk 0, or P's state after 32."""
    scratch = scenario.cache.config.num_blocks
    tokens = scenario.p_tokens
    if scenario.groups.has_state:
        chain = engine.hasher.chain(tokens[:32])
        span = engine.hasher.shard([ChunkSpan(0, 32 - B, 32, state_key(chain[0].key), state=True)])[0]
        slots = scenario.groups.state_slots([[-1, scratch], [-1, -1]], 32)
    else:
        span = engine.hasher.spans(tokens[:32])[0]
        slots = slot_rows([[scratch, scratch + 1], [scratch + 2, scratch + 3]], 32, B, -1)
    assert engine.load([span], slots).scatter(caches, slots) == 1, "P's first step stored nothing there"
    return scenario.layer_names[0], caches[scenario.layer_names[0]][scratch]


def want(scenario: Scenario, req_id: str, layer: str, like: torch.Tensor) -> torch.Tensor:
    """What that page holds when it is P's (its window block 0: the KV of its first B tokens; its state after 32),
    and what Q's forward writes into the block vLLM gave Q's attention group (Q's prompt fits in one block)."""
    if req_id == "p":
        return pattern("p", layer, scenario.p_tokens[:32 if scenario.groups.has_state else B], like)
    return pattern("q", scenario.layer_names[1], scenario.q_tokens, like)


@pytest.mark.parametrize("halves", list(SCENARIOS), indirect=True)
def test_a_block_vllm_frees_mid_request_is_read_by_its_save_before_the_next_forward_writes_it(
        halves: tuple[Scenario, Any, Any, Any, dict[str, torch.Tensor]]) -> None:
    scenario, engine, sched, work, caches = halves
    run(scenario, sched, work, caches)
    layer, page = stored_page(scenario, engine, caches)
    assert torch.equal(page, want(scenario, "p", layer, page)), "a stored page is not P's own"


@pytest.mark.parametrize("halves", list(SCENARIOS), indirect=True)
def test_on_a_side_stream_the_next_forward_overwrites_the_freed_block_before_the_save_reads_it(
        halves: tuple[Scenario, Any, Any, Any, dict[str, torch.Tensor]]) -> None:
    """The ordering before this fix (every gather on the side stream): the model above reproduces the race, and
    the stored page is what Q's forward wrote into the block vLLM gave it."""
    scenario, engine, sched, work, caches = halves
    work.worker_side.async_saves = AsyncSaves(on_forward_stream=False)
    run(scenario, sched, work, caches)
    layer, page = stored_page(scenario, engine, caches)
    assert torch.equal(page, want(scenario, "q", layer, page)), "the freed block was not rewritten by Q's forward"
