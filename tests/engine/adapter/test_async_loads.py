"""Asynchronous loads (services/engine/adapter/async_loads.py) without vLLM: the scheduler's decision, and the
worker side's bookkeeping driven the way vLLM's model runner drives it (start_load_kv, then get_finished and
get_block_ids_with_load_errors in every step), on a real cache engine with a real NATS and disk store."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from kvmesh.services.engine.adapter.async_loads import AsyncLoads, loads_asynchronously
from kvmesh.services.engine.adapter.request_meta import KVMeshConnectorMetadata, LoadSpec, ReqMeta, RequestTracker
from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK
from kvmesh.shared.wire.keys import KeyParams

from support.engine import BLOCK, CHUNK, PagedKV, disk_store_mesh, engine_config, random_tokens
from support.waiting import WAIT_S, wait_until

connector = pytest.importorskip("kvmesh.services.engine.connector")
worker_side = pytest.importorskip("kvmesh.services.engine.adapter.worker_side")

PARAMS = KeyParams(model="test-model", kv_format="")


# ---- the scheduler's decision ---------------------------------------------------------------------------------
@pytest.mark.parametrize("enabled, to_load, need, cpu_tokens, expected", [
    (True, 999, 999, 0, True),  # nothing in the CPU tier: from the disk / remote store, between steps
    (True, 999, 999, 768, True),  # part of it below the CPU tier
    (True, 999, 999, 1000, False),  # all in the CPU tier: today's synchronous load
    (True, 615, 999, 999, False),  # vLLM holds the first 384 itself, the CPU tier the rest
    (True, 0, 999, 0, False),  # nothing to load
    (False, 999, 999, 0, False),  # enable_async_loading off
])
def test_only_a_load_that_needs_a_lower_tier_is_asynchronous(enabled: bool, to_load: int, need: int,
                                                              cpu_tokens: int, expected: bool) -> None:
    assert loads_asynchronously(enabled, to_load, need, cpu_tokens) is expected


def test_the_async_load_is_carried_once_with_its_flag() -> None:
    t = RequestTracker("r", SimpleNamespace(all_token_ids=list(range(1000))), prompt_len=1000, hit=1000)
    t.num_to_load, t.load_pending, t.load_async = 999, True, True
    assert t.take_load(256) == LoadSpec(end=1000, need=999, mask_start=0, skip_prefix=0, asynchronous=True)
    assert t.take_load(256) is None


# ---- the worker side ------------------------------------------------------------------------------------------
@pytest.fixture
def disk_mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    with disk_store_mesh(tmp_path / "disk") as mesh:
        yield mesh


@pytest.fixture
def engine(disk_mesh: LocalMesh, tmp_path: Path) -> Iterator[tuple[CacheEngine, PagedKV]]:
    kv = PagedKV(num_blocks=128)
    worker = build_engine(engine_config(nats_url=disk_mesh.nats_url, local_disk=str(tmp_path / "disk")), PARAMS,
                          kv.layout)
    try:
        assert worker.wait_connected(WAIT_S)
        wait_until(lambda: worker.storage.lower(LOCAL_DISK), what="the disk store found")
        yield worker, kv
    finally:
        worker.close()


def on_disk_only(worker: CacheEngine, kv: PagedKV, tokens: torch.Tensor) -> torch.Tensor:
    """Store `tokens`' KV, wait until the disk store has it, drop it from the CPU tier; its slots."""
    slots = kv.slots(len(tokens))
    token_api.store(worker, tokens, **kv.kv(slots))
    client = worker.storage.lower(LOCAL_DISK)
    assert client is not None and worker.nats_loop is not None
    assert worker.wait_write_behind(WAIT_S)
    assert worker.nats_loop.call(client.wait_written(WAIT_S), WAIT_S + 1, default=False)
    token_api.clear(worker, LOCAL_CPU)
    return slots


def worker_connector(worker: CacheEngine, kv: PagedKV, timeout: float = WAIT_S) -> Any:
    side = worker_side.WorkerSide(worker.config, BLOCK)
    side.engine, side.kv_caches = worker, kv.caches
    side.async_loads = AsyncLoads(timeout)  # a deadline blocking_timeout_secs may not take (0: passed at once)
    return connector.KVMeshConnector.from_sides(worker_side=side)


