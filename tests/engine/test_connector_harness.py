"""The connector driven exactly as vLLM's GPU model runner calls it (tests/support/connector_driver.py), on real paged
tensors: start_load_kv, per layer wait_for_layer_load / the layer's forward / save_kv_layer, wait_for_save,
get_finished, with the scheduler half planning each step.

Runs on CUDA when present (the CuPy kernels or torch's CUDA path; saves on a side stream ordered after the
forward; with use_layerwise, loads copied layer by layer on a side stream, each layer's attention waiting for
its own) and always on CPU (the torch path, the same call sequence; the layer-wise loader set as the connector
sets it on CUDA). What must hold on both: what each layer's forward reads after wait_for_layer_load is the
stored KV; every stored chunk holds what the torch path's gather of the request's blocks gives; a finished
request is reported once its saves are done.
"""

from __future__ import annotations

import zlib
from typing import Iterator

import pytest
import torch

from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.core.kv_layout import KVLayout, detect_layout
from kvmesh.services.engine.core.layer_pipeline import LayerPipeline
from kvmesh.services.engine.core.layerwise_load import LayerwiseLoader
from kvmesh.services.engine.core.paged_torch import gather
from kvmesh.shared.protocol import LOCAL_CPU

from support.engine import BLOCK, CHUNK, HEAD_SIZE, HEADS, LAYERS, random_tokens

pytest.importorskip("kvmesh.services.engine.connector")
from support.connector_driver import (  # noqa: E402
    Step, blocks, rank0_engine, request, run_step, scheduler_half, worker_half)

NUM_BLOCKS = 64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="CUDA is not available"))]


class Paged:
    """vLLM's paged caches on `device`: CPU -> its CPU layout (LBHNC), CUDA -> flash-attention's [2, nb, bs, H, D];
    one buffer for all layers, as vLLM allocates them."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cpu":
            buffer = torch.zeros(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.bfloat16)
            backend, isa = "CPU_ATTN", "vec"
        else:
            buffer = torch.zeros(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, dtype=torch.bfloat16,
                                 device=self.device)
            backend, isa = "FLASH_ATTN", None
        self.caches = {f"model.layers.{i}.self_attn": buffer[i] for i in range(LAYERS)}
        self.layout: KVLayout = detect_layout(self.caches, BLOCK, backend, cpu_isa=isa)

    def block(self, cache: torch.Tensor, block_id: int) -> torch.Tensor:
        return cache[block_id] if self.device.type == "cpu" else cache[:, block_id]


class Forward:
    """Stands for the model's layers: layer i writes the KV of the blocks it computes (a pattern of the request
    and the block's place in its sequence) and reads the blocks loaded for it (recorded, on its stream)."""

    def __init__(self, paged: Paged) -> None:
        self.paged = paged
        self.compute: tuple[str, list[int], range] = ("", [], range(0))
        self.read: tuple[list[int], range] = ([], range(0))
        self.seen: dict[int, list[torch.Tensor]] = {}  # layer -> the loaded blocks as the layer read them

    def pattern(self, req_id: str, logical: int, layer: int) -> torch.Tensor:
        shape = self.paged.block(next(iter(self.paged.caches.values())), 0).shape
        gen = torch.Generator().manual_seed(zlib.crc32(f"{req_id}/{layer}/{logical}".encode()))
        return torch.randn(shape, generator=gen).to(torch.bfloat16).to(self.paged.device)

    def __call__(self, layer: int, name: str) -> None:
        cache = self.paged.caches[name]
        block_ids, loaded = self.read
        self.seen[layer] = [self.paged.block(cache, block_ids[j]).clone() for j in loaded]
        req_id, block_ids, logical_blocks = self.compute
        for j in logical_blocks:
            self.paged.block(cache, block_ids[j]).copy_(self.pattern(req_id, j, layer))


