"""The connector's own logic without a running vLLM: load/save arithmetic, slot mappings, config split, version
check, failed loads reported as load errors (vLLM recomputes them), failed stores skipped."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvmesh.services.engine.adapter.request_meta import KVMeshConnectorMetadata, LoadSpec, ReqMeta, RequestTracker, SaveSpec
from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.core.kv_layout import NHD_2X, KVLayout
from kvmesh.shared.wire.keys import ChunkHasher, ChunkSpan, KeyParams, chunk_spans

connector = pytest.importorskip("kvmesh.services.engine.connector")
worker_side = pytest.importorskip("kvmesh.services.engine.adapter.worker_side")
model_identity = pytest.importorskip("kvmesh.services.engine.adapter.model_identity").model_identity

C = 256  # chunk_size
B = 128  # block_size


def tracker(prompt_len: int, hit: int = 0, local: int = 0) -> RequestTracker:
    request = SimpleNamespace(all_token_ids=list(range(prompt_len)))
    t = RequestTracker("r", request, prompt_len=prompt_len, hit=hit, local=local)
    t.saved_upto = hit
    return t


def test_full_hit_loads_all_but_the_last_token_and_retrieves_the_whole_last_chunk() -> None:
    t = tracker(1000, hit=1000)
    t.num_to_load, t.load_pending = 999, True
    assert t.take_load(C) == LoadSpec(end=1000, need=999, mask_start=0, skip_prefix=0)
    assert t.take_load(C) is None  # once


def test_partial_hit_with_a_local_prefix_skips_what_vllm_holds() -> None:
    t = tracker(2000, hit=1536, local=384)  # vLLM's prefix cache had 3 blocks
    t.num_to_load, t.load_pending = 1536 - 384, True
    assert t.take_load(C) == LoadSpec(end=1536, need=1536, mask_start=256, skip_prefix=384)


def test_no_load_when_vllm_dropped_it() -> None:
    t = tracker(2000, hit=1536)
    t.num_to_load, t.load_pending = 0, True
    assert t.take_load(C) is None


def test_saves_follow_chunked_prefill_and_store_each_chunk_once() -> None:
    t = tracker(5000)
    assert t.take_save(2048, C, True, False) == SaveSpec(end=2048, mask_start=0)
    assert t.take_save(4000, C, True, False) == SaveSpec(end=3840, mask_start=2048)  # whole chunks only
    assert t.take_save(5000, C, True, False) == SaveSpec(end=5000, mask_start=3840)  # prompt end: partial chunk
    assert t.take_save(5001, C, True, False) is None  # decode, save_decode_cache off
    assert t.take_save(5000, C, True, False) is None


def test_partial_last_chunk_only_with_save_unfull_chunk() -> None:
    t = tracker(300)
    assert t.take_save(300, C, False, False) == SaveSpec(end=256, mask_start=0)
    assert tracker(12).take_save(12, C, True, False) == SaveSpec(end=12, mask_start=0)  # the pin quickstart: 12 tokens
    assert tracker(12).take_save(12, C, False, False) is None


def test_decode_cache_saved_in_whole_chunks_when_asked() -> None:
    t = tracker(300)
    assert t.take_save(300, C, True, True) == SaveSpec(end=300, mask_start=0)
    assert t.take_save(400, C, True, True) is None
    assert t.take_save(512, C, True, True) == SaveSpec(end=512, mask_start=256)


def test_held_prefix_is_not_stored_again() -> None:
    t = tracker(1000, hit=768)
    assert t.take_save(1000, C, True, False) == SaveSpec(end=1000, mask_start=768)
    full = tracker(1000, hit=1000)
    assert full.take_save(1000, C, True, False) is None


def test_slot_mapping_and_blocks() -> None:
    req = ReqMeta("r", KEYS[:2], [7, 3, 9])
    slots = req.slot_mapping(300, B)
    assert slots.dtype == torch.int64 and slots.shape == (300,)
    assert slots[0] == 7 * B and slots[127] == 7 * B + 127 and slots[128] == 3 * B and slots[299] == 9 * B + 43
    assert req.block_ids_for(100, 260, B) == {7, 3, 9}
    assert req.block_ids_for(128, 256, B) == {3}
    assert req.block_ids_for(5, 5, B) == set()
    assert "loads=0" in repr(KVMeshConnectorMetadata([req]))


def test_extra_config_split() -> None:
    engine, own = connector.split_extra_config({"lmcache.chunk_size": 512, "model_name": "m",
                                                "kvmesh.lookup_timeout_secs": 1})
    assert engine == {"lmcache.chunk_size": 512, "kvmesh.lookup_timeout_secs": 1}
    assert own == {"model_name": "m"}
    config = EngineConfig().with_overrides(engine, "kv_connector_extra_config")
    assert (config.chunk_size, config.lookup_timeout_secs) == (512, 1.0)


def test_version_check(monkeypatch: pytest.MonkeyPatch) -> None:
    assert connector.check_vllm_version("0.32.0") == "0.32.0"
    assert connector.check_vllm_version("0.33.2.dev4+gabc") == "0.33.2.dev4+gabc"
    for bad in ("0.31.9", "0.34.0", "1.0.0", "not-a-version"):
        with pytest.raises(connector.UnsupportedVLLMVersion, match="supports vLLM >= 0.32.0, < 0.34.0"):
            connector.check_vllm_version(bad)
    monkeypatch.setenv("KVMESH_SKIP_VLLM_VERSION_CHECK", "1")
    assert connector.check_vllm_version("0.40.0") == "0.40.0"


class FakeEngine:
    """Loads the chunks of the first `held` tokens (or raises), records stores (first token, end)."""

    rank = 0  # its rank's lease is looked up by it (adapter/cpu_leases.py): none is taken here

    def __init__(self, held: int | None) -> None:
        self.held = held
        self.stored: list[tuple[int, int]] = []

    def chunk_spans(self, chain_keys: list[bytes], num_tokens: int, first_chunk: int = 0) -> list[ChunkSpan]:
        return chunk_spans(chain_keys, num_tokens, C)[first_chunk:]

    def load(self, spans: list[ChunkSpan], slot_mapping: torch.Tensor | None = None, *, tiers: Any = None,
             leased: Any = None) -> Any:
        if self.held is None:
            raise RuntimeError("disk store unreachable")
        held = sum(1 for span in spans if span.end <= self.held)
        return SimpleNamespace(scatter=lambda kv_caches, slot_mapping, skip_prefix=0, pipeline=None: held)

    def save(self, spans: list[ChunkSpan], kv_caches: Any, slot_mapping: torch.Tensor, stream: Any = None,
             retention: Any = None, store_to: Any = None, first_token: int = 0) -> None:
        if self.held is None:
            raise RuntimeError("pool broken")
        self.stored.append((spans[0].start, spans[-1].end))

    def forward_started(self) -> None:  # no write-behind here
        pass

    def forward_ended(self) -> None:
        pass


def worker(engine: FakeEngine) -> Any:
    side = worker_side.WorkerSide(EngineConfig(chunk_size=C), B)
    side.engine = engine
    return side


KEYS = [bytes([i]) * 16 for i in range(4)]  # chain keys of the 4 chunks of a 1000-token request


@pytest.mark.parametrize("held, bad", [(1000, set()), (512, {5, 6, 7, 8}), (None, {1, 2, 3, 4, 5, 6, 7, 8})])
def test_failed_loads_become_load_errors(held: int | None, bad: set[int]) -> None:
    conn = worker(FakeEngine(held))
    req = ReqMeta("r", KEYS, [1, 2, 3, 4, 5, 6, 7, 8], LoadSpec(end=1000, need=999, mask_start=0, skip_prefix=0))
    conn.start_load_kv(KVMeshConnectorMetadata([req]))
    assert conn.get_block_ids_with_load_errors() == bad
    assert conn.get_block_ids_with_load_errors() == set()  # reported once


def test_blocks_vllm_computed_itself_are_never_reported() -> None:
    conn = worker(FakeEngine(None))
    req = ReqMeta("r", KEYS, [1, 2, 3, 4, 5, 6, 7, 8], LoadSpec(end=768, need=768, mask_start=256, skip_prefix=384))
    conn.start_load_kv(KVMeshConnectorMetadata([req]))
    # 1..3 are vLLM's own (skip_prefix); 4..6 were not loaded, and the forward fills 7, 8 over them
    assert conn.get_block_ids_with_load_errors() == {4, 5, 6, 7, 8}


def test_failed_store_is_skipped() -> None:
    engine = FakeEngine(None)
    conn = worker(engine)
    meta = KVMeshConnectorMetadata([ReqMeta("r", KEYS[:3], [1, 2, 3, 4, 5], save=SaveSpec(600, 256))])
    conn.wait_for_save(meta)  # logs, does not raise
    engine.held = 0
    conn.wait_for_save(meta)
    assert engine.stored == [(256, 600)]


# ---- what the GPU path must get right, decided without a GPU ------------------------------------------------------
@pytest.mark.parametrize("world_rank, world_size, expected", [(0, 1, 0), (3, 1, 0), (5, 2, 1), (6, 4, 2)])
def test_a_data_parallel_replica_keys_and_looks_up_by_its_rank_inside_the_replica(
        world_rank: int, world_size: int, expected: int) -> None:
    # vLLM's distributed groups are not initialised here: the world rank (dp_rank × world_size + rank) is used
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size, rank=world_rank))
    assert worker_side.replica_rank(vllm_config) == expected


def test_block_size_comes_from_the_kv_cache_groups_spec() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    assert connector.kv_block_size(vllm_config, kv_cache_config) == 64
    assert connector.kv_block_size(vllm_config, None) == 16


@pytest.mark.parametrize("cache_dtype", ["auto", "bfloat16", "fp8", "fp8_e5m2", "fp8_ds_mla"])
def test_per_token_kv_cache_dtypes_are_cached(cache_dtype: str) -> None:
    assert connector.unsupported_cache_dtype(cache_dtype) is None


@pytest.mark.parametrize("cache_dtype", ["nvfp4", "nvfp4_ds_mla", "turboquant_k8v4", "ultraquant_4bit",
                                         "int8_per_token_head", "fp8_per_token_head"])
def test_kv_cache_dtypes_packed_per_block_are_refused_with_a_reason(cache_dtype: str) -> None:
    reason = connector.unsupported_cache_dtype(cache_dtype)
    assert reason is not None and cache_dtype in reason and "partial blocks" in reason


def test_what_changes_kv_beyond_the_model_name_changes_every_key() -> None:
    """The weight revision, the quantization and the KV cache dtype (fp8_e4m3 and fp8_e5m2 share torch's uint8)
    each give other chunk keys; a model with none of them set keeps the keys of its bare name."""
    def keys(model: str, cache_dtype: str = "auto", dtype: torch.dtype = torch.bfloat16) -> list[bytes]:
        layout = KVLayout(NHD_2X, 4, 16, 2, 64, dtype, False, cache_dtype=cache_dtype)
        return ChunkHasher(KeyParams(model, layout.chunk_format()), C).keys(list(range(2 * C)))

    plain = SimpleNamespace(revision=None, quantization=None)
    assert model_identity("m", plain) == "m"
    assert model_identity("m", SimpleNamespace()) == "m"
    revised = model_identity("m", SimpleNamespace(revision="abc123", quantization=None))
    quantized = model_identity("m", SimpleNamespace(revision=None, quantization="awq"))
    both = model_identity("m", SimpleNamespace(revision="abc123", quantization="awq"))
    assert len({"m", revised, quantized, both}) == 4
    variants = [keys("m"), keys(revised), keys(quantized), keys(both), keys("m", "fp8_e4m3", torch.uint8),
                keys("m", "fp8_e5m2", torch.uint8), keys("m", dtype=torch.uint8)]
    for i, first in enumerate(variants):  # no two variants share a key, in any chunk
        for second in variants[i + 1:]:
            assert not set(first) & set(second)
    assert keys("m", "bfloat16") == keys("m"), "a cache dtype that only names the model's dtype changes nothing"


def test_layers_that_differ_turn_the_cache_off_instead_of_failing_vllms_start(
        caplog: pytest.LogCaptureFixture) -> None:
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="draft-with-other-heads"))
    conn = worker_side.WorkerSide(EngineConfig(), 16, vllm_config=vllm_config)
    caches = {"model.layers.0": torch.zeros(2, 4, 16, 8, 64), "draft.layers.0": torch.zeros(2, 4, 16, 4, 64)}
    with caplog.at_level("WARNING"):
        conn.register_kv_caches(caches)
    assert conn.engine is None and conn.kv_caches == {}
    assert any("loads and stores nothing for model draft-with-other-heads" in r.getMessage() for r in caplog.records)
