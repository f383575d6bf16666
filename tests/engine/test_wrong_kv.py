"""Never the wrong KV (issue 23): loads and saves that stay correct when a promised chunk is gone at load time, a
request is resumed with a longer chain, a rank holds more than the hit, or a chunk does not fit its span.

The connector's two halves are driven as vLLM drives them (tests/support/connector_driver.py) over a real cache engine,
with a context-dependent KV oracle (tests/support/kv_oracle.py): a token's KV depends on the KV its earlier block holds,
so a block that was never loaded poisons everything computed after it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import pytest
import torch

from kvmesh.services.engine.adapter.cpu_mirror import StepEventLog
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.services.engine.core.layerwise_load import LayerwiseLoader
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK
from kvmesh.shared.wire.keys import ChunkSpan

from support.kv_oracle import ContextForward
from support.engine import BLOCK, CHUNK, PagedKV, random_tokens
from support.engine_mesh import disk_mesh  # noqa: F401 (a fixture: NATS + a disk store)
from support.waiting import WAIT_S, wait_until
from support.worker_engine import engine  # noqa: F401 (a fixture: an engine on it)

pytest.importorskip("kvmesh.services.engine.connector")
from support.connector_driver import (  # noqa: E402
    Step, blocks, rank0_engine, request, run_step, scheduler_half, worker_half)

SCRATCH = list(range(50, 64))  # the oracle's own blocks


@pytest.fixture
def paged() -> Iterator[tuple[CacheEngine, PagedKV]]:
    kv = PagedKV(num_blocks=64)
    with rank0_engine(kv.layout) as worker:
        yield worker, kv


def stored_chunks_are_the_oracles(worker: CacheEngine, oracle: ContextForward, tokens: list[int]) -> list[int]:
    """The indexes of `tokens`' chunks (and of its block prefixes) held in the CPU tier with KV other than the
    oracle's for their key."""
    wrong = []
    spans = worker.hasher.spans(tokens)
    for i, span in enumerate(spans):
        ref = worker.cpu.acquire(span.key)
        if ref is None:
            continue
        try:
            chunk = ref.slot.view(worker.layout.dtype, worker.layout.chunk_shape(span.num_tokens))
            if not oracle.chunk_is(chunk, tokens, span.start, span.end):
                wrong.append(i)
        finally:
            ref.release()
    return wrong


