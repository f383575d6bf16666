"""Loads that run between vLLM's steps (LMCache's `enable_async_loading`).

Scheduler side: a request whose hit is not all in the workers' CPU tiers when it is first looked up (some
chunks must come from the disk or remote store) is answered `load_kv_async=True` (`loads_asynchronously`); vLLM allocates its blocks, parks
it in WAITING_FOR_REMOTE_KVS and keeps running the other requests. The next step's metadata carries its load.

Worker side (`AsyncLoads`): `start_load_kv` hands the load's fetch to the NATS loop (the storage manager's
fetch: chunks the scheduler's lookup is already prefetching are waited for, not read twice) and returns.
Every step, `get_finished` (vLLM's worker thread, between forwards) takes the loads whose fetch has ended or
whose deadline (`blocking_timeout_secs`) has passed, scatters what arrived into the request's blocks (which
no other request uses while it waits) and reports the request in finished_recving; what did not arrive is
reported as load errors in the same step, so vLLM recomputes it. A fetch that ends after its deadline only
releases its chunks: its request's blocks may by then hold recomputed KV.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.services.engine.adapter.request_load import RequestLoad
    from kvmesh.services.engine.core.chunk_load import ChunkLoad

log = logging.getLogger(__name__)

# How long a step that runs no forward (every scheduled request is waiting for its load) waits for a fetch to
# end before it returns (it returns as soon as one ends): vLLM would otherwise spin through empty steps on the
# cores the fetch needs. Each empty step costs the EngineCore and the worker an IPC round trip and Python work
# (the worker's while holding the GIL its fetch thread needs): at 10 ms a 31-chunk disk-store load of 8,000
# tokens took 0.8-5 s on a 2-core machine, at 50 ms 58-113 ms (benchmarks/ttft.py, hybrid demo, issue 38). A
# request that arrives meanwhile waits at most this long to be scheduled, and only while nothing else runs.
# The scheduler's empty steps wait as long for a lower-tier lookup in flight (`SchedulerLookup.wait_answer`).
IDLE_WAIT_SECS = 0.05


def loads_asynchronously(enabled: bool, to_load: int, need: int, cpu_tokens: int) -> bool:
    """Whether the scheduler answers load_kv_async: the load is switched on, there is something to load, and
    the CPU tiers do not hold all `need` tokens (the rest comes from a slower tier)."""
    return enabled and to_load > 0 and cpu_tokens < need


@dataclass
class PendingLoad:
    load: "RequestLoad"
    fetched: "ChunkLoad"  # the fetch on the NATS loop
    deadline: float  # time.monotonic()


class AsyncLoads:
    """Worker side: the asynchronous loads in flight, by request id (vLLM's worker thread only)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._pending: dict[str, PendingLoad] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def pending(self) -> list[PendingLoad]:
        """The loads in flight, oldest first."""
        return list(self._pending.values())

    def add(self, load: "RequestLoad", fetched: "ChunkLoad") -> None:
        self._pending[load.req.req_id] = PendingLoad(load, fetched, time.monotonic() + self.timeout)

    def wait(self, timeout: float) -> None:
        """Wait until one fetch ends, at most `timeout` seconds."""
        if self._pending:
            concurrent.futures.wait([p.fetched.future for p in self._pending.values()], timeout,
                                    concurrent.futures.FIRST_COMPLETED)

    def take_ready(self) -> list[PendingLoad]:
        """The loads whose fetch ended (with the chunks it got: a prefix of their spans, maybe none) or whose
        deadline passed (given up: with none), removed from the pending ones."""
        now = time.monotonic()
        ready: list[PendingLoad] = []
        for req_id, pending in list(self._pending.items()):
            if pending.fetched.done():
                ready.append(pending)
            elif now >= pending.deadline:
                log.warning("loading KV for request %s took longer than %.1fs (blocking_timeout_secs); vLLM "
                            "recomputes it", req_id, self.timeout)
                pending.fetched.release()
                ready.append(pending)
            else:
                continue
            del self._pending[req_id]
        return ready

    def discard(self, req_ids: "set[str] | frozenset[str]") -> list[PendingLoad]:
        """Give up the loads of these requests (preempted, or ended while loading): nothing is scattered into
        their blocks; whatever their fetches bring is released. The loads given up."""
        dropped = [self._pending.pop(req_id) for req_id in req_ids if req_id in self._pending]
        for pending in dropped:
            pending.fetched.release()
        return dropped

    def abandon_all(self) -> None:
        """Shutdown: whatever the fetches still bring is released."""
        for pending in self._pending.values():
            pending.fetched.release()
        self._pending.clear()
