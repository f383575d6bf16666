"""The connector's metrics without a running vLLM: intervals, aggregation over ranks, the trip through a plain
dict (as between vLLM's processes) and the Prometheus exposition under LMCache's names."""

from __future__ import annotations

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