def test_a_failed_load_is_never_saved_and_the_recomputed_kv_is(paged: tuple[CacheEngine, PagedKV]) -> None:
    """Finding 1: a request promised 2 chunks + 1 block (a block prefix) whose second chunk is gone at load time.
    Its load fails from token 32; the same step's forward computes tokens 80.. over the blocks the load left
    wrong. Nothing from token 32 on may be stored then; once vLLM has recomputed from the failed block, that KV
    is stored, and the same prompt again is a whole-prompt hit with the oracle's KV."""
    worker, kv = paged
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=False)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
    oracle = ContextForward(kv, SCRATCH)
    try:
        # a: 2 chunks + 24 tokens, stored (its third chunk also as its first block: the block prefix at 80)
        t_a = random_tokens(2 * CHUNK + BLOCK + 8, seed=31).tolist()
        a_blocks = [1, 2, 3, 4, 5, 6]
        assert sched.get_num_new_matched_tokens(request("a", t_a), 0) == (0, False)
        sched.update_state_after_alloc(request("a", t_a), blocks(a_blocks), 0)
        oracle.run(t_a, a_blocks, 0, len(t_a))
        run_step(sched, work, Step(new=[("a", a_blocks, 0, len(t_a))], finished=set()))
        run_step(sched, work, Step(finished={"a"}))

        # b extends a: promised 80 tokens (chunks 0 and 1, and chunk 2's first block)
        t_b = t_a[:2 * CHUNK + BLOCK] + random_tokens(24, seed=32).tolist()  # 104 tokens
        b = request("b", t_b)
        assert sched.get_num_new_matched_tokens(b, 0) == (2 * CHUNK + BLOCK, False)
        # chunk 1 is evicted between the lookup and the load
        assert worker.cpu.remove(worker.hasher.spans(t_b)[1].key)
        b_blocks = [10, 11, 12, 13, 14, 15, 16]
        for block in b_blocks:  # a previous owner's KV, as in reused blocks
            for cache in kv.caches.values():
                cache[block].normal_()
        sched.update_state_after_alloc(b, blocks(b_blocks), 2 * CHUNK + BLOCK)

        class LoadThenForward:
            """The forward of the loading step: tokens 80.. computed over whatever the load left."""
            def __call__(self, layer: int, name: str) -> None:
                if layer == 0:
                    oracle.run(t_b, b_blocks, 2 * CHUNK + BLOCK, len(t_b))
        result = run_step(sched, work, Step(new=[("b", b_blocks, 2 * CHUNK + BLOCK, 24)]), LoadThenForward())
        # blocks 2..4 (tokens 32..80) were not loaded, and the forward filled 5..6 over them
        assert result.load_errors == set(b_blocks[2:]), "not every block over the failed load is a load error"
        assert stored_chunks_are_the_oracles(worker, oracle, t_b) == [], "a chunk of the failed load was stored"

        # vLLM recomputes from the first failed block (token 32) and the request ends
        oracle.run(t_b, b_blocks, 2 * BLOCK, len(t_b))
        run_step(sched, work, Step(cached=[("b", [], 2 * BLOCK, len(t_b) - 2 * BLOCK, False)]))
        run_step(sched, work, Step(finished={"b"}))
        assert oracle.holds(t_b, b_blocks, len(t_b))
        assert stored_chunks_are_the_oracles(worker, oracle, t_b) == []
        assert token_api.lookup(worker, t_b, search_range=[LOCAL_CPU]) == len(t_b), "the recomputed chunks were stored"

        # the same prompt again: a proven whole-prompt load of the oracle's KV
        c, c_blocks = request("c", t_b), [20, 21, 22, 23, 24, 25, 26]
        assert sched.get_num_new_matched_tokens(c, 0) == (len(t_b) - 1, False)
        sched.update_state_after_alloc(c, blocks(c_blocks), len(t_b) - 1)
        result = run_step(sched, work, Step(new=[("c", c_blocks, len(t_b) - 1, 1)]))
        assert result.load_errors == set()
        assert oracle.holds(t_b, c_blocks, len(t_b) - 1)
    finally:
        sched.shutdown()


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_rank_holding_more_than_the_hit_loads_the_hit_cleanly(paged: tuple[CacheEngine, PagedKV],
                                                                layerwise: bool) -> None:
    """Finding 4: the load of a 64-token hit while the same step computes and saves up to 104 (the step's chain
    keys reach past the hit), and the CPU tier gained the third chunk after the lookup (as a rank holding more
    than every rank agrees on): the hit loads, nothing past it is read, nothing raises into the model runner."""
    worker, kv = paged
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=False)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
    if layerwise:
        work.worker_side.layerwise = LayerwiseLoader(kv.layout, torch.device("cpu"))
    oracle = ContextForward(kv, SCRATCH)
    try:
        t = random_tokens(3 * CHUNK + 8, seed=41).tolist()
        a_blocks = [1, 2, 3, 4, 5, 6, 7]
        oracle.run(t, a_blocks, 0, len(t))
        token_api.store(worker, t[:2 * CHUNK], kv_caches=kv.caches, slot_mapping=oracle._slots(a_blocks, 0, 2 * CHUNK))
        sched.update_connector_output(run_step(sched, work, Step()).worker_meta and None)  # mirror catches up
        b = request("b", t)
        assert sched.get_num_new_matched_tokens(b, 0) == (2 * CHUNK, False)
        token_api.store(worker, t[:3 * CHUNK], kv_caches=kv.caches, slot_mapping=oracle._slots(a_blocks, 0, 3 * CHUNK))
        b_blocks = [10, 11, 12, 13, 14, 15, 16]
        sched.update_state_after_alloc(b, blocks(b_blocks), 2 * CHUNK)

        class Forward:
            def __call__(self, layer: int, name: str) -> None:
                if layer == 0:
                    oracle.run(t, b_blocks, 2 * CHUNK, len(t))
        result = run_step(sched, work, Step(new=[("b", b_blocks, 2 * CHUNK, len(t) - 2 * CHUNK)]), Forward())
        assert result.load_errors == set()
        assert oracle.holds(t, b_blocks, len(t))
        assert stored_chunks_are_the_oracles(worker, oracle, t) == []
    finally:
        sched.shutdown()


