"""The gateway against a real nats-server and a fake backend (tokenizer + detokenizer).

The fake backend answers ``TokenizeRequest`` (one token per prompt word) and then
publishes ``GatewayStep`` deltas that spell "The capital of France is Paris." (one word
per token, cut at ``max_tokens``). Prompts containing "slow" produce one delta and then
wait for an abort; with "children first" the samples of n > 1 come last to first; prompts containing "fail" end with an engine error; ``max_tokens``
above 100 is refused by the fake tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from websockets.asyncio.client import connect as ws_connect

from gateway.service import GatewayService
from shared import subjects
from shared.bus import Bus
from shared.config import Settings
from shared.messages import (
    AbortRequests,
    DecodedLogprobs,
    GatewayStep,
    GroupStats,
    RequestDelta,
    SchedulerStats,
    ServiceError,
    StatsQuery,
    TokenizeReply,
    TokenizeRequest,
    TokenLogprob,
)
from shared.model_source import ModelInfo
from shared.service import answer_pings, engine_ping_names
from shared.subjects import TOKENIZER_QUEUE, Subjects

ANSWER = ["The", " capital", " of", " France", " is", " Paris."]
FULL = "".join(ANSWER)
PROMPT = "What is the capital of France?"  # 6 words = 6 prompt tokens


def fake_logprobs(i: int, piece: str, num_top: int) -> DecodedLogprobs:
    """Output token ``i`` (text ``piece``): log probability -i / 10 (the first is -inf: JSON
    has none), rank 1; alternatives "alt0", "alt1", ... at -1, -2, ..."""
    sampled = TokenLogprob(token_id=100 + i, token=piece, bytes=piece.encode(),
                           logprob=-i / 10 if i else float("-inf"), rank=1)
    alts = [TokenLogprob(token_id=900 + k, token=f"alt{k}", bytes=f"alt{k}".encode(), logprob=-1.0 - k,
                         rank=k + 1) for k in range(num_top)]
    return DecodedLogprobs(sampled=sampled, top=alts)


def fake_prompt_logprobs(text: str, num_top: int) -> list[DecodedLogprobs]:
    """Prompt word ``i`` (text " word" but the first): log probability -i, the first None."""
    words = text.split()
    out = []
    for i, w in enumerate(words):
        piece = w if i == 0 else " " + w
        token = TokenLogprob(token_id=i, token=piece, bytes=piece.encode(), logprob=-float(i) if i else None,
                             rank=1 if i else None)
        alts = [] if not i else [TokenLogprob(token_id=900 + k, token=f"alt{k}", bytes=f"alt{k}".encode(),
                                              logprob=-10.0 - k, rank=k + 1) for k in range(num_top)]
        out.append(DecodedLogprobs(sampled=token, top=alts))
    return out


class FakeBackend:
    """Tokenizer + detokenizer stand-in that records what the gateway sends."""

    def __init__(self, bus: Bus, model: str) -> None:
        self.bus = bus
        self.model = model
        self.subjects = Subjects(model)
        self.requests: dict[str, TokenizeRequest] = {}
        self.aborted: list[str] = []
        self._abort_events: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.bus.subscribe(
            self.subjects.tokenize, TokenizeRequest, self._on_tokenize, queue=TOKENIZER_QUEUE
        )
        await self.bus.subscribe(self.subjects.abort, AbortRequests, self._on_abort)
        await self.bus.subscribe(self.subjects.stats_get, StatsQuery, self._on_stats)
        for service in engine_ping_names(1):
            await answer_pings(self.bus, self.model, service)
        await self.bus.flush()

    async def _on_stats(self, _: StatsQuery) -> SchedulerStats:
        group = GroupStats(group_id="g0", num_blocks=8, num_free_blocks=8, block_size=16, num_running=0)
        return SchedulerStats(num_running=0, num_waiting=0, groups=[group])

    async def _on_abort(self, message: AbortRequests) -> None:
        for request_id in message.request_ids:
            self.aborted.append(request_id)
            self._abort_events.setdefault(request_id, asyncio.Event()).set()

    async def wait_aborted(self, request_id: str, timeout: float = 5.0) -> None:
        await asyncio.wait_for(self._abort_events.setdefault(request_id, asyncio.Event()).wait(), timeout)

    async def _on_tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        self.requests[req.request_id] = req
        params = req.sampling_params
        if params.max_tokens is not None and params.max_tokens > 100:
            error = ServiceError(
                message=f"max_tokens={params.max_tokens} is too large: prompt + max_tokens exceeds max_model_len=106",
                param="max_tokens",
            )
            return TokenizeReply(request_id=req.request_id, error=error)
        if isinstance(req.prompt, list):
            text, prompt_ids = "", req.prompt
        else:
            text = req.prompt if req.prompt is not None else str(req.messages[-1]["content"])
            prompt_ids = list(range(len(text.split())))
        task = asyncio.create_task(self._generate(req, text, len(prompt_ids)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return TokenizeReply(request_id=req.request_id, prompt_token_ids=prompt_ids,
                             prompt=text if req.return_prompt else None)

    async def _send(self, req: TokenizeRequest, **fields: Any) -> None:
        delta = RequestDelta(request_id=req.request_id, **fields)
        await self.bus.publish(subjects.gateway(req.gateway_id), GatewayStep(outputs=[delta]))

    async def _generate(self, req: TokenizeRequest, text: str, num_prompt: int) -> None:
        await asyncio.sleep(0.01)
        if "refuse" in text:  # as the scheduler refuses (priority, KV cache too small) after tokenizing
            error = ServiceError(message="priority=-1 needs --scheduling-policy priority", param="priority")
            await self._send(req, finished=True, finish_reason="error", error=error)
            return
        if req.notify_accepted:  # as the scheduler, once queued
            await self._send(req, accepted=True)
        if "slow" in text:
            await self._send(
                req, text="Hello", token_ids=[7], num_prompt_tokens=num_prompt, num_output_tokens=1
            )
            await self.wait_aborted(req.request_id, timeout=10)
            return
        if "fail" in text:
            await self._send(
                req, text="Oops", token_ids=[7], num_prompt_tokens=num_prompt, num_output_tokens=1
            )
            error = ServiceError(message="executor group g0 failed", type="internal_error", status=500)
            await self._send(req, finished=True, finish_reason="error", error=error)
            return
        params = req.sampling_params
        limit = params.max_tokens or len(ANSWER)
        pieces = ANSWER[:limit]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            order = range(params.n)[::-1] if "children first" in text else range(params.n)
            for index in order:  # every sample the same answer (the prompt's logprobs with sample 0's)
                await self._send(
                    req,
                    index=index,
                    text=piece,
                    token_ids=[100 + i],
                    logprobs=[] if params.logprobs is None else [fake_logprobs(i, piece, params.logprobs)],
                    prompt_logprobs=(fake_prompt_logprobs(text, params.prompt_logprobs)
                                     if params.prompt_logprobs is not None and i == 0 and index == 0 else []),
                    finished=last,
                    finish_reason=("stop" if len(pieces) == len(ANSWER) else "length") if last else None,
                    num_prompt_tokens=num_prompt,
                    num_output_tokens=i + 1,
                )
            await asyncio.sleep(0.005)


@pytest_asyncio.fixture(scope="module")
async def gw(nats_url: str):
    model = f"gwtest-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(nats_url, name="fake-backend")
    backend = FakeBackend(bus, model)
    await backend.start()
    info = ModelInfo(
        path=Path("/models") / model, name=model, max_model_len=106, eos_token_ids=(2,), vocab_size=1000
    )
    service = GatewayService(Settings(nats_url=nats_url, host="127.0.0.1", port=0), info)
    await service.start()
    base = service.url
    oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        yield SimpleNamespace(model=model, backend=backend, service=service, base=base, oai=oai, http=http)
    await oai.close()
    await service.stop()
    await bus.close()


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


async def test_health_is_503_until_the_engine_is_ready(nats_url):
    info = ModelInfo(path=Path("/models/x"), name=f"noengine-{uuid.uuid4().hex[:8]}", max_model_len=106,
                     eos_token_ids=(2,), vocab_size=1000)
    service = GatewayService(Settings(nats_url=nats_url, host="127.0.0.1", port=0), info)
    await service.start()
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            assert_openai_error(await http.get("/health"), 503)
    finally:
        await service.stop()


async def test_health_needs_every_detokenizer_shard(nats_url):
    """With two detokenizer shards and only shard 0 up (it answers the plain ``detokenizer``
    ping too), /health is 503: shard 1's requests would be lost. Once shard 1 answers, 200."""
    model = f"shards-{uuid.uuid4().hex[:8]}"
    info = ModelInfo(path=Path("/models/x"), name=model, max_model_len=106, eos_token_ids=(2,), vocab_size=1000)
    bus = await Bus.connect(nats_url, name="fake-shards")
    service = GatewayService(Settings(nats_url=nats_url, host="127.0.0.1", port=0, num_detokenizer_shards=2), info)
    try:
        backend = FakeBackend(bus, model)
        await bus.subscribe(backend.subjects.stats_get, StatsQuery, backend._on_stats)
        for name in ("tokenizer", "scheduler", "executor", "detokenizer", "detokenizer.0"):
            await answer_pings(bus, model, name)
        await service.start()
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
            error = assert_openai_error(await http.get("/health"), 503)
            assert error["code"] == "service_unavailable"
            await answer_pings(bus, model, "detokenizer.1")
            assert (await http.get("/health")).status_code == 200
    finally:
        await service.stop()
        await bus.close()


