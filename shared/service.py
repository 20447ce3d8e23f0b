"""The shape every service has: an async context manager that starts, serves, drains.

``run_service`` runs one until SIGTERM/SIGINT, then drains its subscriptions.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Protocol

import nats.errors

from shared import subjects
from shared.bus import Bus
from shared.messages import Ping, Pong, SchedulerStats, StatsQuery


class Service(Protocol):
    name: str

    async def start(self) -> None:
        """Connect, subscribe, and begin serving."""

    async def stop(self) -> None:
        """Drain subscriptions and release resources."""


async def run_service(service: Service) -> None:
    """Start ``service``, serve until SIGTERM or SIGINT, then stop it. A signal while it is
    still starting (connecting to a NATS server that is not up yet, say) ends it too."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(service.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return
    stopping.cancel()
    starting.result()  # a failed start raises here
    try:
        await stop.wait()
    finally:
        await service.stop()


class ServiceConflictError(RuntimeError):
    """Another instance already serves what this one would (one scheduler per model and NATS,
    one detokenizer per shard, one executor per group id): two would both act on every message
    and corrupt the output."""


async def refuse_if_served(bus: Bus, model: str, service: str, what: str, timeout: float = 0.5,
                           advice: str = "run one per model and NATS server") -> None:
    """Raise ``ServiceConflictError`` if something answers pings on ``ping(model, service)``.

    Call before subscribing; then ``answer_pings`` on the same name. Two instances started in
    the same instant can both pass: this catches the common mistakes (a second ``serve`` on a
    shared NATS, ``docker compose --scale scheduler=2``), not a race.

    Raises:
        ServiceConflictError: "another <what> already serves <model> on this NATS server; <advice>".
    """
    try:
        await bus.request(subjects.ping(model, service), Ping(), Pong, timeout=timeout)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return
    raise ServiceConflictError(
        f"another {what} already serves {model} on this NATS server; {advice}"
    )


async def answer_pings(bus: Bus, model: str, service: str) -> None:
    """Answer ``Ping`` on ``ping(model, service)``: call once the service is ready to serve."""

    async def pong(_: Ping) -> Pong:
        return Pong(service=service)

    await bus.subscribe(subjects.ping(model, service), Ping, pong)
    await bus.flush()


def engine_ping_names(num_detokenizer_shards: int) -> tuple[str, ...]:
    """The ping names an engine must answer to be ready: the tokenizer, the scheduler, the
    executor and every detokenizer shard ``detokenizer.<n>`` for n in
    ``range(num_detokenizer_shards)`` (the plain name ``detokenizer`` is answered by every
    shard, so it says nothing about a missing one).

    Raises:
        ValueError: ``num_detokenizer_shards`` < 1.
    """
    if num_detokenizer_shards < 1:
        raise ValueError(f"num_detokenizer_shards must be >= 1, got {num_detokenizer_shards}")
    return ("tokenizer", "scheduler", "executor", *(f"detokenizer.{n}" for n in range(num_detokenizer_shards)))


async def engine_ready(bus: Bus, model: str, num_detokenizer_shards: int, timeout: float = 1.0) -> bool:
    """True when every service of :func:`engine_ping_names` answers a ping (each of the
    ``num_detokenizer_shards`` detokenizer shards included) and the scheduler has an
    executor group.

    Raises:
        ValueError: ``num_detokenizer_shards`` < 1.
    """
    try:
        for service in engine_ping_names(num_detokenizer_shards):
            await bus.request(subjects.ping(model, service), Ping(), Pong, timeout=timeout)
        stats = await bus.request(subjects.Subjects(model).stats_get, StatsQuery(), SchedulerStats, timeout)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return False
    return bool(stats.groups)


async def wait_engine_ready(bus: Bus, model: str, num_detokenizer_shards: int, timeout: float = 300.0) -> None:
    """Wait until :func:`engine_ready` (every detokenizer shard included).

    Raises:
        TimeoutError: not ready within ``timeout`` seconds.
        ValueError: ``num_detokenizer_shards`` < 1.
    """
    deadline = time.monotonic() + timeout
    while not await engine_ready(bus, model, num_detokenizer_shards):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine of {model} is not ready after {timeout} s")
        await asyncio.sleep(0.1)
