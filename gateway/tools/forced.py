"""The reply that ``tool_choice`` ``required`` or a named function forces through structured
outputs (``schemas.py``): a JSON array of ``{"name": ..., "parameters": {...}}``, as vLLM
asks for. All of it is calls; there is no content."""

from __future__ import annotations

from gateway.tools.json_scan import skip_ws
from gateway.tools.parser import Parse, ToolParser, read_call_list


class ForcedToolParser(ToolParser):
    """``[{"name": ..., "parameters": ...}, ...]`` as the whole reply."""

    name = "forced"

    def parse(self, text: str, final: bool) -> Parse:
        pos = skip_ws(text, 0)
        if pos == len(text) or text[pos] != "[":
            return Parse("")
        return Parse("", read_call_list(text, pos, ("parameters", "arguments"), self.memo))
