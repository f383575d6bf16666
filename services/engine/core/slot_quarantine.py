"""Pool slots a store may still write into (docs/architecture.md "A slot lent to a store"): a get the store did not
answer in time raises StoreMayWrite, and its slot is held out of use, never reused, until the store can no longer
write into it (`StoreMayWrite.settled`: it acked the cancel, or its end of the pool socket closed). Not a time
limit: a store stopped now may resume at any later time. A store holding MAX_QUARANTINED_SLOTS such slots is lent
none more (its reads miss at once), so a stalled store cannot drain the pool. `StorageManager.read_into` reads
through it; loop thread only.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from kvmesh.services.engine.tiers.base import StoreMayWrite
from kvmesh.services.engine.tiers.memory_pool import Slot
from kvmesh.shared.rate_limited_log import RateLimitedLog

# a store holding this many quarantined slots (it may still write into them) is lent no more: misses at once
MAX_QUARANTINED_SLOTS = 8


class SlotQuarantine:
    """The quarantined slots, per store location; counted in the storage manager's `stats` (`slots_quarantined`,
    `slots_quarantined_now`, `fetch_store_stalled`), logged on its logger."""

    def __init__(self, stats: collections.Counter[str], log: logging.Logger) -> None:
        self._stats = stats
        self._log = log
        self._rlog = RateLimitedLog(log)
        self._held: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task[None]] = set()  # the waits for the stores to settle, kept referenced

    def stalled(self, location: str) -> bool:
        """The store at `location` holds MAX_QUARANTINED_SLOTS: lend it no slot (counted and logged)."""
        if self._held[location] < MAX_QUARANTINED_SLOTS:
            return False
        self._stats["fetch_store_stalled"] += 1
        self._rlog.warning("store_stalled", "%s holds %d slots it may still write into: answering misses "
                           "from it until it settles them", location, self._held[location])
        return True

    def hold(self, location: str, slot: Slot, exc: StoreMayWrite) -> None:
        """Hold `slot` (one reference, taken by the caller) until the store that may write into it has settled:
        then release it."""
        self._held[location] += 1
        self._stats["slots_quarantined"] += 1
        self._stats["slots_quarantined_now"] += 1
        self._rlog.warning("quarantined", "%s; its pool slot stays out of use until the store can no longer "
                           "write into it (%d slots so)", exc, self._stats["slots_quarantined_now"])

        async def end() -> None:
            try:
                settled = await exc.settled()
            except Exception:  # a bug: the slot stays held (safe), and we say so
                self._log.exception("waiting for %s to settle a get failed; its slot stays out of use", location)
                return
            if settled:
                self._held[location] -= 1
                self._stats["slots_quarantined_now"] -= 1
                slot.release()
            # else: the client closed first (the engine is stopping): the slot stays held for good

        task = asyncio.get_running_loop().create_task(end(), name="kvmesh-slot-quarantine")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