def test_engine_ping_names_name_every_detokenizer_shard():
    assert engine_ping_names(1) == ("tokenizer", "scheduler", "executor", "detokenizer.0")
    assert engine_ping_names(3)[-3:] == ("detokenizer.0", "detokenizer.1", "detokenizer.2")
    with pytest.raises(ValueError, match="num_detokenizer_shards"):
        engine_ping_names(0)


async def test_health_and_models(gw):
    r = await gw.http.get("/health")
    assert r.status_code == 200
    assert gw.service.ready()
    models = await gw.oai.models.list()
    assert [m.id for m in models.data] == [gw.model]
    card = models.data[0]
    assert card.owned_by == "pagedllm"
    assert card.model_extra["max_model_len"] == 106
    assert (await gw.http.get(f"/v1/models/{gw.model}")).json()["id"] == gw.model
    assert_openai_error(await gw.http.get("/v1/models/other"), 404)


async def test_completion(gw):
    out = await gw.oai.completions.create(model=gw.model, prompt=PROMPT, max_tokens=20, temperature=0)
    assert out.id.startswith("cmpl-")
    assert out.object == "text_completion"
    assert out.model == gw.model
    assert out.choices[0].text == FULL
    assert out.choices[0].finish_reason == "stop"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (6, 6, 12)
    sent = gw.backend.requests[out.id]
    assert sent.prompt == PROMPT and sent.messages is None
    assert sent.sampling_params.max_tokens == 20 and sent.sampling_params.temperature == 0.0


