"""The connector's metrics on vLLM's own `/metrics`, named as LMCache names them (`lmcache:*`).

vLLM carries them for us: each step the scheduler-side and the worker-side connectors hand back what they
counted since the last step (`get_kv_connector_stats`); vLLM sums the workers' and the scheduler's
(`KVMeshStats.aggregate`), ships the plain `data` dict to the API server process, rebuilds it there
(`build_kv_connector_stats`) and passes it to `KVMeshPromMetrics.observe`, which feeds Prometheus.

`data` is plain JSON-like (it crosses processes): {"counters": {name: n}, "gauges": {name: value},
"observations": {name: [values]}}, names being the Prometheus names below. Counters add up, gauges of several
ranks add up too (each rank has its own CPU tier), observations are concatenated into histograms.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.shared.protocol import LOCAL_DISK, PEER, REMOTE
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats


@dataclass(frozen=True)
class Metric:
    name: str  # the Prometheus name (a counter's exposition adds `_total`, as prometheus_client does)
    kind: str  # "counter", "gauge", "histogram"
    help: str
    buckets: tuple[float, ...] = ()


_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKENS_PER_SECOND = (1e3, 1e4, 5e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 5e6, 1e7)

METRICS: tuple[Metric, ...] = (
    # scheduler side: one lookup per request
    Metric("lmcache:num_lookup_requests", "counter", "Requests looked up in the cache"),
    Metric("lmcache:num_requested_tokens", "counter", "Prompt tokens of the requests looked up"),
    Metric("lmcache:num_hit_tokens", "counter", "Tokens the cache held for the requests looked up"),
    Metric("lmcache:num_vllm_hit_tokens", "counter", "Tokens vLLM's own prefix cache already held"),
    Metric("lmcache:time_to_lookup", "histogram", "Seconds one lookup took (all tiers)", _SECONDS),
    Metric("lmcache:lookup_hit_rate", "gauge", "Hit tokens / requested tokens over the last interval"),
    # worker side: loads and saves
    Metric("lmcache:num_retrieve_requests", "counter", "Requests whose KV was loaded from the cache"),
    Metric("lmcache:num_retrieved_tokens", "counter", "Tokens loaded into vLLM's KV cache"),
    Metric("lmcache:time_to_retrieve", "histogram", "Seconds one request's load took", _SECONDS),
    Metric("lmcache:retrieve_speed", "histogram", "Tokens per second of one request's load", _TOKENS_PER_SECOND),
    Metric("lmcache:num_store_requests", "counter", "Requests whose new KV was stored"),
    Metric("lmcache:num_stored_tokens", "counter", "Tokens stored (copied out of vLLM's KV cache)"),
    Metric("lmcache:time_to_store", "histogram", "Seconds one request's store took", _SECONDS),
    Metric("lmcache:store_speed", "histogram", "Tokens per second of one request's store", _TOKENS_PER_SECOND),
    Metric("lmcache:num_stored_states", "counter",
           "Recurrent states stored beside chunks (models with Mamba / linear-attention layers: one per chunk end)"),
    Metric("lmcache:num_retrieved_states", "counter",
           "Recurrent states loaded (a hit of a model with Mamba / linear-attention layers resumes from one)"),
    Metric("lmcache:num_failed_retrieve_blocks", "counter",
           "vLLM blocks a load could not fill (reported to vLLM as load errors and recomputed)"),
    Metric("lmcache:put_failed_count", "counter", "Chunks a lower tier (disk, remote) failed to take"),
    Metric("lmcache:num_sealed_chunk_misses", "counter",
           "Chunks from the disk or remote store that did not open under this engine's key (another sharing "
           "domain's or an old key's, moved under another key, stored in clear, damaged): misses, recomputed"),
    Metric("lmcache:local_cpu_evict_count", "counter", "Chunks that left the CPU tier (evicted, removed, cleared)"),
    Metric("lmcache:num_retains_refused", "counter",
           "Requests' retentions (kv_priority, leases) the CPU tier did not take: past retained_cpu_share the chunk "
           "is held as any other"),
    Metric("lmcache:num_local_disk_read_bytes", "counter", "Bytes read from the disk store"),
    Metric("lmcache:num_local_disk_write_bytes", "counter", "Bytes written to the disk store"),
    Metric("lmcache:num_remote_read_bytes", "counter", "Bytes read from the remote tier"),
    Metric("lmcache:num_remote_write_bytes", "counter", "Bytes written to the remote tier"),
    Metric("lmcache:num_p2p_read_chunks", "counter", "Chunks loaded from another instance's CPU tier (P2P)"),
    Metric("lmcache:num_p2p_read_bytes", "counter", "Bytes loaded from another instance's CPU tier (P2P)"),
    Metric("lmcache:num_p2p_failed_reads", "counter",
           "P2P loads that failed (peer gone, slow, refused, bad checksum) or that the peer no longer held"),
    Metric("lmcache:num_p2p_failed_lookups", "counter",
           "P2P lookups the controller did not answer in time: no peer was asked (the tokens are recomputed)"),
    Metric("lmcache:num_p2p_served_chunks", "counter", "Chunks this instance's CPU tier served to peers (P2P)"),
    Metric("lmcache:num_p2p_served_bytes", "counter", "Bytes this instance's CPU tier served to peers (P2P)"),
    Metric("lmcache:local_cache_usage", "gauge", "Bytes held by the CPU tier (all ranks)"),
    Metric("lmcache:pinned_memory_objs_count", "gauge", "Chunks held by the CPU tier (all ranks)"),
    Metric("lmcache:lmcache_is_healthy", "gauge", "1 while every rank's engine reaches its mesh (or needs none)"),
    # per kind of stored object, not per KV cache group: the tiers store whole chunks and states, and a group's
    # share of one is fixed (its layers' pages: the start-up log names each group's)
    Metric("lmcache:chunk_bytes", "gauge",
           "Bytes one full chunk stores (all ranks; with state layers: the attention layers' pages only)"),
    Metric("lmcache:state_bytes", "gauge",
           "Bytes one recurrent state stores (all ranks; the state layers' pages only; 0 without state layers)"),
)
BY_NAME = {m.name: m for m in METRICS}
_PARTS = {"counter": "counters", "gauge": "gauges", "histogram": "observations"}


@dataclass
class KVMeshStats(KVConnectorStats):
    """One interval's counts; see the module docstring for `data`."""

    def __post_init__(self) -> None:
        for part in _PARTS.values():
            self.data.setdefault(part, {})

    def reset(self) -> None:
        self.data = {part: {} for part in _PARTS.values()}

    def count(self, name: str, n: float = 1) -> None:
        counters = self.data["counters"]
        counters[name] = counters.get(name, 0) + n

    def observe(self, name: str, value: float) -> None:
        self.data["observations"].setdefault(name, []).append(value)

    def set_gauge(self, name: str, value: float) -> None:
        self.data["gauges"][name] = value

    def aggregate(self, other: KVConnectorStats) -> KVMeshStats:
        for name, n in other.data.get("counters", {}).items():
            self.count(name, n)
        for name, value in other.data.get("gauges", {}).items():  # each rank's own tier: the instance's is the sum
            gauges = self.data["gauges"]
            gauges[name] = gauges.get(name, 0) + value
        for name, values in other.data.get("observations", {}).items():
            self.data["observations"].setdefault(name, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        summary: dict[str, int | float] = {}
        for name, n in self.data["counters"].items():
            summary[name.removeprefix("lmcache:")] = n
        for name, values in self.data["observations"].items():
            if values:
                summary[f"{name.removeprefix('lmcache:')}_avg"] = round(sum(values) / len(values), 6)
        return summary

    def is_empty(self) -> bool:
        return not any(self.data[part] for part in _PARTS.values())

    def take(self) -> KVMeshStats | None:
        """This interval's stats (None when nothing happened), and a fresh interval from now on."""
        if self.is_empty():
            return None
        taken = KVMeshStats(data=self.data)
        self.reset()
        return taken


class KVMeshPromMetrics(KVConnectorPromMetrics):
    """Registers METRICS with vLLM's metric classes (labels: vLLM's model_name and engine) and feeds them."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_previous()  # vLLM drops its own `vllm:` collectors before it registers again: ours too
        self._metrics: dict[str, Any] = {}
        for metric in METRICS:
            if metric.kind == "counter":
                self._metrics[metric.name] = self._counter_cls(name=metric.name, documentation=metric.help,
                                                               labelnames=labelnames)
            elif metric.kind == "gauge":
                self._metrics[metric.name] = self._gauge_cls(name=metric.name, documentation=metric.help,
                                                             labelnames=labelnames, multiprocess_mode="mostrecent")
            else:
                self._metrics[metric.name] = self._histogram_cls(name=metric.name, documentation=metric.help,
                                                                 labelnames=labelnames, buckets=list(metric.buckets))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]

        def child(name: str) -> Any | None:
            metric = self._metrics.get(name)  # a name from a newer connector: skipped, never an error
            return metric.labels(*labels) if metric is not None else None

        counters = transfer_stats_data.get("counters", {})
        for name, n in counters.items():
            if (c := child(name)) is not None and n > 0:
                c.inc(n)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if (g := child(name)) is not None:
                g.set(value)
        for name, values in transfer_stats_data.get("observations", {}).items():
            if (h := child(name)) is not None:
                for value in values:
                    h.observe(value)
        requested = counters.get("lmcache:num_requested_tokens", 0)
        if requested and (g := child("lmcache:lookup_hit_rate")) is not None:
            g.set(counters.get("lmcache:num_hit_tokens", 0) / requested)


def _unregister_previous() -> None:
    from prometheus_client import REGISTRY

    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").removesuffix("_total") in BY_NAME:
            REGISTRY.unregister(collector)


# StorageManager.stats counters (they only grow) -> the metric their increments feed
STORAGE_COUNTERS = {
    f"read_bytes_{LOCAL_DISK}": "lmcache:num_local_disk_read_bytes",
    f"written_bytes_{LOCAL_DISK}": "lmcache:num_local_disk_write_bytes",
    f"read_bytes_{REMOTE}": "lmcache:num_remote_read_bytes",
    f"written_bytes_{REMOTE}": "lmcache:num_remote_write_bytes",
    f"put_failed_{LOCAL_DISK}": "lmcache:put_failed_count",
    f"put_failed_{REMOTE}": "lmcache:put_failed_count",
    "sealed_miss_foreign": "lmcache:num_sealed_chunk_misses",  # services/engine/tiers/sealed.py
    "sealed_miss_tag": "lmcache:num_sealed_chunk_misses",
    "sealed_miss_unsealed": "lmcache:num_sealed_chunk_misses",
    f"fetched_{PEER}": "lmcache:num_p2p_read_chunks",
    f"read_bytes_{PEER}": "lmcache:num_p2p_read_bytes",
    "p2p_read_failed": "lmcache:num_p2p_failed_reads",
    "p2p_read_missed": "lmcache:num_p2p_failed_reads",
    "p2p_lookup_failed": "lmcache:num_p2p_failed_lookups",
    "p2p_served_chunks": "lmcache:num_p2p_served_chunks",
    "p2p_served_bytes": "lmcache:num_p2p_served_bytes",
}


# the CPU tier's counters (EngineUsage) -> the metric their increments feed
CPU_COUNTERS = {"retains_refused": "lmcache:num_retains_refused"}


class Increments:
    """Turns counters that only grow (kept by another thread) into this interval's increments."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = names
        self._last: dict[str, int] = {}

    def add_to(self, stats: KVMeshStats, current: Mapping[str, int]) -> None:
        for key, metric in self.names.items():
            value = current.get(key, 0)  # one lookup per key: never iterates a dict another thread may grow
            if value != self._last.get(key, 0):
                stats.count(metric, value - self._last.get(key, 0))
                self._last[key] = value


class GaugeClock:
    """Gauges are sent with every step's counts, and at least every `interval` seconds when nothing else is."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._last = 0.0

    def due(self, stats: KVMeshStats) -> bool:
        now = time.monotonic()
        if stats.is_empty() and now - self._last < self.interval:
            return False
        self._last = now
        return True


__all__ = ["METRICS", "STORAGE_COUNTERS", "CPU_COUNTERS", "KVMeshStats", "KVMeshPromMetrics", "GaugeClock",
           "Increments", "Metric"]
