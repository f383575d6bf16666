"""How many full-sync requests the controller sends each principal's producers that it does not know yet.

A heartbeat of a producer the controller has no registration of makes it ask that producer to announce itself
(a SyncRequest: the producer registers and full-syncs). Any engine can heartbeat under as many producer ids of its
own principal as it likes, so those requests are budgeted per principal (`engine.<instance>`, `store.<id>`).
"""

from __future__ import annotations

from typing import Callable


class SyncBudget:
    """A token bucket per principal: `per_s` requests a second, at most `per_s` at once. `take` is O(1).

    Invariant: `_buckets` holds only principals that spent something and have not refilled yet (`forget_full`
    drops the others), so it never outgrows the principals that asked in the last second."""

    def __init__(self, per_s: float, clock: Callable[[], float]) -> None:
        self.per_s = per_s
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # principal -> (tokens, when they were counted)

    def take(self, principal: str) -> bool:
        """Spend one request of `principal`'s budget; False, spending nothing, when none is left."""
        now = self.clock()
        tokens, then = self._buckets.get(principal, (self.per_s, now))
        tokens = min(self.per_s, tokens + (now - then) * self.per_s)
        if tokens < 1:
            self._buckets[principal] = (tokens, now)
            return False
        self._buckets[principal] = (tokens - 1, now)
        return True

    def forget_full(self) -> None:
        """Drop the principals whose bucket has refilled (their entry would say what a new one says)."""
        now = self.clock()
        for principal in [p for p, (tokens, then) in self._buckets.items()
                          if tokens + (now - then) * self.per_s >= self.per_s]:
            del self._buckets[principal]

    def __len__(self) -> int:
        return len(self._buckets)