async def test_completion_defaults_and_forms(gw):
    out = await gw.oai.completions.create(model=gw.model, prompt=[PROMPT])  # a list of one string
    assert gw.backend.requests[out.id].sampling_params.max_tokens == 16  # OpenAI's default
    assert out.choices[0].text == FULL
    out = await gw.oai.completions.create(model="HuggingFaceTB/" + gw.model, prompt=[5, 6, 7], max_tokens=2)
    assert gw.backend.requests[out.id].prompt == [5, 6, 7]
    assert out.choices[0].text == "The capital"
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 2)


async def test_completion_stream_equals_non_stream(gw):
    full = await gw.oai.completions.create(model=gw.model, prompt=PROMPT, max_tokens=20)
    stream = await gw.oai.completions.create(
        model=gw.model, prompt=PROMPT, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == len(ANSWER)
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text == FULL
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * 5 + ["stop"]
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 12
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


async def test_chat(gw):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    out = await gw.oai.chat.completions.create(model=gw.model, messages=messages)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == FULL
    assert out.choices[0].finish_reason == "stop"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (6, 6, 12)
    sent = gw.backend.requests[out.id]
    assert sent.messages == messages and sent.add_generation_prompt
    assert sent.sampling_params.max_tokens is None  # chat default: up to the context length

    stream = await gw.oai.chat.completions.create(
        model=gw.model, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == FULL
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == 6


async def test_chat_sampling_params_mapping(gw):
    out = await gw.oai.chat.completions.create(
        model=gw.model,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
        ],
        max_completion_tokens=3,
        max_tokens=50,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop="\n",
        extra_body={"top_k": 5, "priority": -1, "stop_token_ids": [2], "ignore_eos": True},
    )
    assert out.choices[0].message.content == "The capital of"
    assert out.choices[0].finish_reason == "length"
    sent = gw.backend.requests[out.id]
    assert sent.messages == [{"role": "user", "content": "Hi\nthere"}]
    assert sent.priority == -1
    p = sent.sampling_params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (3, 0.5, 0.9, 5, 7)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == (["\n"], [2], True)


async def test_raw_sse(gw):
    body = {"model": gw.model, "messages": [{"role": "user", "content": PROMPT}], "stream": True}
    async with gw.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = (await r.aread()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in p for p in payloads)  # no include_usage: no usage key
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"


BAD_BODIES = [
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 500}, "max_tokens"),  # refused by the tokenizer
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 17}, "min_tokens"),  # > max_tokens (16)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 5,
                              "max_completion_tokens": 4}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"hello": 5}},
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"²": 5}},
     "logit_bias"),  # "²".isdigit(), but no token id
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 1025}, "prompt"),  # a batch of at most 1024 prompts
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    # integers outside int64 never reach the services (msgpack, torch): each is a 400 naming it
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": 2**63}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**20}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "priority": 2**64}, "priority"),
    ("/v1/completions", {"prompt": PROMPT, "stop_token_ids": [2**64]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2**64]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "meta": [[[[[{"id": 2**64}]]]]]}]},
     "messages"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
async def test_invalid_requests_are_400(gw, path, body, param):
    r = await gw.http.post(path, json={"model": gw.model, **body})
    error = assert_openai_error(r, 400, param)
    assert error["type"] == "invalid_request_error"


async def test_integers_that_never_reach_the_engine_are_not_range_checked(gw):
    """Only the fields that travel to the services must fit int64: a tool schema's bounds
    (tools with tool_choice "none") are passed over; an empty stream_options without stream
    is accepted, as vLLM does. (A message's extra keys do travel, to the chat template:
    out of range there is a 400 naming messages, see BAD_BODIES.)"""
    big = 2**64
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "maximum": big}}}}}]
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "tools": tools,
                                  "tool_choice": "none"}),
        ("/v1/completions", {"prompt": PROMPT, "stream_options": {}}),
    ]:
        r = await gw.http.post(path, json={"model": gw.model, "max_tokens": 2, **body})
        assert r.status_code == 200, r.text


async def test_errors_then_normal_request(gw):
    r = await gw.http.post(
        "/v1/completions", content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"}
    )
    assert "JSON" in assert_openai_error(r, 400)["message"]
    r = await gw.http.post(  # curl -d's default content type: the body is not read as JSON
        "/v1/completions", content=b'{"model": "x", "prompt": "hi"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert "Content-Type: application/json" in assert_openai_error(r, 400)["message"]
    r = await gw.http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    error = assert_openai_error(r, 404, "model")
    assert error["code"] == "model_not_found" and error["message"] == "The model `gpt-9` does not exist."
    r = await gw.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.json()["model"] == gw.model  # no model: the served one, as vLLM
    assert_openai_error(await gw.http.get("/v1/nothing"), 404)

    with pytest.raises(openai.BadRequestError) as exc:
        await gw.oai.completions.create(model=gw.model, prompt=PROMPT, max_tokens=1000)
    assert exc.value.status_code == 400 and "too large" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        await gw.oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        await gw.oai.chat.completions.create(model=gw.model, messages=[])

    with pytest.raises(openai.BadRequestError):  # refused before the stream starts: a plain 400
        await gw.oai.completions.create(model=gw.model, prompt=PROMPT, max_tokens=1000, stream=True)

    out = await gw.oai.completions.create(model=gw.model, prompt=PROMPT)
    assert out.choices[0].text == FULL
    assert gw.service.client.num_in_flight == 0


async def test_internal_error_is_500_and_server_keeps_serving(gw, monkeypatch):
    async def broken_submit(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(gw.service.client, "submit", broken_submit)
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT})
    assert assert_openai_error(r, 500)["type"] == "server_error"
    monkeypatch.undo()
    out = await gw.oai.completions.create(model=gw.model, prompt=PROMPT)
    assert out.choices[0].text == FULL


