"""NATS credentials files (PAGEDLLM_NATS_CREDS) against a real nats-server in JWT operator
mode: an operator, an account and its users made here with ``nkeys`` (as ``nsc`` would), the
account preloaded in a MEMORY resolver. A connection with a user's .creds file is let in; one
without, or with a user that the account did not sign, is refused at once (no retrying for
ever); a service process given the file serves."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import socket
import subprocess
import time

import nats.errors
import nkeys
import pytest
from processes import clean_env, start_service, stop_all
from pydantic import ValidationError

from shared import subjects
from shared.bus import Bus, NatsAuthorizationError, is_authorization_error
from shared.config import Settings
from shared.messages import Ping, Pong
from shared.nats_server import find_nats_server, free_port

UNLIMITED = {"subs": -1, "data": -1, "payload": -1}  # NATS limits: -1 = none (0 would allow nothing)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def new_nkey(prefix: int) -> tuple[nkeys.KeyPair, str]:
    """A fresh key pair of one kind (``nkeys.PREFIX_BYTE_OPERATOR``, ``_ACCOUNT``, ``_USER``)
    and its seed."""
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return nkeys.from_seed(bytearray(seed)), seed.decode()


def public(key: nkeys.KeyPair) -> str:
    return key.public_key.decode()


def signed_jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats_claims: dict) -> str:
    """A NATS JWT (v2) as the jwt library writes it: ``jti`` the base32 SHA-512/256 of the
    claims without it, signed with the issuer's ed25519 nkey."""
    claims = {"iat": int(time.time()), "iss": public(issuer), "name": name, "sub": subject,
              "nats": {**nats_claims, "version": 2}}
    digest = hashlib.new("sha512_256", json.dumps(claims, separators=(",", ":")).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}.{_b64(issuer.sign(f'{head}.{body}'.encode()))}"


