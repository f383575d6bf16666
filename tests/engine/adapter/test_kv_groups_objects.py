"""What a hybrid model's stored objects hold (issue 38): a chunk only its attention (full / sliding) layers' pages, a
state only its state layers' pages, the meta naming which it is; objects of the layout before (every layer in
both, no kind) are misses, counted as bad meta; a plain model's chunks keep their format and bytes.

The caches are vLLM's CPU layout (support.engine.PagedKV), grouped as vLLM groups a Qwen3-Next-like model: three
Gated DeltaNet (state) layers and one full-attention layer per four, every layer's page the same size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import torch

from kvmesh.services.engine.adapter.kv_groups import FULL, SLIDING, STATE, KVGroup, KVGroups
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core.kv_layout import KVLayout
from kvmesh.services.engine.tiers.base import ChunkBuffer
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import LOCAL_DISK, ChunkMeta
from kvmesh.shared.wire import chunk_file
from kvmesh.shared.wire.keys import KEY_BYTES, KeyParams, state_key

from support.engine import BLOCK, CHUNK, HEAD_SIZE, HEADS, PagedKV, engine_config
from support.engine_mesh import PARAMS, disk_mesh  # noqa: F401 (a fixture: NATS + a disk store)
from support.waiting import WAIT_S, wait_until

LAYER = "model.layers.{}.self_attn"
GDN_LAYERS = (LAYER.format(0), LAYER.format(1), LAYER.format(2))
FULL_LAYERS = (LAYER.format(3),)
QWEN3_NEXT_LIKE = KVGroups((KVGroup(STATE, GDN_LAYERS), KVGroup(FULL, FULL_LAYERS)), BLOCK)
PAGE_BYTES = HEADS * BLOCK * 2 * HEAD_SIZE * 2  # one block of one layer, bf16 K and V


def grouped(kv: PagedKV, groups: KVGroups) -> tuple[KVLayout, dict[str, torch.Tensor]]:
    """The layout of `kv` with vLLM's groups, and its layers in chunk order (group by group)."""
    layout = dataclasses.replace(kv.layout, group_layers=groups.layers_per_group(), groups_tag=groups.tag)
    return layout, {name: kv.caches[name] for name in groups.layer_order()}


