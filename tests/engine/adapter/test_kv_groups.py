"""vLLM's KV cache groups (its hybrid KV cache manager): chunks hold every group's KV, each group copied through
its own block table, and a load never writes a block vLLM did not allocate for the group (adapter/kv_groups.py).

The caches are vLLM's CPU layout (support.engine.PagedKV); the groups are those vLLM makes for a mixed model
such as Gemma 2/3: sliding-window layers (0, 2) and full-attention layers (1, 3), each group with its own blocks.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvmesh.services.engine.adapter.kv_groups import FULL, SLIDING, STATE, KVGroup, KVGroups, page_view, slot_rows
from kvmesh.services.engine.adapter.request_meta import LoadSpec, ReqMeta, SaveSpec
from kvmesh.services.engine.adapter.scheduler_side import SchedulerSide
from kvmesh.services.engine.core import token_api

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.wire.keys import KeyParams, has_state_groups, state_key

from support.connector_driver import rank0_engine
from support.engine import BLOCK, CHUNK, PagedKV, engine_config

WINDOW = 2 * BLOCK  # the sliding window, in tokens
SW_LAYERS = ("model.layers.0.self_attn", "model.layers.2.self_attn")
FULL_LAYERS = ("model.layers.1.self_attn", "model.layers.3.self_attn")
GROUPS = KVGroups((KVGroup(SLIDING, SW_LAYERS, WINDOW), KVGroup(FULL, FULL_LAYERS)), BLOCK)


def grouped_kv(seed: int) -> tuple[PagedKV, dict[str, torch.Tensor]]:
    """A random 4-layer paged cache and its layers in chunk order (group by group)."""
    kv = PagedKV(layers=4, seed=seed)
    caches = {name: kv.caches[name] for name in GROUPS.layer_order()}
    kv.layout = dataclasses.replace(kv.layout, group_layers=GROUPS.layers_per_group(), groups_tag=GROUPS.tag)
    return kv, caches


def test_a_freed_block_has_no_slots_and_a_chunk_is_stored_only_while_a_hit_would_find_its_window() -> None:
    rows = slot_rows([[-1, 5, 6], [1, 2, 3]], 40, BLOCK, -1)
    assert rows.shape == (2, 40)
    assert (rows[0, :BLOCK] == -1).all() and rows[0, BLOCK] == 5 * BLOCK and rows[1, 0] == BLOCK
    # 6 blocks: the window (2 blocks) before the token after 96 is blocks 4 and 5; blocks 0-1 already freed
    tables = [[-1, -1, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]]
    assert not GROUPS.held_for_hit(tables, 2 * BLOCK, -1)  # a hit at 32 would load blocks 0 and 1: freed
    assert GROUPS.held_for_hit(tables, 4 * BLOCK, -1)  # blocks 2 and 3 (and the window's first token)
    assert GROUPS.saveable_from(tables, 0, 6 * BLOCK, CHUNK, -1) == CHUNK  # the first chunk cannot be stored
    assert GROUPS.saveable_from(tables, CHUNK, 6 * BLOCK, CHUNK, -1) == CHUNK
    full_only = KVGroups((KVGroup(FULL, FULL_LAYERS),), BLOCK)
    assert not full_only.grouped and GROUPS.grouped
    assert GROUPS.tag == "gS2w32+0,F2" and "gS2w32+0,F2" in dataclasses.replace(
        PagedKV().layout, group_layers=(2, 2), groups_tag=GROUPS.tag).chunk_format()


def test_slot_rows_are_each_tokens_block_slot_from_any_start_and_minus_one_in_freed_blocks() -> None:
    """The definition token by token (block_ids[i // B] * B + i % B), against slot_rows' vectorised build."""
    generator = random.Random(7)
    for _ in range(200):
        num_blocks = generator.randint(1, 9)
        width = num_blocks + generator.randint(0, 2)  # a table may hold blocks past the tokens asked for
        tables = [[generator.choice([-1, generator.randint(0, 99)]) for _ in range(width)]
                  for _ in range(generator.randint(1, 4))]
        num_tokens = generator.randint((num_blocks - 1) * BLOCK + 1, num_blocks * BLOCK)
        start = generator.randint(0, num_tokens)
        rows = slot_rows(tables, num_tokens, BLOCK, -1, start)
        assert rows.dtype == torch.int64 and rows.shape == (len(tables), num_tokens - start)
        expected = [[-1 if table[i // BLOCK] == -1 else table[i // BLOCK] * BLOCK + i % BLOCK
                     for i in range(start, num_tokens)] for table in tables]
        assert rows.tolist() == expected
    with pytest.raises(ValueError, match="block table of 1 blocks for 40 tokens"):
        slot_rows([[1]], 40, BLOCK, -1)


def round_trip(engine: CacheEngine, src_seed: int, dst_seed: int) -> None:
    """Store a 3-chunk prompt from one paged cache, load it into another whose sliding-window group has only
    the window before the hit allocated; every allocated block must hold the source's KV of its group, and no
    other block may change."""
    src, src_caches = grouped_kv(seed=src_seed)
    dst, dst_caches = grouped_kv(seed=dst_seed)
    tokens = list(range(1000, 1000 + 3 * CHUNK))
    num_blocks = len(tokens) // BLOCK
    # source: each group its own blocks; every block held (a save right after the prefill)
    src_tables = [list(range(10, 10 + num_blocks)), list(range(30, 30 + num_blocks))]
    # destination: the sliding-window group has only the window before the hit allocated (vLLM's null block
    # elsewhere), the full group every block
    first_held = GROUPS.groups[0].skipped_tokens(len(tokens)) // BLOCK
    dst_tables = [[-1] * first_held + list(range(50, 50 + num_blocks - first_held)),
                  list(range(70, 70 + num_blocks))]
    before = dst.buffer.clone()
    spans = engine.hasher.spans(tokens)
    engine.save(spans, src_caches, slot_rows(src_tables, len(tokens), BLOCK, -1))
    dst_slots = slot_rows(dst_tables, len(tokens), BLOCK, -1)
    assert engine.load(spans, dst_slots).scatter(dst_caches, dst_slots) == len(spans)
    for layer, name in enumerate(src_caches):
        group = 0 if layer < 2 else 1
        for dst_block, src_block in zip(dst_tables[group], src_tables[group]):
            if dst_block != -1:
                assert torch.equal(dst_caches[name][dst_block], src_caches[name][src_block]), (name, dst_block)
    # nothing else changed: the blocks of no table (vLLM's null block 0 among them) keep their bytes
    written = {b for table in dst_tables for b in table if b >= 0}
    for layer in range(4):
        for block in set(range(dst.num_blocks)) - written:
            assert torch.equal(dst.buffer[layer, block], before[layer, block]), (layer, block)


def test_each_group_is_stored_and_loaded_through_its_own_block_table_and_a_freed_block_is_never_written() -> None:
    with rank0_engine(grouped_kv(seed=0)[0].layout) as engine:
        round_trip(engine, src_seed=1, dst_seed=2)


def test_a_save_reads_slots_of_its_own_chunks_only_and_stores_the_same_bytes_as_from_token_0() -> None:
    """A step's save builds the slots of the tokens it stores (from `start`), not of every token before them: its
    cost does not grow with the prompt. Every window is the same as the whole mapping's columns."""
    tables = [[-1, -1, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]]
    whole = slot_rows(tables, 90, BLOCK, -1)
    for start in (0, BLOCK, 40, 89, 90):  # block-aligned, inside a block, in a freed block, the end
        assert torch.equal(slot_rows(tables, 90, BLOCK, -1, start), whole[:, start:]), start
    plain = ReqMeta(req_id="r", chunk_keys=[], block_ids=[4, 9, 2], save=None)
    assert torch.equal(plain.slot_mapping(60, BLOCK, 20), plain.slot_mapping(60, BLOCK)[20:])
    assert plain.slot_mapping(60, BLOCK, 50).tolist() == [-1] * 10  # past the allocated blocks
    state_groups = KVGroups((KVGroup(STATE, ("model.layers.0.mixer",)), KVGroup(FULL, FULL_LAYERS)), BLOCK)
    state_tables = [[-1, 7, -1, 9], [1, 2, 3, 4]]
    state = state_groups.state_slots(state_tables, 64, start=48)
    assert torch.equal(state, state_groups.state_slots(state_tables, 64)[:, 48:]) and state.shape == (2, BLOCK)
    with pytest.raises(ValueError, match="state after 64 tokens"):
        state_groups.state_slots(state_tables, 64, start=49)

    src, src_caches = grouped_kv(seed=3)
    tokens = list(range(500, 500 + 3 * CHUNK))
    num_blocks = len(tokens) // BLOCK
    src_tables = [list(range(10, 10 + num_blocks)), list(range(30, 30 + num_blocks))]
    with rank0_engine(src.layout) as whole_engine, rank0_engine(src.layout) as window_engine:
        spans = whole_engine.hasher.spans(tokens)
        whole_engine.save(spans[1:], src_caches, slot_rows(src_tables, len(tokens), BLOCK, -1))
        window_engine.save(spans[1:], src_caches, slot_rows(src_tables, len(tokens), BLOCK, -1, CHUNK),
                           first_token=CHUNK)
        with pytest.raises(ValueError, match="starts at token"):
            window_engine.save(spans[:1], src_caches, slot_rows(src_tables, len(tokens), BLOCK, -1, CHUNK),
                               first_token=CHUNK)
        for span in spans[1:]:
            held = [engine.cpu.acquire(span.key) for engine in (whole_engine, window_engine)]
            assert held[0] is not None and held[1] is not None
            shape = src.layout.chunk_shape(span.num_tokens, span.state)
            chunks = [ref.slot.view(src.layout.dtype, shape) for ref in held]
            assert torch.equal(chunks[0], chunks[1]) and chunks[0].abs().sum() > 0, span.start
            for ref in held:
                ref.release()
        assert spans[0].key not in window_engine.cpu


def test_each_tensor_parallel_rank_stores_and_loads_its_own_shard_of_every_group() -> None:
    layout = grouped_kv(seed=0)[0].layout
    engines = [build_engine(engine_config(), KeyParams("test-model", "", world_size=2, rank=rank), layout)
               for rank in range(2)]
    try:
        tokens = list(range(3 * CHUNK))
        assert engines[0].hasher.keys(tokens) != engines[1].hasher.keys(tokens), "each rank keys its own shard"
        for rank, engine in enumerate(engines):  # each rank's shard (its own heads): its own random KV
            round_trip(engine, src_seed=10 + rank, dst_seed=20 + rank)
    finally:
        for engine in engines:
            engine.close()


def test_a_grouped_load_is_asynchronous_and_the_scheduler_saves_only_chunks_a_hit_can_use() -> None:
    config = engine_config(chunk_size=CHUNK)
    side = SchedulerSide(config, BLOCK, None, groups=GROUPS)
    tables = {"r": [[-1, -1, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]]}
    manager = SimpleNamespace(block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=0)),
                              get_block_ids=lambda req_id: tuple([b if b >= 0 else 0 for b in t]
                                                                 for t in tables[req_id]))
    side.bind_kv_cache_manager(manager)
    tracker = SimpleNamespace(req_id="r")
    got, save = side._group_tables(tracker, SaveSpec(end=6 * BLOCK, mask_start=0),  # type: ignore[arg-type]
                                   (0, 6 * BLOCK))
    assert got == tables["r"]
    assert save == SaveSpec(end=6 * BLOCK, mask_start=CHUNK)
    # a prompt whose every chunk lost its window is not stored at all
    tables["r"] = [[-1, -1, -1, -1, 9, 10], [1, 2, 3, 4, 5, 6]]
    assert side._group_tables(tracker, SaveSpec(end=4 * BLOCK, mask_start=0),  # type: ignore[arg-type]
                              (0, 4 * BLOCK))[1] is None


def test_a_failed_grouped_load_is_a_failed_receive_never_a_block_error() -> None:
    from kvmesh.services.engine.adapter.worker_side import WorkerSide

    src, caches = grouped_kv(seed=3)
    with rank0_engine(src.layout) as engine:
        side = WorkerSide(engine.config, BLOCK, groups=GROUPS)
        side.engine, side.kv_caches = engine, caches
        keys = [span.key for span in engine.hasher.spans(list(range(2 * CHUNK)))]
        req = ReqMeta("r", keys, [1, 2, 3, 4], load=LoadSpec(end=2 * CHUNK, need=2 * CHUNK - 1, mask_start=0,
                                                             skip_prefix=0, asynchronous=True),
                      group_block_ids=[[5, 6, 7, 8], [1, 2, 3, 4]])
        side.request_load(req).run()  # nothing stored under those keys: the load fails
    assert side.get_block_ids_with_load_errors() == set()
    assert side.take_failed_recving() == {"r"}
    assert side.take_failed_recving() == set()


@pytest.mark.parametrize("kind", ["MambaSpec"])
def test_a_state_group_without_states_at_block_ends_leaves_the_model_uncached_with_its_name(kind: str) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.linear_attn"], mamba), KVCacheGroupSpec(["model.layers.1.attn"], full)])
    groups, why = KVGroups.of(config)
    assert groups is None and why is not None and kind in why and "model.layers.0.linear_attn" in why


def test_both_halves_store_a_prompt_prefilled_in_steps_and_load_it_into_the_window_only() -> None:
    """The scheduler and worker halves, driven as vLLM drives them, with each step's block tables as vLLM's KV
    cache manager gives them (the sliding-window group frees blocks as the prompt grows)."""
    from kvmesh.services.engine.adapter.async_loads import AsyncLoads
    from kvmesh.services.engine.adapter.scheduler_lookup import SchedulerLookup
    from kvmesh.services.engine.adapter.worker_side import WorkerSide
    from kvmesh.services.engine.connector import KVMeshConnector

    from support.connector_driver import Step, blocks, request, run_step
    from support.engine import random_tokens
    from support.waiting import WAIT_S

    kv, caches = grouped_kv(seed=5)
    tables: dict[str, list[list[int]]] = {}
    manager = SimpleNamespace(block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=0)),
                              get_block_ids=lambda req_id: tuple([b if b >= 0 else 0 for b in t]
                                                                 for t in tables[req_id]))
    with rank0_engine(kv.layout) as engine:
        side = SchedulerSide(engine.config, BLOCK, SchedulerLookup(1, WAIT_S, "test-scheduler"), groups=GROUPS)
        side.bind_kv_cache_manager(manager)
        sched = KVMeshConnector.from_sides(scheduler_side=side)
        worker_side = WorkerSide(engine.config, BLOCK, groups=GROUPS)
        worker_side.engine, worker_side.kv_caches, worker_side.async_loads = engine, caches, AsyncLoads(WAIT_S)
        engine.cpu.listen(worker_side.cpu_events)
        work = KVMeshConnector.from_sides(worker_side=worker_side)
        try:
            # a: 3 chunks, prefilled in two steps of 48 tokens; before the second, vLLM frees the window
            # group's block 0 (tokens before 48 - 32 + 1)
            t_a = random_tokens(3 * CHUNK, seed=41).tolist()
            assert sched.get_num_new_matched_tokens(request("a", t_a), 0) == (0, False)
            sched.update_state_after_alloc(request("a", t_a), blocks([10, 11, 12]), 0)
            tables["a"] = [[10, 11, 12], [30, 31, 32]]
            run_step(sched, work, Step(new=[("a", [10, 11, 12], 0, 48)]))
            tables["a"] = [[-1, 11, 12, 13, 14, 15], [30, 31, 32, 33, 34, 35]]
            run_step(sched, work, Step(cached=[("a", [13, 14, 15], 48, 48, False)]))
            run_step(sched, work, Step(finished={"a"}))
            assert token_api.lookup(engine, t_a, search_range=["LocalCPUBackend"]) == len(t_a)

            # b: the same prompt, a whole-prompt hit all in this process's CPU tier: leased at the lookup and
            # loaded in the step that schedules it (cpu_leases.py); vLLM allocated the window group only the
            # window before the hit (blocks 4 and 5)
            b = request("b", t_a)
            assert sched.get_num_new_matched_tokens(b, 0) == (len(t_a) - 1, False)
            tables["b"] = [[-1, -1, -1, -1, 20, 21], [40, 41, 42, 43, 44, 45]]
            sched.update_state_after_alloc(b, blocks(tables["b"][0]), len(t_a) - 1)
            before = kv.buffer.clone()
            result = run_step(sched, work, Step(new=[("b", tables["b"][0], len(t_a) - 1, 1)]))
            assert result.finished_recving == set() and result.load_errors == set()
            assert worker_side.take_failed_recving() == set()
            names = list(caches)
            for layer, name in enumerate(names):
                pairs = [(14, 20), (15, 21)] if layer < 2 else [(30 + i, 40 + i) for i in range(6)]
                for src, dst in pairs:
                    assert torch.equal(caches[name][dst], caches[name][src]), (name, dst)
            written = {20, 21, *range(40, 46)}
            for layer in range(4):
                for block in set(range(kv.num_blocks)) - written:
                    assert torch.equal(kv.buffer[layer, block], before[layer, block]), (layer, block)
            run_step(sched, work, Step(finished={"b"}))

            # c: vLLM's own prefix cache gave 64 tokens and had freed the window group's first blocks; chunk 0's
            # window (blocks 0 and 1) is gone, so chunk 0 is not stored; chunks 1 and 2 are
            t_c = random_tokens(3 * CHUNK, seed=42).tolist()
            assert sched.get_num_new_matched_tokens(request("c", t_c), 64) == (0, False)
            sched.update_state_after_alloc(request("c", t_c), blocks([]), 0)
            tables["c"] = [[-1, -1, 52, 53, 54, 55], [60, 61, 62, 63, 64, 65]]
            run_step(sched, work, Step(new=[("c", tables["c"][0], 64, 32)]))
            keys = [span.key for span in engine.hasher.spans(t_c)]
            assert [key in engine.cpu for key in keys] == [False, True, True]
        finally:
            sched.shutdown()


