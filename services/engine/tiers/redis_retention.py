"""Retention on the Redis tier (redis.py): a request's kv_priority and lease mapped onto Redis's `volatile-ttl`
eviction, within each engine principal's share of Redis's `maxmemory`.

Redis cannot be told an eviction order, but under `maxmemory-policy volatile-ttl` it evicts the keys with the
shortest remaining TTL first (only keys that have one). Every chunk the tier writes expires after the base TTL
(`redis_chunk_ttl_secs`), refreshed by puts and hits (never shortened), so among unretained chunks the least
recently used has the least left. A retained chunk's TTL is the base plus `extra_secs`:

  * a lease: the seconds left of it (at most MAX_LEASE_SECS, 30 days). Until it ends the chunk has more left than
    any unretained one; when it ends it has the base left, as a chunk just written: it rejoins the order as a new
    arrival, and leased chunks go sooner lease end first;
  * a priority p > 0 (1 .. MAX_PRIORITY): MAX_LEASE_SECS * (1 + p / MAX_PRIORITY), 30 to 60 days, so it has more
    left than any leased chunk and a higher priority more than a lower one (one priority step is ~2.6 s: priorities
    that close, put some seconds apart, may swap). It holds for that long after its last retained put, not for as
    long as the chunk is held, as in our stores: Redis counts the TTL down.

Limits, honestly: Redis's eviction is sampled (`maxmemory-samples` keys per eviction, a pool of the best
candidates), so under pressure an unretained chunk with more TTL left than a retained one's is never picked
over it, but one may outlive it when the sample missed it; a pin (PERSIST) and its unpin put back the base TTL,
dropping the extra; under another policy (volatile-lru, allkeys-*) the TTLs order nothing and leases are not
honoured (a WARNING at start: RedisTier.check_settings).

The share (`retained_redis_share` of `maxmemory`, per engine principal: its ranks together) is kept in Redis, in
the sorted set `<p>:retained:{<principal>}` (redis_scripts.RETAIN): member `<chunk hex>:<bytes>`, score the
retention's end (unix ms). A retained put past the share is written unretained and counted (`retain_refused`).
A chunk Redis evicts still counts until its retention ends: the bound errs on the side of refusing.
"""

from __future__ import annotations

import time

from kvmesh.services.engine.tiers.base import Retention
from kvmesh.shared.eviction.base import MAX_LEASE_SECS, MAX_PRIORITY


def extra_secs(retention: Retention, now: float | None = None) -> float:
    """Seconds a retained chunk's TTL gets over the base (0: not retained; a lease that ended is none)."""
    if retention.priority > 0:
        return MAX_LEASE_SECS * (1 + min(retention.priority, MAX_PRIORITY) / MAX_PRIORITY)
    return min(retention.lease_secs(time.time() if now is None else now) or 0.0, MAX_LEASE_SECS)


def member(key_hex: str, nbytes: int) -> str:
    """The chunk's entry in its principal's retained set: its key and the bytes it counts."""
    return f"{key_hex}:{nbytes}"
