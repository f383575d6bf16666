"""What a Redis / Valkey server's eviction settings mean for the Redis tier (redis.py), which reads them once at
its start (`RedisTier.check_settings`: maxmemory from INFO, maxmemory-policy from CONFIG GET where the server
allows it) and says here, in one WARNING each, what would hurt: a pin drops a chunk's TTL, so only a `volatile-*`
policy keeps pinned chunks (`allkeys-*` evicts them too); only volatile-ttl orders evictions by the TTLs a
request's lease or priority sets (redis_retention.py); noeviction refuses every write once full. Serving goes on
whatever they are.
"""

from __future__ import annotations

import logging

EVICTS_PINNED = frozenset({"allkeys-lru", "allkeys-lfu", "allkeys-random"})
EVICTS_VOLATILE = frozenset({"volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"})
HONOURS_RETENTION = "volatile-ttl"  # the policy that orders evictions by the TTLs retention sets


def warn_unreadable(log: logging.Logger, where: str) -> None:
    """The policy could not be read (CONFIG GET refused, as managed services do)."""
    log.warning("%s: cannot read maxmemory-policy (CONFIG GET refused); unless it is volatile-ttl, chunks' "
                "leases and priorities (kv_priority, lease_until / kv_ttl) are not honoured "
                "(docs/config.md)", where)


def warn_of(log: logging.Logger, where: str, policy: str, unbounded: bool) -> None:
    """One WARNING on `log` where maxmemory-policy `policy` of the server `where` hurts pins, retention or puts;
    `unbounded` (no maxmemory set) is said at INFO."""
    if policy in EVICTS_PINNED:
        log.warning("%s: maxmemory-policy %s evicts pinned chunks too and honours no lease or priority "
                    "(kv_priority, lease_until / kv_ttl); set volatile-ttl", where, policy)
    elif policy == "noeviction" and not unbounded:
        log.warning("%s: maxmemory-policy noeviction refuses every write once maxmemory is reached (puts "
                    "are then skipped), and honours no lease or priority; set volatile-ttl", where)
    elif policy in EVICTS_VOLATILE and policy != HONOURS_RETENTION:
        log.warning("%s: maxmemory-policy %s: chunks' leases and priorities (kv_priority, lease_until / kv_ttl) "
                    "are not honoured, Redis evicts regardless of them; set volatile-ttl", where, policy)
    elif policy not in EVICTS_VOLATILE and policy != "noeviction":
        log.warning("%s: unknown maxmemory-policy %s: leases and priorities are not honoured; volatile-ttl is "
                    "expected", where, policy)
    if unbounded:
        log.info("%s: no maxmemory set: Redis grows until the host's memory is exhausted, and no chunk is "
                 "retained over the others (a share of nothing); set maxmemory and maxmemory-policy "
                 "volatile-ttl", where)
