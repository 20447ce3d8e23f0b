"""The gateway's HTTP and SSE endpoints against a real nats-server and a fake backend
(tokenizer + detokenizer stand-in: ``gateway_fakes.FakeBackend``, the ``gw`` fixture in
``conftest.py``): request mapping, errors and their status codes, aborts when a client
leaves, shutdown, health, metrics. The shapes of chunks and responses are tested without
NATS in ``test_generation.py``, the WebSocket protocol in ``test_websocket.py``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gateway_fakes import ANSWER, FULL, PROMPT, FakeBackend, assert_openai_error
from websockets.asyncio.client import connect as ws_connect

from gateway.service import GatewayService
from shared.bus import Bus
from shared.config import Settings
from shared.messages import GroupStats, SchedulerStats, StatsQuery
from shared.model_source import ModelInfo
from shared.pings import answer_pings, engine_ping_names


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
    assert sent.spec.sampling_params.max_tokens == 20 and sent.spec.sampling_params.temperature == 0.0


async def test_completion_defaults_and_forms(gw):
    out = await gw.oai.completions.create(model=gw.model, prompt=[PROMPT])  # a list of one string
    assert gw.backend.requests[out.id].spec.sampling_params.max_tokens == 16  # OpenAI's default
    assert out.choices[0].text == FULL
    out = await gw.oai.completions.create(model="HuggingFaceTB/" + gw.model, prompt=[5, 6, 7], max_tokens=2)
    assert gw.backend.requests[out.id].prompt == [5, 6, 7]
    assert out.choices[0].text == "The capital"
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 2)


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
    assert sent.spec.sampling_params.max_tokens is None  # chat default: up to the context length

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
    assert sent.spec.priority == -1
    p = sent.spec.sampling_params
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
    # tools without tool_choice mean "auto", which needs --enable-auto-tool-choice (as vLLM)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "none", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "maximum": 2**64}}}]},
     "tools"),  # the tools go to the chat template
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
    """Only the fields that travel to the services must fit int64: an empty stream_options
    without stream is accepted, as vLLM does. (A message's extra keys and the tools do travel,
    to the chat template: out of range there is a 400 naming them, see BAD_BODIES.)"""
    for path, body in [
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


async def test_a_tokenizer_that_fails_on_a_request_is_a_500_at_once_and_it_is_aborted(gw, monkeypatch):
    """The tokenizer's handler raising answers at once (an error reply, not the 30 s timeout):
    a 500 naming the failure; the request, which may have been submitted, is aborted; the
    server keeps serving."""
    started = time.monotonic()
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": "tokenizer-bug"})
    assert time.monotonic() - started < 5.0
    error = assert_openai_error(r, 500)
    assert error == {"message": "the tokenizer failed on this request: RuntimeError: tokenizer bug",
                     "type": "server_error", "param": None, "code": "tokenizer_error"}
    request_id = next(reversed(gw.backend.requests))
    assert gw.backend.requests[request_id].prompt == "tokenizer-bug"
    await gw.backend.wait_aborted(request_id)
    assert gw.service.client.num_in_flight == 0
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


async def test_a_batch_of_prompts_is_one_engine_request_each_merged_into_one_answer(gw):
    """A list of prompts is one engine request each: their streams are merged into one
    response (choice p * n + i is sample i of prompt p; shapes in test_generation.py), the
    same streamed and not; a batch of token-id prompts too."""
    prompts = ["one two", "three four five", "six seven"]
    body = {"model": gw.model, "prompt": prompts, "n": 2, "max_tokens": 3, "echo": True}
    out = (await gw.http.post("/v1/completions", json=body)).json()
    assert [c["text"] for c in out["choices"]] == [p + "The capital of" for p in prompts for _ in range(2)]
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
    assert gw.backend.requests[next(reversed(gw.backend.requests))].spec.notify_accepted


@pytest.mark.parametrize("field,value", [
    ("guided_whitespace_pattern", " *"), ("guided_decoding_backend", "xgrammar"), ("bad_words", ["x"]),
    ("allowed_token_ids", [1, 2]), ("prompt_logprobs", 1), ("truncate_prompt_tokens", 2),
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
    noop = {"spaces_between_special_tokens": True}.get(field)
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, field: noop})
    assert r.status_code == 200, r.text


async def test_other_refusals_as_vllm(gw, monkeypatch):
    """tool_choice without tools, an empty cache_salt, an unknown response_format type and a
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
                                                    "response_format": {"type": "xml"}})
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
    assert request_id not in gw.service.client.requests.pending
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


async def test_penalties_min_p_min_tokens_and_logit_bias_reach_the_engine(gw):
    """OpenAI's presence/frequency penalties and logit_bias (string token-id keys) and vLLM's
    repetition_penalty, min_p and min_tokens travel in the request's SamplingParams (biases
    clamped to [-100, 100], as vLLM); null penalties are the no-op values."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 3, "logit_bias": {"42": -150, "7": 2.5}}
    r = await gw.http.post("/v1/chat/completions", json={"model": gw.model, **body})
    assert r.status_code == 200, r.text
    sent = gw.backend.requests[r.json()["id"]].spec.sampling_params
    assert (sent.presence_penalty, sent.frequency_penalty, sent.repetition_penalty, sent.min_p, sent.min_tokens,
            sent.logit_bias) == (0.5, -0.25, 1.2, 0.1, 3, {42: -100.0, 7: 2.5})
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "presence_penalty": None,
                                                    "repetition_penalty": None, "logit_bias": None})
    sent = gw.backend.requests[r.json()["id"]].spec.sampling_params
    assert (sent.presence_penalty, sent.repetition_penalty, sent.logit_bias, sent.has_penalties) == (0, 1, {}, False)


async def test_min_tokens_above_the_limit_names_the_limit_the_request_has(gw):
    """The 400 names the limit as the request sets it: completions' max_tokens default (16),
    or chat's max_completion_tokens; not the engine's max_tokens."""
    r = await gw.http.post("/v1/completions", json={"model": gw.model, "prompt": PROMPT, "min_tokens": 50})
    assert "min_tokens=50 is more than max_tokens=16 (its default when not given)" in r.json()["error"]["message"]
    r = await gw.http.post("/v1/chat/completions", json={"model": gw.model, "messages": [{"role": "user", "content": "x"}],
                                                         "min_tokens": 5, "max_completion_tokens": 4, "max_tokens": 9})
    assert r.json()["error"]["message"].endswith("min_tokens=5 is more than max_completion_tokens=4")
