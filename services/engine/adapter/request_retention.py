"""What a request asks of its KV through `kv_transfer_params`: how long it is kept and which tiers it uses.

Agent frameworks pass a priority and a lease, vLLM per-request tier filters (docs/connector.md "Per-request
retention and tiers"). All of it is client input, untrusted (docs/security.md): the scheduler reads it once per
request (`request_kv_params`); a key with a bad value is dropped, the request is served without it, and one
rate-limited WARNING names the key and the problem. Never an exception.

  * `kv_priority`: int, 0 to MAX_PRIORITY; above 0 the request's chunks are kept over those of priority 0 (and
    higher over lower) while they are held.
  * `lease_until` (unix seconds) and/or `kv_ttl` (seconds from now): the chunks are kept over unleased ones
    until the later of the two. At most MAX_LEASE_SECS from now.
  * `kv_load_tiers` / `kv_store_tiers`: lists of tier names (`TIER_NAMES`); the request loads only from and stores
    only to those. An empty list: none.

What a principal may keep this way is bounded where the chunks are held (`retained_cpu_share`: the CPU tier,
docs/config.md; `--retained-share`: the disk and remote stores), never by the request.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from kvmesh.services.engine.tiers.base import NO_RETENTION, Retention
from kvmesh.shared.eviction.base import MAX_LEASE_SECS, MAX_PRIORITY
from kvmesh.shared.protocol import LOCAL_CPU, LOCAL_DISK, PEER, REMOTE
from kvmesh.shared.rate_limited_log import RateLimitedLog

log = logging.getLogger("kvmesh.connector")
_rlog = RateLimitedLog(log, 10.0)

PRIORITY = "kv_priority"
LEASE_UNTIL = "lease_until"
TTL = "kv_ttl"
LOAD_TIERS = "kv_load_tiers"
STORE_TIERS = "kv_store_tiers"

STORED_IN = frozenset((LOCAL_CPU, LOCAL_DISK, REMOTE))  # tiers a save writes to
MAX_TIER_NAMES = 16  # a list longer than this is not a list of tiers

# accepted names (case-insensitive) -> the location they mean: KVMesh's and LMCache's backend names, and
# the short names of the tiers. The Redis tier registers as the remote tier.
TIER_NAMES: dict[str, str] = {
    "localcpubackend": LOCAL_CPU, "hot": LOCAL_CPU, "cpu": LOCAL_CPU,
    "localdiskbackend": LOCAL_DISK, "disk": LOCAL_DISK,
    "remotebackend": REMOTE, "redisbackend": REMOTE, "remote": REMOTE, "redis": REMOTE,
    "p2pbackend": PEER, "p2p": PEER,
}


@dataclass(frozen=True)
class KVRequestParams:
    """One request's retention (tiers/base.py `Retention`) and tier choice: locations (protocol.LOCAL_CPU, ...)
    it loads from and stores to, None for every tier."""

    retention: Retention = NO_RETENTION
    load_tiers: frozenset[str] | None = None
    store_tiers: frozenset[str] | None = None

    def loads_from(self, location: str) -> bool:
        return self.load_tiers is None or location in self.load_tiers

    def stores_to(self, location: str) -> bool:
        return self.store_tiers is None or location in self.store_tiers

    @property
    def stores_anywhere(self) -> bool:
        """Whether its store tiers name a tier that holds chunks (P2P serves what the CPU tier holds)."""
        return self.store_tiers is None or bool(self.store_tiers & STORED_IN)


DEFAULT = KVRequestParams()


def request_kv_params(request_id: str, params: Mapping[str, Any] | None, now: float | None = None
                      ) -> KVRequestParams:
    """The request's retention and tiers from its `kv_transfer_params` (DEFAULT when it names none). Each bad
    key is left out with a rate-limited WARNING."""
    if not isinstance(params, Mapping) or not any(name in params for name in
                                                   (PRIORITY, LEASE_UNTIL, TTL, LOAD_TIERS, STORE_TIERS)):
        return DEFAULT
    now = time.time() if now is None else now
    priority = _checked(request_id, PRIORITY, params, _priority, 0)
    lease_until = _checked(request_id, LEASE_UNTIL, params, lambda v: _lease_until(v, now), None)
    ttl_until = _checked(request_id, TTL, params, lambda v: now + _ttl(v), None)
    leases = [end for end in (lease_until, ttl_until) if end is not None]
    return KVRequestParams(Retention(priority, max(leases) if leases else None),
                           load_tiers=_checked(request_id, LOAD_TIERS, params, _tiers, None),
                           store_tiers=_checked(request_id, STORE_TIERS, params, _tiers, None))


def _checked(request_id: str, name: str, params: Mapping[str, Any], parse: Any, default: Any) -> Any:
    if name not in params or params[name] is None:
        return default
    try:
        return parse(params[name])
    except ValueError as exc:
        _rlog.warning(f"bad_{name}", "request %s: kv_transfer_params %s ignored: %s (served without it)",
                      request_id, name, exc)
        return default


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{type(value).__name__} where an integer is expected")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{type(value).__name__} where a number is expected")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _priority(value: Any) -> int:
    priority = _int(value)
    if not 0 <= priority <= MAX_PRIORITY:
        raise ValueError(f"{priority} is outside 0..{MAX_PRIORITY}")
    return priority


def _ttl(value: Any) -> float:
    secs = _number(value)
    if not 0 < secs <= MAX_LEASE_SECS:
        raise ValueError(f"{secs!r} seconds is outside (0, {MAX_LEASE_SECS:.0f}]")
    return secs


def _lease_until(value: Any, now: float) -> float:
    until = _number(value)
    if until <= now:
        raise ValueError(f"{until!r} is not in the future (unix seconds; now {now:.0f})")
    if until - now > MAX_LEASE_SECS:
        raise ValueError(f"{until!r} is more than {MAX_LEASE_SECS:.0f} seconds from now")
    return until


def _tiers(value: Any) -> frozenset[str]:
    if not isinstance(value, list) or len(value) > MAX_TIER_NAMES:
        raise ValueError(f"expected a list of at most {MAX_TIER_NAMES} tier names")
    tiers = set()
    for name in value:
        location = TIER_NAMES.get(name.strip().lower()) if isinstance(name, str) and len(name) <= 64 else None
        if location is None:
            raise ValueError(f"unknown tier {str(name)[:64]!r} (known: LocalCPUBackend, LocalDiskBackend, "
                             "RemoteBackend, RedisBackend, P2PBackend)")
        tiers.add(location)
    return frozenset(tiers)
