"""Eviction policies with pins: one implementation each, shared by the CPU tier, the disk store and the remote
store, chosen by the `cache_policy` config key (LRU, LFU, FIFO, MRU).

  base.py     the common part: byte budget, nested pins with optional TTL, expiry, refusals, retention
              (priorities and leases kept over the rest, bounded per owner);
  lru.py, lfu.py, fifo.py, mru.py   one small class each: the victim order and what a hit does;
  factory.py  `make_policy(name, capacity_bytes)`.
"""

from kvmesh.shared.eviction.base import Clock, EvictionPolicy, Key
from kvmesh.shared.eviction.factory import POLICIES, POLICY_NAMES, make_policy
from kvmesh.shared.eviction.fifo import FIFOPolicy
from kvmesh.shared.eviction.lfu import LFUPolicy
from kvmesh.shared.eviction.lru import LRUPolicy
from kvmesh.shared.eviction.mru import MRUPolicy

__all__ = ["POLICIES", "POLICY_NAMES", "Clock", "EvictionPolicy", "FIFOPolicy", "Key", "LFUPolicy", "LRUPolicy",
           "MRUPolicy", "make_policy"]
