"""The shape every service has: an async context manager that starts, serves, drains.

``run_service`` runs one until SIGTERM/SIGINT, then drains its subscriptions.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Protocol


class Service(Protocol):
    name: str

    async def start(self) -> None:
        """Connect, subscribe, and begin serving."""

    async def stop(self) -> None:
        """Drain subscriptions and release resources."""


async def run_service(service: Service) -> None:
    """Start ``service``, serve until SIGTERM or SIGINT, then stop it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    try:
        await stop.wait()
    finally:
        await service.stop()