def test_a_state_group_is_cached_only_in_align_mode_and_its_state_travels_beside_the_chunks() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)

    def config(*specs: Any) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])

    align = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,), mamba_cache_mode="align")
    groups, why = KVGroups.of(config(align, full))
    assert why is None and groups is not None and groups.has_state and groups.tag == "gM1,F1"
    assert "'none'" in KVGroups.of(config(MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,)),
                                          full))[1]
    assert "no attention layer" in KVGroups.of(config(align))[1]

    tables = [[-1, 7, -1, 9], [1, 2, 3, 4]]  # a step of tokens [32, 64): it started from block 1, runs in block 3
    assert groups.state_pages(tables, 32, 64) == {64: 3}  # only the running state: block 1's page is never named
    assert groups.state_pages(tables, 0, 40) == {}  # no block in the running column (never expected of vLLM)
    chunk = groups.chunk_slots(tables, 64)
    assert (chunk[0] == -1).all() and chunk[1, 16] == 2 * 16  # the state group's pages travel as states only
    state = groups.state_slots(tables, 64)
    assert state.shape == (2, 64) and (state[1] == -1).all() and (state[0, :48] == -1).all()
    assert state[0, 48:].tolist() == list(range(9 * 16, 10 * 16))
    assert state_key(b"k" * 16) == state_key(b"k" * 16) != b"k" * 16 and len(state_key(b"k" * 16)) == 16
    assert has_state_groups(f"bfloat16/LBHNC-16/{groups.tag}")
    assert not any(has_state_groups(fmt) for fmt in ("bfloat16/LBHNC-16/gS2w32+0,F2", "bfloat16/MLA-64", ""))


