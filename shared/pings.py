"""Pings (``subjects.ping``): what answering them tells, and what asking them finds out.

A service answers pings on its name once it serves (``answer_pings``); before it serves, a
ping on the same name tells whether another instance already does (``refuse_if_served``:
``ServiceConflictError``). The engine is ready when every service answers and the scheduler
has an executor group (``engine_missing``, ``engine_ready``, ``wait_engine_ready``).
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
from nats.aio.subscription import Subscription

from shared import subjects
from shared.bus import Bus, RemoteError
from shared.messages import Ping, Pong, SchedulerStats, StatsQuery


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
    except RemoteError:  # something answered, with an error: it is there
        pass
    raise ServiceConflictError(
        f"another {what} already serves {model} on this NATS server; {advice}"
    )


async def answer_pings(bus: Bus, model: str, service: str) -> Subscription:
    """Answer ``Ping`` on ``ping(model, service)``: call once the service is ready to serve.
    Returns the subscription (flushed)."""

    async def pong(_: Ping) -> Pong:
        return Pong(service=service)

    sub = await bus.subscribe(subjects.ping(model, service), Ping, pong)
    await bus.flush()
    return sub


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


#: in :func:`engine_missing`: the scheduler answers but has no executor group registered
NO_EXECUTOR_GROUP = "executor group"


async def engine_missing(bus: Bus, model: str, num_detokenizer_shards: int, timeout: float = 1.0) -> list[str]:
    """What the engine lacks to serve: the name of each service of :func:`engine_ping_names`
    that does not answer a ping (pinged together), and ``NO_EXECUTOR_GROUP`` when the
    scheduler has no executor group registered. Empty: ready.

    Raises:
        ValueError: ``num_detokenizer_shards`` < 1.
    """
    names = engine_ping_names(num_detokenizer_shards)

    async def answers(service: str) -> bool:
        try:
            await bus.request(subjects.ping(model, service), Ping(), Pong, timeout=timeout)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, RemoteError):
            return False
        return True

    answered = await asyncio.gather(*(answers(name) for name in names))
    missing = [name for name, ok in zip(names, answered, strict=True) if not ok]
    if "scheduler" not in missing:
        try:
            stats = await bus.request(subjects.Subjects(model).stats_get, StatsQuery(), SchedulerStats, timeout)
            if not stats.groups:
                missing.append(NO_EXECUTOR_GROUP)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, RemoteError):
            missing.append("scheduler")
    return missing


async def engine_ready(bus: Bus, model: str, num_detokenizer_shards: int, timeout: float = 1.0) -> bool:
    """True when :func:`engine_missing` finds nothing missing: every service answers a ping
    (each of the ``num_detokenizer_shards`` detokenizer shards included) and the scheduler
    has an executor group.

    Raises:
        ValueError: ``num_detokenizer_shards`` < 1.
    """
    return not await engine_missing(bus, model, num_detokenizer_shards, timeout)


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
