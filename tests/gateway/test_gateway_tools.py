"""Tool calling through the gateway (OpenAI SDK and HTTP) in front of the fake engine, whose
answers are scripted ("SAY:..."): the tools reach the tokenizer for the chat template,
"required" and named functions are forced with vLLM's schemas, and the calls come back in
OpenAI's shapes, whole and streamed, on a server with ``--enable-auto-tool-choice
--tool-call-parser hermes``."""

from __future__ import annotations

import pytest
from gateway_fakes import assert_openai_error

GATEWAY_SETTINGS = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def say(text: str) -> list[dict]:
    return [{"role": "user", "content": "SAY:" + text}]


async def create(gw, text: str, **kw):
    return await gw.oai.chat.completions.create(model=gw.model, messages=say(text), tools=[WEATHER, NOW], **kw)


async def streamed(gw, text: str, **kw) -> tuple[str, list[dict], str | None, list]:
    """The content, the calls (id, name, arguments joined) and the finish_reason of a stream,
    checked on the way: a call's first delta has its id, type and name (arguments ""), later
    ones only arguments; no chunk holds two deltas of one call."""
    content, calls, finish, chunks = "", [], None, []
    async for chunk in await create(gw, text, stream=True, **kw):
        chunks.append(chunk)
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        indexes = [d.index for d in choice.delta.tool_calls or ()]
        assert len(indexes) == len(set(indexes))
        for d in choice.delta.tool_calls or ():
            if d.id is not None:
                assert (d.index, d.type, d.function.arguments) == (len(calls), "function", "")
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            else:
                assert d.type is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish, chunks


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


async def test_auto_reads_hermes_calls_and_the_tools_reach_the_template(gw):
    r = await create(gw, "Let me check.\n" + CALL)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert calls_of(choice.message) == [("get_weather", '{"city": "Paris"}')]
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"
    sent = gw.backend.requests[r.id]
    assert sent.tools == [WEATHER, NOW] and sent.spec.sampling_params.structured_outputs is None


async def test_auto_streams_calls_as_openai_and_adds_up_to_the_whole_answer(gw):
    content, calls, finish, chunks = await streamed(gw, "Let me check.\n" + TWO_CALLS)
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert len({c["id"] for c in calls}) == 2
    assert chunks[0].choices[0].delta.role == "assistant"
    whole = (await create(gw, "Let me check.\n" + TWO_CALLS)).choices[0].message
    assert whole.content == content and calls_of(whole) == [(c["name"], c["arguments"]) for c in calls]


async def test_auto_without_a_call_is_plain_content(gw):
    r = await create(gw, "Paris is sunny <b>today</b>.")
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == (
        "Paris is sunny <b>today</b>.", [], "stop")
    content, calls, finish, _ = await streamed(gw, "Paris is sunny <b>today</b>.")
    assert (content, calls, finish) == ("Paris is sunny <b>today</b>.", [], "stop")


async def test_tool_choice_none_reads_no_call(gw):
    r = await create(gw, CALL, tool_choice="none")
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == (
        CALL, [], "stop")
    assert gw.backend.requests[r.id].tools == [WEATHER, NOW]  # still shown to the model, as vLLM


@pytest.mark.parametrize("stream", [False, True])
async def test_required_and_named_are_forced_with_vllms_schemas(gw, stream):
    forced = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    params = {"city": {"type": "string"}}
    weather_item = {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": {
        "type": "object", "properties": params, "required": ["city"]}}, "required": ["name", "parameters"]}
    now_item = {"properties": {"name": {"type": "string", "enum": ["now"]}, "parameters": {
        "type": "object", "properties": {}}}, "required": ["name", "parameters"]}
    for choice, schema, reason in [
        ("required", {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [weather_item, now_item]}},
         "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}},
         {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", **weather_item}}, "stop"),
    ]:
        if stream:
            content, calls, finish, chunks = await streamed(gw, forced, tool_choice=choice)
            request_id = chunks[0].id
            assert (content, [(c["name"], c["arguments"]) for c in calls], finish) == (
                "", [("get_weather", '{"city": "Paris"}')], reason)
        else:
            r = await create(gw, forced, tool_choice=choice)
            request_id = r.id
            assert r.choices[0].message.content is None and r.choices[0].finish_reason == reason
            assert calls_of(r.choices[0].message) == [("get_weather", '{"city": "Paris"}')]
        so = gw.backend.requests[request_id].spec.sampling_params.structured_outputs
        assert (so.json, so.disable_any_whitespace) == (schema, True)


async def test_required_with_parallel_tool_calls_false_allows_one_call(gw):
    r = await create(gw, '[{"name": "now", "parameters": {}}]', tool_choice="required", parallel_tool_calls=False)
    assert gw.backend.requests[r.id].spec.sampling_params.structured_outputs.json["maxItems"] == 1


async def test_a_conversation_carries_calls_and_results_back(gw):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "SAY:It is sunny."},
    ]
    r = await gw.oai.chat.completions.create(model=gw.model, messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    sent = gw.backend.requests[r.id].messages
    assert sent[1]["tool_calls"] == messages[1]["tool_calls"] and sent[2]["tool_call_id"] == "call_1"


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"messages": USER, "tools": []}, "tools", "tools must not be an empty array"),
    ({"messages": USER, "tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"messages": USER, "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}},
     "tool_choice", "the function 'now' is not one of `tools`"),
    ({"messages": USER, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined with response_format"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages", "tool_calls"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c"}]}, "messages", "needs content"),
    ({"messages": USER, "tools": [
        {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"x": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"x": {"type": "integer"}}}}}],
      "tool_choice": "required"}, "tools", "$defs entry 'x'"),
])
async def test_bad_tool_requests_are_400_naming_the_field(gw, body, param, says):
    r = await gw.http.post("/v1/chat/completions", json={"model": gw.model, **body})
    assert says in assert_openai_error(r, 400, param)["message"]


