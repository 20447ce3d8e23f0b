"""The bus's ordering guarantee that services rely on: after ``subscribe`` then ``flush``,
a message published from another connection is delivered."""

from __future__ import annotations

import asyncio

from shared.bus import Bus
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
