"""Waiting in a test for what another task or connection does (a service's state, a message
received): poll a condition every 10 ms."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    """Return once ``predicate()`` is true, checked every 10 ms.

    Raises:
        AssertionError: "timed out", still false after ``timeout`` seconds.
    """
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")
