"""benchmarks/multi_round_qa.py without a vLLM: the arrival schedule every peer gets, the regimes' tier sizes, the
QPS sweep's verdict and its flag."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from multi_round_qa import GB, max_qps_held, parse_qps, regime_sizes, schedule  # noqa: E402


def test_the_schedule_is_the_same_for_every_peer_of_a_seed_and_has_the_asked_rate() -> None:
    first = schedule(400, 3, 4.0, "poisson", random.Random(0))
    assert first == schedule(400, 3, 4.0, "poisson", random.Random(0))
    starts, gaps = first
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert statistics.mean(b - a for a, b in zip(starts, starts[1:])) == pytest.approx(1 / 4.0, rel=0.15)
    assert all(len(user) == 2 for user in gaps)
    assert statistics.mean(g for user in gaps for g in user) == pytest.approx(400 / 4.0, rel=0.15)
    uniform_starts, uniform_gaps = schedule(4, 2, 2.0, "uniform", random.Random(1))
    assert uniform_starts == [0.0, 0.5, 1.0, 1.5] and uniform_gaps == [[2.0]] * 4
    with pytest.raises(ValueError, match="QPS must be > 0"):
        schedule(4, 2, 0.0, "poisson", random.Random(0))


@pytest.mark.parametrize("regime, ratio", [("a", 0.5), ("b", 3.0), ("c", 4.0)])
def test_each_regime_sizes_the_cpu_tier_against_the_working_set(regime: str, ratio: float) -> None:
    working = 3 * GB  # the disk store of regimes a and b (4 GB) holds it
    sizes = regime_sizes(regime, working, in_flight_bytes=0.1 * GB)
    assert sizes.w_over_cpu_tier == pytest.approx(ratio)
    assert (sizes.remote_gb is not None) == (regime == "c")
    if regime == "c":  # the working set outgrows the CPU tier and the disk store's cap together
        assert working > (sizes.cpu_gb + sizes.disk_gb) * GB
    else:
        assert sizes.disk_gb * GB >= working


def test_the_cpu_tier_never_drops_below_the_requests_in_flight() -> None:
    sizes = regime_sizes("b", working_bytes=0.3 * GB, in_flight_bytes=0.2 * GB)
    assert sizes.cpu_gb == pytest.approx(0.2) and sizes.w_over_cpu_tier == pytest.approx(1.5)


def test_a_qps_is_held_only_with_every_lower_one_under_the_bound_and_no_failure() -> None:
    levels = [{"qps": 1.0, "ttft_p90_s": 0.2, "failures": 0}, {"qps": 2.0, "ttft_p90_s": 0.9, "failures": 0},
              {"qps": 4.0, "ttft_p90_s": 1.5, "failures": 0}, {"qps": 8.0, "ttft_p90_s": 0.5, "failures": 0}]
    assert max_qps_held(levels, bound=1.0) == 2.0  # 8 is under the bound, but 4 was not
    assert max_qps_held([{"qps": 1.0, "ttft_p90_s": 0.1, "failures": 1}], bound=1.0) is None
    assert max_qps_held([], bound=1.0) is None


def test_the_qps_flag_names_what_is_wrong() -> None:
    assert parse_qps("4, 1,2,2") == [1.0, 2.0, 4.0]
    with pytest.raises(argparse.ArgumentTypeError, match="numbers separated by commas"):
        parse_qps("1,fast")
    with pytest.raises(argparse.ArgumentTypeError, match="all > 0"):
        parse_qps("0,1")


def test_the_levels_rotate_over_the_peers_and_skip_those_that_missed_or_broke(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    import multi_round_qa as mrqa

    runs: list[tuple[float, str]] = []
    p90 = {"slow": 5.0, "fast": 0.1, "broken": 0.1}

    def measure(setup: object, name: str, server: object, qps: float, prompts: object) -> dict[str, object]:
        runs.append((qps, name))
        if name == "broken" and qps > 1:
            raise ConnectionError("the server died")
        return {"qps": qps, "failures": 0, "ttft_p90_s": p90[name]}

    monkeypatch.setattr(mrqa, "measure_level", measure)
    monkeypatch.setattr(mrqa, "IDLE_BETWEEN_S", 0.0)
    setup = argparse.Namespace(levels=[(1.0, []), (2.0, []), (4.0, [])], full_sweep=False, bound=1.0)
    peers = [mrqa.Peer(name, server=None, kv_blocks=1, info={}) for name in ("fast", "slow", "broken")]
    mrqa.interleave(setup, peers)  # type: ignore[arg-type]
    # each level starts one peer further on; "slow" missed the bound at QPS 1, "broken" failed at QPS 2
    assert runs == [(1.0, "fast"), (1.0, "slow"), (1.0, "broken"), (2.0, "broken"), (2.0, "fast"), (4.0, "fast")]
    fast, slow, broken = peers
    assert [level["qps"] for level in fast.levels] == [1.0, 2.0, 4.0] and fast.result(1.0)["max_qps_held"] == 4.0
    assert slow.skipped == [2.0, 4.0] and slow.result(1.0)["max_qps_held"] is None
    assert broken.skipped == [4.0] and broken.error is not None and "QPS 2: ConnectionError" in broken.error