async def test_a_request_over_nats_max_payload_is_413_and_server_keeps_serving(gw, monkeypatch):
    """A body too large for one NATS message (a default nats-server takes 1 MiB) is refused
    with 413 request_too_large, not a 500; nothing stays in flight."""
    monkeypatch.setattr(gw.service.client.bus.nc, "_max_payload", 4096)
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": "word " * 2000})
    error = assert_openai_error(r, 413)
    assert error["code"] == "request_too_large" and "4096 bytes" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert gw.service.client.num_in_flight == 0
    monkeypatch.undo()
    out = await gw.oai.completions.create(model=gw.model, prompt=PROMPT)
    assert out.choices[0].text == FULL


async def test_engine_error_mid_stream(gw):
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": "please fail"})
    error = assert_openai_error(r, 500)
    assert error["message"] == "executor group g0 failed" and error["type"] == "internal_error"

    body = {"model": gw.model, "prompt": "please fail", "stream": True}
    async with gw.http.stream("POST", "/v1/completions", json=body) as r:
        raw = (await r.aread()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "Oops"
    assert json.loads(events[1].removeprefix("data: "))["error"]["message"] == "executor group g0 failed"
    assert events[-1] == "data: [DONE]"

    stream = await gw.oai.completions.create(model=gw.model, prompt="please fail", stream=True)
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    out = await gw.oai.completions.create(model=gw.model, prompt=PROMPT)  # still serving
    assert out.choices[0].text == FULL


async def test_a_batch_of_prompts_gives_n_choices_per_prompt_with_echo(gw):
    """A list of prompts is one engine request each: choice p * n + i is sample i of prompt
    p, usage sums the prompts, streamed and not; echo starts each choice with its prompt."""
    prompts = ["one two", "three four five", "six seven"]
    body = {"model": gw.model, "prompt": prompts, "n": 2, "max_tokens": 3, "echo": True}
    out = (await gw.http.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["text"] for c in out["choices"]] == [p + "The capital of" for p in prompts for _ in range(2)]
    assert out["usage"] == {"prompt_tokens": 2 + 3 + 2, "completion_tokens": 3 * 6, "total_tokens": 25,
                            "prompt_tokens_details": None}
    async with gw.http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [json.loads(e.removeprefix("data: ")) for e in (await r.aread()).decode().split("\n\n")
                  if e and e != "data: [DONE]"]
    texts = ["" for _ in range(6)]
    for event in events[:-1]:
        assert event["id"] == events[0]["id"] and len(event["choices"]) == 1
        texts[event["choices"][0]["index"]] += event["choices"][0]["text"]
    assert texts == [c["text"] for c in out["choices"]] and events[-1]["usage"] == out["usage"]
    ids = (await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": [[5, 6], [7]],
                                                       "max_tokens": 1})).json()
    assert [c["text"] for c in ids["choices"]] == ["The", "The"] and ids["usage"]["prompt_tokens"] == 3
    assert gw.service.client.num_in_flight == 0


async def test_continuous_usage_stats_put_the_usage_in_every_chunk(gw):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far of
    its own choice (its prompt's tokens, its own output); the last chunk the whole usage."""
    body = {"model": gw.model, "prompt": ["one two", "three four five"], "n": 2, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with gw.http.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(e.removeprefix("data: ")) for e in (await r.aread()).decode().split("\n\n")
                  if e and e != "data: [DONE]"]
    seen = [0, 0, 0, 0]
    for event in events[:-1]:
        index = event["choices"][0]["index"]
        seen[index] += 1
        assert event["usage"]["completion_tokens"] == seen[index]
        assert event["usage"]["prompt_tokens"] == (2 if index < 2 else 3)
    assert seen == [3, 3, 3, 3] and events[-1]["usage"]["completion_tokens"] == 12


async def test_a_batch_with_a_refused_prompt_runs_none(gw):
    """One prompt of a batch refused (by the tokenizer, or by the scheduler for a stream): the
    request is a 400 and the prompts already accepted are aborted."""
    aborted = len(gw.backend.aborted)
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": ["a slow one", "refuse me"],
                                                    "stream": True})
    assert_openai_error(r, 400, "priority")
    for _ in range(200):
        if any(rid.endswith("-0") for rid in gw.backend.aborted[aborted:]):
            break
        await asyncio.sleep(0.01)
    assert any(rid.endswith("-0") for rid in gw.backend.aborted[aborted:])
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": ["a slow one", "x"],
                                                    "max_tokens": 500})
    assert_openai_error(r, 400, "max_tokens")
    # refused by the scheduler, not streamed: still refused before any output, and not counted
    aborts = await _aborts_counted(gw)
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": ["a slow one", "refuse"]})
    assert assert_openai_error(r, 400, "priority")["message"].startswith("prompt 1 of the batch: priority=-1")
    assert await _aborts_counted(gw) == aborts
    assert gw.service.client.num_in_flight == 0


