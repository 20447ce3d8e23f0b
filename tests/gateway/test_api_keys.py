"""``--api-key``: /v1 routes and the WebSocket need a bearer key (several keys allowed),
compared in constant time; /health and /metrics stay open."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import openai
import pytest
import websockets
from gateway_fakes import FakeBackend

from gateway.auth import key_matches, parse_api_keys
from gateway.service import GatewayService
from shared.bus import Bus
from shared.config import Settings
from shared.model_source import ModelInfo


def test_keys_parse_and_match():
    assert parse_api_keys(None) == [] and parse_api_keys(" a , ,b") == ["a", "b"]
    assert key_matches("b", ["a", "b"]) and not key_matches("c", ["a", "b"]) and not key_matches("", ["a"])
    assert not key_matches("a", [])


async def test_v1_needs_a_valid_key_and_health_and_metrics_stay_open(nats_url, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_API_KEY", "sk-one, sk-two")
    model = f"keys-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="fake-backend")
    backend = FakeBackend(bus, model)
    await backend.start()
    info = ModelInfo(path=Path("/models") / model, name=model, max_model_len=106, eos_token_ids=(2,), vocab_size=1000)
    service = GatewayService(Settings(nats_url=nats_url, host="127.0.0.1", port=0), info)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            for headers in ({}, {"Authorization": "Bearer sk-three"}, {"Authorization": "Basic sk-one"},
                            {"Authorization": "Bearer"}):
                r = await http.get("/v1/models", headers=headers)
                assert r.status_code == 401, headers
                assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
            r = await http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 401
            assert (await http.get("/health")).status_code in (200, 503)  # open (503: no real engine here)
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.options("/v1/models", headers={"Origin": "http://x", "Access-Control-Request-Method":
                                                              "GET"})).status_code == 200
        for key in ("sk-one", "sk-two"):
            client = openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key=key, max_retries=0, timeout=10)
            out = await client.completions.create(model=model, prompt="hello", max_tokens=3)
            assert out.choices[0].text
            await client.close()
        bad = openai.AsyncOpenAI(base_url=f"{service.url}/v1", api_key="wrong", max_retries=0, timeout=10)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        await bad.close()
        ws_url = service.url.replace("http://", "ws://") + "/v1/stream"
        with pytest.raises(websockets.exceptions.InvalidStatus):
            async with websockets.connect(ws_url):
                pass
        async with websockets.connect(ws_url, additional_headers={"Authorization": "Bearer sk-two"}) as ws:
            assert ws.state.name == "OPEN"
    finally:
        await service.stop()
        await bus.close()


def test_the_flag_takes_several_keys_as_vllm_does():
    from pagedllm.cli import build_parser, settings_from_args

    args = build_parser().parse_args(["serve", "--api-key", "k1", "k2,k3"])
    assert parse_api_keys(settings_from_args(args).api_key) == ["k1", "k2", "k3"]
    assert settings_from_args(build_parser().parse_args(["serve"])).api_key is None
