"""The tool-call parsers (gateway/tools/) on fixed strings, whole and streamed in pieces of
every size: a stream adds up to the whole text's result, each call starts with one delta
holding its id, type and name (arguments ""), and no marker leaks into the content."""

from __future__ import annotations

import json

import pytest

from gateway.tools import TOOL_PARSERS, ForcedToolParser, ToolParser, get_tool_parser
from gateway.tools.hermes import HermesToolParser
from gateway.tools.json_scan import NotJson, scan_object, value_end
from gateway.tools.llama3_json import Llama3JsonToolParser
from gateway.tools.mistral import MistralToolParser
from shared.config import Settings

WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TRICKY_ARGS = '{"s": "a}\\"b{ [", "n": [1, {"x": null}], "t": true}'


def calls_of(found) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in found.tool_calls]


def stream(parser_cls: type[ToolParser], text: str, size: int) -> tuple[str, list[dict]]:
    """Feed ``text`` in pieces of ``size`` characters; the content streamed and, per call, its
    deltas (checked: the first has id, type, name and arguments "", the rest only arguments)."""
    parser = parser_cls()
    content, calls = "", []
    pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    for piece in pieces:
        content += piece.content
        for delta in piece.tool_calls:
            if delta.id is not None:
                assert delta.index == len(calls)
                assert delta.id.startswith("call_") and delta.type == "function"
                assert delta.function.arguments == "" and delta.function.name
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
            else:
                assert delta.type is None and delta.function.name is None and delta.function.arguments
                calls[delta.index]["arguments"] += delta.function.arguments
    return content, calls


def assert_streams_as_whole(parser_cls: type[ToolParser], text: str) -> None:
    whole = parser_cls.extract(text)
    for size in (1, 2, 3, 7, len(text)):
        content, calls = stream(parser_cls, text, size)
        assert (content.strip() or None if calls else content) == whole.content, size
        assert [(c["name"], c["arguments"]) for c in calls] == calls_of(whole), size


# ---------------------------------------------------------------- hermes

HERMES_TWO = (f'Let me look that up.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n'
              f'</tool_call>\n<tool_call>\n{{"name": "echo", "arguments": {TRICKY_ARGS}}}\n</tool_call>')


@pytest.mark.parametrize(("text", "content", "calls"), [
    (HERMES_TWO, "Let me look that up.", [("get_weather", WEATHER_ARGS), ("echo", TRICKY_ARGS)]),
    (f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}</tool_call>', None,
     [("get_weather", WEATHER_ARGS)]),
    # the closing tag may be missing; "arguments" may come first; a string holding the JSON
    (f'<tool_call>\n{{"arguments": {WEATHER_ARGS}, "name": "get_weather"}}', None, [("get_weather", WEATHER_ARGS)]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("Use <b>bold</b> < here", "Use <b>bold</b> < here", []),
    # not a call: all of it is content, as vLLM
    ('Hmm <tool_call>{"name": get_weather}</tool_call>', 'Hmm <tool_call>{"name": get_weather}</tool_call>', []),
    ('<tool_call>{"city": "Paris"}</tool_call>', '<tool_call>{"city": "Paris"}</tool_call>', []),
    # one good call, then a broken one: the good one stands
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": 3}', None, [("a", "{}")]),
])
def test_hermes_reads_calls_and_content(text, content, calls):
    found = HermesToolParser.extract(text)
    assert found.content == content
    assert calls_of(found) == calls
    assert len({c.id for c in found.tool_calls}) == len(calls)
    assert all(json.loads(args) is not None for _, args in calls)
    assert_streams_as_whole(HermesToolParser, text)


def test_hermes_stream_sends_content_at_once_and_holds_back_a_marker():
    parser = HermesToolParser()
    assert parser.feed("Sure").content == "Sure"
    assert parser.feed(", one moment. <tool").content == ", one moment."
    assert parser.feed("_call>").content == ""
    first = parser.feed('\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.index, d.id is not None, d.function.name, d.function.arguments) for d in first.tool_calls] == [
        (0, True, "get_weather", ""), (0, False, None, '{"ci')]
    assert [d.function.arguments for d in parser.feed('ty": "Paris"}}\n</tool_call>').tool_calls] == ['ty": "Paris"}']
    end = parser.finish()
    assert end.content == "" and end.tool_calls == [] and parser.called


