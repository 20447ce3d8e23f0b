"""Mistral tool calls (``--tool-call-parser mistral``): ``[TOOL_CALLS]`` followed by a JSON
array of ``{"name": ..., "arguments": {...}}`` (the format of Mistral's tokenizers before
v11). ``[TOOL_CALLS]`` is a special token, so this parser has the gateway keep special
tokens in the text. Text before it is content."""

from __future__ import annotations

from gateway.tools.json_scan import NotJson, skip_ws
from gateway.tools.parser import Parse, ToolParser, held_back, read_call, read_call_list

TOOL_CALLS = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]`` (a lone object is read too)."""

    name = "mistral"
    skip_special_tokens = False

    def parse(self, text: str, final: bool) -> Parse:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return Parse(text if final else held_back(text, TOOL_CALLS))
        content = text[:start].rstrip()
        pos = skip_ws(text, start + len(TOOL_CALLS))
        if pos < len(text) and text[pos] == "[":
            return Parse(content, read_call_list(text, pos, ("arguments",), self.memo))
        if pos < len(text) and text[pos] == "{":
            try:
                return Parse(content, [read_call(text, pos, ("arguments",), self.memo)[0]])
            except NotJson:
                pass
        return Parse(content)