async def test_a_stream_the_scheduler_refuses_is_a_plain_400(gw):
    """A streaming request waits for the scheduler's acceptance before its 200: a refusal
    after tokenization (priority, KV cache too small) is an HTTP 400 that the SDK raises as
    BadRequestError, not a 200 stream carrying an error event."""
    for stream in (True, False):
        r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": "refuse me", "stream": stream})
        error = assert_openai_error(r, 400, "priority")
        assert error["message"] == "priority=-1 needs --scheduling-policy priority"
    with pytest.raises(openai.BadRequestError):
        await gw.oai.chat.completions.create(model=gw.model, messages=[{"role": "user", "content": "refuse"}],
                                             stream=True)
    assert gw.service.client.num_in_flight == 0
    stream = await gw.oai.chat.completions.create(model=gw.model, messages=[{"role": "user", "content": "x"}],
                                                  stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == FULL
    assert gw.backend.requests[next(reversed(gw.backend.requests))].notify_accepted


@pytest.mark.parametrize("field,value", [
    ("guided_choice", ["yes", "no"]), ("guided_json", {"type": "object"}), ("guided_regex", "a+"),
    ("structured_outputs", {"choice": ["a"]}), ("bad_words", ["x"]), ("allowed_token_ids", [1, 2]),
    ("prompt_logprobs", 1), ("use_beam_search", True), ("truncate_prompt_tokens", 2),
("chat_template_kwargs", {"enable_thinking": True}),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("spaces_between_special_tokens", False),
])
async def test_vllm_fields_not_served_are_refused_by_name(gw, field, value):
    """A vLLM or OpenAI field this server does not implement, asking for something, is a 400
    naming it (ignoring it would change what the output means); its no-op value is accepted."""
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = await gw.http.post(path, json={"model": gw.model, **body, field: value})
        assert field in assert_openai_error(r, 400, field)["message"]
    noop = {"spaces_between_special_tokens": True, "use_beam_search": False}.get(field)
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, field: noop})
    assert r.status_code == 200, r.text


async def test_other_refusals_as_vllm(gw, monkeypatch):
    """tool_choice without tools, an empty cache_salt, a completions response_format and a
    boolean token id are 400s; unknown fields are ignored and logged, as vLLM does."""
    from gateway.protocol import base as protocol

    chat = {"model": gw.model, "messages": [{"role": "user", "content": "x"}]}
    for tool_choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        r = await gw.http.post("/v1/chat/completions", json={**chat, "tool_choice": tool_choice})
        assert "`tools` must be set" in assert_openai_error(r, 400, "tool_choice")["message"]
    for none in ({"tool_choice": "none"}, {"function_call": "none"}):  # accepted, as vLLM
        r = await gw.http.post("/v1/chat/completions", json={**chat, **none})
        assert r.status_code == 200
    r = await gw.http.post("/v1/chat/completions", json={**chat, "add_special_tokens": True})
    assert_openai_error(r, 400, "add_special_tokens")
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "add_special_tokens": False})
    assert_openai_error(r, 400, "add_special_tokens")
    r = await gw.http.post("/v1/chat/completions", json={**chat, "cache_salt": ""})
    assert "non-empty" in assert_openai_error(r, 400, "cache_salt")["message"]
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT,
                                                    "response_format": {"type": "json_object"}})
    assert_openai_error(r, 400, "response_format")
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": [[True]]})
    assert_openai_error(r, 400, "prompt")
    logged = []
    monkeypatch.setattr(protocol.log, "warning", lambda event, **kw: logged.append((event, kw)))
    r = await gw.http.post("/v1/chat/completions", json={**chat, "store": True, "frobnicate": 1})
    assert r.status_code == 200 and logged == [("request_fields_ignored", {"fields": ["frobnicate", "store"]})]


async def _aborts_counted(gw) -> float:
    """vllm:request_success_total{finished_reason="abort"} of the gateway's /metrics (0 when absent)."""
    for line in (await gw.http.get("/metrics")).text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_streaming_disconnect_aborts(gw):
    body = {"model": gw.model, "prompt": "a slow one", "stream": True, "max_tokens": 50}
    aborts_before = await _aborts_counted(gw)
    async with httpx.AsyncClient(base_url=gw.base, timeout=10) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            request_id = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["text"] == "Hello"
                    break
    await gw.backend.wait_aborted(request_id)
    assert request_id.startswith("cmpl-") and request_id in gw.backend.aborted
    await asyncio.sleep(0.05)
    assert request_id not in gw.service.client._pending
    assert await _aborts_counted(gw) == aborts_before + 1  # vLLM's finished_reason="abort"


async def test_requests_in_flight_at_shutdown_get_a_503(gw, nats_url):
    """A gateway stopping with requests still running past its drain timeout answers them: a
    503 server_shutting_down with an OpenAI body, and a stream's error event then [DONE]
    (uvicorn would cancel them: a text/plain 500 and a cut stream). They are aborted."""
    from gateway.service import SHUTDOWN_GRACE_S

    info = ModelInfo(path=Path("/models") / gw.model, name=gw.model, max_model_len=106, eos_token_ids=(2,),
                     vocab_size=1000)
    service = GatewayService(Settings(nats_url=nats_url, host="127.0.0.1", port=0, gateway_drain_timeout_s=0.5),
                             info)
    await service.start()
    body = {"model": gw.model, "prompt": "a slow one", "max_tokens": 50}
    async with httpx.AsyncClient(base_url=service.url, timeout=20) as http, \
            ws_connect(service.url.replace("http", "ws") + "/v1/stream") as ws:

        async def stream() -> tuple[int, str]:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                return r.status_code, (await r.aread()).decode()

        async def websocket() -> list[dict]:
            await ws.send(json.dumps({"type": "completion", "id": 7, "request": body}))
            messages = []
            while not messages or messages[-1]["type"] == "chunk":
                messages.append(json.loads(await ws.recv()))
            return messages

        plain, streamed = asyncio.create_task(http.post("/v1/completions", json=body)), asyncio.create_task(stream())
        over_ws = asyncio.create_task(websocket())
        for _ in range(500):
            if service.client.num_in_flight == 3:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # all have their first output
        started = asyncio.get_running_loop().time()
        stopping = asyncio.create_task(service.stop())
        while not service._serving.draining:
            await asyncio.sleep(0.01)
        late = await http.post("/v1/completions", json=body)  # while draining: refused at once
        assert assert_openai_error(late, 503)["code"] == "server_shutting_down"
        await stopping
        assert asyncio.get_running_loop().time() - started < 0.5 + SHUTDOWN_GRACE_S + 2.0
        error = assert_openai_error(await plain, 503)
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        status, raw = await streamed
        messages = await over_ws
    assert messages[0] == {"type": "chunk", "id": 7, "chunk": messages[0]["chunk"]}
    assert messages[-1]["type"] == "error" and messages[-1]["error"]["code"] == "server_shutting_down"
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert status == 200 and json.loads(events[0])["choices"][0]["text"] == "Hello"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down" and events[-1] == "[DONE]"


