"""The scheduler's view of its workers' caches (services/engine/adapter/scheduler_lookup.py), without vLLM.

* The CPU tiers come from a mirror fed by the workers' step outputs: answered at once, with no NATS at all.
* The lower tiers: one asynchronous lookup per rank, "ask again" (None) while it is in flight; the worker
  starts moving what it found into its CPU tier.
Real cache engines in this process (vLLM's single-process case: `engines`), a real NATS and disk store.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from kvmesh.services.engine.assembly import build_engine
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.adapter.cpu_mirror import CpuTierEvents, CpuTierMirror, StepEventLog
from kvmesh.services.engine.adapter.scheduler_lookup import LowerLookup, SchedulerLookup
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.ops.local_mesh import LocalMesh
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, REMOTE
from kvmesh.shared.wire.keys import KeyParams

from support.engine import CHUNK, PagedKV, engine_config, random_tokens
from support.engine_mesh import PARAMS, disk_mesh  # noqa: F401 (disk_mesh: a fixture)
from support.worker_engine import (  # noqa: F401 (engine: a fixture)
    engine, only_on_disk, scheduler_lookup, wait_written_to_disk)
from support.waiting import WAIT_S, wait_until


def test_step_events_aggregate_per_rank_and_feed_the_mirror() -> None:
    a, b = bytes(16), bytes([1]) * 16
    events = CpuTierEvents({0: [(True, a), (True, b)]}).aggregate(CpuTierEvents({1: [(True, a)]}))
    events = events.aggregate(CpuTierEvents({0: [(False, b)]}))
    mirror = CpuTierMirror()
    mirror.apply(events)
    assert mirror.prefix(0, [a, b]) == 1 and mirror.prefix(1, [a, b]) == 1 and mirror.prefix(2, [a]) == 0
    log = StepEventLog()
    log.admit(a)
    log.evict(a)
    assert log.take() == [(True, a), (False, a)] and log.take() == []


def ask_until_answered(lookup: SchedulerLookup, chain: list, num_tokens: int, lower: LowerLookup | None,
                       prefetch_from: int = 0, tiers: frozenset[str] | None = None) -> int:
    """The tokens held, asking as vLLM does ("ask again" while `lower`, the lookup in flight, has no answer)."""
    held: int | None = None

    def answered() -> bool:
        nonlocal lower, held
        held, lower = lookup.held(chain, num_tokens, lower, prefetch_from=prefetch_from, tiers=tiers)
        return held is not None

    wait_until(answered, what="the lower tiers' answer")
    assert held is not None
    return held


def test_cpu_hits_come_from_the_mirror_and_disk_hits_ask_again_then_prefetch(
        engine: tuple[CacheEngine, PagedKV, StepEventLog], disk_mesh: LocalMesh) -> None:
    worker, kv, events = engine
    lookup, hasher = scheduler_lookup()
    assert hasher.params == KeyParams("test-model", worker.key_params.kv_format)
    tokens = random_tokens(3 * CHUNK, seed=7)
    chain = hasher.chain(tokens.tolist())
    token_api.store(worker, tokens, **kv.kv(kv.slots(len(tokens))))
    wait_written_to_disk(worker)  # files complete

    # the step's events reach the mirror: a CPU hit, answered at once (no lower-tier lookup)
    lookup.update(CpuTierEvents({0: events.take()}))
    held, lower = lookup.held(chain, len(tokens), None)
    assert held == len(tokens) and lower is None

    # the CPU tier loses the chunks (reported with the next step): the disk store has them
    token_api.clear(worker, LOCAL_CPU)
    lookup.update(CpuTierEvents({0: events.take()}))
    assert token_api.lookup(worker, tokens, [LOCAL_CPU]) == 0
    # while the disk store has not answered, the scheduler is told to ask again, never kept waiting (the store
    # is frozen for that: an answer faster than the next line would be fine, and would prove nothing)
    store = disk_mesh.processes[0]
    os.kill(store.pid, signal.SIGSTOP)
    try:
        held, lower = lookup.held(chain, len(tokens), None)
        assert held is None and lower is not None
    finally:
        os.kill(store.pid, signal.SIGCONT)
    held = ask_until_answered(lookup, chain, len(tokens), lower)
    assert held == len(tokens)
    # the worker started moving them into its CPU tier with the same walk
    wait_until(lambda: token_api.lookup(worker, tokens, [LOCAL_CPU]) == len(tokens),
               what="the prefetch into the CPU tier")
    assert worker.storage.stats[f"fetched_{LOCAL_DISK}"] == 3
    lookup.close()


def test_the_lookups_prefetch_skips_what_vllms_prefix_cache_computed(
        engine: tuple[CacheEngine, PagedKV, StepEventLog], disk_mesh: LocalMesh) -> None:
    """A request whose first tokens vLLM's own prefix cache holds loads only the rest: the lookup still answers
    the whole held prefix, but reads from the disk store only the chunks that end after vLLM's computed tokens."""
    worker, kv, events = engine
    lookup, hasher = scheduler_lookup()
    tokens = random_tokens(4 * CHUNK, seed=17)
    chain = hasher.chain(tokens.tolist())
    token_api.store(worker, tokens, **kv.kv(kv.slots(len(tokens))))
    only_on_disk(worker, events, lookup)

    computed = 2 * CHUNK + 3  # vLLM computed into chunk 2: chunks 0 and 1 end before it, chunk 2 does not
    assert ask_until_answered(lookup, chain, len(tokens), None, prefetch_from=computed) == len(tokens)
    spans = worker.chunk_spans([span.key for span in chain], len(tokens))
    wait_until(lambda: all(span.key in worker.cpu for span in spans[2:]), what="chunks 2 and 3 prefetched")
    assert worker.storage.stats[f"fetched_{LOCAL_DISK}"] == 2
    assert not any(span.key in worker.cpu for span in spans[:2]), "chunks vLLM holds are not read"
    lookup.close()