def test_hermes_stream_of_plain_text_ends_with_its_held_back_whitespace():
    parser = HermesToolParser()
    assert [parser.feed(p).content for p in ("Hi", " there", "\n")] == ["Hi", " there", ""]
    assert parser.finish().content == "\n" and not parser.called


# ---------------------------------------------------------------- llama3_json, mistral, forced

@pytest.mark.parametrize(("text", "content", "calls"), [
    (f'{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}', None, [("get_weather", WEATHER_ARGS)]),
    (f'<|python_tag|>{{"name": "a", "parameters": {{}}}}; {{"name": "b", "arguments": {TRICKY_ARGS}}}', None,
     [("a", "{}"), ("b", TRICKY_ARGS)]),
    ("Paris is the capital.", "Paris is the capital.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
])
def test_llama3_json_reads_calls_and_content(text, content, calls):
    found = Llama3JsonToolParser.extract(text)
    assert (found.content, calls_of(found)) == (content, calls)
    assert_streams_as_whole(Llama3JsonToolParser, text)


@pytest.mark.parametrize(("text", "content", "calls"), [
    (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}, {{"name": "b", "arguments": {{}}}}]',
     None, [("get_weather", WEATHER_ARGS), ("b", "{}")]),
    (f'Checking.[TOOL_CALLS] {{"name": "get_weather", "arguments": {WEATHER_ARGS}}}', "Checking.",
     [("get_weather", WEATHER_ARGS)]),
    ("No tools needed [TOOL", "No tools needed [TOOL", []),
])
def test_mistral_reads_calls_and_keeps_special_tokens(text, content, calls):
    found = MistralToolParser.extract(text)
    assert (found.content, calls_of(found)) == (content, calls)
    assert MistralToolParser.skip_special_tokens is False
    assert_streams_as_whole(MistralToolParser, text)


def test_forced_reply_is_all_calls():
    text = f'[{{"name": "get_weather", "parameters": {WEATHER_ARGS}}},\n {{"name": "echo", "parameters": {TRICKY_ARGS}}}]'
    found = ForcedToolParser.extract(text)
    assert (found.content, calls_of(found)) == (None, [("get_weather", WEATHER_ARGS), ("echo", TRICKY_ARGS)])
    assert_streams_as_whole(ForcedToolParser, text)


def test_a_reply_cut_short_keeps_the_call_begun():
    """max_tokens reached inside the arguments: the call stays, its arguments as far as they went."""
    found = HermesToolParser.extract('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert calls_of(found) == [("get_weather", '{"city": "Pa')] and not found.complete
    assert HermesToolParser.extract(HERMES_TWO).complete


# ---------------------------------------------------------------- the scanner, the registry

def test_a_growing_container_is_scanned_from_where_it_stopped():
    """With a memo, an open value's scan resumes (inside a string, after a backslash) and a
    closed one is not scanned again; the ends are those of a scan from scratch."""
    text = '[{"a": "x}\\"y["}, ["z"]]'  # a backslash-escaped quote and brackets inside a string
    memo: dict = {}
    for cut in range(1, len(text)):
        assert value_end(text[:cut], 0, memo) is None
        assert memo[0].pos == cut
    assert json.loads(text) == [{"a": 'x}"y['}, ["z"]]
    assert value_end(text, 0, memo) == len(text) == value_end(text, 0) and memo[0] == len(text)
    assert value_end(text + " tail", 0, memo) == len(text)

def test_scan_object_spans_and_open_values():
    text = '{"a": "x}", "b": [1, {"c": "]"}], "d": 12'
    scan = scan_object(text, 0)
    assert {k: text[s.start:s.end] for k, s in scan.members.items() if s.end} == {"a": '"x}"', "b": '[1, {"c": "]"}]'}
    assert scan.members["d"].end is None and scan.end is None  # "12" may go on
    assert scan_object(text + "}", 0).end == len(text) + 1
    for bad in ('{"a": [1}', '{a: 1}', '{"a" 1}', '{"a": @}'):
        with pytest.raises(NotJson):
            scan_object(bad, 0)


def test_the_registry_names_the_settings_choices():
    assert set(TOOL_PARSERS) == set(Settings.model_fields["tool_call_parser"].annotation.__args__[0].__args__)
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'pythonic'; one of hermes"):
        get_tool_parser("pythonic")
