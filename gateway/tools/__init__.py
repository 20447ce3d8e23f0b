"""Tool calling: the parsers that read calls out of generated text (one module per format),
their registry by ``--tool-call-parser`` name, and the schemas that force a call."""

from __future__ import annotations

from gateway.tools.forced import ForcedToolParser
from gateway.tools.hermes import HermesToolParser
from gateway.tools.llama3_json import Llama3JsonToolParser
from gateway.tools.mistral import MistralToolParser
from gateway.tools.parser import ExtractedToolCalls, ToolDeltas, ToolParser

#: ``--tool-call-parser`` name -> parser class (``Settings.tool_call_parser`` lists the same names)
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: no parser has that name (the message lists them).
    """
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; one of {', '.join(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ForcedToolParser", "ToolDeltas", "ToolParser", "get_tool_parser"]
