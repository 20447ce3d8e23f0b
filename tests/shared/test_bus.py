"""The bus's ordering guarantee that services rely on (after ``subscribe`` then ``flush``, a
message published from another connection is delivered), and how it logs NATS errors."""

from __future__ import annotations

import asyncio

import nats.errors

from shared import bus as bus_module
from shared.bus import Bus, ConnectionEvents
from shared.messages import Ping


async def test_a_flushed_subscription_gets_every_later_publish(nats_url):
    """nats.py's own flush can return before the server has the SUB (its PING overtakes the
    buffered SUB): 8 % of these messages were lost with it."""
    a = await Bus.connect(nats_url, name="bus-a")
    b = await Bus.connect(nats_url, name="bus-b")
    try:
        lost = 0
        for i in range(300):
            got = asyncio.Event()

            async def on_ping(_: Ping, got: asyncio.Event = got) -> None:
                got.set()

            sub = await a.subscribe(f"bus-test.{i}", Ping, on_ping)
            await a.flush()
            await b.publish(f"bus-test.{i}", Ping())
            await b.nc.flush()  # on the wire at once (nats.py's own flush: one round trip)
            try:
                await asyncio.wait_for(got.wait(), 1.0)
            except TimeoutError:
                lost += 1
            await sub.unsubscribe()
        assert lost == 0
    finally:
        await a.close()
        await b.close()


async def test_a_handshake_without_info_is_a_connection_error(monkeypatch):
    """A server that accepts and closes while it starts or stops makes nats.py raise a plain
    ``nats.errors.Error`` ("empty response ... INFO"): logged as the outage's one connection
    error line, not as a warning on every reconnect attempt. Other NATS errors stay one line
    each."""
    events: list[tuple[str, dict]] = []

    class Log:
        def __getattr__(self, level: str):
            return lambda event, **fields: events.append((f"{level}:{event}", fields))

    monkeypatch.setattr(bus_module, "log", Log())
    conn = ConnectionEvents("test", "nats://127.0.0.1:1")
    await conn.on_error(ConnectionRefusedError(111, "Connect call failed"))
    for _ in range(3):
        await conn.on_error(nats.errors.Error("nats: empty response from server when expecting INFO message"))
    await conn.on_error(nats.errors.SlowConsumerError("s", "", 1, None))
    await conn.on_error(nats.errors.Error("nats: some other protocol error"))
    assert [event for event, _ in events] == [
        "warning:nats_connection_error", "warning:nats_error", "warning:nats_error"]
    assert events[0][1]["errors"] == 1 and conn.errors == 4
    await conn.on_reconnected()
    assert events[-1] == ("info:nats_reconnected", {"connection": "test", "url": "nats://127.0.0.1:1", "errors": 4})
    await conn.on_error(nats.errors.Error("nats: info message, json parse error"))
    assert events[-1][0] == "warning:nats_connection_error" and events[-1][1]["errors"] == 1
