"""Small asyncio helpers every service and the engine use the same way."""

from __future__ import annotations

import asyncio
from typing import Iterable

RECANCEL_SECS = 1.0  # how often a task that is still running after its cancellation is cancelled again


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | None]) -> None:
    """Cancel the tasks and wait until every one has ended (their errors and cancellations are swallowed).

    A task still running a while after its cancellation is cancelled again: a library may swallow one
    cancellation (on Python 3.11 a cancel that races `asyncio.timeout` expiring turns into a timeout, e.g. in
    redis-py's `get_message`), and the task's loop then goes on as if nothing happened."""
    running = [task for task in tasks if task is not None]
    pending = set(running)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_SECS)
    for task in running:
        if not task.cancelled():
            task.exception()  # retrieved here, so asyncio does not report it again at exit
