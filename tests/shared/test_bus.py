"""The bus's ordering guarantee that services rely on (after ``subscribe`` then ``flush``, a
message published from another connection is delivered), how it logs NATS errors, and how a
failing request handler answers."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest

from shared import bus as bus_module
from shared.bus import ERROR_CODE_HEADER, ERROR_HEADER, Bus, ConnectionEvents, RemoteError
from shared.messages import Ping, Pong, ServiceError


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


async def test_connecting_ends_when_cancelled_in_the_turn_an_attempt_fails(monkeypatch):
    """``Bus.connect`` retrying a server that is not up ends on a cancel (SIGTERM to a service
    still connecting), also one that comes in the loop turn where an attempt fails: there,
    Python 3.11's ``asyncio.wait_for`` (around nats.py's TCP connect) returns the attempt's
    error instead of the ``CancelledError``, and nats.py retried for ever (9 of 45 services sent
    SIGTERM 1.5 s after their first failed attempt, the retries' cadence, never stopped)."""
    attempts = 0

    async def refused_as_cancelled(*args: object, **kwargs: object) -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:  # the cancel runs before wait_for's waiter learns of this failure
            asyncio.get_running_loop().call_soon(connecting.cancel)
        raise ConnectionRefusedError(111, "Connect call failed")

    monkeypatch.setattr(asyncio, "open_connection", refused_as_cancelled)  # nats.py's TcpTransport
    connecting = asyncio.ensure_future(Bus.connect("nats://127.0.0.1:1", name="cancel-test"))
    try:
        await asyncio.wait({connecting}, timeout=2)
        assert connecting.cancelled() and attempts == 1, f"still connecting after {attempts} attempts"
    finally:
        connecting.cancel()  # a second one, which lands in nats.py's wait between attempts
        await asyncio.gather(connecting, return_exceptions=True)


async def test_a_failing_request_handler_answers_at_once_with_a_typed_error(nats_url):
    """A request/reply handler that raises answers with nats micro's error headers
    (``Nats-Service-Error``, ``Nats-Service-Error-Code`` 500) instead of leaving the caller to
    wait out its timeout; ``Bus.request`` raises them as a ``RemoteError``. A request that does
    not decode gets 400. The subscription goes on serving."""
    bus = await Bus.connect(nats_url, name="bus-errors")
    calls: list[str] = []

    async def handler(ping: Ping) -> Pong:
        calls.append("called")
        if len(calls) == 1:
            raise RuntimeError("broken\nhandler")
        return Pong(service="fine")

    try:
        await bus.subscribe("bus-test.errors", Ping, handler)
        await bus.flush()
        started = time.monotonic()
        with pytest.raises(RemoteError) as raised:
            await bus.request("bus-test.errors", Ping(), Pong, timeout=10.0)
        assert time.monotonic() - started < 2.0  # at once, not after the 10 s timeout
        assert raised.value.subject == "bus-test.errors"
        assert raised.value.error == ServiceError(message="RuntimeError: broken handler",
                                                  type="server_error", status=500)
        assert (await bus.request("bus-test.errors", Ping(), Pong, timeout=10.0)).service == "fine"

        raw = await bus.nc.request("bus-test.errors", b"\xc1", timeout=10.0)  # not msgpack
        assert raw.data == b"" and raw.headers[ERROR_CODE_HEADER] == "400"
        assert raw.headers[ERROR_HEADER] == "FormatError"  # msgpack's, without a message
        with pytest.raises(RemoteError) as raised:
            await bus.request("bus-test.errors", Pong(service="not a ping"), Pong, timeout=10.0)
        assert raised.value.error.status == 400 and raised.value.error.type == "invalid_request_error"
        assert "ValidationError" in raised.value.error.message
        assert calls == ["called", "called"]
    finally:
        await bus.close()