def test_without_nats_the_mirror_still_answers(engine: tuple[CacheEngine, PagedKV, StepEventLog],
                                               disk_mesh: LocalMesh) -> None:
    worker, kv, events = engine
    lookup, hasher = scheduler_lookup()
    cached, unknown = random_tokens(2 * CHUNK, seed=8), random_tokens(2 * CHUNK, seed=9)
    token_api.store(worker, cached, **kv.kv(kv.slots(len(cached))))
    lookup.update(CpuTierEvents({0: events.take()}))
    disk_mesh.stop()  # NATS and the disk store are gone
    wait_until(lambda: not worker.connected, what="the worker to see NATS gone")
    held, lower = lookup.held(hasher.chain(cached.tolist()), len(cached), None)
    assert held == len(cached) and lower is None, "the CPU tier is answered from the mirror"
    held, lower = lookup.held(hasher.chain(unknown.tolist()), len(unknown), None)
    assert held == 0 and lower is None, "a dead NATS is a miss at once, never an 'ask again'"
    lookup.close()


def test_a_lookup_then_its_load_ask_the_disk_store_once(engine: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    """The load right behind a lower-tier lookup waits for the prefetch the lookup started; it does not ask the
    store again where the chunks are."""
    worker, kv, _ = engine
    tokens = random_tokens(4 * CHUNK, seed=11)
    token_api.store(worker, tokens, **kv.kv(kv.slots(len(tokens))))
    client = wait_written_to_disk(worker)
    assert worker.nats_loop is not None
    token_api.clear(worker, LOCAL_CPU)
    asked: list[int] = []
    contains = client.contains

    async def counted(keys: list) -> int:
        asked.append(len(keys))
        return await contains(keys)

    client.contains = counted  # type: ignore[method-assign]
    spans = worker.chunk_spans([span.key for span in worker.hasher.chain(tokens.tolist())], len(tokens))
    held = worker.nats_loop.call(worker.lookup_and_prefetch(spans), WAIT_S, default=0)
    assert held == len(tokens)
    slots = kv.slots(len(tokens))
    assert worker.load(spans, slots).scatter(kv.caches, slots) == 4
    assert asked == [4], asked


def test_the_lookups_prefetch_takes_at_most_its_share_of_the_cpu_tier(disk_mesh: LocalMesh, tmp_path: Path) -> None:
    """Waiting requests' prefetches fill at most `prefetch_cpu_share` of the CPU tier with chunks no load has read:
    a lookup prefetches the first chunks that fit, the next one none while those wait unread, and once a load
    reads them there is room again. The load reads the rest itself, and what it loads is the stored KV."""
    kv = PagedKV(num_blocks=128)
    worker = build_engine(engine_config(nats_url=disk_mesh.nats_url, local_disk=str(tmp_path / "disk"), cpu_chunks=12,
                                        prefetch_cpu_share=0.25), PARAMS, kv.layout)  # room for 3 chunks
    try:
        assert worker.wait_connected(WAIT_S)
        wait_until(lambda: worker.storage.lower(LOCAL_DISK), what="the disk store found")
        stored = {}
        for seed in (21, 22):
            tokens = random_tokens(4 * CHUNK, seed=seed)
            slots = kv.slots(len(tokens))
            token_api.store(worker, tokens, **kv.kv(slots))
            stored[seed] = (tokens, kv.token_kv(slots))
        wait_written_to_disk(worker)
        token_api.clear(worker, LOCAL_CPU)
        a, b = (worker.chunk_spans([s.key for s in worker.hasher.chain(stored[seed][0].tolist())], 4 * CHUNK)
                for seed in (21, 22))

        def lookup(spans: list) -> int:
            assert worker.nats_loop is not None
            return worker.nats_loop.call(worker.lookup_and_prefetch(spans), WAIT_S, default=0)

        assert lookup(a) == 4 * CHUNK  # the answer is the whole held prefix...
        wait_until(lambda: all(span.key in worker.cpu for span in a[:3]), what="a's first 3 chunks prefetched")
        assert a[3].key not in worker.cpu and worker.cpu.unread_prefetched == 3  # ...the prefetch only what fits
        assert lookup(b) == 4 * CHUNK  # no room: b's chunks wait for its load
        slots = kv.slots(4 * CHUNK)
        assert worker.load(a, slots).scatter(kv.caches, slots) == 4
        assert torch.equal(kv.token_kv(slots), stored[21][1])
        assert worker.cpu.unread_prefetched == 0
        assert lookup(b) == 4 * CHUNK  # a's load read its prefetched chunks: room for b's
        wait_until(lambda: all(span.key in worker.cpu for span in b[:3]), what="b's first 3 chunks prefetched")
        # 3 prefetched and 1 loaded for a, 3 prefetched for b: b's first lookup read nothing
        assert worker.storage.stats[f"fetched_{LOCAL_DISK}"] == 7
    finally:
        worker.close()


def test_a_requests_load_tiers_are_the_only_ones_counted(engine: tuple[CacheEngine, PagedKV, StepEventLog],
                                                        disk_mesh: LocalMesh) -> None:
    """kv_load_tiers (adapter/request_retention.py): the mirror counts only with the CPU tier named, the workers
    walk only the named lower tiers, and a lookup naming no lower tier never asks them."""
    worker, kv, events = engine
    lookup, hasher = scheduler_lookup()
    tokens = random_tokens(3 * CHUNK, seed=9)
    chain = hasher.chain(tokens.tolist())
    token_api.store(worker, tokens, **kv.kv(kv.slots(len(tokens))))
    wait_written_to_disk(worker)
    lookup.update(CpuTierEvents({0: events.take()}))

    assert lookup.held(chain, len(tokens), None, tiers=frozenset({LOCAL_CPU})) == (len(tokens), None)
    assert ask_until_answered(lookup, chain, len(tokens), None, tiers=frozenset({LOCAL_DISK})) == len(tokens)
    assert ask_until_answered(lookup, chain, len(tokens), None, tiers=frozenset({REMOTE})) == 0  # none here
    assert ask_until_answered(lookup, chain, len(tokens), None, tiers=frozenset()) == 0

    token_api.clear(worker, LOCAL_CPU)  # only the disk store holds them now
    lookup.update(CpuTierEvents({0: events.take()}))
    assert lookup.held(chain, len(tokens), None, tiers=frozenset({LOCAL_CPU})) == (0, None)  # never asked below
    assert worker.storage.stats[f"fetched_{LOCAL_DISK}"] == 0  # and nothing was prefetched for it
    assert ask_until_answered(lookup, chain, len(tokens), None, tiers=frozenset({LOCAL_DISK})) == len(tokens)
    lookup.close()


def test_a_step_that_schedules_nothing_waits_for_the_lookup_in_flight(
        engine: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    """While a request waits for its lower-tier lookup, vLLM's steps schedule nothing: such a step's metadata is
    built only once a lookup in flight is answered (or IDLE_WAIT_SECS passed), so the request asks again and is
    answered in the next step, not after empty steps passed back and forth."""
    from support.connector_driver import Step, request, scheduler_half

    worker, kv, events = engine
    sched = scheduler_half(worker.config, kv.layout.block_size, saves_off_forward=False)
    side = sched.scheduler_side
    assert side is not None and side.lookup is not None
    try:
        tokens = random_tokens(3 * CHUNK, seed=23)
        token_api.store(worker, tokens, **kv.kv(kv.slots(len(tokens))))
        only_on_disk(worker, events, side.lookup)
        waiting = request("r1", tokens.tolist())
        assert sched.get_num_new_matched_tokens(waiting, 0) == (None, False)  # asked below: ask again
        assert sched.build_connector_meta(Step().output()).idle  # nothing scheduled: waits for the answer
        assert sched.get_num_new_matched_tokens(waiting, 0)[0] == len(tokens) - 1
    finally:
        sched.shutdown()
