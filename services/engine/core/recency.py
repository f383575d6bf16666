"""Recency refresh: a hit in any tier refreshes the chunk's recency in every store below the CPU tier, so the
stores do not evict the chunks the CPU tier serves most.

Hits are noted from any thread (`note_hits`: vLLM's, on a load) and sent batched, off the hot path: every
`touch_interval_secs` the NATS loop tells each store about the hits since the last refresh (`touch`), in parts
well under the stores' keys-per-request bound.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Sequence

from kvmesh.services.engine.config.engine_config import EngineConfig
from kvmesh.services.engine.tiers.base import StoreTier
from kvmesh.shared.wire.keys import ChunkKey

TOUCH_BATCH = 10_000  # keys per touch request (--max-keys-per-request of the stores: 100,000 by default)


class RecencyRefresh:
    """The hits noted since the last refresh, and the refresh. `stores` answers the stores to touch now (none
    until NATS is first reached), `ready` whether they are reachable."""

    def __init__(self, config: EngineConfig, stores: Callable[[], Sequence[StoreTier]],
                 ready: Callable[[], bool]) -> None:
        self.config = config
        self._stores = stores
        self._ready = ready
        self._hits: set[ChunkKey] = set()  # keys served since the last refresh
        self._lock = threading.Lock()

    def note_hits(self, keys: Sequence[ChunkKey]) -> None:
        """Any thread: these chunks were just served; the stores hear of it at the next refresh."""
        if keys and self._stores():
            with self._lock:
                self._hits.update(keys)

    async def run(self) -> None:
        """Loop thread, until cancelled: a refresh every `touch_interval_secs`."""
        while True:
            await asyncio.sleep(self.config.touch_interval_secs)
            await self.flush()

    async def flush(self) -> None:
        """Loop thread: tell every store about the hits noted since the last flush (and wait for them)."""
        with self._lock:
            keys, self._hits = list(self._hits), set()
        if keys and self._ready():
            stores = self._stores()
            for start in range(0, len(keys), TOUCH_BATCH):
                part = keys[start:start + TOUCH_BATCH]
                await asyncio.gather(*(client.touch(part) for client in stores), return_exceptions=True)
