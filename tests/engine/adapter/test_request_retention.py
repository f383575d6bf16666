"""A request's retention and tiers from its kv_transfer_params (adapter/request_retention.py): what is taken, and
that each bad value is dropped with one rate-limited WARNING naming the key and the problem, never an error."""

from __future__ import annotations

import logging
import math

import pytest

from kvmesh.services.engine.adapter import request_retention
from kvmesh.services.engine.adapter.request_retention import DEFAULT, KVRequestParams, request_kv_params
from kvmesh.services.engine.tiers.base import Retention
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, PEER, REMOTE
from kvmesh.shared.rate_limited_log import RateLimitedLog

NOW = 1_800_000_000.0


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own first warnings (the limiter is per process)."""
    monkeypatch.setattr(request_retention, "_rlog", RateLimitedLog(request_retention.log, 10.0))


def test_no_params_or_none_of_ours_is_the_default() -> None:
    assert request_kv_params("r", None, NOW) is DEFAULT
    assert request_kv_params("r", {"do_remote_prefill": True}, NOW) is DEFAULT
    assert request_kv_params("r", "not a mapping", NOW) is DEFAULT  # type: ignore[arg-type]
    assert DEFAULT.loads_from(LOCAL_CPU) and DEFAULT.stores_to(LOCAL_DISK) and DEFAULT.stores_anywhere
    assert not DEFAULT.retention.asked


def test_every_key_taken() -> None:
    params = request_kv_params("r", {"kv_priority": 7, "lease_until": NOW + 100, "kv_ttl": 50.5,
                                     "kv_load_tiers": ["LocalDiskBackend", "P2PBackend"],
                                     "kv_store_tiers": ["LocalCPUBackend", "redis", "RemoteBackend"]}, NOW)
    assert params == KVRequestParams(Retention(7, NOW + 100), frozenset({LOCAL_DISK, PEER}),
                                     frozenset({LOCAL_CPU, REMOTE}))
    assert not params.loads_from(LOCAL_CPU) and params.loads_from(LOCAL_DISK)
    assert params.retention.lease_secs(NOW + 40) == pytest.approx(60)
    assert params.retention.lease_secs(NOW + 100) is None
    # the later of the two leases wins
    assert request_kv_params("r", {"lease_until": NOW + 10, "kv_ttl": 20}, NOW).retention.lease_until == NOW + 20
    # tier names are case-insensitive; "Hot" is LMCache's name of the CPU tier; an empty list is no tier
    assert request_kv_params("r", {"kv_load_tiers": ["hot"]}, NOW).load_tiers == frozenset({LOCAL_CPU})
    nowhere = request_kv_params("r", {"kv_store_tiers": []}, NOW)
    assert nowhere.store_tiers == frozenset() and not nowhere.stores_anywhere
    assert not request_kv_params("r", {"kv_store_tiers": ["P2PBackend"]}, NOW).stores_anywhere


BAD = [
    ("kv_priority", True, "bool where an integer is expected"),
    ("kv_priority", 1.5, "float where an integer is expected"),
    ("kv_priority", -1, "-1 is outside 0..1000000"),
    ("kv_priority", 10**7, "is outside 0..1000000"),
    ("kv_priority", "9", "str where an integer is expected"),
    ("lease_until", NOW - 1, "is not in the future"),
    ("lease_until", NOW + 31 * 86400, "more than 2592000 seconds from now"),
    ("lease_until", math.inf, "is not a finite number"),
    ("lease_until", "tomorrow", "str where a number is expected"),
    ("kv_ttl", 0, "outside (0, 2592000]"),
    ("kv_ttl", math.nan, "is not a finite number"),
    ("kv_ttl", [5], "list where a number is expected"),
    ("kv_load_tiers", "LocalCPUBackend", "expected a list of at most 16 tier names"),
    ("kv_load_tiers", ["LocalCPUBackend"] * 17, "expected a list of at most 16 tier names"),
    ("kv_store_tiers", ["LocalCPUBackend", "GPU"], "unknown tier 'GPU'"),
    ("kv_store_tiers", [None], "unknown tier 'None'"),
    ("kv_store_tiers", {"LocalCPUBackend": 1}, "expected a list"),
]


@pytest.mark.parametrize(("key", "value", "problem"), BAD, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_a_bad_value_is_dropped_with_a_warning_naming_it(key: str, value: object, problem: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    good = {"kv_priority": 3, "kv_ttl": 60, "kv_load_tiers": ["LocalCPUBackend"], "kv_store_tiers": ["disk"]}
    with caplog.at_level(logging.WARNING, logger="kvmesh.connector"):
        params = request_kv_params("req-1", {**good, key: value}, NOW)
    expected = request_kv_params("req-1", {k: v for k, v in good.items() if k != key}, NOW)
    assert params == expected  # served without that key, the others taken
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"kv_transfer_params {key} ignored" in warnings[0] and problem in warnings[0]
    assert "req-1" in warnings[0]


def test_warnings_are_rate_limited_per_key(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvmesh.connector"):
        for i in range(50):
            request_kv_params(f"r{i}", {"kv_priority": -1, "kv_ttl": -1}, NOW)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and {w.split(" ignored")[0].rsplit(" ", 1)[1] for w in warnings} == {
        "kv_priority", "kv_ttl"}
