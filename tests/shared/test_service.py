"""``BusService``, the base of every engine service, on a real nats-server: ``async with``
starts and stops it; it answers pings once serving; ``stop`` drains the subscriptions it made
(their pending messages are handled), cancels its tasks, and closes the bus only if it opened
it; a second instance of an exclusive service refuses to start."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import nats.errors
import pytest

from shared import subjects
from shared.bus import Bus
from shared.config import Settings
from shared.messages import Ping, Pong
from shared.model_source import ModelInfo
from shared.service import BusService, Exclusive, ServiceConflictError


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
        await second.stop()
        assert second.bus is None
    finally:
        await first.stop()
    assert first.bus is None and own.nc.is_closed


async def test_a_service_needs_a_nats_url_or_a_bus():
    with pytest.raises(ValueError, match="Echo needs settings.nats_url"):
        await Echo(Settings(nats_url=None), model_info()).start()
