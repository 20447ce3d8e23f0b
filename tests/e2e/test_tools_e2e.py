"""Tool calling on the default model under ``pagedllm serve --enable-auto-tool-choice
--tool-call-parser hermes --chat-template examples/tool_chat_template_smollm2.jinja``, through
the OpenAI SDK: every tool_choice, streamed and not, and a conversation that returns a tool's
result. Greedy, so a stream adds up to exactly the non-streamed answer."""

from __future__ import annotations

import json
import os
import signal

import jsonschema
import openai
import pytest
from processes import ROOT, start_serve
from transformers import AutoTokenizer

TEMPLATE = ROOT / "examples" / "tool_chat_template_smollm2.jinja"
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_path):
    proc, port, _ = start_serve(smollm2_path.parent, str(smollm2_path), "--dtype", "float32",
                                "--kv-cache-memory-bytes", str(64 << 20), "--log-level", "WARNING",
                                "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                "--chat-template", str(TEMPLATE))
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
    finally:  # nothing to drain: killed at once (its nats-server dies with it, no orphan is left)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def ask(client, messages=ASK, **kw):
    """The non-streamed and the streamed answer's (content, calls, finish_reason): equal, the
    stream checked to start each call with its id, type and name, then arguments only."""
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, **kw)
    (choice,) = r.choices
    whole = (choice.message.content, [(c.function.name, c.function.arguments) for c in choice.message.tool_calls],
             choice.finish_reason)
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                                stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            if d.id is not None:
                assert (d.index, d.type, d.function.arguments) == (len(calls), "function", "")
                calls.append([d.function.name, ""])
            else:
                calls[d.index][1] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert (content or None, [tuple(c) for c in calls], finish) == whole
    return whole, r.usage


def prompt_tokens(smollm2_path, messages, tools) -> int:
    """The tokens of the conversation as the tool template renders it, here."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=TEMPLATE.read_text(),
                                         add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_required_forces_valid_calls(client):
    (content, calls, finish), _ = ask(client, tool_choice="required", parallel_tool_calls=False, max_tokens=48)
    assert content is None and finish == "tool_calls" and len(calls) == 1
    (name, arguments), = calls
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def test_a_named_function_is_called(client):
    (content, calls, finish), _ = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                      max_tokens=48)
    assert content is None and finish == "stop" and [name for name, _ in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0][1]), TIME["function"]["parameters"])


def test_auto_reads_a_call_the_model_makes(client):
    """The 135M model seldom calls a tool by itself: its free generation is steered by a regex
    (structured outputs, which "auto" takes) into hermes' shape, and the parser reads it."""
    regex = (r'OK\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,9}", '
             r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')
    (content, calls, finish), _ = ask(client, max_tokens=48, extra_body={"structured_outputs": {"regex": regex}})
    assert (content, [name for name, _ in calls], finish) == ("OK.", ["get_weather"], "tool_calls")
    jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])


def test_none_answers_in_text_with_the_tools_in_the_prompt(client, smollm2_path):
    (content, calls, finish), usage = ask(client, tool_choice="none", max_tokens=3)
    assert isinstance(content, str) and content and calls == [] and finish in ("stop", "length")
    assert usage.prompt_tokens == prompt_tokens(smollm2_path, ASK, TOOLS)


def test_a_tool_result_goes_back_to_the_model(client, smollm2_path):
    """The README's two turns: a forced call, its message and the tool's result sent back."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=48,
                                           tool_choice="required", parallel_tool_calls=False).choices[0].message
    messages = [*ASK, first, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "22 C, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=3, temperature=0,
                                       tool_choice="none")
    assert r.choices[0].message.content and r.choices[0].message.tool_calls == []
    # the call and its result were rendered by the template (as here, token for token)
    messages[1] = first.model_dump(exclude_none=True)  # arguments as an object, as transformers' templates take them
    function = messages[1]["tool_calls"][0]["function"]
    function["arguments"] = json.loads(function["arguments"])
    assert r.usage.prompt_tokens == prompt_tokens(smollm2_path, messages, TOOLS)
