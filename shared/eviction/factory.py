"""The policy named by the `cache_policy` config key (and the stores' `--cache-policy` flag)."""

from __future__ import annotations

import time

from kvmesh.shared.eviction.base import Clock, EvictionPolicy
from kvmesh.shared.eviction.fifo import FIFOPolicy
from kvmesh.shared.eviction.lfu import LFUPolicy
from kvmesh.shared.eviction.lru import LRUPolicy
from kvmesh.shared.eviction.mru import MRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy, LFUPolicy, FIFOPolicy, MRUPolicy)}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)  # what `cache_policy` accepts, in LMCache's spelling


def make_policy(name: str, capacity_bytes: int, clock: Clock = time.monotonic) -> EvictionPolicy:
    """A new, empty policy of `name` (case-insensitive) under `capacity_bytes`; ValueError for unknown names."""
    policy = POLICIES.get(name.strip().upper())
    if policy is None:
        raise ValueError(f"cache_policy: unknown eviction policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    return policy(capacity_bytes, clock)