def test_a_plain_models_chunks_keep_their_format_and_bytes() -> None:
    """One full-attention group, and a sliding-window + full model (no state): every layer in every chunk, the
    meta exactly as before (the fmt names no kind, the pool slot is one chunk)."""
    kv = PagedKV(layers=4)
    plain = kv.layout
    whole = 4 * (CHUNK // BLOCK) * PAGE_BYTES
    assert plain.chunk_shape(CHUNK) == (4, CHUNK // BLOCK, HEADS, BLOCK, 2 * HEAD_SIZE)
    assert plain.chunk_nbytes(CHUNK) == plain.slot_nbytes(CHUNK) == whole
    assert plain.object_format() == plain.chunk_format() == "bfloat16/LBHNC-16"
    assert plain.state_block == 0
    assert [field.name for field in dataclasses.fields(ChunkMeta)] == \
        ["key", "num_tokens", "shape", "dtype", "fmt", "nbytes", "checksum"]
    gemma_like = KVGroups((KVGroup(SLIDING, (LAYER.format(0), LAYER.format(2)), 2 * BLOCK),
                           KVGroup(FULL, (LAYER.format(1), LAYER.format(3)))), BLOCK)
    windowed, _ = grouped(kv, gemma_like)
    assert windowed.chunk_nbytes(CHUNK) == windowed.slot_nbytes(CHUNK) == whole
    assert windowed.object_format() == windowed.chunk_format() == "bfloat16/LBHNC-16/gS2w32+0,F2"
    for layout in (plain, windowed):
        engine = build_engine(engine_config(), KeyParams("test-model", ""), layout, use_mesh=False)
        try:
            span = engine.hasher.spans(list(range(CHUNK)))[0]
            assert engine._chunk_meta(span) == ChunkMeta(span.key, CHUNK, [4, CHUNK // BLOCK, HEADS, BLOCK,
                                                                           2 * HEAD_SIZE], "bfloat16",
                                                         layout.chunk_format(), whole)
            assert engine.pool.slot_nbytes == whole
            assert (engine.usage().chunk_bytes, engine.usage().state_bytes) == (whole, 0)  # lmcache:*_bytes
        finally:
            engine.close()


def test_a_hybrid_chunk_holds_only_its_attention_pages_and_a_state_only_its_state_pages() -> None:
    """Qwen3-Next-like (3 GDN + 1 full attention): a chunk is the full-attention layer's pages of its blocks, a
    state the three GDN layers' one page each, in the CPU tier exactly those bytes; and they load back."""
    src, dst = PagedKV(layers=4, seed=1), PagedKV(layers=4, seed=2)
    layout, src_caches = grouped(src, QWEN3_NEXT_LIKE)
    _, dst_caches = grouped(dst, QWEN3_NEXT_LIKE)
    assert layout.chunk_nbytes(CHUNK) == 1 * (CHUNK // BLOCK) * PAGE_BYTES
    assert layout.chunk_nbytes(BLOCK, state=True) == 3 * PAGE_BYTES
    assert layout.slot_nbytes(CHUNK) == 3 * PAGE_BYTES  # a state outweighs a chunk here: a slot holds either
    assert layout.object_format() == layout.chunk_format() + ";chunk"
    assert layout.object_format(state=True) == layout.chunk_format() + ";state"
    tokens = list(range(2 * CHUNK))
    blocks = len(tokens) // BLOCK
    src_tables = [[-1] * (blocks - 1) + [40], list(range(10, 10 + blocks))]  # the state after the prompt: 40
    dst_tables = [[-1] * (blocks - 1) + [45], list(range(20, 20 + blocks))]
    engine = build_engine(engine_config(), KeyParams("test-model", ""), layout, use_mesh=False)
    try:
        chain = engine.hasher.chain(tokens)
        spans, state = engine.hasher.shard(chain), engine.hasher.state_spans(chain, BLOCK)[-1]
        engine.save(spans, src_caches, QWEN3_NEXT_LIKE.chunk_slots(src_tables, len(tokens)))
        engine.save([state], src_caches, QWEN3_NEXT_LIKE.state_slots(src_tables, state.end))
        for span, nbytes, fmt in [*((s, layout.chunk_nbytes(CHUNK), ";chunk") for s in spans),
                                  (state, 3 * PAGE_BYTES, ";state")]:
            ref = engine.cpu.acquire(span.key)
            assert ref is not None
            try:
                assert ref.meta.nbytes == nbytes and math.prod(ref.meta.shape) * 2 == nbytes
                assert ref.meta.fmt.endswith(fmt)
            finally:
                ref.release()
        chunk_slots = QWEN3_NEXT_LIKE.chunk_slots(dst_tables, len(tokens))
        assert engine.load(spans, chunk_slots).scatter(dst_caches, chunk_slots) == len(spans)
        state_slots = QWEN3_NEXT_LIKE.state_slots(dst_tables, len(tokens))
        assert engine.load([state], state_slots).scatter(dst_caches, state_slots) == 1
        for name in GDN_LAYERS:
            assert torch.equal(dst_caches[name][45], src_caches[name][40]), name
        for dst_block, src_block in zip(dst_tables[1], src_tables[1]):
            assert torch.equal(dst_caches[FULL_LAYERS[0]][dst_block], src_caches[FULL_LAYERS[0]][src_block])
        assert engine.storage.stats["cpu_bad_meta"] == 0
        assert (engine.usage().chunk_bytes, engine.usage().state_bytes) == (2 * PAGE_BYTES, 3 * PAGE_BYTES)
    finally:
        engine.close()


def old_layout_meta(layout: KVLayout, key: bytes, num_tokens: int, data: bytes) -> ChunkMeta:
    """The meta the layout before the split gave every object of a state model: all layers, the chunk format."""
    shape = [layout.num_layers, -(-num_tokens // BLOCK), HEADS, BLOCK, 2 * HEAD_SIZE]
    return ChunkMeta(key, num_tokens, shape, "bfloat16", layout.chunk_format(), math.prod(shape) * 2,
                     chunk_file.checksum(data))


# one Mamba2 layer per three attention layers: an old state (every layer's page) outsizes a state's slot
MAMBA_ONE_IN_FOUR = KVGroups((KVGroup(STATE, (LAYER.format(0),)),
                              KVGroup(FULL, (LAYER.format(1), LAYER.format(2), LAYER.format(3)))), BLOCK)


def test_objects_of_the_old_layout_are_never_asked_and_refused_when_paired(disk_mesh: LocalMesh,
                                                                          tmp_path: Path) -> None:
    """A state model's keys differ from those the layout before the split stored its objects under (every layer,
    no kind), so those are never asked. An old chunk and state paired with this engine's spans anyway: from the CPU
    tier each is a miss counted as bad meta; from the disk store each (larger than its kind's slot now: a state's
    slot is one page here) a miss the store answers without writing; nothing lands in vLLM's blocks. A state of
    the new layout only in the disk store is found by the lookup (as a state) and loads."""
    kv = PagedKV(layers=4, seed=3)
    layout, caches = grouped(kv, MAMBA_ONE_IN_FOUR)
    before_split = f"kvmesh/1|{PARAMS.model}|{layout.chunk_format()}|1|0".encode()
    assert KeyParams(PARAMS.model, layout.chunk_format()).root() != \
        hashlib.blake2b(before_split, digest_size=KEY_BYTES).digest()
    assert KeyParams(PARAMS.model, kv.layout.chunk_format()).root() == \
        hashlib.blake2b(f"kvmesh/1|{PARAMS.model}|{kv.layout.chunk_format()}|1|0".encode(),
                        digest_size=KEY_BYTES).digest(), "a plain model's keys changed"
    tokens = list(range(CHUNK))
    tables = [[-1, 46], [20, 21]]
    engine = build_engine(engine_config(nats_url=disk_mesh.nats_url, local_disk=str(tmp_path / "disk")), PARAMS,
                          layout)
    try:
        assert engine.wait_connected(WAIT_S)
        wait_until(lambda: engine.storage.lower(LOCAL_DISK), what="the disk store found")
        disk = engine.storage.lower(LOCAL_DISK)
        assert disk is not None and engine.nats_loop is not None
        chain = engine.hasher.chain(tokens)
        chunk, state = engine.hasher.shard(chain)[0], engine.hasher.state_spans(chain, BLOCK)[0]
        chunk_slots = MAMBA_ONE_IN_FOUR.chunk_slots(tables, CHUNK)
        state_slots = MAMBA_ONE_IN_FOUR.state_slots(tables, CHUNK)
        before = kv.buffer.clone()
        # in the CPU tier
        for span in (chunk, state):
            slot = engine.cpu.allocate()
            assert slot is not None
            assert engine.cpu.put(old_layout_meta(layout, span.key, span.num_tokens, b""), slot)
        for span, slots in ((chunk, chunk_slots), (state, state_slots)):
            counted = engine.storage.stats["cpu_bad_meta"]
            assert engine.load([span], slots).scatter(caches, slots) == 0
            assert engine.storage.stats["cpu_bad_meta"] > counted, "an old-layout object was not counted"
        cpu_refusals = engine.storage.stats["cpu_bad_meta"]
        for key in (chunk.key, state.key):
            engine.cpu.remove(key)
        # in the disk store
        for span in (chunk, state):
            data = bytes(old_layout_meta(layout, span.key, span.num_tokens, b"").nbytes)
            meta = old_layout_meta(layout, span.key, span.num_tokens, data)
            assert engine.nats_loop.call(disk.put(meta, ChunkBuffer(memoryview(data))), WAIT_S, default=False)
        assert engine.nats_loop.call(disk.wait_written(WAIT_S), WAIT_S + 2, default=False)
        for span, slots in ((chunk, chunk_slots), (state, state_slots)):
            fetched = engine.load([span], fetch=True)
            assert fetched is not None
            assert fetched.scatter(caches, slots) == 0
        assert engine.storage.stats["fetch_bad_meta"] == 0  # neither left the store: each outsizes its slot
        assert torch.equal(kv.buffer, before), "an old-layout object was written into vLLM's blocks"
        # a state of this layout, only in the disk store: the lookup of it (as a state) finds it, and it loads
        other = engine.hasher.chain(list(range(1, CHUNK + 1)))
        new_state = engine.hasher.state_spans(other, BLOCK)[0]
        engine.save([new_state], caches, MAMBA_ONE_IN_FOUR.state_slots([[-1, 40], [10, 11]], CHUNK))
        assert engine.wait_write_behind(WAIT_S)
        assert engine.nats_loop.call(disk.wait_written(WAIT_S), WAIT_S + 2, default=False)
        engine.cpu.remove(new_state.key)
        looked_up = engine.chunk_spans([state_key(other[0].key)], BLOCK, state=True)
        assert looked_up[0].key == new_state.key and looked_up[0].state
        assert engine.nats_loop.call(engine.lookup_and_prefetch(looked_up), WAIT_S, default=0) == BLOCK
        fetched = engine.load([new_state], fetch=True)
        assert fetched is not None and fetched.scatter(caches, state_slots) == 1
        assert torch.equal(caches[LAYER.format(0)][46], caches[LAYER.format(0)][40])
        assert engine.storage.stats["fetch_bad_meta"] == 0 and engine.storage.stats["cpu_bad_meta"] == cpu_refusals
    finally:
        engine.close()


def test_the_start_up_line_names_each_groups_bytes_per_chunk_and_per_state() -> None:
    layout, _ = grouped(PagedKV(layers=4), QWEN3_NEXT_LIKE)
    line = QWEN3_NEXT_LIKE.describe(layout.chunk_nbytes(CHUNK), layout.chunk_nbytes(BLOCK, state=True))
    mib = PAGE_BYTES / 2**20
    assert line == (f"chunk {2 * mib:.2f} MiB, state after each chunk {3 * mib:.2f} MiB: state x3 {3 * mib:.2f} "
                    f"MiB per state, full x1 {2 * mib:.2f} MiB per chunk")
