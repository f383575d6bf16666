"""Stream ordering of the off-critical-path copies on CUDA (skipped elsewhere): the layer-wise loader's per-layer
scatters on its side stream against the torch path, each layer read on the forward's stream right after
`wait(layer)` while the side stream is held back by a sleep kernel (a missing wait reads zeros); a save's
gather on a side stream ordered after the forward's writes; and a grouped model's save read before the next
forward rewrites its blocks (vLLM frees them mid-request) while the stream the worker gathers on is held back
(the last two need the engine's dependencies, else skipped). The CPU variants of the same call sequences are
tests/engine/test_connector_harness.py and tests/engine/adapter/test_async_saves.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from kvmesh.services.engine.core.kv_layout import detect_layout  # noqa: E402
from kvmesh.services.engine.core.layerwise_load import ChunkCopy, LayerwiseLoader  # noqa: E402
from kvmesh.services.engine.core.paged_torch import scatter  # noqa: E402

DEVICE = torch.device("cuda", torch.cuda.current_device())
LAYERS, NB, BS, HEADS, D, CHUNK = 4, 32, 16, 2, 64, 32
SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H100: long enough for the host to run ahead of the side stream


def paged() -> tuple[dict[str, torch.Tensor], object]:
    buffer = torch.zeros(LAYERS, 2, NB, BS, HEADS, D, dtype=torch.bfloat16, device=DEVICE)
    caches = {f"layer.{i}": buffer[i] for i in range(LAYERS)}
    return caches, detect_layout(caches, BS, "FLASH_ATTN")


def test_each_layer_read_after_its_wait_holds_the_loaded_kv() -> None:
    caches, layout = paged()
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randperm(NB, generator=gen)[:4]
    slots = (blocks.repeat_interleave(BS) * BS + torch.arange(BS).repeat(4))
    chunks = [torch.randn(layout.chunk_shape(CHUNK), generator=gen).to(layout.dtype).pin_memory() for _ in range(2)]
    copies = [ChunkCopy(chunks[c], slots[c * CHUNK:(c + 1) * CHUNK].to(DEVICE), skip=3 if c == 0 else 0)
              for c in range(2)]
    oracle = {name: torch.zeros_like(cache) for name, cache in caches.items()}
    for c in copies:
        scatter(c.chunk.to(DEVICE), oracle, layout, c.slots, c.skip)
    loader = LayerwiseLoader(layout, DEVICE)
    with torch.cuda.stream(loader.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the side stream's copies start late
    loader.start(caches, copies, [])
    seen = {}
    for name, cache in caches.items():
        loader.wait(name)
        seen[name] = cache.clone()  # on the forward's stream, right after the wait
    loader.finish()
    torch.cuda.synchronize()
    for name in caches:
        assert torch.equal(seen[name], oracle[name]), name


def test_a_saves_gather_on_a_side_stream_reads_what_the_forward_wrote() -> None:
    pytest.importorskip("nats")
    from kvmesh.services.engine.assembly import build_engine
    from kvmesh.services.engine.config.engine_config import EngineConfig
    from kvmesh.shared.wire.keys import KeyParams

    caches, layout = paged()
    engine = build_engine(EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.05), KeyParams("m", ""), layout,
                          use_mesh=False, device=DEVICE)
    try:
        tokens = list(range(2 * CHUNK))
        spans = engine.hasher.spans(tokens)
        slots = torch.arange(2 * CHUNK, dtype=torch.int64)  # blocks 0..3
        torch.cuda._sleep(SLEEP_CYCLES)  # the forward is still running when the save is queued...
        for cache in caches.values():
            cache.fill_(1.5)  # ...and writes the KV last
        side = torch.cuda.Stream(DEVICE)
        job = engine.save(spans, caches, slots, side)
        assert job is not None
        job.admit()  # waits for the copy's event
        for span in spans:
            ref = engine.cpu.acquire(span.key)
            assert ref is not None
            try:
                assert bool((ref.slot.view(layout.dtype, layout.chunk_shape(span.num_tokens)) == 1.5).all())
            finally:
                ref.release()
    finally:
        engine.close()


def test_a_grouped_models_save_is_read_before_the_next_forward_rewrites_its_blocks() -> None:
    """vLLM frees a sliding window's (or a state's) blocks while the request runs and may hand them to the next
    step's forward at once (adapter/async_saves.py): the worker's gather must be ordered before that forward's
    writes. The stream the worker gathers on is held back by a sleep kernel; the next forward's write is queued
    on the forward's stream right after wait_for_save. A gather on an unordered side stream reads the new values."""
    pytest.importorskip("nats")
    worker_side = pytest.importorskip("kvmesh.services.engine.adapter.worker_side")
    from kvmesh.services.engine.adapter.kv_groups import FULL, SLIDING, KVGroup, KVGroups
    from kvmesh.services.engine.adapter.request_meta import KVMeshConnectorMetadata, ReqMeta, SaveSpec
    from kvmesh.services.engine.assembly import build_engine
    from kvmesh.services.engine.config.engine_config import EngineConfig
    from kvmesh.shared.wire.keys import KeyParams

    caches, layout = paged()
    names = list(caches)
    groups = KVGroups((KVGroup(SLIDING, tuple(names[:2]), 2 * BS), KVGroup(FULL, tuple(names[2:]))), BS)
    layout = dataclasses.replace(layout, group_layers=groups.layers_per_group(), groups_tag=groups.tag)
    engine = build_engine(EngineConfig(chunk_size=CHUNK, max_local_cpu_size=0.05), KeyParams("m", ""), layout,
                          use_mesh=False, device=DEVICE)
    side = worker_side.WorkerSide(engine.config, BS, saves_off_forward=True, groups=groups)
    side.engine, side.kv_caches = engine, caches
    try:
        tokens = list(range(CHUNK))
        spans = engine.hasher.spans(tokens)
        save = ReqMeta("p", [span.key for span in spans], [0, 1], save=SaveSpec(end=CHUNK, mask_start=0),
                       group_block_ids=[[0, 1], [2, 3]])
        for cache in caches.values():
            cache.fill_(1.5)  # the forward wrote the request's KV
        with torch.cuda.stream(side.async_saves.stream(DEVICE)):
            torch.cuda._sleep(SLEEP_CYCLES)  # the stream the gather goes on is busy for a while
        side.wait_for_save(KVMeshConnectorMetadata(requests=[save]))
        for cache in caches.values():
            cache.fill_(2.5)  # the next forward writes another request's KV into the freed blocks
        side.async_saves.drain()  # waits for the copies, admits their chunks
        ref = engine.cpu.acquire(spans[0].key)
        assert ref is not None, "the save stored nothing"
        try:
            chunk = ref.slot.view(layout.dtype, layout.chunk_shape(spans[0].num_tokens))
            assert bool((chunk == 1.5).all()), "the save read the next forward's KV"
        finally:
            ref.release()
    finally:
        engine.close()