def request(worker: CacheEngine, tokens: torch.Tensor, blocks: list[int], need: int) -> ReqMeta:
    chain = [span.key for span in worker.hasher.chain(tokens.tolist())]
    load = LoadSpec(end=len(tokens), need=need, mask_start=0, skip_prefix=0, asynchronous=True)
    return ReqMeta("r", chain, blocks, load)


def step(conn: Any, metadata: KVMeshConnectorMetadata) -> tuple[set[str], set[int]]:
    """One step of vLLM's model runner, as far as loads go: (finished_recving, load errors)."""
    conn.bind_connector_metadata(metadata)
    conn.start_load_kv(None)
    _, done = conn.get_finished(set())
    errors = conn.get_block_ids_with_load_errors()
    conn.clear_connector_metadata()
    return done or set(), errors


def run_until_finished(conn: Any, req: ReqMeta) -> tuple[int, set[int]]:
    """Steps until the request is reported finished: (the steps it took, its load errors)."""
    steps, errors = 1, set()
    done, errors = step(conn, KVMeshConnectorMetadata([req]))
    while not done:  # later steps carry nothing for it: vLLM keeps it in WAITING_FOR_REMOTE_KVS
        def next_step() -> bool:
            nonlocal done, steps
            more, errs = step(conn, KVMeshConnectorMetadata(idle=True))
            errors.update(errs)
            done |= more
            steps += 1
            return bool(done)

        wait_until(next_step, WAIT_S, what="the async load reported finished")
    assert done == {"r"}
    return steps, errors


