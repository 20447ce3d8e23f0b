"""``BusService``, the base of every engine service, on a real nats-server: ``async with``
starts and stops it; it answers pings once serving; ``stop`` drains the subscriptions it made
(their pending messages are handled), cancels its tasks, and closes the bus only if it opened
it; a second instance of an exclusive service refuses to start."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import nats.errors
import pytest
import structlog

from shared import subjects
from shared.bus import Bus
from shared.config import Settings
from shared.messages import Ping, Pong
from shared.model_source import ModelInfo
from shared.pings import ServiceConflictError
from shared.service import BusService, Exclusive, FatalServiceError, run_service


class Echo(BusService):
    """Answers ``Ping`` on ``<base>.echo`` with its handled count; one exclusive instance."""

    name = "echo"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handled = 0
        self.stopped_with_bus: bool | None = None
        self.loop_task: asyncio.Task | None = None

    def exclusive(self) -> Exclusive:
        return Exclusive(self.name, "echo service", advice="one is enough")

    async def serve(self) -> None:
        await self.subscribe(f"{self.subjects.base}.echo", Ping, self._on_ping)
        self.loop_task = self.spawn(asyncio.sleep(3600))

    async def on_stop(self) -> None:
        self.stopped_with_bus = self.bus is not None and not self.bus.nc.is_closed

    async def _on_ping(self, _: Ping) -> Pong:
        await asyncio.sleep(0.05)
        self.handled += 1
        return Pong(service=str(self.handled))


def model_info() -> ModelInfo:
    name = f"svc-{uuid.uuid4().hex[:8]}"
    return ModelInfo(path=Path("/models") / name, name=name, max_model_len=64, eos_token_ids=(2,), vocab_size=100)


async def test_a_service_on_a_shared_bus_drains_its_subscriptions_and_leaves_the_bus_open(nats_url):
    info = model_info()
    bus = await Bus.connect(nats_url, name="test-shared")
    client = await Bus.connect(nats_url, name="test-client")
    echo_subject = f"{subjects.Subjects(info.name).base}.echo"
    try:
        async with Echo(Settings(), info, bus) as service:
            assert (await client.request(subjects.ping(info.name, "echo"), Ping(), Pong, 2.0)).service == "echo"
            assert (await client.request(echo_subject, Ping(), Pong, 2.0)).service == "1"
            pending = [asyncio.ensure_future(client.request(echo_subject, Ping(), Pong, 5.0)) for _ in range(3)]
            await client.nc.flush()
            await asyncio.sleep(0.01)  # on the service's side before it stops
        assert sorted(p.service for p in await asyncio.gather(*pending)) == ["2", "3", "4"]  # drained
        assert service.stopped_with_bus is True and service.loop_task.cancelled()
        assert service.bus is bus and not bus.nc.is_closed  # not its own: left open
        with pytest.raises(nats.errors.NoRespondersError):
            await client.request(echo_subject, Ping(), Pong, 2.0)
        with pytest.raises(nats.errors.NoRespondersError):
            await client.request(subjects.ping(info.name, "echo"), Ping(), Pong, 2.0)
    finally:
        await client.close()
        await bus.close()


async def test_a_service_closes_the_bus_it_opened_and_refuses_a_second_instance(nats_url):
    info = model_info()
    first, second = Echo(Settings(nats_url=nats_url), info), Echo(Settings(nats_url=nats_url), info)
    await first.start()
    own = first.bus
    try:
        with pytest.raises(ServiceConflictError, match=f"another echo service already serves {info.name} on this "
                                                       "NATS server; one is enough"):
            await second.start()
        assert second.bus is None  # the failed start closed the bus it had opened
        await second.stop()
        assert second.bus is None
    finally:
        await first.stop()
    assert first.bus is None and own.nc.is_closed


async def test_a_service_needs_a_nats_url_or_a_bus():
    with pytest.raises(ValueError, match="Echo needs settings.nats_url"):
        await Echo(Settings(nats_url=None), model_info()).start()


class Failing(Echo):
    """An Echo whose task fails once it serves (an executor refused by the scheduler, say)."""

    async def serve(self) -> None:
        await super().serve()
        self.spawn(self._fail_soon())

    async def _fail_soon(self) -> None:
        await asyncio.sleep(0.05)
        raise FatalServiceError("cannot go on")


async def test_a_failed_task_ends_the_service_and_run_service_raises_its_error(nats_url):
    """A spawned task that raises is logged and ends the service: ``run_service`` stops it (its
    other tasks cancelled, its own bus closed) and raises the error, so the process exits
    rather than serve on without the task."""
    service = Failing(Settings(nats_url=nats_url), model_info())
    with structlog.testing.capture_logs() as logs, pytest.raises(FatalServiceError, match="cannot go on"):
        await asyncio.wait_for(run_service(service), 5)
    assert service.bus is None and service.loop_task.cancelled() and service.stopped_with_bus is True
    failed = [entry for entry in logs if entry["event"] == "service_task_failed"]
    assert [(entry["service"], entry["error"]) for entry in failed] == [("echo", "cannot go on")]


class LosesACancel(Echo):
    """An Echo whose start goes on through the first cancel (as a Python 3.11 ``wait_for`` does
    when what it waits for ends in the same loop turn) and starts all the same."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loading = asyncio.Event()

    async def load(self) -> None:
        self.loading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass


async def test_a_service_that_starts_despite_the_cancel_of_a_sigterm_is_stopped(nats_url):
    """SIGTERM while the service starts cancels its start; a start that ends all the same (the
    cancel lost) is then stopped by ``run_service`` (its bus closed), not left serving."""
    service = LosesACancel(Settings(nats_url=nats_url), model_info())
    running = asyncio.ensure_future(run_service(service))
    try:
        await asyncio.wait_for(service.loading.wait(), 5)  # run_service handles SIGTERM from now on
        signal.raise_signal(signal.SIGTERM)
        await asyncio.wait_for(running, 10)
        assert service.bus is None and service.stopped_with_bus is True and service.loop_task.cancelled()
    finally:
        running.cancel()
        await service.stop()
