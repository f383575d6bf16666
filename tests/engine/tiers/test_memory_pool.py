"""The CPU pool's size classes (services/engine/tiers/memory_pool.py) with the CPU tier over it (cpu.py): a hybrid
model's chunks and states each take a slot of their own size, so the pool holds more of them; eviction makes room
for either class; slots of both classes are lent to the disk store in place; plain layouts are as before."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from kvmesh.services.engine.adapter.kv_groups import FULL, SLIDING, STATE, KVGroup, KVGroups
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core.kv_layout import KVLayout
from kvmesh.services.engine.tiers.cpu import LocalCPUBackend
from kvmesh.services.engine.tiers.memory_pool import MemoryPool, MemoryPoolClosed, Slot, slab_nbytes
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import LOCAL_DISK, ChunkMeta
from kvmesh.shared.wire.keys import KeyParams

from support.engine import PagedKV, engine_config
from support.engine_mesh import PARAMS, disk_mesh  # noqa: F401 (a fixture: NATS + a disk store)
from support.waiting import WAIT_S, wait_until

KiB = 1024
LAYER = "model.layers.{}.self_attn"
# the demo Qwen3-Next-like model (scripts/make_demo_model.py "qwen3next"): 3 GDN layers and 1 full-attention layer,
# 2 KV heads of 64, bf16; vLLM's hybrid manager gives the attention layer 256-token blocks (one page of a layer is
# one GDN state), and KVMesh's chunk is one block
DEMO_BLOCK = DEMO_CHUNK = 256
QWEN3_NEXT_DEMO = KVGroups((KVGroup(STATE, (LAYER.format(0), LAYER.format(1), LAYER.format(2))),
                            KVGroup(FULL, (LAYER.format(3),))), DEMO_BLOCK)


def demo_kv(seed: int = 0) -> tuple[KVLayout, dict[str, torch.Tensor], PagedKV]:
    kv = PagedKV(num_blocks=8, seed=seed, layers=4, heads=2, head_size=64, block_size=DEMO_BLOCK)
    layout = dataclasses.replace(kv.layout, group_layers=QWEN3_NEXT_DEMO.layers_per_group(),
                                 groups_tag=QWEN3_NEXT_DEMO.tag)
    return layout, {name: kv.caches[name] for name in QWEN3_NEXT_DEMO.layer_order()}, kv


def demo_config(**overrides: object) -> object:
    return engine_config(chunk_size=DEMO_CHUNK, **overrides)


def meta(key: bytes, nbytes: int, state: bool = False) -> ChunkMeta:
    return ChunkMeta(key, DEMO_CHUNK, [nbytes // 2], "bfloat16", "state" if state else "chunk", nbytes)


def put(cpu: LocalCPUBackend, key: bytes, state: bool = False) -> Slot:
    slot = cpu.allocate(state)
    assert slot is not None, f"no slot for {key!r}"
    assert cpu.put(meta(key, slot.nbytes, state), slot)
    return slot


def test_the_demo_hybrids_chunk_and_state_each_take_a_slot_of_their_own_size() -> None:
    """Qwen3-Next-like demo: a chunk is 128 KiB, a state 384 KiB. Before, every slot was 384 KiB (a chunk filled a
    third of its slot); now the CPU tier holds a chunk + its state in 512 KiB, not 768 KiB, and the pool three
    times as many chunks. /usage and the lmcache gauges count exactly those bytes."""
    layout, caches, _ = demo_kv()
    chunk_bytes, state_bytes = layout.chunk_nbytes(DEMO_CHUNK), layout.chunk_nbytes(layout.state_block, state=True)
    assert (chunk_bytes, state_bytes) == (128 * KiB, 384 * KiB)
    before_per_object = layout.slot_nbytes(DEMO_CHUNK)  # what every slot was
    assert before_per_object == 384 * KiB
    config = demo_config(max_local_cpu_size=(12 * 384 * KiB + 100) / 1024**3)
    engine = build_engine(config, KeyParams("test-model", ""), layout, use_mesh=False)
    try:
        pool = engine.pool
        assert pool.class_nbytes == (chunk_bytes, state_bytes) and pool.slab_nbytes == 384 * KiB
        assert pool.num_slots == 36 == 3 * (config.max_local_cpu_bytes // before_per_object)  # chunks it holds
        tokens = list(range(2 * DEMO_CHUNK))
        chain = engine.hasher.chain(tokens)
        spans, state = engine.hasher.shard(chain), engine.hasher.state_spans(chain, DEMO_BLOCK)[-1]
        tables = [[-1, 5], [0, 1]]  # the state after the prompt in block 5, the chunks' pages in blocks 0 and 1
        engine.save(spans, caches, QWEN3_NEXT_DEMO.chunk_slots(tables, len(tokens)))
        engine.save([state], caches, QWEN3_NEXT_DEMO.state_slots(tables, state.end))
        held = 2 * chunk_bytes + state_bytes
        assert engine.cpu.used_bytes == pool.held_bytes == held == 640 * KiB  # 3 * 384 KiB before
        assert engine.cpu.usage().used_bytes == engine.usage().cpu_bytes == held
        for span, nbytes in ((spans[0], chunk_bytes), (spans[1], chunk_bytes), (state, state_bytes)):
            ref = engine.cpu.acquire(span.key)
            assert ref is not None and ref.slot.nbytes == ref.meta.nbytes == nbytes
            ref.release()
        assert pool.num_free == 36 - 3 - 2  # two chunks in one slab (room for one more), the state a slab of its own
    finally:
        engine.close()


def test_plain_and_sliding_window_layouts_keep_one_slot_per_chunk() -> None:
    """No state layers: one size class, every slot one chunk, exactly as before."""
    kv = PagedKV(layers=4)
    windowed = dataclasses.replace(kv.layout, group_layers=(2, 2), groups_tag=KVGroups(
        (KVGroup(SLIDING, (LAYER.format(0), LAYER.format(2)), 32), KVGroup(FULL, (LAYER.format(1), LAYER.format(3)))),
        16).tag)
    for layout in (kv.layout, windowed):
        chunk = layout.chunk_nbytes(engine_config().chunk_size)
        config = engine_config(max_local_cpu_size=(5 * chunk + 100) / 1024**3)
        engine = build_engine(config, KeyParams("test-model", ""), layout, use_mesh=False)
        try:
            pool = engine.pool
            assert pool.class_nbytes == (chunk,) and pool.slot_nbytes == pool.slab_nbytes == chunk
            assert pool.parts_per_slab == (1,) and pool.num_slots == pool.num_slabs == 5
            slots = [engine.cpu.allocate() for _ in range(5)]
            assert all(slot is not None and slot.nbytes == chunk for slot in slots)
            assert [slot.offset for slot in slots if slot] == [i * chunk for i in range(5)]
            assert engine.cpu.allocate() is None and pool.held_bytes == 5 * chunk
            for slot in slots:
                assert slot is not None
                slot.release()
            assert pool.num_free == 5 and pool.held_bytes == 0
        finally:
            engine.close()


def test_a_slab_fits_both_classes_with_the_least_waste() -> None:
    """Sizes of 2 and 3 pages share 6-page slabs (3 chunks or 2 states, nothing wasted), 1 and 3 pages 3-page
    slabs; one size is its own slab. A pool too small for the common multiple takes the slab that wastes least in
    it (3 pages, one of either, rather than no slab at all)."""
    page = 4096
    assert slab_nbytes((2 * page, 3 * page), 60 * page) == 6 * page
    assert slab_nbytes((page, 3 * page), 60 * page) == 3 * page
    assert slab_nbytes((5 * page,), 60 * page) == 5 * page
    assert slab_nbytes((256 * KiB, 768 * KiB), 2**30) == 768 * KiB  # the Mamba2-like demo: 3 chunks or a state
    assert slab_nbytes((2 * page, 3 * page), 4 * page) == 3 * page
    pool = MemoryPool(12 * page, 2 * page, use_shm=False, state_nbytes=3 * page)
    assert pool.parts_per_slab == (3, 2) and pool.num_slabs == 2 and pool.num_slots == 6
    states = [pool.allocate(state=True) for _ in range(4)]
    assert all(slot is not None and slot.nbytes == 3 * page for slot in states) and pool.allocate() is None
    assert sorted(slot.offset for slot in states if slot) == [0, 3 * page, 6 * page, 9 * page]
    for slot in states:
        assert slot is not None
        slot.release()
    chunks = [pool.allocate() for _ in range(6)]
    assert all(slot is not None and slot.nbytes == 2 * page for slot in chunks) and pool.allocate(True) is None
    for slot in chunks:
        assert slot is not None
        slot.release()
    assert pool.held_bytes == 0 and pool.num_free == 6


def test_eviction_makes_room_for_either_class_freeing_whole_slabs_for_the_other() -> None:
    """Two 384 KiB slabs full of six chunks: a state evicts the coldest chunk's slab (its three chunks, not the
    coldest chunk of each slab); a chunk then evicts the coldest chunk alone; a state never evicts a slab with a
    pinned chunk, and a chunk makes room by evicting a state (its whole slab)."""
    layout, _, _ = demo_kv()
    pool = MemoryPool(2 * 384 * KiB, layout.chunk_nbytes(DEMO_CHUNK), use_shm=False,
                      state_nbytes=layout.chunk_nbytes(layout.state_block, state=True))
    cpu = LocalCPUBackend(pool)
    try:
        keys = [bytes([i]) * 16 for i in range(6)]
        for key in keys:
            put(cpu, key)
        assert cpu.used_bytes == 6 * 128 * KiB and pool.num_free == 0
        cpu.touch_keys([keys[0], keys[1], keys[2]])  # the first slab's chunks are now the hot ones
        put(cpu, b"s" * 16, state=True)
        assert cpu.evictions == 3 and [key in cpu for key in keys] == [True] * 3 + [False] * 3
        assert cpu.used_bytes == pool.held_bytes == 3 * 128 * KiB + 384 * KiB
        put(cpu, b"c" * 16)  # the coldest is keys[0]: a chunk, so it goes alone
        assert cpu.evictions == 4 and keys[0] not in cpu and keys[1] in cpu and b"s" * 16 in cpu
        # a pinned chunk keeps its slab from going to a state: the state (of the other slab) goes instead
        cpu.touch_keys([b"s" * 16])
        assert cpu.prefix([keys[1]]) == 1
        assert asyncio.run(cpu.pin([keys[1]])) == DEMO_CHUNK
        put(cpu, b"t" * 16, state=True)
        assert b"s" * 16 not in cpu and keys[1] in cpu and b"c" * 16 in cpu and keys[2] in cpu
        assert cpu.used_bytes == pool.held_bytes == 3 * 128 * KiB + 384 * KiB
        # a chunk with every chunk slot held and pinned/busy: the state's slab goes whole
        busy = cpu.acquire(keys[2])
        assert busy is not None
        assert asyncio.run(cpu.pin([b"c" * 16])) == DEMO_CHUNK
        put(cpu, b"d" * 16)
        assert b"t" * 16 not in cpu and cpu.used_bytes == 4 * 128 * KiB
        busy.release()
    finally:
        cpu.close()
        pool.close()
    assert pool.held_bytes == 0


def test_slots_of_both_classes_are_lent_to_the_disk_store_and_read_back_in_place(disk_mesh: LocalMesh,  # noqa: F811
                                                                               tmp_path: Path) -> None:
    """The demo hybrid on the mesh with a disk store: its chunks and state go down from their own slots through
    the lent pool, and come back (fetched into fresh slots of their own size, in place) to load into other
    blocks whole."""
    layout, caches, kv = demo_kv(seed=1)
    _, dst_caches, _ = demo_kv(seed=2)
    engine = build_engine(demo_config(nats_url=disk_mesh.nats_url, local_disk=str(tmp_path / "disk")), PARAMS,
                          layout)
    try:
        assert engine.wait_connected(WAIT_S)
        wait_until(lambda: engine.storage.lower(LOCAL_DISK), what="the disk store found")
        disk = engine.storage.lower(LOCAL_DISK)
        assert disk is not None and engine.nats_loop is not None and engine.pool.segment is not None
        tokens = list(range(2 * DEMO_CHUNK))
        chain = engine.hasher.chain(tokens)
        spans, state = engine.hasher.shard(chain), engine.hasher.state_spans(chain, DEMO_BLOCK)[-1]
        src_tables, dst_tables = [[-1, 5], [0, 1]], [[-1, 6], [2, 3]]
        engine.save(spans, caches, QWEN3_NEXT_DEMO.chunk_slots(src_tables, len(tokens)))
        engine.save([state], caches, QWEN3_NEXT_DEMO.state_slots(src_tables, state.end))
        assert engine.wait_write_behind(WAIT_S)
        assert engine.nats_loop.call(disk.wait_written(WAIT_S), WAIT_S + 2, default=False)
        for span in (*spans, state):
            engine.cpu.remove(span.key)
        assert engine.pool.held_bytes == 0
        chunk_slots = QWEN3_NEXT_DEMO.chunk_slots(dst_tables, len(tokens))
        fetched = engine.load(spans, chunk_slots, fetch=True)
        assert fetched is not None and fetched.scatter(dst_caches, chunk_slots) == 2
        state_slots = QWEN3_NEXT_DEMO.state_slots(dst_tables, state.end)
        fetched = engine.load([state], state_slots, fetch=True)
        assert fetched is not None and fetched.scatter(dst_caches, state_slots) == 1
        for name in (LAYER.format(0), LAYER.format(1), LAYER.format(2)):
            assert torch.equal(dst_caches[name][6], caches[name][5]), name
        for dst, src in ((2, 0), (3, 1)):
            assert torch.equal(dst_caches[LAYER.format(3)][dst], caches[LAYER.format(3)][src])
        assert engine.storage.stats["fetched_LocalDiskBackend"] == 3 and engine.storage.stats["fetch_bad_meta"] == 0
        # back in the CPU tier, each in a slot of its size
        assert engine.cpu.used_bytes == engine.pool.held_bytes == 2 * 128 * KiB + 384 * KiB
        del kv
    finally:
        engine.close()


def test_a_pool_is_unmapped_only_once_the_threads_working_in_it_are_done() -> None:
    """A seal or an open runs on a worker thread that cancelling its caller does not stop (tiers/sealed.py): a
    stopping engine's close waits for it before the shared memory goes, instead of pulling it from under the
    thread (a segfault)."""
    pool = MemoryPool(4 * 4096, 4096, use_shm=True)
    assert pool.segment is not None
    inside, leave = threading.Event(), threading.Event()

    def sealing() -> None:
        with pool.in_use():
            inside.set()
            leave.wait(WAIT_S)

    worker = threading.Thread(target=sealing)
    worker.start()
    assert inside.wait(WAIT_S)
    closer = threading.Thread(target=pool.close)
    closer.start()
    wait_until(lambda: pool._closed, what="close to begin")
    closer.join(0.5)  # time for an unwaiting close to unmap: it waits instead (this can only pass by waiting)
    assert closer.is_alive() and pool.segment is not None, "still mapped while the thread works in it"
    leave.set()
    worker.join(WAIT_S)
    closer.join(WAIT_S)
    assert not closer.is_alive() and pool.segment is None
    with pytest.raises(MemoryPoolClosed):
        with pool.in_use():
            pass


def test_a_slot_viewed_again_in_the_same_shape_gives_its_bytes_without_new_views() -> None:
    """A slot holds objects of one shape again and again (each step's save): its view is made once, and a view of
    another dtype or shape is of the same leading bytes."""
    pool = MemoryPool(4 * 4096, 4096, use_shm=False)
    try:
        slot = pool.allocate()
        assert slot is not None
        first = slot.view(torch.float32, [4, 8])
        first.copy_(torch.arange(32, dtype=torch.float32).view(4, 8))
        assert slot.view(torch.float32, (4, 8)) is first
        other = slot.view(torch.int32, (2, 16))
        assert other.shape == (2, 16) and other.dtype == torch.int32
        assert torch.equal(other.view(torch.float32).view(-1), torch.arange(32, dtype=torch.float32))
        half = slot.view(torch.float32, (16,))
        assert torch.equal(half, torch.arange(16, dtype=torch.float32))
        assert slot.view(torch.float32, (4, 8)).data_ptr() == slot.tensor.data_ptr()
    finally:
        pool.close()
