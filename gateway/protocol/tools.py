"""The request side of tool calling: ``tools`` (function definitions), ``tool_choice``, and
the assistant ``tool_calls`` a conversation carries back, as OpenAI's chat API has them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FunctionDefinition(BaseModel):
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None = no arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates take it (transformers' ``apply_chat_template(tools=...)``)."""
        return self.model_dump(exclude_none=True)


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming a function: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunctionParam(BaseModel):
    """A past call's function: its name and its arguments as a JSON string (OpenAI's)."""

    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str


class ToolCallParam(BaseModel):
    """One past call in an assistant message's ``tool_calls``."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunctionParam
