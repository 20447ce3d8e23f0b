"""Hermes-style tool calls (``--tool-call-parser hermes``): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>`` (the
closing tag may be missing at the end of the text), as NousResearch's Hermes 2 Pro format
and Qwen2.5's template have them. Text before the first ``<tool_call>`` is content; text
between and after the calls is dropped (as vLLM's hermes parser does)."""

from __future__ import annotations

from gateway.tools.json_scan import NotJson, skip_ws
from gateway.tools.parser import CallDraft, Parse, ToolParser, held_back, read_call

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, one or more."""

    name = "hermes"

    def parse(self, text: str, final: bool) -> Parse:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            return Parse(text if final else held_back(text, TOOL_CALL_START))
        calls: list[CallDraft] = []
        while start >= 0:
            body = skip_ws(text, start + len(TOOL_CALL_START))
            if body == len(text):
                break
            try:
                call, end = read_call(text, body, ("arguments", "parameters"), self.memo)
            except NotJson:
                break
            calls.append(call)
            if end is None:
                break
            after = skip_ws(text, end)
            if text.startswith(TOOL_CALL_END, after):
                after += len(TOOL_CALL_END)
            start = text.find(TOOL_CALL_START, after)
        return Parse(text[:text.find(TOOL_CALL_START)].rstrip(), calls)