@pytest.fixture(params=DEVICES)
def paged_engine(request: pytest.FixtureRequest) -> Iterator[tuple[CacheEngine, Paged]]:
    paged = Paged(request.param)
    with rank0_engine(paged.layout, paged.device) as worker:
        yield worker, paged


def slots_of(block_ids: list[int], num_tokens: int) -> torch.Tensor:
    return torch.as_tensor([b * BLOCK + i for b in block_ids for i in range(BLOCK)])[:num_tokens]


def set_loader(work: object, paged: Paged, loader: str) -> None:
    """What register_kv_caches sets up: on CUDA with use_layerwise the layer-wise loader; on a CPU with a core
    beside the forward's (cpu_load_pipeline) the layer pipeline; else neither (loads written before the forward)."""
    side = work.worker_side  # type: ignore[attr-defined]
    if loader == "pipeline" and paged.device.type != "cpu":
        pytest.skip("the layer pipeline writes CPU caches only")
    if loader == "layerwise":
        side.layerwise = LayerwiseLoader(paged.layout, paged.device)
    elif loader == "pipeline":
        side.pipeline = LayerPipeline(list(paged.caches))


def compute_and_save(sched: object, work: object, forward: Forward, tokens: list[int], block_ids: list[int],
                     off_forward: bool) -> None:
    """Request "a" of `tokens` (whole blocks) computed into `block_ids` in one step, saved, and finished."""
    a = request("a", tokens)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)  # type: ignore[attr-defined]
    sched.update_state_after_alloc(a, blocks(block_ids), 0)  # type: ignore[attr-defined]
    forward.compute = ("a", block_ids, range(len(tokens) // BLOCK))
    run_step(sched, work, Step(new=[("a", block_ids, 0, len(tokens))]), forward)
    assert sched.request_finished(a, block_ids) == (off_forward, None)  # type: ignore[attr-defined]
    assert run_step(sched, work, Step(finished={"a"})).finished_sending == ({"a"} if off_forward else set())


def load_and_compute(sched: object, work: object, forward: Forward, b: object, block_ids: list[int],
                     hit: int) -> object:
    """Request b, whose first `hit` tokens are a saved prompt's and whose last chunk is new: a CPU-tier hit
    loaded into `block_ids` and its chunk computed, in one step (what it returned)."""
    assert sched.get_num_new_matched_tokens(b, 0) == (hit, False)  # type: ignore[attr-defined]
    sched.update_state_after_alloc(b, blocks(block_ids), hit)  # type: ignore[attr-defined]
    loaded = range(hit // BLOCK)
    forward.compute = ("b", block_ids, range(hit // BLOCK, (hit + CHUNK) // BLOCK))
    forward.read = (block_ids, loaded)
    return run_step(sched, work, Step(new=[("b", block_ids, hit, CHUNK)]), forward)


@pytest.mark.parametrize("loader", ["before_forward", "layerwise", "pipeline"])
def test_the_model_runners_call_sequence_loads_and_saves_the_right_kv(
        paged_engine: tuple[CacheEngine, Paged], loader: str) -> None:
    worker, paged = paged_engine
    off_forward = paged.device.type == "cuda"
    sched = scheduler_half(worker.config, BLOCK, off_forward)
    work = worker_half(worker, paged.caches, BLOCK, off_forward)
    set_loader(work, paged, loader)
    forward = Forward(paged)
    try:
        # request a: its 4-chunk prompt is computed and saved
        tokens_a = random_tokens(4 * CHUNK, seed=11).tolist()
        blocks_a = list(range(2, 10))
        compute_and_save(sched, work, forward, tokens_a, blocks_a, off_forward)
        assert token_api.lookup(worker, tokens_a, search_range=[LOCAL_CPU]) == 4 * CHUNK

        # every stored chunk is what the torch path gathers from a's blocks
        for c, span in enumerate(worker.hasher.spans(tokens_a)):
            oracle = torch.empty(paged.layout.chunk_shape(CHUNK), dtype=paged.layout.dtype, device=paged.device)
            gather(paged.caches, paged.layout, slots_of(blocks_a, 4 * CHUNK)[c * CHUNK:(c + 1) * CHUNK], oracle)
            ref = worker.cpu.acquire(span.key)
            assert ref is not None
            try:
                chunk = ref.slot.view(worker.layout.dtype, worker.layout.chunk_shape(span.num_tokens))
                assert torch.equal(chunk.cpu(), oracle.cpu()), f"chunk {c}"
            finally:
                ref.release()

        # request b shares a's prompt and adds a chunk: the 4 chunks are loaded into new blocks, the 5th computed
        tokens_b = tokens_a + random_tokens(CHUNK, seed=12).tolist()
        b, blocks_b = request("b", tokens_b), list(range(30, 40))
        result = load_and_compute(sched, work, forward, b, blocks_b, len(tokens_a))
        assert result.load_errors == set()
        for layer in range(LAYERS):  # what each layer's attention read after wait_for_layer_load
            want = [forward.pattern("a", j, layer) for j in range(8)]
            assert all(torch.equal(got, w) for got, w in zip(forward.seen[layer], want)), f"layer {layer}"
        assert sched.request_finished(b, blocks_b) == (off_forward, None)
        assert run_step(sched, work, Step(finished={"b"})).finished_sending == ({"b"} if off_forward else set())
        assert token_api.lookup(worker, tokens_b, search_range=[LOCAL_CPU]) == 5 * CHUNK
        assert worker.pool.num_free == worker.pool.num_slots - 5, "the loads' references were released"
    finally:
        if work.worker_side.layerwise is not None:
            work.worker_side.layerwise.close()
        if work.worker_side.pipeline is not None:
            work.worker_side.pipeline.close()
        work.worker_side.async_saves.drain()
        sched.shutdown()


def test_a_load_the_layer_pipeline_failed_to_write_is_a_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's thread fails writing the last layer of a step's load: the forward is not held up, and the step
    reports the load's blocks and the blocks computed over them as load errors (vLLM recomputes them), and
    gives the pool slots back."""
    from kvmesh.services.engine.core import layer_pipeline

    paged = Paged("cpu")
    with rank0_engine(paged.layout, paged.device) as worker:
        sched = scheduler_half(worker.config, BLOCK, False)
        work = worker_half(worker, paged.caches, BLOCK, False)
        set_loader(work, paged, "pipeline")
        forward = Forward(paged)
        try:
            tokens_a = random_tokens(2 * CHUNK, seed=13).tolist()
            compute_and_save(sched, work, forward, tokens_a, list(range(2, 6)), False)

            written = layer_pipeline.write_planned

            def fail_at_the_last_layer(plan, caches, layers=None):  # type: ignore[no-untyped-def]
                if layers is not None and layers.start == LAYERS - 1:
                    raise RuntimeError("injected: the last layer cannot be written")
                written(plan, caches, layers)

            monkeypatch.setattr(layer_pipeline, "write_planned", fail_at_the_last_layer)
            b, blocks_b = request("b", tokens_a + random_tokens(CHUNK, seed=14).tolist()), list(range(30, 36))
            result = load_and_compute(sched, work, forward, b, blocks_b, len(tokens_a))
            assert result.load_errors == set(blocks_b)  # loaded, and computed over the failed load
            assert worker.pool.num_free == worker.pool.num_slots - 2, "the load's references were released"
        finally:
            work.worker_side.pipeline.close()
            sched.shutdown()


def test_kv_transfer_params_retain_what_a_request_saves_and_choose_its_tiers(
        caplog: pytest.LogCaptureFixture) -> None:
    """Per-request retention and tiers (adapter/request_retention.py) through both halves: a leased request's
    chunks are retained by the worker's CPU tier; a request whose kv_load_tiers leave the CPU tier out is
    promised nothing from it, one that names it loads from it, one with no store tier plans no save, and a bad
    value is dropped with a WARNING naming the key, the request served without it."""
    paged = Paged("cpu")
    with rank0_engine(paged.layout, paged.device) as worker:
        sched = scheduler_half(worker.config, BLOCK, False)
        work = worker_half(worker, paged.caches, BLOCK, False)
        forward = Forward(paged)
        try:
            tokens = random_tokens(2 * CHUNK, seed=21).tolist()
            a, blocks_a = request("a", tokens, kv_transfer_params={"kv_ttl": 600, "kv_priority": 2}), [2, 3, 4, 5]
            assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
            sched.update_state_after_alloc(a, blocks(blocks_a), 0)
            forward.compute = ("a", blocks_a, range(4))
            run_step(sched, work, Step(new=[("a", blocks_a, 0, 2 * CHUNK)]), forward)
            run_step(sched, work, Step(finished={"a"}))
            keys = [span.key for span in worker.hasher.spans(tokens)]
            assert all(worker.cpu.is_retained(key) for key in keys)

            elsewhere = request("b", tokens, kv_transfer_params={"kv_load_tiers": ["LocalDiskBackend"]})
            assert sched.get_num_new_matched_tokens(elsewhere, 0) == (0, False)
            cpu_only = {"kv_load_tiers": ["LocalCPUBackend"], "kv_store_tiers": []}
            c, blocks_c = request("c", tokens + random_tokens(CHUNK, seed=22).tolist(),
                                  kv_transfer_params=cpu_only), list(range(10, 16))
            assert sched.get_num_new_matched_tokens(c, 0) == (2 * CHUNK, False)
            sched.update_state_after_alloc(c, blocks(blocks_c), 2 * CHUNK)
            meta = sched.build_connector_meta(Step(new=[("c", blocks_c, 2 * CHUNK, CHUNK)]).output())
            assert [(r.req_id, r.load is not None, r.save) for r in meta.requests] == [("c", True, None)]

            # a leased request that loads chunks stored without a lease keeps them too
            plain = random_tokens(2 * CHUNK, seed=23).tolist()
            p, blocks_p = request("p", plain), [20, 21, 22, 23]
            assert sched.get_num_new_matched_tokens(p, 0) == (0, False)
            sched.update_state_after_alloc(p, blocks(blocks_p), 0)
            forward.compute = ("p", blocks_p, range(4))
            run_step(sched, work, Step(new=[("p", blocks_p, 0, 2 * CHUNK)]), forward)
            run_step(sched, work, Step(finished={"p"}))
            plain_keys = [span.key for span in worker.hasher.spans(plain)]
            assert not any(worker.cpu.is_retained(key) for key in plain_keys)
            q, blocks_q = request("q", plain + random_tokens(CHUNK, seed=24).tolist(),
                                  kv_transfer_params={"kv_ttl": 60}), list(range(40, 46))
            assert sched.get_num_new_matched_tokens(q, 0) == (2 * CHUNK, False)
            sched.update_state_after_alloc(q, blocks(blocks_q), 2 * CHUNK)
            forward.compute, forward.read = ("q", blocks_q, range(4, 6)), (blocks_q, range(4))
            assert run_step(sched, work, Step(new=[("q", blocks_q, 2 * CHUNK, CHUNK)]), forward).load_errors == set()
            assert all(worker.cpu.is_retained(key) for key in plain_keys)

            with caplog.at_level("WARNING", logger="kvmesh.connector"):
                d = request("d", tokens, kv_transfer_params={"kv_priority": "high"})
                assert sched.get_num_new_matched_tokens(d, 0) == (2 * CHUNK - 1, False)
            assert any("kv_priority ignored" in r.getMessage() and "str where an integer" in r.getMessage()
                       for r in caplog.records)
        finally:
            sched.shutdown()
