"""LRUPolicy: recency, byte cap, pins exempt and nested, refusals change nothing."""

import time

from kvmesh.shared.eviction import LRUPolicy, make_policy

import pytest


def filled(capacity: int, keys: str, size: int = 10) -> LRUPolicy:
    policy = LRUPolicy(capacity)
    for key in keys:
        assert policy.victims_for(size) == []
        policy.add(key, size)
    return policy


def test_least_recently_used_is_the_victim() -> None:
    policy = filled(30, "abc")
    policy.touch("a")
    assert policy.victims_for(10) == ["b"]
    assert policy.victims_for(20) == ["b", "c"]


def test_pinned_keys_are_never_victims_and_refusal_when_only_pins_left() -> None:
    policy = filled(30, "abc")
    assert policy.pin("a") and policy.pin("b")
    assert policy.victims_for(10) == ["c"]
    policy.pin("c")
    assert policy.victims_for(10) is None
    assert len(policy) == 3 and policy.used_bytes == 30


def test_pins_nest_and_last_unpin_makes_most_recent() -> None:
    policy = filled(30, "abc")
    policy.pin("a")
    policy.pin("a")
    policy.unpin("a")
    assert policy.is_pinned("a")
    policy.unpin("a")
    assert not policy.is_pinned("a")
    assert policy.victims_for(10) == ["b"]
    assert not policy.unpin("a") and not policy.pin("zz")


def test_pin_ttl_expires() -> None:
    policy = filled(20, "ab")
    policy.pin("a", ttl_secs=0.05)
    assert policy.victims_for(10) == ["b"]
    time.sleep(0.06)
    assert sorted(policy.victims_for(20)) == ["a", "b"]  # the expired pin no longer protects "a"


def test_too_large_is_refused_and_remove_frees() -> None:
    policy = filled(30, "ab")
    assert policy.victims_for(31) is None
    assert policy.remove("a") == 10 and policy.used_bytes == 10 and "a" not in policy
    assert policy.remove("a") == 0


def test_factory() -> None:
    assert isinstance(make_policy("lru", 1), LRUPolicy)
    with pytest.raises(ValueError, match="cache_policy"):
        make_policy("ARC", 1)
