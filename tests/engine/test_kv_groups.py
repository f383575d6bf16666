"""vLLM's KV cache groups (its hybrid KV cache manager): chunks hold every group's KV, each group copied through
its own block table, and a load never writes a block vLLM did not allocate for the group (adapter/kv_groups.py).

The caches are vLLM's CPU layout (support.engine.PagedKV); the groups are those vLLM makes for a mixed model
such as Gemma 2/3: sliding-window layers (0, 2) and full-attention layers (1, 3), each group with its own blocks.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kvmesh.services.engine.adapter.kv_groups import FULL, SLIDING, KVGroup, KVGroups, slot_rows
from kvmesh.services.engine.adapter.request_meta import LoadSpec, ReqMeta, SaveSpec
from kvmesh.services.engine.adapter.scheduler_side import SchedulerSide

from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.keys import KeyParams

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
    engine.store_chunks(spans, src_caches, slot_rows(src_tables, len(tokens), BLOCK, -1))
    assert engine.retrieve_chunks(spans, dst_caches, slot_rows(dst_tables, len(tokens), BLOCK, -1)) == len(spans)
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


def test_each_tensor_parallel_rank_stores_and_loads_its_own_shard_of_every_group() -> None:
    layout = grouped_kv(seed=0)[0].layout
    engines = [CacheEngine(engine_config(), KeyParams("test-model", "", world_size=2, rank=rank), layout)
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
    side.bind_block_tables(manager)
    tracker = SimpleNamespace(req_id="r")
    got, save = side._group_tables(tracker, SaveSpec(end=6 * BLOCK, mask_start=0))  # type: ignore[arg-type]
    assert got == tables["r"]
    assert save == SaveSpec(end=6 * BLOCK, mask_start=CHUNK)
    # a prompt whose every chunk lost its window is not stored at all
    tables["r"] = [[-1, -1, -1, -1, 9, 10], [1, 2, 3, 4, 5, 6]]
    assert side._group_tables(tracker, SaveSpec(end=4 * BLOCK, mask_start=0))[1] is None  # type: ignore[arg-type]


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
        side._load(req)  # nothing stored under those keys: the load fails
    assert side.get_block_ids_with_load_errors() == set()
    assert side.take_failed_recving() == {"r"}
    assert side.take_failed_recving() == set()


@pytest.mark.parametrize("kind", ["MambaSpec"])
def test_a_group_kind_kvmesh_does_not_cache_leaves_the_model_uncached_with_its_name(kind: str) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    mamba = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.linear_attn"], mamba), KVCacheGroupSpec(["model.layers.1.attn"], full)])
    groups, why = KVGroups.of(config)
    assert groups is None and why is not None and kind in why and "model.layers.0.linear_attn" in why
