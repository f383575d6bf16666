"""benchmarks/ttft.py's breakdown of a warm sample without a vLLM: a real Prometheus endpoint on loopback (the
exposition vLLM's /metrics serves), read around one "request" as the benchmark reads a server's."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from ttft import PARTS, overhead_breakdown, sample_parts  # noqa: E402
from vllm_peers import Server, free_port  # noqa: E402


@pytest.fixture
def metrics() -> Iterator[tuple[Server, dict[str, Histogram]]]:
    """A Prometheus endpoint with the histograms the breakdown reads (vLLM's carry labels, summed over), and a
    Server pointed at it."""
    registry = CollectorRegistry()
    histograms = {name: Histogram(name, name, ["model_name", "engine"], registry=registry) for name in PARTS.values()}
    port = free_port()
    http, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    server = Server.__new__(Server)  # no vLLM behind it: only its url is read
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server, histograms
    finally:
        http.shutdown()
        thread.join(timeout=30)


def test_a_samples_parts_are_what_the_server_recorded_for_it(metrics: tuple[Server, dict[str, Histogram]]) -> None:
    server, histograms = metrics
    for histogram in histograms.values():  # earlier requests, on two engines: not this sample's
        histogram.labels("m", "0").observe(5.0)
        histogram.labels("m", "1").observe(7.0)
    before = server.histograms(("vllm:", "lmcache:"))
    assert before["vllm:request_queue_time_seconds"] == (12.0, 2.0)
    recorded = {"server_ttft_ms": 0.020, "queue_ms": 0.001, "prefill_ms": 0.016, "kvmesh_lookup_ms": 0.0005,
                "kvmesh_load_ms": 0.0009}
    for part, seconds in recorded.items():
        histograms[PARTS[part]].labels("m", "0").observe(seconds)
    parts = sample_parts(server, before, ttft_s=0.050)
    for part, seconds in recorded.items():
        assert parts[part] == pytest.approx(seconds * 1e3), part
    assert parts["api_ms"] == pytest.approx(30.0)  # the client's 50 ms less the server's 20
    assert parts["engine_other_ms"] == pytest.approx(3.0)  # the server's 20 less queue 1 and prefill 16


def test_kvmeshs_parts_beyond_vllms_own_hit() -> None:
    peers = {"kvmesh-cpu": {"8193": {"warm_breakdown_ms": {"prefill_ms": 16.0, "api_ms": 28.0, "kvmesh_load_ms": 1.0}}},
             "vllm-prefix-cache": {"8193": {"warm_breakdown_ms": {"prefill_ms": 11.5, "api_ms": 27.5}}}}
    out = overhead_breakdown(peers, [8193, 16385])
    assert list(out) == ["8193"]  # 16385 was not measured
    assert out["8193"]["kvmesh_minus_vllm_ms"] == {"prefill_ms": 4.5, "api_ms": 0.5}