def test_a_cpu_tier_chunk_that_does_not_fit_its_span_is_a_miss(paged: tuple[CacheEngine, PagedKV]) -> None:
    """Finding 5: a key paired with a span of another token count (a 10-token span naming a whole chunk's key)
    is never scattered from the CPU tier: a miss, counted."""
    worker, kv = paged
    oracle = ContextForward(kv, SCRATCH)
    t = random_tokens(2 * CHUNK, seed=51).tolist()
    oracle.run(t, [1, 2, 3, 4], 0, len(t))
    token_api.store(worker, t, kv_caches=kv.caches, slot_mapping=oracle._slots([1, 2, 3, 4], 0, len(t)))
    whole = worker.hasher.spans(t)[1]
    short = ChunkSpan(whole.index, whole.start, whole.start + 10, whole.key)
    before = [kv.caches[name][20].clone() for name in kv.caches]
    slots = oracle._slots([18, 19, 20], 0, CHUNK + 10)
    assert worker.load([worker.hasher.spans(t)[0], short], slots).scatter(kv.caches, slots) == 1
    assert worker.storage.stats["cpu_bad_meta"] == 1
    assert all(torch.equal(kv.caches[name][20], block) for name, block in zip(kv.caches, before)), \
        "the short span's blocks were written"


def test_a_resumed_request_looks_up_its_new_chain(engine: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    """Finding 3: a request hits 74 tokens (2 chunks + 10) on disk, decodes to 104 (with save_decode_cache its
    third chunk is stored whole under its own chain key), is preempted and resumes with the CPU tier empty. Its
    first lookup's answer belonged to the 74-token chain; the resumed request asks the disk store anew and loads
    the oracle's KV of the 104-token chain, with no load error."""
    worker, kv, _ = engine  # a real NATS and disk store (support/worker_engine.py)
    config = dataclasses.replace(worker.config, save_decode_cache=True, enable_async_loading=False)  # loads in-step
    sched = scheduler_half(config, BLOCK, saves_off_forward=False)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
    oracle = ContextForward(kv, list(range(100, 128)))
    client = worker.storage.lower(LOCAL_DISK)
    assert client is not None and worker.nats_loop is not None

    def on_disk_only() -> None:
        assert worker.wait_write_behind(WAIT_S)
        assert worker.nats_loop.call(client.wait_written(WAIT_S), WAIT_S + 1, default=False)
        token_api.clear(worker, LOCAL_CPU)
        run_step(sched, work, Step())  # the mirror hears of it

    def lookup(req: Any) -> int:
        answers: list[Any] = []
        wait_until(lambda: answers.append(sched.get_num_new_matched_tokens(req, 0)[0]) or answers[-1] is not None,
                   what="the lookup's answer")
        return answers[-1]

    def forward(tokens: list[int], block_ids: list[int], start: int, end: int) -> Any:
        return lambda layer, name: oracle.run(tokens, block_ids, start, end) if layer == 0 else None

    try:
        prompt = random_tokens(2 * CHUNK + 10, seed=61).tolist()
        a_blocks = [1, 2, 3, 4, 5]
        a = request("a", prompt)
        assert lookup(a) == 0
        sched.update_state_after_alloc(a, blocks(a_blocks), 0)
        run_step(sched, work, Step(new=[("a", a_blocks, 0, len(prompt))]), forward(prompt, a_blocks, 0, len(prompt)))
        run_step(sched, work, Step(finished={"a"}))
        on_disk_only()

        tokens = list(prompt)
        r = request("r", tokens)
        assert lookup(r) == len(prompt) - 1
        r_blocks = [10, 11, 12, 13, 14]
        sched.update_state_after_alloc(r, blocks(r_blocks), len(prompt) - 1)
        result = run_step(sched, work, Step(new=[("r", r_blocks, len(prompt) - 1, 1)]),
                          forward(tokens, r_blocks, len(prompt) - 1, len(prompt)))
        assert result.load_errors == set()
        for i, token in enumerate(random_tokens(3 * CHUNK + 8 - len(prompt), seed=62).tolist()):  # decode to 104
            position = len(tokens)
            tokens.append(token)
            r.num_tokens = len(tokens)
            new_block = [15 + len(r_blocks) - 5] if position % BLOCK == 0 else []
            r_blocks += new_block
            run_step(sched, work, Step(cached=[("r", new_block, position, 1, False)]),
                     forward(tokens, r_blocks, position, position + 1))
        assert oracle.holds(tokens, r_blocks, len(tokens))
        on_disk_only()

        run_step(sched, work, Step(preempted={"r"}))
        assert lookup(r) == 3 * CHUNK, "the resumed chain's three whole chunks, asked anew"
        resumed = [30, 31, 32, 33, 34, 35, 36]
        sched.update_state_after_alloc(r, blocks(resumed), 3 * CHUNK)
        result = run_step(sched, work, Step(cached=[("r", resumed, 3 * CHUNK, len(tokens) - 3 * CHUNK, True)]),
                          forward(tokens, resumed, 3 * CHUNK, len(tokens)))
        assert result.load_errors == set()
        assert oracle.holds(tokens, resumed, len(tokens))
    finally:
        sched.shutdown()


def test_a_request_sharing_a_block_whose_load_failed_does_not_save_past_it(
        paged: tuple[CacheEngine, PagedKV]) -> None:
    """vLLM's prefix cache gives y the blocks x is loading in the same step; x's load fails from its second
    chunk, so y's forward computes its third chunk over the blocks the load left wrong: y stores nothing from
    there either (the worker cuts the saves of every request of the step that holds a failed block)."""
    worker, kv = paged
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=False)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
    oracle = ContextForward(kv, SCRATCH)
    try:
        shared = random_tokens(2 * CHUNK, seed=81).tolist()
        oracle.run(shared, [1, 2, 3, 4], 0, len(shared))
        token_api.store(worker, shared, kv_caches=kv.caches, slot_mapping=oracle._slots([1, 2, 3, 4], 0, len(shared)))
        run_step(sched, work, Step())  # the mirror hears of it
        t_x = shared + random_tokens(CHUNK, seed=82).tolist()
        t_y = shared + random_tokens(CHUNK, seed=83).tolist()
        x, y = request("x", t_x), request("y", t_y)
        assert sched.get_num_new_matched_tokens(x, 0) == (2 * CHUNK, False)
        assert worker.cpu.remove(worker.hasher.spans(t_x)[1].key)  # gone between lookup and load
        x_blocks, y_blocks = [10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 20, 21]  # y: vLLM's prefix-cache hit
        for block in x_blocks:
            for cache in kv.caches.values():
                cache[block].normal_()
        sched.update_state_after_alloc(x, blocks(x_blocks), 2 * CHUNK)
        assert sched.get_num_new_matched_tokens(y, 2 * CHUNK) == (0, False)
        sched.update_state_after_alloc(y, blocks(y_blocks), 0)

        def forward(layer: int, name: str) -> None:
            if layer == 0:
                oracle.run(t_x, x_blocks, 2 * CHUNK, len(t_x))
                oracle.run(t_y, y_blocks, 2 * CHUNK, len(t_y))
        result = run_step(sched, work, Step(new=[("x", x_blocks, 2 * CHUNK, CHUNK), ("y", y_blocks, 2 * CHUNK, CHUNK)]),
                          forward)
        # x's blocks 12, 13 were not loaded; x's 14, 15 and y's 20, 21 were computed over them
        assert result.load_errors == {12, 13, 14, 15, 20, 21}
        assert stored_chunks_are_the_oracles(worker, oracle, t_x) == []
        assert stored_chunks_are_the_oracles(worker, oracle, t_y) == [], "y stored a chunk computed over x's failed load"
    finally:
        sched.shutdown()


