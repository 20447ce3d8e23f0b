"""The JSON schemas that force a tool call through structured outputs, as vLLM's:

- ``tool_choice: "required"``: an array of at least one ``{"name", "parameters"}`` object,
  each one of the tools (``anyOf``, the name an ``enum`` of one, ``parameters`` that tool's
  schema);
- a named function: the same array with exactly one item, that function.

``required`` with OpenAI's ``parallel_tool_calls: false`` has ``maxItems`` 1 too.

A tool without ``parameters`` takes ``{"type": "object", "properties": {}}``. The tools'
``$defs`` move to the top of the schema (their ``$ref``s point there); two tools defining one
name differently is an error.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol.tools import ChatTool

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolSchemaError(ValueError):
    """The tools cannot be forced together (conflicting ``$defs``); the message names them."""


def _call_schema(tool: ChatTool, defs: dict[str, Any]) -> dict[str, Any]:
    parameters = dict(tool.function.parameters) if tool.function.parameters is not None else dict(_NO_PARAMETERS)
    for name, definition in parameters.pop("$defs", {}).items():
        if name in defs and defs[name] != definition:
            raise ToolSchemaError(f"tools: the $defs entry {name!r} of function {tool.function.name!r} differs "
                                  "from another tool's of the same name")
        defs[name] = definition
    return {
        "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
        "required": ["name", "parameters"],
    }


def required_schema(tools: list[ChatTool], one_call: bool = False) -> dict[str, Any]:
    """The schema of ``tool_choice: "required"``: one or more calls of any of ``tools``
    (``one_call``: exactly one, for ``parallel_tool_calls: false``).

    Raises:
        ToolSchemaError: two tools define one ``$defs`` name differently.
    """
    defs: dict[str, Any] = {}
    items = [_call_schema(tool, defs) for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if one_call:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tool: ChatTool) -> dict[str, Any]:
    """The schema of a named ``tool_choice``: exactly one call of ``tool``."""
    defs: dict[str, Any] = {}
    item = _call_schema(tool, defs)
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", **item}}
    if defs:
        schema["$defs"] = defs
    return schema
