"""``tool_use``: what a chat request's ``tools`` and ``tool_choice`` ask of the engine and the
gateway, as vLLM's server decides it:

- ``none``: the tools still reach the chat template; no call is read from the reply;
- ``auto`` (the default with tools): generation is free and the server's
  ``--tool-call-parser`` reads the calls; without ``--enable-auto-tool-choice`` it is a 400;
- ``required`` and a named function: generation is forced through structured outputs to the
  JSON of ``schemas.py``, without whitespace, which ``ForcedToolParser`` reads (so the call
  always parses); ``required`` with ``parallel_tool_calls: false`` allows one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError
from gateway.protocol.requests import ChatCompletionRequest
from gateway.protocol.tools import NamedToolChoice
from gateway.tools import ForcedToolParser, ToolParser, get_tool_parser
from gateway.tools.schemas import ToolSchemaError, named_schema, required_schema
from shared.config import Settings
from shared.messages import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class ToolUse:
    """How one chat request uses its tools.

    ``parser``: reads each choice's calls (None: none are read); ``schema``: the JSON schema
    a forced reply follows (None: generation is free); ``named``: a named function was forced
    (its finish_reason stays "stop", as OpenAI's and vLLM's); ``template_tools``: the tools as
    the chat template takes them (None: no tools).
    """

    parser: type[ToolParser] | None = None
    schema: dict[str, Any] | None = None
    named: bool = False
    template_tools: list[dict[str, Any]] | None = None

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` as this use needs them: the forced schema as structured outputs; special
        tokens kept for a parser whose call marker is one."""
        update: dict[str, Any] = {}
        if self.parser is not None and not self.parser.skip_special_tokens:
            update["skip_special_tokens"] = False
        if self.schema is not None:
            # compact JSON: the arguments read as OpenAI's, and no tokens go to spacing
            update["structured_outputs"] = StructuredOutputsParams(json=self.schema, disable_any_whitespace=True)
        # as a derived copy (not checked again): a forced call's schema also goes with beam search
        return params.derive(**update) if update else params


NO_TOOLS = ToolUse()


def tool_use(body: ChatCompletionRequest, settings: Settings) -> ToolUse:
    """What ``body``'s tools ask for, on a server with ``settings``.

    Raises:
        APIError: 400 (param ``tool_choice``) for "auto" on a server started without
            ``--enable-auto-tool-choice``, or for a forced call with another structured output
            constraint (``response_format``, ...); 400 (param ``tools``) for tools whose forced
            schema cannot be made.
    """
    if not body.tools:
        return NO_TOOLS
    template_tools = [tool.template_dict() for tool in body.tools]
    choice = body.effective_tool_choice
    if choice == "none":
        return ToolUse(template_tools=template_tools)
    if choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise APIError.of(400, 'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                                   "--tool-call-parser to be set (tool_choice is \"auto\" when tools are given "
                                   "without it)", param="tool_choice")
        return ToolUse(parser=get_tool_parser(settings.tool_call_parser), template_tools=template_tools)
    if body.structured_outputs_path is not None:  # as vLLM: guided decoding or forced tools, not both
        raise APIError.of(400, f"tool_choice: a forced tool call cannot be combined with "
                               f"{body.structured_outputs_path.split('.')[0]}; use tool_choice \"auto\" or \"none\"",
                          param="tool_choice")
    try:
        if isinstance(choice, NamedToolChoice):
            tool = next(t for t in body.tools if t.function.name == choice.function.name)
            return ToolUse(ForcedToolParser, named_schema(tool), True, template_tools)
        schema = required_schema(body.tools, one_call=body.parallel_tool_calls is False)
        return ToolUse(ForcedToolParser, schema, False, template_tools)
    except ToolSchemaError as exc:
        raise APIError.of(400, str(exc), param="tools") from None