def test_a_save_ending_inside_a_chunk_hashed_for_more_tokens_uses_the_shorter_sequences_key(
        paged: tuple[CacheEngine, PagedKV]) -> None:
    """Found by the simulation (tests/engine/fuzz.py): a request that grew past its prompt (decode) and then recomputes
    from a failed load's block saves up to its prompt's end, inside a chunk its chain already names for the
    longer sequence. That save must use the key a sequence ending there gives its partial chunk, never the
    longer chunk's key with fewer tokens."""
    worker, _ = paged
    from kvmesh.services.engine.adapter.request_meta import RequestTracker
    from kvmesh.shared.wire.keys import ChunkHasher, KeyParams

    hasher = ChunkHasher(KeyParams("test-model", worker.key_params.kv_format), CHUNK)
    tokens = random_tokens(CHUNK + 8, seed=91).tolist()
    tracker = RequestTracker("r", request("r", tokens), prompt_len=CHUNK - 2)
    assert tracker.chain_keys(hasher, len(tokens)) == [s.key for s in hasher.chain(tokens)]
    assert tracker.chain_keys(hasher, CHUNK - 2) == [s.key for s in hasher.chain(tokens[:CHUNK - 2])]
    assert tracker.chain_keys(hasher, CHUNK + 3) == [s.key for s in hasher.chain(tokens[:CHUNK + 3])]
    assert tracker.chain_keys(hasher, CHUNK) == [s.key for s in hasher.chain(tokens[:CHUNK])]