async def test_non_streaming_disconnect_aborts(gw):
    before = set(gw.backend.requests)
    with pytest.raises(httpx.ReadTimeout):
        async with httpx.AsyncClient(base_url=gw.base, timeout=0.5) as http:
            await http.post(
                "/v1/chat/completions",
                json={"model": gw.model, "messages": [{"role": "user", "content": "slow"}]},
            )
    (request_id,) = set(gw.backend.requests) - before
    await gw.backend.wait_aborted(request_id)
    assert request_id.startswith("chatcmpl-")


async def test_websocket_two_concurrent_requests(gw):
    async with ws_connect(f"ws://127.0.0.1:{gw.service.port}/v1/stream") as ws:
        await ws.send(
            json.dumps({"type": "completion", "id": "a", "request": {"model": gw.model, "prompt": PROMPT}})
        )
        await ws.send(
            json.dumps(
                {
                    "type": "chat",
                    "id": 2,
                    "request": {
                        "model": gw.model,
                        "messages": [{"role": "user", "content": PROMPT}],
                        "max_tokens": 4,
                        "stream_options": {"include_usage": True},
                    },
                }
            )
        )
        await ws.send(
            json.dumps({"type": "chat", "id": "bad", "request": {"model": gw.model, "messages": []}})
        )
        await ws.send("not json")
        chunks: dict[Any, list[dict]] = {"a": [], 2: []}
        done: dict[Any, dict] = {}
        errors: dict[Any, dict] = {}
        while len(done) < 2 or len(errors) < 2:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
            if msg["type"] == "chunk":
                chunks[msg["id"]].append(msg["chunk"])
            elif msg["type"] == "done":
                done[msg["id"]] = msg["response"]
            else:
                assert msg["type"] == "error"
                errors[msg["id"]] = msg["error"]
        assert done["a"]["object"] == "text_completion"
        assert (
            "".join(c["choices"][0]["text"] for c in chunks["a"]) == done["a"]["choices"][0]["text"] == FULL
        )
        assert done[2]["object"] == "chat.completion"
        assert done[2]["choices"][0]["message"] == {
            "role": "assistant",
            "content": "The capital of France",
            "refusal": None,
            "tool_calls": [],
        }
        assert done[2]["choices"][0]["finish_reason"] == "length"
        assert chunks[2][0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[2] if c["choices"]) == (
            "The capital of France"
        )
        assert chunks[2][-1]["usage"]["completion_tokens"] == 4 and "usage" not in chunks["a"][-1]
        assert errors["bad"]["param"] == "messages" and errors["bad"]["type"] == "invalid_request_error"
        assert set(errors[None]) == {"message", "type", "param", "code"}

        # the connection is still open after errors
        await ws.send(json.dumps({"type": "completion", "request": {"model": "nope", "prompt": "x"}}))
        msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert msg == {
            "type": "error",
            "id": None,
            "error": {
                "message": "The model `nope` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            },
        }


async def test_websocket_disconnect_aborts(gw):
    async with ws_connect(f"ws://127.0.0.1:{gw.service.port}/v1/stream") as ws:
        await ws.send(
            json.dumps({"type": "completion", "id": 1, "request": {"model": gw.model, "prompt": "slow"}})
        )
        msg = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert msg["type"] == "chunk" and msg["chunk"]["choices"][0]["text"] == "Hello"
        request_id = msg["chunk"]["id"]
    await gw.backend.wait_aborted(request_id)


async def test_port_in_use_and_stop_aborts_in_flight(gw, nats_url):
    info = gw.service.model_info
    with pytest.raises(OSError):
        await GatewayService(Settings(nats_url=nats_url, port=gw.service.port), info).start()

    second = GatewayService(Settings(nats_url=nats_url, port=0, gateway_drain_timeout_s=0.3), info)
    await second.start()
    assert second.port != gw.service.port and second.ready()
    body = {"model": gw.model, "prompt": "slow", "stream": True}
    async with httpx.AsyncClient(base_url=second.url, timeout=10) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            request_id = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
            await asyncio.wait_for(second.stop(), 5)  # drains for 0.3 s, then aborts
    await gw.backend.wait_aborted(request_id)
    assert not second.ready()


async def test_metrics_from_scheduler_stats_and_requests(gw):
    stats = SchedulerStats(
        num_running=3, num_waiting=2, num_preemptions=4,
        groups=[GroupStats(group_id="g0", num_blocks=200, num_free_blocks=150, block_size=16, num_running=3,
                           prefix_cache_queries=1000, prefix_cache_hits=640)],
    )
    await gw.backend.bus.publish(gw.backend.subjects.stats, stats)
    await gw.backend.bus.flush()

    def value(text: str, name: str, labels: str = "") -> float:
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} {labels} not in metrics")

    for _ in range(50):
        text = (await gw.http.get("/metrics")).text
        if "vllm:num_requests_running" in text:
            break
        await asyncio.sleep(0.05)
    before = value(text, "vllm:request_success_total", 'finished_reason="stop"') if "request_success_total" in text else 0
    gen_before = value(text, "vllm:generation_tokens_total") if "generation_tokens_total" in text else 0
    assert value(text, "vllm:num_requests_running") == 3 and value(text, "vllm:num_requests_waiting") == 2
    assert value(text, "vllm:kv_cache_usage_perc", 'group="g0"') == 0.25
    assert value(text, "vllm:prefix_cache_hits_total", 'group="g0"') == 640
    assert value(text, "vllm:prefix_cache_queries_total", 'group="g0"') == 1000
    assert value(text, "vllm:num_preemptions_total") == 4
    for _ in range(2):
        await gw.oai.completions.create(model=gw.model, prompt=PROMPT)
    text = (await gw.http.get("/metrics")).text
    assert value(text, "vllm:request_success_total", 'finished_reason="stop"') == before + 2
    assert value(text, "vllm:generation_tokens_total") == gen_before + 2 * len(ANSWER)
    assert value(text, "vllm:time_to_first_token_seconds_count") >= 2
    assert value(text, "vllm:e2e_request_latency_seconds_count") >= 2
    assert f'model_name="{gw.model}"' in text


