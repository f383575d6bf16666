"""benchmarks/serving.py without a vLLM: the multi-round prompts every peer gets, the working set the KV spaces are
sized from, and the statistics it reports."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from serving import (Sample, Shape, build_prompts, hit_rates, percentile, ratios, summarize,  # noqa: E402
                     working_set_tokens)

CORPUS = list(range(1000, 1300))  # shorter than the run needs: pieces wrap around it


def encode(text: str) -> list[int]:
    return list(text.encode())


def test_rounds_extend_each_users_history_behind_one_shared_system_prompt() -> None:
    shape = Shape(users=3, rounds=3, system=40, context=100, question=10, answer=5)
    prompts = build_prompts(shape, CORPUS, encode, bos=7)
    assert [len(r) for r in prompts] == [3, 3, 3]
    for r, this_round in enumerate(prompts):
        for prompt in this_round:
            assert len(prompt) == 1 + 40 + 100 + (r + 1) * 10 + r * 5
            assert prompt[:41] == prompts[0][0][:41] and prompt[0] == 7
    for u in range(3):
        for r in range(1, 3):
            before = prompts[r - 1][u]
            assert prompts[r][u][:len(before)] == before  # the next round reuses the whole previous prompt
    # each user's document is its own: users' prompts part within the first tokens after the system prompt
    for a in range(3):
        for b in range(a + 1, 3):
            assert prompts[0][a][41:41 + 32] != prompts[0][b][41:41 + 32]
    # every peer gets the same prompts
    assert build_prompts(shape, CORPUS, encode, bos=7) == prompts


def test_bad_shapes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="every size must be >= 1"):
        build_prompts(Shape(users=0, rounds=1, system=4, context=8, question=2, answer=1), CORPUS, encode, None)
    with pytest.raises(ValueError, match="empty corpus"):
        build_prompts(Shape(users=1, rounds=1, system=4, context=8, question=2, answer=1), [], encode, None)


def test_working_set_counts_each_distinct_prefix_once() -> None:
    shape = Shape(users=4, rounds=2, system=30, context=50, question=6, answer=3)
    prompts = build_prompts(shape, CORPUS, encode, bos=None)
    ends = [tuple(p) + (-1,) * 3 for p in prompts[-1]]
    distinct = {end[:i] for end in ends for i in range(1, len(end) + 1)}
    assert working_set_tokens(prompts, 3) == len(distinct)
    assert working_set_tokens(prompts, 3) < sum(map(len, ends))  # the system prompt is shared


def test_percentile_interpolates_between_ranks() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 50) == 3.0 and percentile(values, 100) == 5.0
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    assert percentile(values, 90) == pytest.approx(cuts[89])
    assert percentile(values, 99) == pytest.approx(cuts[98])
    assert percentile([2.5], 99) == 2.5
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="within 0..100"):
        percentile(values, 101)


def test_summary_rates_are_over_the_rounds_wall_time() -> None:
    samples = [Sample(r, u, 100, 0.0, ttft, ttft + 1, 16, "") for r, u, ttft in
               [(1, 0, 1.0), (1, 1, 2.0), (2, 0, 0.1), (2, 1, 0.3)]]
    figures = summarize(samples, [3.0, 1.0])
    assert figures["requests"] == 4
    assert figures["requests_per_s"] == 1.0 and figures["generated_tokens_per_s"] == 16.0
    assert figures["ttft_p50_s"] == pytest.approx(0.65) and figures["e2e_p50_s"] == pytest.approx(1.65)
    assert figures["round_ttft_p50_s"] == pytest.approx([1.5, 0.2])
    assert figures["warm_ttft_p50_s"] == pytest.approx(0.2)  # rounds 2.. only
    peers = {"LMCache": {**figures, "ttft_p50_s": 1.3}, "kvmesh-cpu": figures,
             "floor": {**figures, "round_wall_s": [2.0, 2.0], "warm_ttft_p50_s": 0.16}}
    out = ratios(peers)
    assert out["kvmesh-cpu_p50_ttft_over_LMCache"] == pytest.approx(0.5)
    assert out["kvmesh-cpu_round_wall_over_floor"] == [1.5, 0.5]
    assert out["kvmesh-cpu_warm_p50_ttft_over_floor"] == pytest.approx(1.25)
    assert "kvmesh-disk_p50_ttft_over_LMCache" not in out


def test_hit_rates_say_where_prompt_tokens_came_from() -> None:
    counted = {"vllm:prefix_cache_queries_total": 4000.0, "vllm:prefix_cache_hits_total": 1000.0,
               "vllm:external_prefix_cache_queries_total": 3000.0, "vllm:external_prefix_cache_hits_total": 2400.0}
    assert hit_rates(counted) == {"vllm_prefix_cache_hit_rate": 0.25, "connector_hit_rate": 0.8}
    # vLLM alone counts no connector queries: no rate rather than a division by zero
    alone = {"vllm:prefix_cache_queries_total": 4000.0, "vllm:prefix_cache_hits_total": 0.0,
             "vllm:external_prefix_cache_queries_total": 0.0, "vllm:external_prefix_cache_hits_total": 0.0}
    assert hit_rates(alone) == {"vllm_prefix_cache_hit_rate": 0.0, "connector_hit_rate": None}
    assert hit_rates({}) == {"vllm_prefix_cache_hit_rate": None, "connector_hit_rate": None}
