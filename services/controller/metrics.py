"""Controller metrics: the counters and latency histograms the core updates on the controller's event loop.

`GET /metrics` renders them, with the index and ingest figures of the moment, in api/metrics_page.py.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds
        self.count += 1

    def render(self, name: str, labels: str = "") -> list[str]:
        lines, running = [], 0
        sep = "," if labels else ""
        for bound, count in zip(self.buckets, self.counts):
            running += count
            lines.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        suffix = f"{{{labels}}}" if labels else ""
        lines.append(f"{name}_sum{suffix} {self.total:.6f}")
        lines.append(f"{name}_count{suffix} {self.count}")
        return lines


@dataclass
class Metrics:
    lookup_seconds: Histogram = field(default_factory=Histogram)
    lookups: int = 0
    lookup_hits: int = 0
    commands: Counter[tuple[str, str]] = field(default_factory=Counter)  # (op, outcome) -> count
    command_seconds: Histogram = field(default_factory=Histogram)
