"""Hits that end at a block boundary inside a chunk (services/engine/adapter/block_prefix.py).

A prompt that extends an earlier one shares its KV up to the earlier prompt's last whole block; the chain's
whole-chunk keys alone reuse only up to its last whole chunk. Checked here: the arithmetic, that a block
prefix's key is exactly the key a shorter sequence gives its partial last chunk (extras included), and, with
the connector's two halves driven as vLLM drives them over a real engine, that the longer prompt loads the
earlier prompt's KV up to that block (from the CPU tier through the mirror, and from the disk store through
the "ask again" lookup), saves its own chunk under the chain key, and never loads another prompt's KV.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from kvmesh.services.engine.adapter.block_prefix import BlockPrefixProbe, probe_ends, saved_prefix_end
from kvmesh.services.engine.adapter.cpu_mirror import StepEventLog
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK
from kvmesh.shared.wire.keys import ChunkHasher, KeyExtras, KeyParams

from support.engine import BLOCK, CHUNK, PagedKV, random_tokens
from support.engine_mesh import disk_mesh  # noqa: F401 (a fixture)
from support.kv_oracle import Forward
from support.waiting import wait_until
from support.worker_engine import engine, only_on_disk, scheduler_lookup  # noqa: F401 (engine: a fixture)

pytest.importorskip("kvmesh.services.engine.connector")
from support.connector_driver import (  # noqa: E402
    prefill, rank0_engine, request, scheduler_half, worker_half)


def test_probes_are_the_block_boundaries_strictly_inside_the_next_chunk_longest_first() -> None:
    assert probe_ends(512, 768, 256, 64) == [704, 640, 576]
    assert probe_ends(512, 700, 256, 64) == [640, 576]  # the sequence ends inside the chunk
    assert probe_ends(512, 530, 256, 64) == []  # inside the chunk's first block: nothing to share
    assert probe_ends(0, 300, 256, 128) == [128]
    assert probe_ends(500, 768, 256, 64) == []  # a hit inside a chunk is already a block prefix
    assert probe_ends(512, 768, 256, 256) == []  # one block per chunk: the chain's keys are block keys


def test_a_prompt_ending_inside_a_chunk_saves_its_last_whole_blocks_there() -> None:
    assert saved_prefix_end(700, 256, 64) == 640
    assert saved_prefix_end(640, 256, 64) == 0  # the partial chunk is whole blocks: it is the prefix itself
    assert saved_prefix_end(550, 256, 64) == 0  # inside the chunk's first block
    assert saved_prefix_end(768, 256, 64) == 0  # ends on a chunk boundary
    assert saved_prefix_end(700, 256, 256) == 0


@pytest.mark.parametrize("extras", [None, KeyExtras(lora_id="adapter-1", cache_salt="tenant-a",
                                                    mm_identifiers=["img"], mm_offsets=[530], mm_lengths=[100])])
def test_a_block_prefix_is_keyed_as_the_shorter_sequences_partial_last_chunk(extras: KeyExtras | None) -> None:
    hasher = ChunkHasher(KeyParams("m", "f"), 256)
    tokens = random_tokens(760, seed=3).tolist()
    chain = hasher.chain(tokens, extras=extras)
    for end in (640, 576, 128):
        span = hasher.prefix_span(tokens, chain, end, extras)
        shorter = hasher.chain(tokens[:end], extras=extras)[-1]
        assert (span.index, span.start, span.end, span.key) == (shorter.index, shorter.start, shorter.end, shorter.key)
        assert span.key != chain[span.index].key  # never the whole chunk's key
    other = KeyExtras(lora_id="adapter-2")
    assert hasher.prefix_span(tokens, chain, 640, extras).key != hasher.prefix_span(
        tokens, hasher.chain(tokens, extras=other), 640, other).key
    with pytest.raises(ValueError, match="needs 800 tokens"):
        hasher.prefix_span(tokens, chain, 800, extras)


@pytest.fixture
def paged() -> Iterator[tuple[CacheEngine, PagedKV]]:
    kv = PagedKV(num_blocks=64)
    with rank0_engine(kv.layout) as worker:
        yield worker, kv


def test_an_extended_prompt_loads_the_earlier_prompts_kv_up_to_its_last_whole_block(
        paged: tuple[CacheEngine, PagedKV]) -> None:
    worker, kv = paged
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=False)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
    forward = Forward(kv)
    try:
        # r1 ends one block and 5 tokens into its third chunk: that chunk is stored whole (21 tokens) and as
        # its first block (16 tokens)
        t1 = random_tokens(2 * CHUNK + BLOCK + 5, seed=1).tolist()
        assert prefill(sched, work, forward, "r1", t1, [1, 2, 3, 4, 5, 6]) == (0, False)

        # r2 extends r1: its third chunk is whole and misses, but its first block is r1's
        t2 = t1 + random_tokens(40, seed=2).tolist()
        r2_blocks = [10, 11, 12, 13, 14, 15, 16, 17]
        assert prefill(sched, work, forward, "r2", t2, r2_blocks) == (2 * CHUNK + BLOCK, False)
        assert forward.holds("r1", r2_blocks, range(5)), "r2's first 5 blocks hold r1's KV, loaded"

        # r2 saved its own third chunk under the chain key: the same prompt again is a whole-prompt hit
        assert sched.get_num_new_matched_tokens(request("r3", t2), 0) == (len(t2) - 1, False)

        # a prompt that differs inside that first block shares only the whole chunks before it
        t4 = t1[: 2 * CHUNK + 3] + random_tokens(50, seed=4).tolist()
        assert sched.get_num_new_matched_tokens(request("r4", t4), 0) == (2 * CHUNK, False)
    finally:
        sched.shutdown()


def test_a_block_prefix_is_found_and_loaded_only_in_a_requests_load_tiers(paged: tuple[CacheEngine, PagedKV]) -> None:
    """kv_load_tiers (adapter/request_retention.py) govern block prefixes as they govern whole chunks: a request
    naming the CPU tier loads r1's KV up to its last whole block from it; one naming only the disk store (which
    this engine has not) is promised nothing, though the CPU tier holds it all."""
    worker, kv = paged
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=False)
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
    forward = Forward(kv)
    try:
        t1 = random_tokens(2 * CHUNK + BLOCK + 5, seed=7).tolist()
        assert prefill(sched, work, forward, "r1", t1, [1, 2, 3, 4, 5, 6]) == (0, False)
        t2 = t1 + random_tokens(40, seed=8).tolist()
        assert sched.get_num_new_matched_tokens(
            request("r3", t2, kv_transfer_params={"kv_load_tiers": ["LocalDiskBackend"]}), 0) == (0, False)
        hits = worker.cpu.hits
        r2_blocks = [10, 11, 12, 13, 14, 15, 16, 17]
        assert prefill(sched, work, forward, "r2", t2, r2_blocks,
                       kv_transfer_params={"kv_load_tiers": ["LocalCPUBackend"]}) == (2 * CHUNK + BLOCK, False)
        assert forward.holds("r1", r2_blocks, range(5)), "r2's first 5 blocks hold r1's KV, loaded"
        assert worker.cpu.hits == hits + 3, "two whole chunks and the block prefix, from the CPU tier"
    finally:
        sched.shutdown()


def test_a_block_prefix_is_published_to_routers_like_a_partial_last_chunk(paged: tuple[CacheEngine, PagedKV]) -> None:
    kv_events = pytest.importorskip("kvmesh.services.engine.adapter.kv_events")
    worker, kv = paged
    sched = scheduler_half(worker.config, BLOCK, saves_off_forward=False,
                           kv_events=kv_events.KVEventLog(1000, CHUNK))  # vLLM's --kv-events-config
    work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
    try:
        tokens = random_tokens(2 * CHUNK + BLOCK + 5, seed=6).tolist()
        prefill(sched, work, Forward(kv), "r1", tokens, [1, 2, 3, 4, 5, 6])
        chain = sched.scheduler_side.tracker("r1").chain
        stored = {tuple(e.token_ids): e for e in sched.take_events() if type(e).__name__ == "BlockStored"}
        assert len(stored) == 4, "two whole chunks, the partial last one and its block prefix"
        prefix = stored[tuple(tokens[2 * CHUNK: 2 * CHUNK + BLOCK])]
        assert prefix.parent_block_hash == kv_events.external_hash(chain[1].key)
    finally:
        sched.shutdown()


def test_a_block_prefix_only_on_disk_is_found_by_asking_again(
        engine: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    worker, kv, events = engine  # a worker engine with a real NATS and disk store (support/worker_engine.py)
    lookup, hasher = scheduler_lookup()
    tokens = random_tokens(2 * CHUNK, seed=5).tolist()
    chain = hasher.chain(tokens)
    prefix = hasher.prefix_span(tokens, chain, CHUNK + BLOCK)
    worker.save([chain[0], prefix], kv.caches, kv.slots(CHUNK + BLOCK))  # what r1's save leaves
    only_on_disk(worker, events, lookup)

    probe = BlockPrefixProbe.of(hasher, tokens, chain, CHUNK, BLOCK, None)
    assert [s.end for s in probe.spans] == [CHUNK + BLOCK]
    answers: list[tuple[bool, object]] = []
    wait_until(lambda: answers.append(probe.held(lookup)) or answers[-1][0], what="the disk store's answer")
    assert answers[0] == (False, None), "the first answer is 'ask again': the disk store is asked"
    assert answers[-1] == (True, prefix)
    # the same walk moved it into the CPU tier, for the load one step later
    wait_until(lambda: prefix.key in worker.cpu, what="the block prefix prefetched into the CPU tier")
    lookup.close()


def test_a_block_prefix_lookup_asks_only_the_requests_load_tiers(
        engine: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    """With kv_load_tiers the block-prefix probe looks only in those tiers: naming the CPU tier only, a prefix
    the disk store holds is not found and the store is never asked; naming the disk store only, it is found
    there, and nothing is prefetched into the CPU tier (that request's load never reads it)."""
    worker, kv, events = engine
    lookup, hasher = scheduler_lookup()
    tokens = random_tokens(2 * CHUNK, seed=9).tolist()
    chain = hasher.chain(tokens)
    prefix = hasher.prefix_span(tokens, chain, CHUNK + BLOCK)
    worker.save([chain[0], prefix], kv.caches, kv.slots(CHUNK + BLOCK))
    only_on_disk(worker, events, lookup)

    cpu_only = BlockPrefixProbe.of(hasher, tokens, chain, CHUNK, BLOCK, None)
    assert cpu_only.held(lookup, frozenset({LOCAL_CPU})) == (True, None), "answered at once: no store asked"
    assert cpu_only.lowers == [None]
    disk_only = BlockPrefixProbe.of(hasher, tokens, chain, CHUNK, BLOCK, None)
    answers: list[tuple[bool, object]] = []
    wait_until(lambda: answers.append(disk_only.held(lookup, frozenset({LOCAL_DISK}))) or answers[-1][0],
               what="the disk store's answer")
    assert answers[-1] == (True, prefix)
    assert prefix.key not in worker.cpu and worker.storage.stats[f"fetched_{LOCAL_DISK}"] == 0, "nothing prefetched"
    lookup.close()
