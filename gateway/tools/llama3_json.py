"""Llama 3.1/3.2 JSON tool calls (``--tool-call-parser llama3_json``): the reply is one or
more JSON objects ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), separated by
``;``, maybe after ``<|python_tag|>`` (kept only when special tokens are). A reply whose
first character is not ``{`` is content (as vLLM's parser decides)."""

from __future__ import annotations

from gateway.tools.json_scan import NotJson, skip_ws
from gateway.tools.parser import CallDraft, Parse, ToolParser, read_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": ...}; {...}`` as the whole reply."""

    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parse:
        pos = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_ws(text, pos + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(text[pos:]) and not final:
            return Parse("")
        if pos == len(text):
            return Parse(text if final else "")
        if text[pos] != "{":
            return Parse(text)
        calls: list[CallDraft] = []
        while pos < len(text) and text[pos] == "{":
            try:
                call, end = read_call(text, pos, ("parameters", "arguments"), self.memo)
            except NotJson:
                break
            calls.append(call)
            if end is None:
                break
            pos = skip_ws(text, end)
            if pos >= len(text) or text[pos] != ";":
                break
            pos = skip_ws(text, pos + 1)
        return Parse("", calls)
