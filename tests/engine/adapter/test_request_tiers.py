"""A request's kv_load_tiers (adapter/request_retention.py) on the worker's loads, through both halves of the
connector on a real cache engine, NATS and disk store: a tier the request leaves out is never read, even when
it holds the chunk; the chunk comes from a tier the request names. KV checked with the context oracle
(support/kv_oracle.py `ContextForward`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvmesh.services.engine.adapter.cpu_mirror import StepEventLog
from kvmesh.services.engine.core import token_api
from kvmesh.services.engine.core.cache_engine import CacheEngine
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK

from support.engine import BLOCK, CHUNK, PagedKV, random_tokens
from support.engine_mesh import disk_mesh  # noqa: F401 (a fixture)
from support.kv_oracle import ContextForward
from support.waiting import WAIT_S, wait_until
from support.worker_engine import engine  # noqa: F401 (a fixture)

pytest.importorskip("kvmesh.services.engine.connector")
from support.connector_driver import Step, blocks, request, run_step, scheduler_half, worker_half  # noqa: E402

SCRATCH = range(100, 128)  # the oracle's own blocks


def on_disk(worker: CacheEngine) -> None:
    """Wait until every chunk the CPU tier took has reached the disk store."""
    client = worker.storage.lower(LOCAL_DISK)
    assert client is not None and worker.nats_loop is not None
    assert worker.wait_write_behind(WAIT_S)
    assert worker.nats_loop.call(client.wait_written(WAIT_S), WAIT_S + 1, default=False)


def answered(sched: Any, req: Any) -> tuple[int | None, bool]:
    """The lookup's answer, asking again as vLLM does while the lower tiers are asked."""
    answer: tuple[int | None, bool] = (None, False)

    def ask() -> bool:
        nonlocal answer
        answer = sched.get_num_new_matched_tokens(req, 0)
        return answer[0] is not None

    wait_until(ask, what="the lookup's answer")
    return answer


@pytest.mark.parametrize("between_steps", [False, True], ids=["in-step", "async"])
def test_a_load_that_leaves_the_cpu_tier_out_reads_the_disk_store_not_the_cpu_copy(
        engine: tuple[CacheEngine, PagedKV, StepEventLog], between_steps: bool) -> None:
    worker, kv, _ = engine
    sched = scheduler_half(dataclasses.replace(worker.config, enable_async_loading=between_steps), BLOCK, False)
    work = worker_half(worker, kv.caches, BLOCK, False)
    forward = ContextForward(kv, SCRATCH)
    try:
        tokens = random_tokens(2 * CHUNK, seed=41).tolist()
        a, blocks_a = request("a", tokens), [1, 2, 3, 4]
        assert answered(sched, a) == (0, False)
        sched.update_state_after_alloc(a, blocks(blocks_a), 0)
        forward.run(tokens, blocks_a, 0, len(tokens))
        run_step(sched, work, Step(new=[("a", blocks_a, 0, len(tokens))]))
        run_step(sched, work, Step(finished={"a"}))
        on_disk(worker)
        keys = [span.key for span in worker.hasher.spans(tokens)]
        assert all(key in worker.cpu for key in keys), "the CPU tier holds both chunks too"

        longer = tokens + random_tokens(CHUNK, seed=42).tolist()
        b, blocks_b = request("b", longer, kv_transfer_params={"kv_load_tiers": ["LocalDiskBackend"]}), \
            [10, 11, 12, 13, 14, 15]
        cpu_reads, disk_reads = worker.cpu.hits, worker.storage.stats[f"fetched_{LOCAL_DISK}"]
        assert answered(sched, b) == (2 * CHUNK, between_steps)
        assert worker.storage.stats[f"fetched_{LOCAL_DISK}"] == disk_reads, "its lookup prefetched nothing"
        sched.update_state_after_alloc(b, blocks(blocks_b), 2 * CHUNK)
        if between_steps:  # loaded between steps, then scheduled
            recving: set[str] = set()

            def loaded() -> bool:
                result = run_step(sched, work, Step())
                assert result.load_errors == set()
                recving.update(result.finished_recving)
                return "b" in recving

            wait_until(loaded, what="b's load reported")
            assert forward.holds(longer, blocks_b, 2 * CHUNK)
        else:
            def compute(layer: int, _name: str) -> None:  # vLLM's forward, after the load
                if layer == 0:
                    forward.run(longer, blocks_b, 2 * CHUNK, len(longer))

            result = run_step(sched, work, Step(new=[("b", blocks_b, 2 * CHUNK, CHUNK)]), compute)
            assert result.load_errors == set()
            assert forward.holds(longer, blocks_b, len(longer)), "the loaded KV and what was computed over it"
        assert worker.cpu.hits == cpu_reads, "the CPU tier's copy was never read"
        assert worker.storage.stats[f"fetched_{LOCAL_DISK}"] == disk_reads + 2, "both chunks came from disk"
        assert all(key in worker.cpu for key in keys)
    finally:
        sched.shutdown()


def test_a_load_that_names_only_the_cpu_tier_never_reads_below(
        engine: tuple[CacheEngine, PagedKV, StepEventLog]) -> None:
    worker, kv, _ = engine
    tokens = random_tokens(2 * CHUNK, seed=43)
    slots = kv.slots(len(tokens))
    token_api.store(worker, tokens, **kv.kv(slots))
    on_disk(worker)
    token_api.clear(worker, LOCAL_CPU)  # only the disk store holds them now
    spans = worker.chunk_spans([span.key for span in worker.hasher.chain(tokens.tolist())], len(tokens))
    cpu_only = frozenset({LOCAL_CPU})
    assert worker.load(spans, slots, tiers=cpu_only).scatter(kv.caches, slots) == 0
    fetched = worker.load(spans, fetch=True, tiers=cpu_only)
    assert fetched is not None
    wait_until(fetched.done, what="the fetch ended")
    assert fetched.scatter(kv.caches, slots) == 0
    fetched.release()
    assert worker.storage.stats[f"fetched_{LOCAL_DISK}"] == 0, "the disk store was never read"
    assert worker.load(spans, slots).scatter(kv.caches, slots) == 2  # every tier: from disk
