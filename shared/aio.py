"""Small asyncio helpers every service and the engine use the same way."""

from __future__ import annotations

import asyncio
from typing import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | None]) -> None:
    """Cancel the tasks and wait until every one has ended (their errors and cancellations are swallowed)."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
