"""The connector's metrics without a running vLLM: intervals, aggregation over ranks, the trip through a plain
dict (as between vLLM's processes) and the Prometheus exposition under LMCache's names."""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace

import pytest

stats_module = pytest.importorskip("kvmesh.services.engine.adapter.connector_stats")
from kvmesh.services.engine.adapter.connector_stats import (  # noqa: E402
    METRICS,
    STORAGE_COUNTERS,
    Increments,
    KVMeshPromMetrics,
    KVMeshStats,
)
from kvmesh.shared.protocol import LOCAL_DISK, REMOTE  # noqa: E402


def test_an_interval_is_taken_once_and_nothing_is_none() -> None:
    stats = KVMeshStats()
    assert stats.take() is None
    stats.count("lmcache:num_hit_tokens", 256)
    stats.observe("lmcache:time_to_lookup", 0.002)
    taken = stats.take()
    assert taken is not None and taken.data["counters"] == {"lmcache:num_hit_tokens": 256}
    assert stats.take() is None, "the next interval starts empty"


def test_ranks_add_up_and_the_payload_survives_a_process_boundary() -> None:
    rank0, rank1 = KVMeshStats(), KVMeshStats()
    for rank, used in ((rank0, 100), (rank1, 50)):
        rank.count("lmcache:num_retrieved_tokens", 511)
        rank.observe("lmcache:time_to_retrieve", 0.01)
        rank.set_gauge("lmcache:local_cache_usage", used)
    total = rank0.aggregate(rank1)
    assert total.data["counters"]["lmcache:num_retrieved_tokens"] == 1022
    assert total.data["gauges"]["lmcache:local_cache_usage"] == 150
    assert len(total.data["observations"]["lmcache:time_to_retrieve"]) == 2
    rebuilt = KVMeshStats(data=pickle.loads(pickle.dumps(total.to_dict())))
    assert rebuilt.reduce()["num_retrieved_tokens"] == 1022 and not rebuilt.is_empty()


def test_increments_of_the_storage_managers_counters() -> None:
    increments, stats = Increments(STORAGE_COUNTERS), KVMeshStats()
    counters = {f"read_bytes_{LOCAL_DISK}": 1000, f"put_failed_{REMOTE}": 1, "fetched_x": 9}
    increments.add_to(stats, counters)
    counters[f"read_bytes_{LOCAL_DISK}"] += 500
    counters[f"put_failed_{LOCAL_DISK}"] = 2
    increments.add_to(stats, counters)
    assert stats.data["counters"] == {"lmcache:num_local_disk_read_bytes": 1500, "lmcache:put_failed_count": 3}


