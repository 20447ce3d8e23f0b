"""The ``gw`` fixture: a gateway on a real nats-server in front of ``FakeBackend``
(``gateway_fakes.py``), with an OpenAI SDK client and an HTTP client (one per test module;
a module's ``GATEWAY_SETTINGS`` dict adds settings)."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest_asyncio
from gateway_fakes import FakeBackend

from gateway.service import GatewayService
from shared.bus import Bus
from shared.config import Settings
from shared.model_source import ModelInfo


@pytest_asyncio.fixture(scope="module")
async def gw(request, nats_url: str):
    model = f"gwtest-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="fake-backend")
    backend = FakeBackend(bus, model)
    await backend.start()
    info = ModelInfo(
        path=Path("/models") / model, name=model, max_model_len=106, eos_token_ids=(2,), vocab_size=1000
    )
    extra = getattr(request.module, "GATEWAY_SETTINGS", {})
    service = GatewayService(Settings(nats_url=nats_url, host="127.0.0.1", port=0, **extra), info)
    await service.start()
    base = service.url
    oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        yield SimpleNamespace(model=model, backend=backend, service=service, base=base, oai=oai, http=http)
    await oai.close()
    await service.stop()
    await bus.close()
