"""The embedded nats-server requires the token generated at its start: a client without it
(another local user) is refused; the token never reaches the logs."""

from __future__ import annotations

import nats
import nats.errors
import pytest

from shared.bus import Bus, ConnectionEvents, redact_url
from shared.nats_server import EmbeddedNats


def test_urls_are_logged_without_their_credentials():
    assert redact_url("nats://s3cret@127.0.0.1:4222") == "nats://***@127.0.0.1:4222"
    assert redact_url("nats://user:pw@host:4222/x") == "nats://***@host:4222/x"
    assert redact_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert ConnectionEvents("x", "nats://tok@h:1").url == "nats://***@h:1"


async def test_the_embedded_server_refuses_clients_without_its_token():
    with EmbeddedNats() as server:
        assert server.url == f"nats://{server.token}@127.0.0.1:{server.port}" and len(server.token) >= 24
        assert EmbeddedNats().token != server.token  # one per start
        for url in (f"nats://127.0.0.1:{server.port}", f"nats://wrong@127.0.0.1:{server.port}"):
            with pytest.raises((nats.errors.Error, OSError)):
                await nats.connect(url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)
        bus = await Bus.connect(server.url, name="auth-test")
        await bus.nc.publish("x", b"y")
        await bus.close()