def test_prometheus_exposition_uses_lmcache_names_and_vllms_labels() -> None:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest

    def build() -> KVMeshPromMetrics:
        return KVMeshPromMetrics(SimpleNamespace(kv_transfer_config=None), {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                                 ["model_name", "engine"], {0: ["demo", "0"]})

    build()
    prom = build()  # a second logger in the same process (vLLM re-creates it) registers again without a clash
    stats = KVMeshStats()
    stats.count("lmcache:num_requested_tokens", 1000)
    stats.count("lmcache:num_hit_tokens", 768)
    stats.observe("lmcache:time_to_retrieve", 0.02)
    stats.set_gauge("lmcache:lmcache_is_healthy", 1)
    stats.count("lmcache:a_metric_of_a_newer_connector", 1)  # skipped, never an error
    prom.observe(stats.to_dict())
    text = generate_latest(REGISTRY).decode()
    labels = '{engine="0",model_name="demo"}'
    assert f"lmcache:num_hit_tokens_total{labels} 768.0" in text
    assert f"lmcache:lookup_hit_rate{labels} 0.768" in text
    assert f"lmcache:time_to_retrieve_count{labels} 1.0" in text
    assert f"lmcache:lmcache_is_healthy{labels} 1.0" in text
    exposed = {m.name for m in METRICS if m.name in text}
    assert exposed == {m.name for m in METRICS}, "every metric is registered"


def test_a_waiting_request_is_counted_and_logged_once_per_answer(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM asks get_num_new_matched_tokens again every step while a request waits (for blocks, a batch slot):
    its lookup counters and INFO line come once per answer, not once per ask."""
    pytest.importorskip("kvmesh.services.engine.connector")
    from support.connector_driver import prefill, rank0_engine, request, scheduler_half, worker_half
    from support.engine import BLOCK, CHUNK, PagedKV, random_tokens
    from support.kv_oracle import Forward

    kv = PagedKV(num_blocks=64)
    with rank0_engine(kv.layout) as worker:
        sched = scheduler_half(worker.config, BLOCK, saves_off_forward=False)
        work = worker_half(worker, kv.caches, BLOCK, saves_off_forward=False)
        try:
            tokens = random_tokens(2 * CHUNK + 5, seed=21).tolist()
            assert prefill(sched, work, Forward(kv), "r1", tokens, [1, 2, 3, 4, 5]) == (0, False)
            need = len(tokens) - 1  # all of it is held; vLLM computes the last token
            sched.get_kv_connector_stats()  # r1's lookup: taken, so what follows is r2's alone
            caplog.clear()
            waiting = request("r2", tokens)
            kvmesh_log = logging.getLogger("kvmesh")  # the connector's import may have stopped it propagating
            kvmesh_log.addHandler(caplog.handler)
            try:
                with caplog.at_level("INFO", logger="kvmesh"):
                    for _ in range(3):  # three steps without room for it
                        assert sched.get_num_new_matched_tokens(waiting, 0) == (need, False)
                    # its first block came into vLLM's prefix cache meanwhile: a new answer, reported again
                    assert sched.get_num_new_matched_tokens(waiting, BLOCK) == (need - BLOCK, False)
                    assert sched.get_num_new_matched_tokens(waiting, BLOCK) == (need - BLOCK, False)
            finally:
                kvmesh_log.removeHandler(caplog.handler)
            stats = sched.get_kv_connector_stats()
            assert stats is not None
            counters = stats.data["counters"]
            assert counters["lmcache:num_lookup_requests"] == 2
            assert counters["lmcache:num_hit_tokens"] == 2 * len(tokens)
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Reqid: r2, Total")]
            assert lines == [f"Reqid: r2, Total tokens {len(tokens)}, hit tokens {len(tokens)}, need to load {n}"
                             for n in (need, need - BLOCK)]
        finally:
            sched.shutdown()


def test_retentions_the_cpu_tier_refuses_are_counted() -> None:
    """A leased request (kv_ttl) through both halves stores 4 chunks into a CPU tier whose retained_cpu_share
    holds 2: the other 2 are held as any other, and the worker's stats count them once."""
    from kvmesh.services.engine.assembly import build_engine
    from kvmesh.services.engine.adapter.scheduler_lookup import engines
    from kvmesh.shared.wire.keys import KeyParams

    from support.connector_driver import Step, blocks, request, run_step, scheduler_half, worker_half
    from support.engine import BLOCK, CHUNK, PagedKV, engine_config, random_tokens

    kv = PagedKV(num_blocks=64)
    engine = build_engine(engine_config(cpu_chunks=8, retained_cpu_share=0.25), KeyParams(model="test-model",
                                                                                           kv_format=""), kv.layout)
    engines.add(0, engine)
    sched = scheduler_half(engine.config, BLOCK, False)
    work = worker_half(engine, kv.caches, BLOCK, False)
    try:
        tokens = random_tokens(4 * CHUNK, seed=5).tolist()
        leased, block_ids = request("a", tokens, kv_transfer_params={"kv_ttl": 600}), list(range(1, 9))
        assert sched.get_num_new_matched_tokens(leased, 0) == (0, False)
        sched.update_state_after_alloc(leased, blocks(block_ids), 0)
        run_step(sched, work, Step(new=[("a", block_ids, 0, len(tokens))]))
        keys = [span.key for span in engine.hasher.spans(tokens)]
        assert [engine.cpu.is_retained(key) for key in keys] == [True, True, False, False]
        taken = work.get_kv_connector_stats()
        assert taken is not None and taken.data["counters"]["lmcache:num_retains_refused"] == 2
        assert engine.cpu.usage().retains_refused == 2  # what the controller's /usage reports of it
        again = work.get_kv_connector_stats()
        assert again is None or "lmcache:num_retains_refused" not in again.data["counters"], "counted once"
    finally:
        sched.shutdown()
        engines.remove(engine)
        engine.close()