def free_blocks(kv: PagedKV, used: torch.Tensor, count: int) -> list[int]:
    taken = set((used // BLOCK).tolist())
    return [b for b in range(kv.num_blocks) if b not in taken][:count]


def test_a_load_from_disk_lands_in_its_blocks_and_is_reported_once(engine: tuple[CacheEngine, PagedKV]) -> None:
    worker, kv = engine
    tokens = random_tokens(4 * CHUNK, seed=31)
    src = on_disk_only(worker, kv, tokens)
    expected = kv.token_kv(src)
    req = request(worker, tokens, free_blocks(kv, src, 8), need=4 * CHUNK - 1)
    free_before = worker.pool.num_free
    _, errors = run_until_finished(worker_connector(worker, kv), req)
    assert errors == set()
    assert torch.equal(kv.token_kv(req.slot_mapping(4 * CHUNK, BLOCK)), expected)
    assert worker.storage.stats["fetched_LocalDiskBackend"] == 4
    # the CPU tier keeps the fetched chunks (its own references); the load's references were released
    assert worker.pool.num_free == free_before - 4
    assert token_api.lookup(worker, tokens, search_range=[LOCAL_CPU]) == 4 * CHUNK


def test_a_whole_prompt_one_token_past_a_block_loads_into_the_blocks_vllm_allocated(
        engine: tuple[CacheEngine, PagedKV]) -> None:
    """The hit is the whole prompt, its last chunk one token; vLLM computes that token itself and allocated blocks
    for the others only: the load reads the last chunk and writes no token past those blocks (it was a load error,
    slot_mapping one slot short, and vLLM recomputed the whole prompt)."""
    worker, kv = engine
    tokens = random_tokens(4 * CHUNK + 1, seed=33)
    src = on_disk_only(worker, kv, tokens)
    assert token_api.lookup(worker, tokens) == 4 * CHUNK + 1
    expected = kv.token_kv(src[:4 * CHUNK])
    blocks = free_blocks(kv, src, 4 * CHUNK // BLOCK)  # exactly the blocks of the tokens it loads
    req = request(worker, tokens, blocks, need=4 * CHUNK)
    _, errors = run_until_finished(worker_connector(worker, kv), req)
    assert errors == set()
    assert torch.equal(kv.token_kv(req.slot_mapping(4 * CHUNK, BLOCK)), expected)
    assert worker.storage.stats["fetched_LocalDiskBackend"] == 5


def test_what_the_stores_lack_is_reported_as_load_errors_with_the_finish(
        engine: tuple[CacheEngine, PagedKV]) -> None:
    worker, kv = engine
    tokens = random_tokens(6 * CHUNK, seed=32)
    src = on_disk_only(worker, kv, tokens[:4 * CHUNK])  # the store holds the first 4 of 6 chunks
    blocks = free_blocks(kv, src, 12)
    _, errors = run_until_finished(worker_connector(worker, kv), request(worker, tokens, blocks, need=6 * CHUNK))
    assert errors == set(blocks[8:12])  # tokens 128..191: blocks 8..11 (two 16-token blocks per chunk)
    assert torch.equal(kv.token_kv(torch.as_tensor(
        [b * BLOCK + i for b in blocks[:8] for i in range(BLOCK)])), kv.token_kv(src))


def test_a_load_past_its_deadline_is_recomputed_and_its_late_chunks_are_released(
        engine: tuple[CacheEngine, PagedKV], disk_mesh: LocalMesh) -> None:
    worker, kv = engine
    tokens = random_tokens(4 * CHUNK, seed=33)
    src = on_disk_only(worker, kv, tokens)
    blocks = free_blocks(kv, src, 8)
    before = kv.token_kv(torch.as_tensor([b * BLOCK + i for b in blocks for i in range(BLOCK)]))
    conn = worker_connector(worker, kv, timeout=0.0)  # the deadline has passed by the first step's end
    # ... and the fetch cannot have ended by then: the store is stopped until that step is over (a busy machine
    # can otherwise finish a small fetch within the step, which then loads it: no failure to see)
    store = disk_mesh.processes[0]
    os.kill(store.pid, signal.SIGSTOP)
    try:
        steps, errors = run_until_finished(conn, request(worker, tokens, blocks, need=4 * CHUNK))
    finally:
        os.kill(store.pid, signal.SIGCONT)
    assert steps == 1 and errors == set(blocks)
    # the fetch still ends on the NATS loop: its chunks stay in the CPU tier only, the blocks stay untouched
    wait_until(lambda: token_api.lookup(worker, tokens, search_range=[LOCAL_CPU]) == 4 * CHUNK
               and worker.pool.num_free == worker.pool.num_slots - 4, what="the late fetch parked, no leak")
    assert torch.equal(kv.token_kv(torch.as_tensor([b * BLOCK + i for b in blocks for i in range(BLOCK)])), before)


def test_without_a_lower_tier_the_load_runs_at_once_and_finishes_in_the_same_step(tmp_path: Path) -> None:
    kv = PagedKV(num_blocks=128)
    worker = build_engine(engine_config(), PARAMS, kv.layout)  # no NATS, no store: nothing to fetch from
    try:
        tokens = random_tokens(2 * CHUNK, seed=34)
        src = kv.slots(len(tokens))
        token_api.store(worker, tokens, **kv.kv(src))
        req = request(worker, tokens, free_blocks(kv, src, 4), need=2 * CHUNK - 1)
        done, errors = step(worker_connector(worker, kv), KVMeshConnectorMetadata([req]))
        assert done == {"r"} and errors == set()
        assert torch.equal(kv.token_kv(req.slot_mapping(2 * CHUNK, BLOCK)), kv.token_kv(src))
    finally:
        worker.close()


@pytest.mark.parametrize("how", ["ended", "preempted"])
def test_a_load_given_up_never_scatters_into_its_blocks_and_releases_its_chunks(
        engine: tuple[CacheEngine, PagedKV], how: str) -> None:
    worker, kv = engine
    tokens = random_tokens(4 * CHUNK, seed=35)
    src = on_disk_only(worker, kv, tokens)
    blocks = free_blocks(kv, src, 8)
    slots = torch.as_tensor([b * BLOCK + i for b in blocks for i in range(BLOCK)])
    before = kv.token_kv(slots)
    conn = worker_connector(worker, kv)
    req = request(worker, tokens, blocks, need=4 * CHUNK - 1)
    conn.bind_connector_metadata(KVMeshConnectorMetadata([req]))
    conn.start_load_kv(None)
    conn.clear_connector_metadata()
    wait_until(lambda: all(p.fetched.done() for p in conn.worker_side.async_loads.pending()),
               what="the fetch ended (its chunks are ready to scatter)")
    if how == "ended":  # aborted while it waits: vLLM holds its blocks until the load is reported
        assert conn.get_finished({"r"}) == (None, {"r"})
    else:  # preempted (vLLM frees its blocks, which this step may give to another request): never reported
        conn.handle_preemptions(KVMeshConnectorMetadata(preempted={"r"}))
        assert conn.get_finished(set()) == (None, None)
    assert len(conn.worker_side.async_loads) == 0 and conn.get_block_ids_with_load_errors() == set()
    assert torch.equal(kv.token_kv(slots), before), "nothing was scattered into the blocks"
    wait_until(lambda: worker.pool.num_free == worker.pool.num_slots - 4, what="the load's chunks released")