def user_creds(account: nkeys.KeyPair, name: str) -> str:
    """A .creds file's text: a new user's JWT, signed by ``account``, and its seed."""
    user, seed = new_nkey(nkeys.PREFIX_BYTE_USER)
    user_jwt = signed_jwt(account, public(user), name, {"type": "user", "pub": {}, "sub": {}, **UNLIMITED})
    return (f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n")


@pytest.fixture(scope="module")
def jwt_server(tmp_path_factory):
    """A nats-server trusting one operator, with one account: (url, a user's .creds file,
    the .creds file of a user signed by an account the server does not know)."""
    tmp = tmp_path_factory.mktemp("nats-jwt")
    operator, _ = new_nkey(nkeys.PREFIX_BYTE_OPERATOR)
    account, _ = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    stranger, _ = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    limits = {**UNLIMITED, "imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1}
    port = free_port()
    (tmp / "nats.conf").write_text(
        f"listen: 127.0.0.1:{port}\n"
        f"operator: {signed_jwt(operator, public(operator), 'pagedllm-test', {'type': 'operator'})}\n"
        "resolver: MEMORY\n"
        f"resolver_preload: {{ {public(account)}: "
        f"{signed_jwt(operator, public(account), 'engine', {'type': 'account', 'limits': limits})} }}\n")
    (tmp / "engine.creds").write_text(user_creds(account, "engine"))
    (tmp / "stranger.creds").write_text(user_creds(stranger, "stranger"))
    proc = subprocess.Popen([find_nats_server(), "-c", str(tmp / "nats.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        assert proc.poll() is None, "nats-server did not take the operator configuration"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.05)
    yield f"nats://127.0.0.1:{port}", tmp / "engine.creds", tmp / "stranger.creds"
    stop_all([proc])


async def test_a_connection_with_the_credentials_file_is_let_in(jwt_server):
    url, creds, _ = jwt_server

    async def pong(_: Ping) -> Pong:
        return Pong(service="creds-test")

    bus = await asyncio.wait_for(Bus.connect(url, name="creds-test", creds=creds), 10)
    try:
        await bus.subscribe("creds.ping", Ping, pong)
        await bus.flush()
        assert await bus.request("creds.ping", Ping(), Pong, timeout=5) == Pong(service="creds-test")
    finally:
        await bus.close()


async def test_a_connection_without_credentials_is_refused_at_once(jwt_server):
    """Refused, not retried for ever; the message names the server without the password."""
    host = jwt_server[0].removeprefix("nats://")
    for url in (f"nats://{host}", f"nats://user:s3cret@{host}"):
        with pytest.raises(NatsAuthorizationError) as refused:
            await asyncio.wait_for(Bus.connect(url, name="intruder"), 10)
        message = str(refused.value)
        assert message.startswith(f"NATS at {url.replace('user:s3cret', '***')} refused the credentials of "
                                  "connection 'intruder'"), message
        assert "s3cret" not in message and "PAGEDLLM_NATS_CREDS" in message


def test_only_a_refusal_of_the_credentials_ends_a_new_connection():
    assert is_authorization_error(nats.errors.Error("nats: 'Authorization Violation'"))
    assert is_authorization_error(nats.errors.Error("nats: 'User Authentication Expired'"))
    assert not is_authorization_error(nats.errors.Error("nats: 'Authentication Timeout'"))  # may pass next time
    assert not is_authorization_error(ConnectionRefusedError("refused"))


async def test_a_user_of_an_account_the_server_does_not_trust_is_refused(jwt_server):
    with pytest.raises(NatsAuthorizationError):
        await asyncio.wait_for(Bus.connect(jwt_server[0], name="stranger", creds=jwt_server[2]), 10)


async def test_a_credentials_file_that_is_not_there_is_an_error(jwt_server, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.creds"):
        await Bus.connect(jwt_server[0], creds=tmp_path / "missing.creds")


def test_the_setting_names_the_file_and_needs_a_url(tmp_path):
    creds = tmp_path / "svc.creds"
    with pytest.raises(ValidationError, match="nats_creds: no such file"):
        Settings(nats_url="nats://nats:4222", nats_creds=creds)
    creds.write_text("x")
    with pytest.raises(ValidationError, match="nats_creds needs nats_url"):
        Settings(nats_creds=creds)
    settings = Settings(nats_url="nats://nats:4222", nats_creds=creds)
    assert settings.to_env()["PAGEDLLM_NATS_CREDS"] == str(creds)  # services started by serve get it too


def test_the_command_line_takes_nats_creds(tmp_path):
    import argparse

    from pagedllm.cli import add_settings_flags, settings_from_args

    creds = tmp_path / "svc.creds"
    creds.write_text("x")
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    args = parser.parse_args(["--nats-url", "nats://nats:4222", "--nats-creds", str(creds)])
    assert settings_from_args(args).nats_creds == creds


@pytest.mark.heavy
def test_a_service_process_serves_with_its_credentials_file_and_stops_without(jwt_server, smollm2_path):
    """``pagedllm service tokenizer`` with PAGEDLLM_NATS_CREDS answers pings; without it, it
    exits at once with one line saying NATS refused it."""
    url, creds, _ = jwt_server
    model = "creds-test"
    env = clean_env(PAGEDLLM_NATS_URL=url, PAGEDLLM_MODEL=str(smollm2_path), PAGEDLLM_SERVED_MODEL_NAME=model,
                    PAGEDLLM_CACHE_DIR=str(smollm2_path.parent))
    refused = start_service("tokenizer", env, stderr=subprocess.PIPE)
    served = start_service("tokenizer", {**env, "PAGEDLLM_NATS_CREDS": str(creds)})
    try:
        assert refused.wait(60) == 1
        assert "pagedllm service tokenizer: NATS at nats://127.0.0.1" in refused.stderr.read()

        async def ping() -> None:
            bus = await Bus.connect(url, name="creds-test", creds=creds)
            try:
                deadline = time.monotonic() + 60
                while True:
                    assert served.poll() is None, "the tokenizer with the credentials exited"
                    try:
                        await bus.request(subjects.ping(model, "tokenizer"), Ping(), Pong, timeout=1)
                        return
                    except Exception:
                        assert time.monotonic() < deadline, "the tokenizer did not answer"
                        await asyncio.sleep(0.2)
            finally:
                await bus.close()

        asyncio.run(ping())
    finally:
        stop_all([refused, served])


@pytest.mark.e2e
def test_the_offline_engine_runs_on_a_server_that_needs_its_credentials_file(jwt_server, smollm2_path):
    """``LLM(nats_url=..., nats_creds=...)``: every in-process service and the client connect
    with the file, and generation works (SmolLM2, greedy: the known answer)."""
    from pagedllm import LLM, SamplingParams

    url, creds, _ = jwt_server
    with LLM(model=str(smollm2_path), dtype="float32", nats_url=url, nats_creds=str(creds),
             served_model_name="creds-llm", kv_cache_memory_bytes=32 << 20) as llm:
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].text.strip().startswith("Paris")
