"""The response shapes: completions and chat completions, whole and as streaming chunks,
their log probabilities and usage, and the model cards of ``GET /v1/models``."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


#: the floor of a reported log probability: JSON has no -inf (vLLM's value)
MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """``value`` as a JSON-safe log probability: -inf, and NaN (from a broken logits row),
    become ``MIN_LOGPROB``."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


class CompletionLogprobs(BaseModel):
    """A completion choice's ``logprobs`` (OpenAI's legacy shape): per token its text, its
    offset in the choice's text, its log probability and the most likely tokens' (the
    sampled one included, so up to ``logprobs`` + 1 entries)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it


class CompletionResponse(BaseModel):
    """A non-streaming ``text_completion``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streaming completion (``usage`` only with ``include_usage``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    """A call's function: its name and arguments (the model's JSON text, as OpenAI's)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class TopLogprob(BaseModel):
    """One of the most likely tokens at a position (chat ``top_logprobs``)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The sampled token at one position of a chat choice, and the most likely tokens there."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """A non-streaming ``chat.completion``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class _NoNone(BaseModel):
    """A model whose unset (None) keys are left out when dumped."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_NoNone):
    """A piece of a streamed call's function: its name in the call's first delta, then
    pieces of its arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_NoNone):
    """A piece of a streamed tool call (``index``: which call of the choice); ``id`` and
    ``type`` only in its first delta, as OpenAI streams them."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_NoNone):
    """The ``delta`` of a chat chunk; unset (None) keys are left out."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streaming chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
