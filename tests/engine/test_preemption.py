"""Preemption and request ends, with the connector's two halves driven as vLLM's scheduler and model runner drive
them (tests/support/connector_driver.py) over a real cache engine and paged KV in this process.

What must hold: a preempted request's freed blocks are reused by another request, and neither request's chunks
ever hold the other's KV; the preempted request resumes in new blocks, loads what it saved and saves the rest
from its new blocks. Where saves run off the forward's path (CUDA; `saves_off_forward` here on CPU drives the
same bookkeeping), vLLM holds an ended request's blocks (request_finished answers True) until the worker
reports it once in finished_sending; on CPU nothing is held."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.protocol import LOCAL_CPU

from support.engine import BLOCK, CHUNK, PagedKV, random_tokens
from support.kv_oracle import Forward

pytest.importorskip("kvmesh.services.engine.connector")
from support.connector_driver import (  # noqa: E402
    Step, blocks, rank0_engine, request, run_step, scheduler_half, worker_half)


@pytest.fixture
def engine() -> Iterator[tuple[CacheEngine, PagedKV]]:
    kv = PagedKV(num_blocks=64)
    with rank0_engine(kv.layout) as worker:
        yield worker, kv


def cached_correctly(worker: CacheEngine, kv: PagedKV, forward: Forward, req_id: str, tokens: list[int],
                     scratch: list[int]) -> bool:
    """Whether the CPU tier holds all of `tokens` with `req_id`'s KV (loaded into `scratch` blocks to check)."""
    slots = torch.as_tensor([b * BLOCK + i for b in scratch for i in range(BLOCK)])[:len(tokens)]
    if token_api.lookup(worker, tokens, search_range=[LOCAL_CPU]) != len(tokens):
        return False
    token_api.retrieve(worker, tokens, kv_caches=kv.caches, slot_mapping=slots)
    return forward.holds(req_id, scratch, range(len(tokens) // BLOCK))


@pytest.mark.parametrize("saves_off_forward", [False, True])
def test_a_preempted_requests_blocks_are_reused_and_it_resumes_with_its_own_kv(
        engine: tuple[CacheEngine, PagedKV], saves_off_forward: bool) -> None:
    worker, kv = engine
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward)
    forward = Forward(kv)
    try:
        t1, t2 = random_tokens(4 * CHUNK, seed=1).tolist(), random_tokens(2 * CHUNK, seed=2).tolist()
        r1, r2 = request("r1", t1), request("r2", t2)
        first_blocks = [3, 9, 4, 12]  # r1's first half (a chunked prefill of 2 chunks = 4 blocks)
        assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
        sched.update_state_after_alloc(r1, blocks(first_blocks), 0)
        forward.compute("r1", first_blocks, 0, 4)
        run_step(sched, work, Step(new=[("r1", first_blocks, 0, 2 * CHUNK)]), forward)

        # r1 is preempted: vLLM frees its blocks and gives them to r2 in the same step
        assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)
        sched.update_state_after_alloc(r2, blocks(first_blocks), 0)
        forward.compute("r2", first_blocks, 0, 4)
        run_step(sched, work, Step(new=[("r2", first_blocks, 0, 2 * CHUNK)], preempted={"r1"}), forward)
        assert sched.scheduler_side.tracker("r1").block_ids == []

        # r1 resumes in new blocks: its saved half is loaded (from the CPU tier), the rest computed and saved
        resumed = [20, 21, 22, 23, 24, 25, 26, 27]
        assert sched.get_num_new_matched_tokens(r1, 0) == (2 * CHUNK, False)
        sched.update_state_after_alloc(r1, blocks(resumed), 2 * CHUNK)
        forward.compute("r1", resumed, 4, 4)
        result = run_step(sched, work, Step(cached=[("r1", resumed, 2 * CHUNK, 2 * CHUNK, True)]), forward)
        assert result.load_errors == set()
        assert forward.holds("r1", resumed, range(8)), "r1's loaded half is its own KV, not r2's"
        assert cached_correctly(worker, kv, forward, "r1", t1, [40 + i for i in range(8)])
        assert cached_correctly(worker, kv, forward, "r2", t2, [50 + i for i in range(4)])
    finally:
        sched.shutdown()


