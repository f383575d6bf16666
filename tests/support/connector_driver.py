"""Drive KVMeshConnector's two halves the way vLLM does, without vLLM's engine: the scheduler half as vLLM's
scheduler calls it (lookup, allocation, one `SchedulerOutput` per step, request ends) and the worker half in
the order vLLM's GPU model runner calls it in one step (handle_preemptions, bind, start_load_kv, per layer
wait_for_layer_load / forward / save_kv_layer, wait_for_save, get_finished, load errors, worker meta, clear).

Both halves are real connector objects over a real CacheEngine in this process (vLLM's single-process case);
what vLLM's forward would compute is written by the test (`Step.forward`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch

from kvmesh.services.engine.adapter.async_loads import AsyncLoads
from kvmesh.services.engine.adapter.kv_events import KVEventLog
from kvmesh.services.engine.adapter.scheduler_lookup import SchedulerLookup, engines
from kvmesh.services.engine.adapter.scheduler_side import SchedulerSide
from kvmesh.services.engine.adapter.worker_side import WorkerSide
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.core.kv_layout import KVLayout
from kvmesh.shared.wire.keys import KeyParams

from support.engine import BLOCK, engine_config
from support.kv_oracle import Forward
from support.waiting import WAIT_S

import kvmesh.services.engine.connector as connector


@contextmanager
def rank0_engine(layout: KVLayout, device: Any = None) -> Iterator[CacheEngine]:
    """A CacheEngine for `layout`, registered as rank 0 so the scheduler half's lookups reach it; closed after."""
    worker = build_engine(engine_config(), KeyParams(model="test-model", kv_format=""), layout, device=device)
    engines.add(0, worker)
    try:
        yield worker
    finally:
        engines.remove(worker)
        worker.close()


def scheduler_half(config: EngineConfig, block_size: int, saves_off_forward: bool, world_size: int = 1,
                   kv_events: KVEventLog | None = None) -> connector.KVMeshConnector:
    """The scheduler half as vLLM creates it (without a VllmConfig); close it with `.shutdown()`. With
    `world_size` > 1 its lookups take the minimum over that many ranks' engines (simulated TP). `kv_events`:
    as with vLLM's --kv-events-config."""
    lookup = SchedulerLookup(world_size=world_size, timeout=WAIT_S, nats_name="test-scheduler")
    side = SchedulerSide(config, block_size, lookup, saves_off_forward=saves_off_forward, kv_events=kv_events)
    return connector.KVMeshConnector.from_sides(scheduler_side=side)


def worker_half(engine: CacheEngine, caches: dict[str, torch.Tensor], block_size: int, saves_off_forward: bool,
                load_timeout: float = WAIT_S) -> connector.KVMeshConnector:
    """The worker half after register_kv_caches created `engine` for `caches` (its `worker_side.layerwise`:
    set a LayerwiseLoader for use_layerwise, as the connector does on CUDA)."""
    side = WorkerSide(engine.config, block_size, saves_off_forward=saves_off_forward)
    side.engine, side.kv_caches = engine, caches
    side.async_loads = AsyncLoads(load_timeout)
    engine.cpu.listen(side.cpu_events)  # the CPU tier's admissions reach the scheduler's mirror
    return connector.KVMeshConnector.from_sides(worker_side=side)


def request(req_id: str, tokens: list[int], cache_salt: str | None = None,
            lora_request: Any = None, kv_transfer_params: dict[str, Any] | None = None) -> SimpleNamespace:
    """What the connector reads of vLLM's Request (`lora_request`: an object with lora_name / lora_path /
    lora_int_id, as vLLM's LoRARequest; `kv_transfer_params`: the request body's)."""
    return SimpleNamespace(request_id=req_id, num_tokens=len(tokens), num_prompt_tokens=len(tokens),
                           all_token_ids=tokens, lora_request=lora_request, mm_features=[], prompt_embeds=None,
                           cache_salt=cache_salt, kv_transfer_params=kv_transfer_params)


