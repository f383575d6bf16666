"""shared/aio.py: cancel_and_wait ends tasks even when one swallows its first cancellation."""

from __future__ import annotations

import asyncio

from kvmesh.shared.aio import cancel_and_wait


async def test_a_task_that_swallows_a_cancellation_is_cancelled_again() -> None:
    never, started = asyncio.Event(), asyncio.Event()
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        started.set()
        while True:
            try:
                await never.wait()
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed == 1:
                    continue  # as a cancel lost to a racing timeout: the loop goes on
                raise

    async def failing() -> None:
        raise RuntimeError("ended with an error")

    tasks = [asyncio.create_task(stubborn()), asyncio.create_task(failing()), None]
    await started.wait()
    await cancel_and_wait(tasks)
    assert swallowed == 2 and all(task.done() for task in tasks if task is not None)