def test_a_state_layers_pages_are_seen_as_attention_pages_over_the_same_memory() -> None:
    pages = torch.zeros(8, 4096, dtype=torch.uint8)  # 8 blocks of 4 KiB, as vLLM's one buffer holds them
    attention = pages.view(torch.bfloat16).view(8, 2, 16, 64)  # [blocks, heads, block_size, 2 * head_size]
    state = pages.view(8, 1, 1, 4096)[:, :, :, :1000]  # vLLM's view of a state: the first bytes of each page
    view = page_view(state, attention)
    assert view.shape == attention.shape and view.dtype == attention.dtype and view.stride() == attention.stride()
    view[3].fill_(1.0)
    assert (state[3] != 0).all() and (state[2] == 0).all()
    with pytest.raises(ValueError, match="pages"):
        page_view(pages.view(16, 1, 1, 2048), attention)


def test_a_chunk_size_the_blocks_do_not_divide_serves_the_model_without_the_cache(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's hybrid manager may unify every group's block size past chunk_size (384 for a tiny Granite 4.0-H
    here): the CPU layout copies whole blocks, so the model is served without the cache, never a failed start."""
    from kvmesh.services.engine.adapter.worker_side import WorkerSide

    kv = PagedKV()
    side = WorkerSide(engine_config(chunk_size=40), BLOCK,
                      vllm_config=SimpleNamespace(model_config=SimpleNamespace(model="granite-like")))
    with caplog.at_level("WARNING", logger="kvmesh.connector"):
        side.register_kv_caches(kv.caches)
    assert side.engine is None and side.kv_caches == {}
    assert any("granite-like" in r.message and "not a multiple of block_size 16" in r.message
               for r in caplog.records), caplog.text


STATE_GROUPS = KVGroups((KVGroup(STATE, SW_LAYERS), KVGroup(FULL, FULL_LAYERS)), BLOCK)


def test_each_tensor_parallel_rank_stores_loads_and_pins_its_own_shard_of_the_state_beside_the_chunks() -> None:
    """A state group (layers 0 and 2 as Mamba / GDN layers) on two ranks: each rank stores its chunks (the
    attention layers only) and its shard of the state after each chunk under its own key, a load into other
    blocks restores both, and a pin of the tokens pins the states with the chunks."""
    kv = PagedKV(layers=4, seed=0)
    layout = dataclasses.replace(kv.layout, group_layers=STATE_GROUPS.layers_per_group(),
                                 groups_tag=STATE_GROUPS.tag)
    assert layout.state_block == BLOCK and layout.chunk_format().endswith("/gM2,F2")
    engines = [build_engine(engine_config(), KeyParams("test-model", "", world_size=2, rank=rank), layout)
               for rank in range(2)]
    tokens = list(range(2 * CHUNK))
    num_blocks = len(tokens) // BLOCK
    # vLLM's align mode: the state group holds a page only where a step ended (here after each chunk)
    state_pages = {CHUNK // BLOCK - 1: 40, num_blocks - 1: 41}
    src_tables = [[state_pages.get(i, -1) for i in range(num_blocks)], list(range(10, 10 + num_blocks))]
    dst_tables = [[-1] * (num_blocks - 1) + [45], list(range(20, 20 + num_blocks))]
    try:
        keys = [[span.key for span in engine.hasher.state_spans(engine.hasher.chain(tokens), BLOCK)]
                for engine in engines]
        assert keys[0] != keys[1] and len(keys[0]) == 2, "each rank keys its own shard of each state"
        for rank, engine in enumerate(engines):
            src = PagedKV(layers=4, seed=30 + rank)
            dst = PagedKV(layers=4, seed=40 + rank)
            src_caches = {name: src.caches[name] for name in STATE_GROUPS.layer_order()}
            dst_caches = {name: dst.caches[name] for name in STATE_GROUPS.layer_order()}
            chain = engine.hasher.chain(tokens)
            spans, states = engine.hasher.shard(chain), engine.hasher.state_spans(chain, BLOCK)
            engine.save(spans, src_caches, STATE_GROUPS.chunk_slots(src_tables, len(tokens)))
            for state in states:
                engine.save([state], src_caches, STATE_GROUPS.state_slots(src_tables, state.end))
            chunk_slots = STATE_GROUPS.chunk_slots(dst_tables, len(tokens))
            assert engine.load(spans, chunk_slots).scatter(dst_caches, chunk_slots) == len(spans)
            state_slots = STATE_GROUPS.state_slots(dst_tables, len(tokens))
            assert engine.load([states[-1]], state_slots).scatter(dst_caches, state_slots) == 1
            for name in SW_LAYERS:  # the state after the prompt, in the one block vLLM allocated for it
                assert torch.equal(dst_caches[name][45], src_caches[name][41]), name
            for name in FULL_LAYERS:
                for dst_block, src_block in zip(dst_tables[1], src_tables[1]):
                    assert torch.equal(dst_caches[name][dst_block], src_caches[name][src_block]), name
            assert token_api.pin(engine, tokens) == len(tokens)
            assert all(engine.cpu.is_pinned(span.key) for span in [*spans, *states])
            assert token_api.unpin(engine, tokens) == len(tokens)
            assert not any(engine.cpu.is_pinned(span.key) for span in [*spans, *states])
    finally:
        for engine in engines:
            engine.close()
