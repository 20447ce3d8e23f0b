"""docker-compose.yml's NATS authorization (deploy/nats.conf): a valid nats-server configuration
with one user per pagedllm service; each service of the compose file connects as its own user,
with the password that the nats service is given too; the server lets each in with its own
password only and refuses what its user may not do. (tests/e2e/test_e2e_stack.py runs the
whole compose stack on this server, every service as its user.)"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess

import nats
import pytest
import yaml
from processes import (
    COMPOSE_NATS_CONF,
    ROOT,
    compose_nats_passwords,
    compose_nats_url,
    start_compose_nats,
    stop_all,
)

from shared.bus import Bus, NatsAuthorizationError
from shared.messages import Ping, Pong
from shared.nats_server import find_nats_server

SERVICES = {"scheduler", "tokenizer", "detokenizer", "executor", "gateway", "batch"}


def compose_services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def service_urls() -> dict[str, str]:
    """Each pagedllm service's ``PAGEDLLM_NATS_URL`` in docker-compose.yml."""
    return {name: svc["environment"]["PAGEDLLM_NATS_URL"] for name, svc in compose_services().items()
            if name != "nats"}


def test_each_service_connects_as_its_own_user_with_a_password_the_nats_service_gets():
    urls = service_urls()
    assert set(urls) == SERVICES
    nats_env = compose_services()["nats"]["environment"]
    users = dict(re.findall(r"\{user: (\w+), password: \$(\w+),", COMPOSE_NATS_CONF.read_text()))
    assert set(users) == SERVICES
    for name, url in urls.items():
        var = f"{name.upper()}_NATS_PASSWORD"
        assert url == f"nats://{name}:${{{var}}}@nats:4222"
        assert nats_env[var].startswith(f"${{{var}:?")  # compose refuses to start without it
        assert users[name] == var
    assert set(compose_nats_passwords()) == set(users.values())


def test_nats_conf_is_valid_and_needs_every_password():
    passwords = compose_nats_passwords()
    check = [find_nats_server(), "-t", "-c", str(COMPOSE_NATS_CONF)]
    valid = subprocess.run(check, env={**os.environ, **passwords}, capture_output=True, text=True, timeout=30)
    assert valid.returncode == 0, valid.stderr
    del passwords["BATCH_NATS_PASSWORD"]
    missing = subprocess.run(check, env={**os.environ, **passwords}, capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0 and "BATCH_NATS_PASSWORD" in missing.stderr


@pytest.fixture(scope="module")
def compose_nats(tmp_path_factory):
    """deploy/nats.conf's server: each service's URL on it."""
    passwords = compose_nats_passwords()
    proc, port = start_compose_nats(tmp_path_factory.mktemp("compose-nats"), passwords)
    yield {name: compose_nats_url(url, passwords, port) for name, url in service_urls().items()}
    stop_all([proc])


async def test_each_service_gets_in_with_its_own_password_only(compose_nats):
    for name, url in compose_nats.items():
        await (await asyncio.wait_for(Bus.connect(url, name=name), 10)).close()
    scheduler_password = compose_nats["scheduler"].split(":")[2].split("@")[0]
    stolen = compose_nats["tokenizer"].replace(compose_nats["tokenizer"].split(":")[2].split("@")[0],
                                               scheduler_password)
    with pytest.raises(NatsAuthorizationError):
        await asyncio.wait_for(Bus.connect(stolen, name="tokenizer"), 10)


async def test_a_request_between_two_users_gets_its_reply(compose_nats):
    """The gateway asks the tokenizer (its inbox under _INBOX.>; the tokenizer may answer it:
    allow_responses)."""
    gateway = await Bus.connect(compose_nats["gateway"], name="gateway")
    tokenizer = await Bus.connect(compose_nats["tokenizer"], name="tokenizer")

    async def pong(_: Ping) -> Pong:
        return Pong(service="tokenizer")

    try:
        await tokenizer.subscribe("pagedllm.m.ping.tokenizer", Ping, pong)
        await tokenizer.flush()
        assert await gateway.request("pagedllm.m.ping.tokenizer", Ping(), Pong, timeout=5) == Pong(service="tokenizer")
    finally:
        await gateway.close()
        await tokenizer.close()


@pytest.mark.parametrize("user, action, subject", [
    ("tokenizer", "publish", "pagedllm.m.exec.g.step"),  # only the scheduler sends step plans
    ("gateway", "publish", "pagedllm.m.submit"),  # requests are submitted by the tokenizer
    ("executor", "subscribe", "pagedllm.m.tokenize"),  # prompts are read by the tokenizer only
    ("detokenizer", "subscribe", "pagedllm.gw.g"),  # a gateway's outputs by that gateway only
])
async def test_what_a_user_may_not_do_is_refused(compose_nats, user, action, subject):
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats.connect(compose_nats[user], error_cb=on_error, allow_reconnect=False, connect_timeout=5)
    try:
        if action == "publish":
            await nc.publish(subject, b"x")
        else:
            await nc.subscribe(subject)
        await nc.flush()
        deadline = asyncio.get_running_loop().time() + 5
        while not errors and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
    finally:
        await nc.close()
    kind = "publish" if action == "publish" else "subscription"
    assert [str(e).lower() for e in errors] == [f'nats: permissions violation for {kind} to "{subject}"']
