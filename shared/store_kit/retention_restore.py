"""Retention read back where a store persisted it (the disk store's index snapshot, a persisting remote store's
retention file: shared/store_kit/state_file.py) and re-taken on the index at start.

A retention (a put's kv_priority and lease, ChunkIndex.retain_put) is client input, so what was persisted of it is
read back as such (`bounded_retention`: out-of-range entries dropped, lease ends clamped to MAX_LEASE_SECS from
now), and re-taken within its owner principal's share of the capacity as the store's `--retained-share` sets it at
that start (`restore_retention`): a restart never lets a principal keep more than a put could. Lease ends are
wall-clock (ChunkIndex.retentions), so a lease keeps ending on time across the restart.
"""

from __future__ import annotations

import time
from typing import Any

from kvmesh.shared.eviction.base import MAX_LEASE_SECS, MAX_PRIORITY
from kvmesh.shared.store_kit.chunk_index import ChunkIndex
from kvmesh.shared.wire.keys import ChunkKey


def bounded_retention(priority: object, lease_end: object, now: float) -> tuple[int, float | None, bool] | None:
    """A persisted retention read back, as untrusted input (the disk store's snapshot, a store's retention file):
    (priority, wall-clock lease end or None, whether the lease end was clamped to MAX_LEASE_SECS from `now`); None
    when it is out of bounds: a priority that is no int in 0..MAX_PRIORITY, a lease end that is no finite number
    >= 0 (0: no lease)."""
    if type(priority) is not int or not 0 <= priority <= MAX_PRIORITY:
        return None
    if lease_end is None:
        return priority, None, False
    if type(lease_end) not in (int, float) or not 0 <= lease_end < float("inf"):  # also NaN
        return None
    horizon = now + MAX_LEASE_SECS
    return priority, (min(float(lease_end), horizon) or None), lease_end > horizon


def restore_retention(index: ChunkIndex[Any], key: ChunkKey, owner: str, priority: int, lease_end: float | None,
                      share: float) -> bool:
    """Re-take a persisted retention (bounds checked by the reader) on a key `index` holds, within `owner`'s
    `share` of the capacity as it is now; True if taken. A lease that ended is gone, a key no longer held is
    skipped, one past the bound is held unretained and counted in the index's `retains_refused`."""
    lease_secs = None if lease_end is None else lease_end - time.time()
    if (priority <= 0 and (lease_secs is None or lease_secs <= 0)) or key not in index:
        return False
    return index.retain_held(key, owner, int(share * index.capacity_bytes), priority,
                             lease_secs if lease_secs is not None and lease_secs > 0 else None)
