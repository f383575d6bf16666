"""How tests wait: on a condition, with a generous deadline that only matters when the test fails.

CI shares two cores with other work, so a test never sleeps for "long enough" and never asserts how long
something took (speed is measured in benchmarks/). It waits for the condition itself:

* `wait_until(predicate)` / `await wait_until_async(predicate)`: poll until `predicate()` is truthy and return
  its value; `TimeoutError` naming `what` after `timeout` seconds.
* `finishes(fn)`: run a call that must not block (e.g. "skipped, never waited for") in a thread; its result, or
  `TimeoutError` instead of a test that hangs forever.
* `ManualClock`: behaviour that is about time (a TTL expiring, a producer going silent) runs on a clock the
  test advances by hand, where the code takes a `clock` (default `time.monotonic`).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

WAIT_S = 30.0  # every deadline: generous, reached only when the awaited thing never happens


def wait_until(predicate: Callable[[], T], timeout: float = WAIT_S, *, what: str = "condition",
               interval: float = 0.02) -> T:
    """Poll `predicate` until it returns something truthy; that value. TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not met within {timeout:g}s")
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], timeout: float = WAIT_S, *,
                           what: str = "condition", interval: float = 0.02) -> T:
    """`wait_until` on an event loop (other tasks run between polls); `predicate` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not met within {timeout:g}s")
        await asyncio.sleep(interval)


def finishes(fn: Callable[[], T], timeout: float = WAIT_S, *, what: str = "the call") -> T:
    """Run `fn()` in a daemon thread and return its result (or raise its exception); TimeoutError if it is still
    running after `timeout` s, so a call that wrongly blocks fails the test instead of hanging it."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="test-finishes", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise TimeoutError(f"{what} blocked: still running after {timeout:g}s")
    ok, value = outcome[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


class ManualClock:
    """A monotonic clock that moves only when the test says so (pass it where the code takes `clock`)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
