"""Chat templates with tools (services/tokenizer/chat.py) and the serve settings that choose
them: the tool template renders SmolLM2's own text when there are no tools, past calls'
arguments reach the template as objects, and a bad template or tool setting fails at once."""

from __future__ import annotations

import pytest
from processes import ROOT
from pydantic import ValidationError
from transformers import AutoTokenizer

from services.tokenizer.chat import ChatRenderer, load_chat_template, normalize_messages
from services.tokenizer.errors import TokenizeError
from shared.config import Settings

TOOL_TEMPLATE = ROOT / "examples" / "tool_chat_template_smollm2.jinja"
TOOLS = [{"type": "function", "function": {"name": "now", "description": "The time"}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}}


@pytest.fixture(scope="module")
def renderers(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return ChatRenderer(tokenizer), ChatRenderer(tokenizer, load_chat_template(str(TOOL_TEMPLATE)))


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
])
def test_the_tool_template_without_tools_is_smollm2s_own(renderers, messages):
    own, tool = renderers
    for prompt in (True, False):
        assert tool.render(messages, prompt) == own.render(messages, prompt)


def test_the_tool_template_lists_tools_and_renders_calls_and_results(renderers):
    _, tool = renderers
    messages = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    assert tool.render(messages, True, TOOLS) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n"
        "You can call functions to help with the request. These are the functions, each a JSON object on one line:\n"
        '<tools>\n{"name": "now", "description": "The time"}\n</tools>\n\n'
        "To call a function, answer with one JSON object per call, each inside tool_call tags:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nTime?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_request_template_wins_and_a_template_that_fails_is_a_tokenize_error(renderers):
    own, _ = renderers
    assert own.render([{"role": "user", "content": "Hi"}], False, chat_template="{{ messages[0].content }}!") == "Hi!"
    with pytest.raises(TokenizeError, match="the chat template rejected the messages: no"):
        own.render([{"role": "user", "content": "Hi"}], False, chat_template="{{ raise_exception('no') }}")


def test_past_call_arguments_reach_the_template_as_objects():
    (_, assistant) = normalize_messages([{"role": "user", "content": "x"},
                                         {"role": "assistant", "content": None, "tool_calls": [
                                             CALL, {**CALL, "function": {"name": "f", "arguments": "not json"}}]}])
    assert assistant["content"] == ""
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [{"tz": "UTC"}, "not json"]
    with pytest.raises(TokenizeError, match=r"messages\[0\].tool_calls\[0\] must be"):
        normalize_messages([{"role": "assistant", "tool_calls": [{"id": "c"}]}])


def test_chat_template_and_tool_settings_are_checked_at_start(tmp_path):
    assert Settings(chat_template=str(TOOL_TEMPLATE)).chat_template == str(TOOL_TEMPLATE)
    assert Settings(chat_template="{{ messages }}").chat_template == "{{ messages }}"
    with pytest.raises(ValidationError, match="chat_template: no such file 'missing.jinja'"):
        Settings(chat_template="missing.jinja")
    with pytest.raises(ValidationError, match="enable_auto_tool_choice needs tool_call_parser"):
        Settings(enable_auto_tool_choice=True)
    with pytest.raises(ValidationError, match="tool_call_parser"):
        Settings(tool_call_parser="pythonic")
    with pytest.raises(ValueError, match="chat_template: cannot read"):
        load_chat_template(str(tmp_path))
