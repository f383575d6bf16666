"""Tensor-parallel ranks simulated on threads of one process, meeting where vLLM's ranks meet.

Each rank's worker step runs on its own thread (as vLLM's ranks run in their own processes). They meet in the
connector's load agreement (`ThreadAgreement`, each worker half's `agreement`, as the gloo all-reduce of
load_agreement.py) and before and after each layer's reads of every rank's caches (`Ranks.layer_barrier`: the
simulated all-reduce). What they compute therefore does not depend on thread timing.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

# how long a rank waits for the others at a meeting point: past any load deadline a schedule sets, so it is reached
# only when a rank never comes (then the step fails instead of hanging)
RANK_WAIT_S = 120.0


class ThreadAgreement:
    """The connector's RankAgreement (load_agreement.py) for ranks on threads: an element-wise minimum over
    `world_size` callers that meet at a barrier. A call whose list differs in length from the other ranks' (the
    connector broke the protocol: every rank must pass the same loads) is recorded in `errors`, since the
    connector swallows what `min_over_ranks` raises."""

    def __init__(self, world_size: int, timeout: float = RANK_WAIT_S) -> None:
        self.world_size = world_size
        self.calls = 0  # rounds completed
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._pending: list[list[int]] = []
        self._result: list[int] = []
        self._barrier = threading.Barrier(world_size, action=self._reduce, timeout=timeout)

    def _reduce(self) -> None:  # run by one thread once every rank arrived, before any is released
        pending, self._pending = self._pending, []
        if len({len(v) for v in pending}) != 1:
            self.errors.append(f"min_over_ranks called with lists of lengths {[len(v) for v in pending]}")
            raise ValueError(self.errors[-1])
        self._result = [min(col) for col in zip(*pending)]
        self.calls += 1

    def min_over_ranks(self, values: Sequence[int]) -> list[int]:
        with self._lock:
            self._pending.append(list(values))
        self._barrier.wait()
        # safe to read: the next round's _reduce needs this thread at the barrier again
        return list(self._result)

    def abort(self) -> None:
        """A rank failed: the others stop waiting for it (BrokenBarrierError) instead of hanging."""
        self._barrier.abort()


class NoAgreement:
    """Each rank keeps its own answer: the connector without its load agreement (as before it existed), to show
    what the agreement prevents."""

    calls = 0
    errors: list[str] = []

    def min_over_ranks(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def abort(self) -> None:
        pass


class Ranks:
    """`world_size` ranks: one thread each (none for one rank), a barrier for their layer reads, their agreement."""

    def __init__(self, world_size: int, agreement: bool = True) -> None:
        self.world_size = world_size
        self.agreement: ThreadAgreement | NoAgreement | None = None
        if world_size > 1:
            self.agreement = ThreadAgreement(world_size) if agreement else NoAgreement()
        self._barrier = threading.Barrier(world_size, timeout=RANK_WAIT_S) if world_size > 1 else None
        self._pool = ThreadPoolExecutor(world_size, thread_name_prefix="sim-rank") if world_size > 1 else None

    def layer_barrier(self) -> None:
        if self._barrier is not None:
            self._barrier.wait()

    def run(self, step: Callable[[int], Any]) -> list[Any]:
        """`step(rank)` on every rank; the results in rank order, or the first rank's exception (not one that
        only saw a barrier broken because of it)."""
        if self._pool is None:
            return [step(0)]

        def one(rank: int) -> Any:
            try:
                return step(rank)
            except BaseException:
                self.abort()  # the other ranks would wait for this one at a barrier
                raise

        futures = [self._pool.submit(one, rank) for rank in range(self.world_size)]
        errors = [exc for exc in (future.exception() for future in futures) if exc is not None]
        if errors:
            raise min(errors, key=lambda e: "BrokenBarrierError" in type(e).__name__ + str(e))
        return [future.result() for future in futures]

    def abort(self) -> None:
        if self._barrier is not None:
            self._barrier.abort()
        if self.agreement is not None:
            self.agreement.abort()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["RANK_WAIT_S", "NoAgreement", "Ranks", "ThreadAgreement"]