def blocks(ids: list[int]) -> SimpleNamespace:
    """vLLM's KVCacheBlocks, as update_state_after_alloc reads it."""
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


@dataclass
class Step:
    """One SchedulerOutput, as build_connector_meta reads it."""

    new: list[tuple[str, list[int], int, int]] = field(default_factory=list)  # id, blocks, computed, scheduled
    cached: list[tuple[str, list[int], int, int, bool]] = field(default_factory=list)  # + resumed
    finished: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)

    def output(self) -> SimpleNamespace:
        scheduled = {r: n for r, _, _, n in self.new} | {r: n for r, _, _, n, _ in self.cached}
        return SimpleNamespace(
            total_num_scheduled_tokens=sum(scheduled.values()), num_scheduled_tokens=scheduled,
            scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
                                for r, b, c, _ in self.new],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r for r, *_ in self.cached], new_block_ids=[(b,) if b else None for _, b, *_ in self.cached],
                num_computed_tokens=[c for _, _, c, _, _ in self.cached],
                resumed_req_ids={r for r, _, _, _, resumed in self.cached if resumed}),
            finished_req_ids=set(self.finished), preempted_req_ids=set(self.preempted))


@dataclass
class StepResult:
    finished_sending: set[str]
    finished_recving: set[str]
    load_errors: set[int]
    worker_meta: Any = None  # what the scheduler's update_connector_output receives


def run_worker_step(worker: Any, metadata: Any, finished: set[str],
                    forward: Callable[[int, str], None] | None = None,
                    before_finished: Callable[[], None] | None = None) -> StepResult:
    """The worker half through one step, in vLLM's GPU model runner's order. `forward(i, layer_name)` stands
    for layer i's attention writing its KV (after wait_for_layer_load, before save_kv_layer).
    `before_finished()` runs between wait_for_save and get_finished (a simulation waits there, by condition,
    for the asynchronous fetches started in this step, so that what get_finished reports does not depend on
    timing)."""
    worker.handle_preemptions(metadata)
    worker.bind_connector_metadata(metadata)
    worker.start_load_kv(None)
    if not metadata.idle:
        for i, (name, cache) in enumerate(worker.worker_side.kv_caches.items()):
            worker.wait_for_layer_load(name)
            if forward is not None:
                forward(i, name)
            worker.save_kv_layer(name, cache, None)
    worker.wait_for_save()
    if before_finished is not None:
        before_finished()
    sending, recving = worker.get_finished(finished)
    errors = worker.get_block_ids_with_load_errors()
    worker_meta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return StepResult(set(sending or ()), set(recving or ()), errors, worker_meta)


def run_step(scheduler: Any, worker: Any, step: Step,
             forward: Callable[[int, str], None] | None = None) -> StepResult:
    """One engine step: the scheduler's metadata, the worker's step, its output back to the scheduler."""
    metadata = scheduler.build_connector_meta(step.output())
    result = run_worker_step(worker, metadata, step.finished, forward)
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=result.worker_meta,
                                                      invalid_block_ids=set(result.load_errors)))
    return result


def prefill(sched: object, work: object, forward: Forward, req_id: str, tokens: list[int], block_ids: list[int],
            kv_transfer_params: dict[str, Any] | None = None) -> tuple[int, bool]:
    """One request through lookup, allocation and one step that computes its whole prompt; the lookup's answer."""
    req = request(req_id, tokens, kv_transfer_params=kv_transfer_params)
    answer = sched.get_num_new_matched_tokens(req, 0)  # type: ignore[attr-defined]
    loaded = answer[0] or 0
    sched.update_state_after_alloc(req, blocks(block_ids), loaded)  # type: ignore[attr-defined]
    first = loaded // BLOCK
    forward.compute(req_id, block_ids, first, -(-len(tokens) // BLOCK) - first)
    result = run_step(sched, work, Step(new=[(req_id, block_ids, loaded, len(tokens) - loaded)]), forward)
    assert result.load_errors == set()
    return answer