async def test_cors_preflight_is_answered_as_vllm(gw):
    """Browsers' CORS preflight gets any origin allowed (vLLM's default), not a 405."""
    r = await gw.http.options("/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = await gw.http.get("/v1/models", headers={"Origin": "http://example.com"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


async def test_chat_logprobs_as_openai_shapes_them(gw):
    """``logprobs`` with ``top_logprobs``: one entry per generated token (text, log probability,
    bytes, the most likely tokens), whole in the response and per token in the stream; the
    engine asked for ``top_logprobs`` alternatives; -inf is reported as -9999 (JSON has no
    infinity). Without ``logprobs`` the choice's logprobs is null."""
    messages = [{"role": "user", "content": PROMPT}]
    r = await gw.oai.chat.completions.create(model=gw.model, messages=messages, logprobs=True, top_logprobs=2)
    assert gw.backend.requests[r.id].sampling_params.logprobs == 2
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ANSWER and r.choices[0].message.content == FULL
    assert [t.logprob for t in content] == [-9999.0] + [-i / 10 for i in range(1, len(ANSWER))]
    assert [bytes(t.bytes) for t in content] == [a.encode() for a in ANSWER]
    assert all([(x.token, x.logprob) for x in t.top_logprobs] == [("alt0", -1.0), ("alt1", -2.0)] for t in content)

    r = await gw.oai.chat.completions.create(model=gw.model, messages=messages, logprobs=True, max_tokens=3)
    assert gw.backend.requests[r.id].sampling_params.logprobs == 0
    assert [(t.token, t.top_logprobs) for t in r.choices[0].logprobs.content] == [(a, []) for a in ANSWER[:3]]

    stream = await gw.oai.chat.completions.create(model=gw.model, messages=messages, logprobs=True, top_logprobs=1,
                                                  stream=True)
    streamed = [t for chunk in [c async for c in stream] if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.content]
    assert [(t.token, [x.token for x in t.top_logprobs]) for t in streamed] == [(a, ["alt0"]) for a in ANSWER]

    r = await gw.oai.chat.completions.create(model=gw.model, messages=messages)
    assert r.choices[0].logprobs is None and gw.backend.requests[r.id].sampling_params.logprobs is None


async def test_completion_logprobs_as_openai_shapes_them(gw):
    """Completions' legacy shape: tokens, token_logprobs, text_offset (cumulative over the
    token texts, continued across stream chunks) and, per token, the sampled and the
    ``logprobs`` most likely tokens by text."""
    offsets = [sum(len(a) for a in ANSWER[:i]) for i in range(len(ANSWER))]
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["text"] == FULL
    assert choice["logprobs"] == {
        "tokens": ANSWER,
        "token_logprobs": [-9999.0] + [-i / 10 for i in range(1, len(ANSWER))],
        "text_offset": offsets,
        "top_logprobs": [{a: (-i / 10 if i else -9999.0), "alt0": -1.0} for i, a in enumerate(ANSWER)],
    }
    stream = await gw.oai.completions.create(model=gw.model, prompt=PROMPT, logprobs=0, stream=True)
    chunks = [c.choices[0].logprobs for c in [c async for c in stream] if c.choices and c.choices[0].logprobs]
    assert [t for lp in chunks for t in lp.tokens] == ANSWER
    assert [o for lp in chunks for o in lp.text_offset] == offsets
    assert [d for lp in chunks for d in lp.top_logprobs] == [{a: (-i / 10 if i else -9999.0)}
                                                             for i, a in enumerate(ANSWER)]
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT})
    assert r.json()["choices"][0]["logprobs"] is None


