"""What a producer (an engine worker's CPU tier, a disk or remote store) says of its own holdings: the `usage`
entry of its HealthReply's details, which the controller's /usage asks for (services/controller/usage.py).

The controller's index knows which keys each producer holds, never their bytes, pins or hits; these figures are
the producer's own, as of its answer. They arrive over NATS, so `TierUsage.from_details` trusts them only as far
as they are checked: every figure a non-negative integer below 2**63 (one with a default may be absent: a producer
that predates it), or the whole entry is None.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

USAGE_DETAIL = "usage"  # the HealthReply details key
MAX_FIGURE = 2**63 - 1


@dataclass(frozen=True)
class TierUsage:
    num_chunks: int  # chunks held
    used_bytes: int  # bytes they take in the tier (its own accounting: a CPU slot, a store's charge)
    capacity_bytes: int  # the tier's byte budget
    pinned_chunks: int  # chunks pinned now
    hits: int  # reads that found their chunk since the producer started (a CPU tier's retrievals, peer reads and
    # moves out; a store's gets)
    evictions: int  # chunks its policy evicted to make room since it started (not removals, clears or wipes)
    # requests' retentions (kv_priority, leases) it did not take since it started: past its retained share (the CPU
    # tier's `retained_cpu_share`, a store's `--retained-share`) the chunk is held as any other. A producer that
    # predates the figure reports none: 0.
    retains_refused: int = 0

    def as_detail(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_details(cls, details: Any) -> TierUsage | None:
        """The figures in a HealthReply's `details`; None when they are absent or any is not a figure."""
        entry = details.get(USAGE_DETAIL) if isinstance(details, dict) else None
        if not isinstance(entry, dict):
            return None
        values = {f.name: entry.get(f.name, f.default) for f in dataclasses.fields(cls)}
        if not all(type(v) is int and 0 <= v <= MAX_FIGURE for v in values.values()):
            return None
        return cls(**values)
