"""Never the wrong KV, below vLLM: real cache engines, a real NATS, a real controller and disk store.

* Chunks stored with a LoRA adapter or a cache_salt are found, loaded and pinned only with them.
* The controller's /lookup, /pin and /unpin take `cache_salt` and `lora_name` (LMCache's JSON stays valid).
* Tensor parallel: each rank keys and stores its own shard; the controller lists the instance once, and only
  where every rank holds the chunk.
* MLA (one latent KV replicated on every rank): one key for all ranks, the shared tier holds one copy (rank 0
  writes it) and every rank loads it.
* The connector's decision for models whose KV cache it cannot copy whole (vLLM's own spec classes).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest
import torch

from kvmesh.services.controller.config import ControllerConfig
from kvmesh.services.controller.service import ControllerService
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.core.kv_layout import detect_layout
from kvmesh.shared.messaging.embedded_nats import EmbeddedNats
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK
from kvmesh.shared.wire.keys import KeyExtras, KeyParams

from support.engine import CHUNK, PagedKV, disk_store_mesh, engine_config, random_tokens
from support.waiting import WAIT_S, wait_until, wait_until_async

PARAMS = KeyParams(model="test-model", kv_format="")
LORA_A = KeyExtras(lora_id="files:aaaa")
LORA_B = KeyExtras(lora_id="files:bbbb")


@pytest.fixture
def kv() -> PagedKV:
    return PagedKV(num_blocks=128)


# ---- the engine alone ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stored, other", [(LORA_A, LORA_B), (KeyExtras(cache_salt="s1"), KeyExtras(cache_salt="s2")),
                                           (LORA_A, None)])
def test_chunks_with_extras_load_only_with_the_same_extras(kv: PagedKV, stored: KeyExtras,
                                                          other: KeyExtras | None) -> None:
    engine = build_engine(engine_config(), PARAMS, kv.layout, use_mesh=False)
    try:
        tokens, slots = random_tokens(100, seed=1), kv.slots(100)
        token_api.store(engine, tokens, **kv.kv(slots), extras=stored)
        assert token_api.lookup(engine, tokens, extras=stored) == 100
        assert token_api.lookup(engine, tokens, extras=other) == 0
        if other is not None:
            assert token_api.lookup(engine, tokens) == 0, "a plain request never sees chunks keyed with extras"

        target = PagedKV(num_blocks=128, seed=7)
        target_slots = target.slots(100)
        before = target.buffer.clone()
        assert not token_api.retrieve(engine, tokens, **target.kv(target_slots), extras=other).any()
        assert torch.equal(target.buffer, before), "a miss writes nothing"
        assert token_api.retrieve(engine, tokens, **target.kv(target_slots), extras=stored).all()
        assert torch.equal(target.token_kv(target_slots), kv.token_kv(slots))
    finally:
        engine.close()


# ---- the controller with a real engine -----------------------------------------------------------------------
@contextlib.asynccontextmanager
async def controller_on(nats_url: str) -> AsyncIterator[httpx.AsyncClient]:
    config = ControllerConfig(host="127.0.0.1", port=0, nats_url=nats_url, controller_id="controller-test",
                              command_timeout_s=WAIT_S, tick_interval_s=0.05)
    service = await ControllerService(config).start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=2 * WAIT_S) as client:
            yield client
    finally:
        await service.stop()


async def test_controller_lookup_and_pin_take_cache_salt_and_lora_name(nats_server: EmbeddedNats,
                                                                       kv: PagedKV) -> None:
    engine = await asyncio.to_thread(lambda: build_engine(engine_config(nats_url=nats_server.url,
                                                                       lmcache_instance_id="tenant"), PARAMS,
                                                          kv.layout))
    try:
        assert await asyncio.to_thread(engine.wait_connected, WAIT_S)
        async with controller_on(nats_server.url) as client:
            engine.note_lora("sql", LORA_A.lora_id)  # a request used adapter "sql": registered again
            tokens = random_tokens(3 * CHUNK, seed=3)
            token_list = tokens.tolist()
            extras = KeyExtras(lora_id=LORA_A.lora_id, cache_salt="s1")
            await asyncio.to_thread(token_api.store, engine, tokens, **kv.kv(kv.slots(len(tokens))), extras=extras)

            async def lookup(**fields: str) -> dict[str, Any]:
                response = await client.post("/lookup", json={"tokens": token_list, **fields})
                assert response.status_code == 200, response.text
                return response.json()["layout_info"]

            async def listed() -> bool:
                return await lookup(cache_salt="s1", lora_name="sql") == {"tenant": [LOCAL_CPU, len(tokens)]}

            await wait_until_async(listed, what="/lookup with the salt and the adapter to list the instance")
            assert await lookup() == {}, "without them: nothing (LMCache's JSON still works)"
            assert await lookup(cache_salt="s1") == {} and await lookup(lora_name="sql") == {}
            assert await lookup(cache_salt="s2", lora_name="sql") == {}
            assert await lookup(cache_salt="s1", lora_name="never-served") == {}

            body = {"tokens": token_list, "instance_id": "tenant", "location": LOCAL_CPU}
            plain = await client.post("/pin", json=body)
            assert plain.status_code == 200 and plain.json()["num_tokens"] == 0
            pinned = await client.post("/pin", json={**body, "cache_salt": "s1", "lora_name": "sql"})
            assert pinned.status_code == 200 and pinned.json()["num_tokens"] == len(tokens), pinned.text
            unknown = await client.post("/pin", json={**body, "lora_name": "never-served"})
            assert unknown.status_code == 404 and "never-served" in unknown.json()["detail"]
            unpinned = await client.post("/unpin", json={**body, "cache_salt": "s1", "lora_name": "sql"})
            assert unpinned.status_code == 200 and unpinned.json()["num_tokens"] == len(tokens)
            bad = await client.post("/lookup", json={"tokens": token_list, "cache_salt": ""})
            assert bad.status_code == 422
    finally:
        await asyncio.to_thread(engine.close)


# ---- tensor parallel and MLA: two real ranks -------------------------------------------------------------------
@pytest.fixture
def disk_mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    with disk_store_mesh(tmp_path / "disk") as mesh:
        yield mesh


def rank_engine(url: str | None, layout: Any, rank: int, world_size: int = 2, **overrides: object) -> CacheEngine:
    config = engine_config(nats_url=url, lmcache_instance_id="tp", **overrides) if url else engine_config(**overrides)
    engine = build_engine(config, KeyParams("test-model", "", world_size, rank), layout, use_mesh=url is not None)
    if url:
        assert engine.wait_connected(WAIT_S)
    return engine


async def test_tensor_parallel_ranks_keep_their_own_shards_and_are_listed_once(nats_server: EmbeddedNats) -> None:
    shards = [PagedKV(num_blocks=128, seed=rank) for rank in range(2)]  # each rank: its own heads' KV
    engines = await asyncio.gather(*(asyncio.to_thread(rank_engine, nats_server.url, shards[r].layout, r)
                                     for r in range(2)))
    try:
        assert [e.worker_id.partition("@")[0] for e in engines] == ["tp.r0", "tp.r1"]
        tokens = random_tokens(2 * CHUNK, seed=4)
        slots = [shard.slots(len(tokens)) for shard in shards]
        assert engines[0].hasher.keys(tokens) != engines[1].hasher.keys(tokens), "every rank keys its own shard"
        async with controller_on(nats_server.url) as client:
            async def layout() -> dict[str, Any]:
                return (await client.post("/lookup", json={"tokens": tokens.tolist()})).json()["layout_info"]

            await asyncio.to_thread(token_api.store, engines[0], tokens, **shards[0].kv(slots[0]))
            await asyncio.to_thread(engines[0].wait_write_behind)

            async def rank0_known() -> bool:
                instances = (await client.get("/instances")).json()
                return bool(instances) and await layout() == {}

            await wait_until_async(rank0_known, what="both ranks registered, rank 0 holding alone")
            await asyncio.to_thread(token_api.store, engines[1], tokens, **shards[1].kv(slots[1]))

            async def listed_once() -> bool:
                return await layout() == {"tp": [LOCAL_CPU, len(tokens)]}

            await wait_until_async(listed_once, what="the instance listed once, when both ranks hold the chunks")
        # each rank loads its own shard, bit for bit
        for rank, engine in enumerate(engines):
            target = PagedKV(num_blocks=128, seed=10 + rank)
            target_slots = target.slots(len(tokens))
            assert token_api.retrieve(engine, tokens, **target.kv(target_slots)).all()
            assert torch.equal(target.token_kv(target_slots), shards[rank].token_kv(slots[rank]))
    finally:
        for engine in engines:
            await asyncio.to_thread(engine.close)


def mla_caches(seed: int, layers: int = 2, num_blocks: int = 64, block_size: int = 16, dim: int = 96) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn": torch.randn(num_blocks, 1, block_size, dim, generator=generator)
            for i in range(layers)}


def test_mla_is_keyed_once_for_all_ranks_and_stored_once(disk_mesh: LocalMesh, tmp_path: Path) -> None:
    caches = [mla_caches(seed=0), mla_caches(seed=0)]  # replicated: both ranks hold the same latent KV
    layout = detect_layout(caches[0], 16, "CPU_MLA")
    assert layout.replicated_across_ranks
    engines = [rank_engine(str(disk_mesh.nats_url), layout, r, local_disk=str(tmp_path / "disk"))
               for r in range(2)]
    try:
        wait_until(lambda: all(e.storage.lower(LOCAL_DISK) is not None for e in engines), what="disk store clients")
        assert engines[0].hasher.keys(list(range(40))) == engines[1].hasher.keys(list(range(40)))
        worker_ids = [e.worker_id.partition("@")[0] for e in engines]  # (each ends in its process's tag)
        assert worker_ids == ["tp.r0", "tp.r1"], "still two workers of one instance"
        tokens = random_tokens(2 * CHUNK, seed=5)
        slots = torch.arange(len(tokens))
        for engine, cache in zip(engines, caches):
            token_api.store(engine, tokens, kv_caches=cache, slot_mapping=slots)
        for engine in engines:
            assert engine.wait_write_behind(WAIT_S)
        assert engines[0].storage.stats["write_behind_done"] == 2
        assert engines[1].storage.stats["write_behind_done"] == 0, "rank 1 leaves the shared tier to rank 0"
        # rank 1 loses its CPU copy and loads rank 0's from the disk store
        token_api.clear(engines[1], LOCAL_CPU)
        wait_until(lambda: token_api.lookup(engines[1], tokens, [LOCAL_DISK]) == len(tokens),
                   what="the disk store's copy")
        target = {name: torch.zeros_like(cache) for name, cache in caches[1].items()}
        assert token_api.retrieve(engines[1], tokens, kv_caches=target, slot_mapping=slots).all()
        assert engines[1].storage.stats[f"fetched_{LOCAL_DISK}"] == 2
        for name, cache in caches[1].items():
            torch.testing.assert_close(target[name][:4], cache[:4], rtol=0, atol=0)
    finally:
        for engine in engines:
            engine.close()


# ---- models the connector refuses ------------------------------------------------------------------------------
def test_kv_cache_groups_the_connector_does_not_cache_are_refused_with_a_reason() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    from kvmesh.services.engine.connector import unsupported_kv_cache

    def config(*specs: Any) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    # a mixed model with vLLM's hybrid manager off: sliding-window layers kept as full attention
    unified = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=128)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=128)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,))
    assert unsupported_kv_cache(None) is None
    assert unsupported_kv_cache(config(full)) is None
    assert unsupported_kv_cache(config(unified)) is None
    assert unsupported_kv_cache(config(mla)) is None
    # vLLM's hybrid manager on (adapter/kv_groups.py): full-attention and sliding-window groups are cached
    assert unsupported_kv_cache(config(full, window)) is None
    assert unsupported_kv_cache(config(window)) is None
    assert "MambaSpec (l1)" in unsupported_kv_cache(config(full, mamba))
    assert "MambaSpec" in unsupported_kv_cache(config(mamba))
    assert "bidirectional" in unsupported_kv_cache(config(FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, non_causal=True)))
    assert "no KV cache groups" in unsupported_kv_cache(config())
    other_block = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                    sliding_window=128)
    assert "different block sizes" in unsupported_kv_cache(config(full, other_block))