def test_an_ended_requests_blocks_are_held_until_its_saves_are_reported_once(
        engine: tuple[CacheEngine, PagedKV]) -> None:
    worker, kv = engine
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=True)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=True)
    forward = Forward(kv)
    try:
        tokens = random_tokens(2 * CHUNK, seed=3).tolist()
        req, ids = request("r", tokens), [5, 6, 7, 8]
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, blocks(ids), 0)
        forward.compute("r", ids, 0, 4)
        assert run_step(sched, work, Step(new=[("r", ids, 0, 2 * CHUNK)]), forward).finished_sending == set()
        assert sched.request_finished(req, ids) == (True, None)  # vLLM keeps the blocks
        assert run_step(sched, work, Step(finished={"r"})).finished_sending == {"r"}
        assert run_step(sched, work, Step()).finished_sending == set()  # reported once
        assert cached_correctly(worker, kv, forward, "r", tokens, [30, 31, 32, 33])

        # a request that never saved is not held, and never reported
        other = request("n", random_tokens(10, seed=4).tolist())
        sched.get_num_new_matched_tokens(other, 0)
        assert sched.request_finished(other, []) == (False, None)
        assert run_step(sched, work, Step(finished={"n"})).finished_sending == set()
    finally:
        sched.shutdown()


def test_on_cpu_an_ended_request_frees_its_blocks_at_once(engine: tuple[CacheEngine, PagedKV]) -> None:
    worker, kv = engine
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=False)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
    try:
        tokens = random_tokens(2 * CHUNK, seed=5).tolist()
        req, ids = request("r", tokens), [1, 2, 3, 4]
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, blocks(ids), 0)
        run_step(sched, work, Step(new=[("r", ids, 0, 2 * CHUNK)]))
        assert token_api.lookup(worker, tokens, search_range=[LOCAL_CPU]) == 2 * CHUNK  # stored within the step
        assert sched.request_finished(req, ids) == (False, None)
        assert run_step(sched, work, Step(finished={"r"})).finished_sending == set()
    finally:
        sched.shutdown()


def test_a_request_that_waits_for_an_async_load_is_not_held_for_its_earlier_saves(
        engine: tuple[CacheEngine, PagedKV]) -> None:
    # vLLM already holds a WAITING_FOR_REMOTE_KVS request's blocks until its load is reported: holding them
    # for a save too would have them freed twice
    worker, _ = engine
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=True)
    try:
        tokens = random_tokens(2 * CHUNK, seed=6).tolist()
        req = request("r", tokens)
        sched.get_num_new_matched_tokens(req, 0)
        tracker: Any = sched.scheduler_side.tracker("r")
        tracker.saves_held = True  # it saved before a preemption
        tracker.num_to_load, tracker.load_async = 2 * CHUNK - 1, True  # resumed with a load from the disk
        sched.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 2 * CHUNK - 1)
        assert sched.request_finished(req, [1, 2, 3, 4]) == (False, None)
    finally:
        sched.shutdown()


def test_a_request_whose_load_failed_is_offered_no_more_loads(engine: tuple[CacheEngine, PagedKV]) -> None:
    # vLLM sends an async-loading request whose load failed back to waiting and looks it up again: promising
    # the same chunks again (a lower tier may still list what it cannot serve) would fail again, for ever
    worker, kv = engine
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=False)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
    forward = Forward(kv)
    try:
        tokens = random_tokens(2 * CHUNK + 1, seed=8).tolist()
        stored, stored_blocks = request("a", tokens), [1, 2, 3, 4, 5]
        assert sched.get_num_new_matched_tokens(stored, 0) == (0, False)
        sched.update_state_after_alloc(stored, blocks(stored_blocks), 0)
        forward.compute("a", stored_blocks, 0, 5)
        run_step(sched, work, Step(new=[("a", stored_blocks, 0, len(tokens))]), forward)

        again, again_blocks = request("b", tokens), [10, 11, 12, 13, 14]
        assert sched.get_num_new_matched_tokens(again, 0) == (2 * CHUNK, False)
        sched.update_state_after_alloc(again, blocks(again_blocks), 2 * CHUNK)
        run_step(sched, work, Step(new=[("b", again_blocks, 2 * CHUNK, 1)]))
        # had its load failed, the workers would have reported its blocks: vLLM reschedules it and asks again
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None, invalid_block_ids={11}))
        assert sched.get_num_new_matched_tokens(again, 0) == (0, False)  # recomputed, not promised again
        assert sched.get_num_new_matched_tokens(request("c", tokens), 0) == (2 * CHUNK, False)  # others still load
    finally:
        sched.shutdown()