async def test_penalties_min_p_min_tokens_and_logit_bias_reach_the_engine(gw):
    """OpenAI's presence/frequency penalties and logit_bias (string token-id keys) and vLLM's
    repetition_penalty, min_p and min_tokens travel in the request's SamplingParams (biases
    clamped to [-100, 100], as vLLM); null penalties are the no-op values."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 3, "logit_bias": {"42": -150, "7": 2.5}}
    r = await gw.http.post("/v1/chat/completions", json={"model": gw.model, **body})
    assert r.status_code == 200, r.text
    sent = gw.backend.requests[r.json()["id"]].sampling_params
    assert (sent.presence_penalty, sent.frequency_penalty, sent.repetition_penalty, sent.min_p, sent.min_tokens,
            sent.logit_bias) == (0.5, -0.25, 1.2, 0.1, 3, {42: -100.0, 7: 2.5})
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "presence_penalty": None,
                                                    "repetition_penalty": None, "logit_bias": None})
    sent = gw.backend.requests[r.json()["id"]].sampling_params
    assert (sent.presence_penalty, sent.repetition_penalty, sent.logit_bias, sent.has_penalties) == (0, 1, {}, False)


async def test_echo_with_logprobs_scores_the_prompt(gw):
    """``echo`` with ``logprobs`` puts the prompt tokens' log probabilities first (the first
    token's null), then the completion's, with text offsets running over the echoed text; with
    ``max_tokens`` 0 the prompt alone comes back, no completion token counted (how
    lm-evaluation-harness scores a text). Streamed, the echo waits for the prompt's log
    probabilities and the completion's offsets go on after it."""
    words = [w if i == 0 else " " + w for i, w in enumerate(PROMPT.split())]
    offsets = [sum(len(t) for t in (words + ANSWER)[:i]) for i in range(len(words) + len(ANSWER))]
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "echo": True, "logprobs": 1})
    body = r.json()
    sent = gw.backend.requests[body["id"]].sampling_params
    assert (sent.logprobs, sent.prompt_logprobs, sent.max_tokens) == (1, 1, 16)
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == PROMPT + FULL
    assert lp["tokens"] == words + ANSWER and lp["text_offset"] == offsets
    assert lp["token_logprobs"][:len(words)] == [None] + [-float(i) for i in range(1, len(words))]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {" is": -1.0, "alt0": -10.0}

    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "echo": True,
                                                    "logprobs": 0, "max_tokens": 0})
    body = r.json()
    assert gw.backend.requests[body["id"]].sampling_params.max_tokens == 1  # the engine generates one, unseen
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"], body["usage"]["completion_tokens"]) == (PROMPT, "length", 0)
    assert choice["logprobs"]["tokens"] == words and choice["logprobs"]["top_logprobs"][1] == {" is": -1.0}

    stream = await gw.oai.completions.create(model=gw.model, prompt=PROMPT, echo=True, logprobs=0, stream=True)
    chunks = [c.choices[0] for c in [c async for c in stream] if c.choices]
    assert chunks[0].text == PROMPT and chunks[0].logprobs.tokens == words
    assert "".join(c.text for c in chunks) == PROMPT + FULL
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == offsets


async def test_streamed_echo_of_n_samples_waits_for_the_prompt_logprobs(gw):
    """With n=2 the prompt's log probabilities come with sample 0's first delta; when sample 1's
    comes first (another detokenizer shard), its echo waits for them: both choices stream the
    prompt with its log probabilities, then their text, offsets going on after the prompt."""
    prompt = "children first please"
    words = ["children", " first", " please"]
    stream = await gw.oai.completions.create(model=gw.model, prompt=prompt, echo=True, logprobs=0, n=2, max_tokens=2,
                                             stream=True)
    chunks = [c.choices[0] for c in [c async for c in stream] if c.choices]
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert mine[0].text == prompt and mine[0].logprobs.tokens == words
        assert mine[0].logprobs.token_logprobs == [None, -1.0, -2.0]
        assert "".join(c.text for c in mine) == prompt + "".join(ANSWER[:2])
        assert [o for c in mine for o in c.logprobs.text_offset] == [0, 8, 14, 21, 24]


def test_completion_top_logprobs_keep_the_likeliest_of_tokens_with_one_text():
    """Tokens holding parts of characters all read U+FFFD: in a completion's top_logprobs (keyed
    by text) the likeliest of them stays, so its maximum is the true one (a sampled byte token
    first used to hide a likelier one); return_tokens_as_token_ids keeps them apart."""
    from gateway.completion import completion_logprobs

    def tok(token_id: int, logprob: float, rank: int) -> TokenLogprob:
        return TokenLogprob(token_id=token_id, token="\ufffd", bytes=bytes([0xE4 + rank]), logprob=logprob, rank=rank)

    items = [DecodedLogprobs(sampled=tok(7, -5.5, 3), top=[tok(8, -2.8, 1), tok(9, -3.0, 2)])]
    out = completion_logprobs(items, 0)
    assert out.tokens == ["\ufffd"] and out.token_logprobs == [-5.5] and out.top_logprobs == [{"\ufffd": -2.8}]
    out = completion_logprobs(items, 0, as_ids=True)
    assert out.tokens == ["token_id:7"]
    assert out.top_logprobs == [{"token_id:7": -5.5, "token_id:8": -2.8, "token_id:9": -3.0}]


async def test_return_tokens_as_token_ids_names_tokens_by_id(gw):
    body = {"model": gw.model, "messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 1,
            "max_tokens": 2, "return_tokens_as_token_ids": True}
    content = (await gw.http.post("/v1/chat/completions", json=body)).json()["choices"][0]["logprobs"]["content"]
    assert [(t["token"], [x["token"] for x in t["top_logprobs"]]) for t in content] == [
        ("token_id:100", ["token_id:900"]), ("token_id:101", ["token_id:900"])]
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "logprobs": 0, "max_tokens": 2,
                                                    "return_tokens_as_token_ids": True})
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:100", "token_id:101"]


async def test_min_tokens_above_the_limit_names_the_limit_the_request_has(gw):
    """The 400 names the limit as the request sets it: completions' max_tokens default (16),
    or chat's max_completion_tokens; not the engine's max_tokens."""
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "min_tokens": 50})
    assert "min_tokens=50 is more than max_tokens=16 (its default when not given)" in r.json()["error"]["message"]
    r = await gw.http.post("/v1/chat/completions", json={"model": gw.model, "messages": [{"role": "user", "content": "x"}],
                                                         "min_tokens": 5, "max_completion_tokens": 4, "max_tokens": 9})
    assert r.json()["error"]["message"].endswith("min_tokens=5 is more than max_completion_tokens=4")
